"""The shipped toy-world weights: strict loading, tokenizer round trip, deterministic
generation, clear errors for missing or corrupted files, and runs that never leave a
half-written record or image behind."""
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coolsd.drafting import SamplingConfig
from coolsd.methods import build_method
from coolsd.records import read_records
from coolsd.toy.assets import ASSETS_DIR, FILES, load_toy_world
from coolsd.toy.job import generate_one, toy_prompts
from coolsd.toy.world import render_batch, sample_scenes

ROOT = Path(__file__).resolve().parents[1]

# The shipped weights come with issue #3's `make toy-assets` build; until they are committed
# these tests report as skipped (visibly), never as passed.
pytestmark = pytest.mark.skipif(
    not (ASSETS_DIR / "manifest.json").is_file(), reason="toy weights not built yet: run `make toy-assets`"
)


@pytest.fixture(scope="module")
def world():
    return load_toy_world()


def test_shipped_weights_load_strictly_and_fit_the_budget(world):
    total = sum((ASSETS_DIR / f).stat().st_size for f in FILES.values())
    assert total <= 25 * 2**20
    # strict loading already happened; the loaded modules carry exactly the file's keys
    from safetensors import safe_open

    with safe_open(str(ASSETS_DIR / FILES["drafter"]), "pt") as f:
        assert set(f.keys()) == set(world.head.state_dict())
    with safe_open(str(ASSETS_DIR / FILES["target"]), "pt") as f:
        keys = set(f.keys())
    assert keys == {f"gpt.{k}" for k in world.gpt.state_dict()} | {f"caption.{k}" for k in world.encoder.state_dict()}


def test_tokenizer_round_trip(world):
    imgs = render_batch(sample_scenes(64, 99))
    with torch.no_grad():
        tokens = world.vq.encode(imgs)
        recon = world.vq.decode_uint8(tokens)
        again = world.vq.encode(recon)
    assert tokens.shape == (64, 64) and int(tokens.max()) < world.gpt.config.vocab_size
    mae = np.abs(recon.astype(float) - imgs.astype(float)).mean() / 255
    assert mae < 0.05
    # re-encoding a uint8 reconstruction is stable up to neighbouring codes (many codes are
    # fine background shades that uint8 rounding can tip over)
    assert (again == tokens).float().mean() > 0.6
    near = (world.neighbours[tokens, :8] == again.unsqueeze(-1)).any(-1) | (again == tokens)
    assert near.float().mean() > 0.9


def test_generation_is_deterministic_per_seed(world):
    scene = toy_prompts(1)[0]
    m = build_method("coolsd", tree="chain", draft_length=4, delta=2.0)
    a = generate_one(world, m, SamplingConfig(), scene.caption, 5)
    b = generate_one(world, m, SamplingConfig(), scene.caption, 5)
    c = generate_one(world, m, SamplingConfig(), scene.caption, 6)
    assert torch.equal(a.tokens, b.tokens) and a.round_lengths == b.round_lengths
    assert not torch.equal(a.tokens, c.tokens)


def test_missing_or_corrupted_weights_are_named(tmp_path):
    d = tmp_path / "assets"
    shutil.copytree(ASSETS_DIR, d)
    (d / FILES["drafter"]).unlink()
    with pytest.raises(FileNotFoundError, match=r"drafter.safetensors.*make toy-assets"):
        load_toy_world(d)
    shutil.copy(ASSETS_DIR / FILES["drafter"], d / FILES["drafter"])
    raw = bytearray((d / FILES["target"]).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (d / FILES["target"]).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"target.safetensors are corrupted.*make toy-assets"):
        load_toy_world(d)


def test_killed_run_leaves_nothing_half_written(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "run.py", "target=toy", "method=eagle", "dataset.n_prompts=40", f"+out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_records(out / "samples.jsonl")) < 5:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    records = read_records(out / "samples.jsonl")
    assert len(records) >= 5
    for r in records:  # every record points to a complete PNG
        with Image.open(out / r["image"]) as im:
            im.load()
            assert im.size == (32, 32)
    finals = [p for p in (out / "images").rglob("*.png")]
    for p in finals:  # no final-named image is truncated
        with Image.open(p) as im:
            im.load()
    assert not (out / "summary.json").exists() or json.loads((out / "summary.json").read_text())
