"""``python -m coolsd.cli.train_drafter``: an EAGLE head trained on the target's own samples and
saved as a folder that the loaders read back (toy world and tiny LlamaGen files)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from coolsd.models.eagle.model import load_eagle_head
from coolsd.cli.train_drafter import main
from coolsd.models.llamagen import LlamaGenConfig, load_gpt
from coolsd.toy.load_assets import load_toy_assets
from coolsd.util.errors import ConfigError
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
    with pytest.raises(ConfigError, match="unknown train option"):
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
    assert json.loads((out / "config.json").read_text())["target_variant"] == "upstream"  # target.variant's default


def test_lumina_drafter_training_writes_a_folder_that_loads_strictly_and_drafts(lumina_files, tmp_path):
    """python -m coolsd.cli.train_drafter target=lumina_mgpt on the tiny files: a couple of steps,
    then the folder (LANTERN's config fields + the target variant) loads strictly and drafts
    through the world (greedy EAGLE = greedy AR)."""
    import warnings

    import numpy as np
    from types import SimpleNamespace

    from coolsd.models.eagle.lumina import LuminaEagleHead, load_lumina_eagle_head
    from coolsd.worlds import load_world
    from factories import compose, lumina_overrides

    over = [o for o in lumina_overrides(lumina_files) if not o.startswith("draft.")]
    caps = tmp_path / "captions.txt"
    caps.write_text("\n".join(["a red circle", "red", "a circle", "red red", "a red", "circle"]))
    out = main(["target=lumina_mgpt", *over, f"train.captions={caps}", "train.samples=4", "train.heldout=2",
                "train.steps=2", "train.batch_size=2", "train.chunk=2", f"train.out={tmp_path / 'd'}"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["target_variant"] == "upstream" and cfg["model_parallel_size"] == 1 and cfg["vocab_size"] == 64
    metrics = json.loads((out / "train_metrics.json").read_text())
    assert metrics["n_target_samples"] == 4 and 0 <= metrics["top1"] <= 1 and "accept_cfg" in metrics
    world = load_world(compose("target=lumina_mgpt", *over, f"draft.path={out}", "sampling.temperature=0"))
    saved = load_file(str(out / "model.safetensors"))
    head = world.drafter().head
    assert isinstance(head, LuminaEagleHead) and all(torch.equal(saved[k], v) for k, v in head.state_dict().items())
    assert torch.equal(head.embed_tokens.weight, world.target.model.model.embed_tokens.weight)
    prompts = [SimpleNamespace(caption="a red circle")]
    ar = world.generate(world.build_method("ar", {}), prompts, [0])
    eagle = world.generate(world.build_method("eagle", {}, tree="mc_sim_7b_63"), prompts, [0])
    assert np.array_equal(ar[0].image, eagle[0].image)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same variant: no warning
        load_lumina_eagle_head(out, world.target, variant="upstream")


def test_trained_llamagen_folder_records_its_variant_and_warns_on_a_mismatch(tmp_path):
    """The drafter-training CLI records target.variant; loading under another variant warns
    naming both; a released folder (no record) does not warn."""
    import warnings

    from coolsd.models.eagle.model import EagleHead
    from coolsd.models.eagle.training import save_drafter
    from coolsd.models.llamagen import LlamaGenGPT, tiny

    gpt = LlamaGenGPT(tiny()).double()
    out = save_drafter(EagleHead.from_target(gpt, seed=0), tmp_path / "d", {}, target_variant="lantern")
    assert json.loads((out / "config.json").read_text())["target_variant"] == "lantern"
    with pytest.warns(UserWarning, match="variant 'lantern'.*variant 'upstream'"):
        load_eagle_head(out, gpt, variant="upstream")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_eagle_head(out, gpt, variant="lantern")
        cfg = json.loads((out / "config.json").read_text())
        del cfg["target_variant"]
        (out / "config.json").write_text(json.dumps(cfg))
        load_eagle_head(out, gpt, variant="upstream")
