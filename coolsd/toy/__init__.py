"""The embedded toy text-to-image world: procedural scenes, a VQ tokenizer, a tiny LlamaGen
target with an EAGLE-1 drafter, and a feature network for the toy metrics."""
