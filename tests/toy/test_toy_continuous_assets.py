"""The shipped toy continuous world (coolsd/toy/assets/continuous_*, `make toy-continuous-assets`):
checksummed files that load strictly, fit the toy world's 25 MiB budget together with the
discrete toy world's files, a codec that reconstructs held-out scenes, and a target that
samples finite tokens in the data range."""
import json

import pytest
import torch

from coolsd.engine.continuous.generate import HeadConfig, ar_generate
from coolsd.toy.continuous import ASSETS_DIR, FILES, MANIFEST, load_toy_continuous, scene_labels
from coolsd.toy.load_assets import FILES as DISCRETE_FILES
from coolsd.toy.scenes import toy_prompts

pytestmark = pytest.mark.skipif(not (ASSETS_DIR / MANIFEST).is_file(),
                                reason="toy continuous weights not built yet: run `make toy-continuous-assets`")


def test_shipped_files_load_strictly_and_fit_the_budget():
    w = load_toy_continuous()
    total = sum((ASSETS_DIR / f).stat().st_size for f in [*FILES.values(), *DISCRETE_FILES.values()])
    assert total <= 25 * 2**20, total
    from safetensors import safe_open

    for name, model in (("target", w.target), ("draft", w.draft)):
        with safe_open(str(ASSETS_DIR / FILES[name]), "pt") as f:
            assert set(f.keys()) == set(model.state_dict())
    m = json.loads((ASSETS_DIR / MANIFEST).read_text())["metrics"]
    assert m["codec"]["heldout_mae"] < 0.01
    assert m["target"]["steps"] >= 1000 and m["draft"]["steps"] >= 1000


def test_shipped_target_samples_finite_tokens_in_the_data_range():
    w = load_toy_continuous()
    scenes = toy_prompts(2)
    toks = ar_generate(w.target, scene_labels(scenes), [0, 1], HeadConfig(steps=10, cfg=2.0, clip_x0=8.0)).tokens
    assert torch.isfinite(toks).all() and toks.abs().max() < 10
    assert w.codec.decode(toks).shape == (2, 32, 32, 3)
