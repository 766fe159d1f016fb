"""``python -m coolsd.drafters.train``: an EAGLE head trained on the target's own samples and
saved as a folder that the loaders read back (toy world and tiny LlamaGen files)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from coolsd.drafters.eagle import load_eagle_head
from coolsd.drafters.train import main
from coolsd.models.llamagen import LlamaGenConfig, load_gpt
from coolsd.toy.assets import load_toy_assets
from factories import TINY_GPT, llamagen_overrides


def test_toy_drafter_training_writes_a_loadable_folder(tmp_path):
    out = main(["target=toy", "train.samples=12", "train.heldout=4", "train.steps=3", "train.batch_size=4",
                f"train.out={tmp_path / 'd'}"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_prefix"] is False and cfg["block_size"] == 64 and cfg["hidden_size"] == 128
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["n_target_samples"] == 12 and 0 <= metrics["top1"] <= 1
    world = load_toy_assets()
    head = load_eagle_head(out, world.gpt)
    saved = load_file(str(out / "model.safetensors"))
    assert head.text_prefix is False and all(torch.equal(saved[k], v) for k, v in head.state_dict().items())
    assert torch.equal(head.embed_tokens.weight, world.gpt.tok_embeddings.weight)  # the target's frozen embedding
    with pytest.raises(SystemExit, match="unknown train option"):
        main(["target=toy", "train.epochs=3"])


def test_llamagen_drafter_training_needs_captions_then_trains(llamagen_files, tmp_path):
    files = llamagen_files
    over = [o for o in llamagen_overrides(files) if not o.startswith(("draft.", "dataset."))]  # no drafter, no eval set
    with pytest.raises(FileNotFoundError, match="training captions"):
        main(["target=llamagen_xl", *over, "train.samples=4"])
    caps = tmp_path / "captions.txt"
    caps.write_text("\n".join(["a red cat", "the dog", "a cat on the mat", "red dog", "the mat", "a dog sits"]))
    out = main(["target=llamagen_xl", *over, f"train.captions={caps}", "train.samples=4",
                "train.heldout=2", "train.steps=2", "train.batch_size=2", f"train.out={tmp_path / 'd'}"])
    gpt = load_gpt(files["gpt"], LlamaGenConfig(**TINY_GPT), dtype=torch.float32)
    head = load_eagle_head(out, gpt)
    assert head.config.block_size == TINY_GPT["block_size"] and head.text_prefix is False
