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

from coolsd.util.records import read_records
from coolsd.toy.load_assets import ASSETS_DIR, FILES, load_toy_assets
from coolsd.toy.scenes import render_batch, sample_scenes, toy_prompts
from coolsd.worlds import load_world
from factories import compose as _compose

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world():
    return load_world(_compose("target=toy"))


def test_shipped_manifest_and_weights_are_present():
    """The toy weights and their manifest are committed (coolsd/toy/assets/): a missing file is a
    failure, never a skip."""
    missing = [name for name in ("manifest.json", *FILES.values()) if not (ASSETS_DIR / name).is_file()]
    assert not missing, f"shipped toy assets missing from {ASSETS_DIR}: {missing} (rebuild: `make toy-assets`)"


def test_shipped_weights_load_strictly_and_fit_the_budget(world):
    total = sum((ASSETS_DIR / f).stat().st_size for f in FILES.values())
    assert total <= 25 * 2**20
    # strict loading already happened; the loaded modules carry exactly the file's keys
    from safetensors import safe_open

    with safe_open(str(ASSETS_DIR / FILES["drafter"]), "pt") as f:
        assert set(f.keys()) == set(world.assets.head.state_dict())
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
    m = world.build_method("coolsd", {"delta": 2.0}, "chain", 4)
    (a,), (b,), (c,) = (world.generate(m, [scene], [s]) for s in (5, 5, 6))
    assert np.array_equal(a.image, b.image) and a.fields["round_lengths"] == b.fields["round_lengths"]
    assert not np.array_equal(a.image, c.image)


def test_missing_or_corrupted_weights_are_named(tmp_path):
    d = tmp_path / "assets"
    shutil.copytree(ASSETS_DIR, d)
    (d / FILES["drafter"]).unlink()
    with pytest.raises(FileNotFoundError, match=r"drafter.safetensors.*make toy-assets"):
        load_toy_assets(d)
    shutil.copy(ASSETS_DIR / FILES["drafter"], d / FILES["drafter"])
    raw = bytearray((d / FILES["target"]).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (d / FILES["target"]).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"target.safetensors are corrupted.*make toy-assets"):
        load_toy_assets(d)


def _identity(records):
    keys = ("method", "prompt_index", "seed", "round_lengths", "target_forwards", "image")
    return sorted(tuple(json.dumps(r[k]) for k in keys) for r in records)


def test_killed_run_resumes_without_losing_or_repeating_samples(tmp_path):
    from coolsd.cli.runner import run

    out, ref = tmp_path / "run", tmp_path / "ref"
    n = 5
    cmd = [sys.executable, "run.py", "method=eagle", f"dataset.n_prompts={n}", f"+out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_records(out / "samples.jsonl")) < 3 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = read_records(out / "samples.jsonl")
    assert 3 <= len(first) < 2 * n, "the run must be killed part-way"
    for r in first:  # every record points to a complete PNG; no final-named image is truncated
        with Image.open(out / r["image"]) as im:
            im.load()
    for p in (out / "images").rglob("*.png"):
        with Image.open(p) as im:
            im.load()
    assert not (out / "summary.json").exists()

    summary = run(_compose("method=eagle", f"dataset.n_prompts={n}", f"+out_dir={out}"))  # resume
    resumed = read_records(out / "samples.jsonl")
    assert len(resumed) == 2 * n and resumed[: len(first)] == first  # nothing lost, nothing rewritten
    run(_compose("method=eagle", f"dataset.n_prompts={n}", f"+out_dir={ref}"))  # uninterrupted
    assert _identity(resumed) == _identity(read_records(ref / "samples.jsonl"))  # none repeated, same samples
    for r in resumed:
        a, b = (np.asarray(Image.open(d / r["image"])) for d in (out, ref))
        assert np.array_equal(a, b)
    assert summary["results"]["eagle"]["accepted_length"]["n"] == n


def test_run_folder_of_another_configuration_is_refused(tmp_path):
    from coolsd.cli.runner import run

    run(_compose("method=coolsd", "dataset.n_prompts=2", f"+out_dir={tmp_path}"))
    before = (tmp_path / "samples.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"another configuration \(.*seed: 0 -> 1.*nothing was overwritten"):
        run(_compose("method=coolsd", "dataset.n_prompts=2", "seed=1", f"+out_dir={tmp_path}"))
    assert (tmp_path / "samples.jsonl").read_bytes() == before


def test_images_that_do_not_match_records_are_an_error(tmp_path):
    from coolsd.cli.runner import run

    cfg = _compose("method=ar", "dataset.n_prompts=2", f"+out_dir={tmp_path}")
    run(cfg)
    rec = read_records(tmp_path / "samples.jsonl")[0]
    (tmp_path / rec["image"]).unlink()
    with pytest.raises(ValueError, match=r"does not match its records"):
        run(cfg)


@pytest.mark.parametrize("method", ["ar", "eagle", "uniform_rsd", "coolsd", "lantern", "lantern_pp", "sjd"])
def test_main_job_runs_every_method(tmp_path, method):
    from coolsd.cli.runner import run

    cfg = _compose(f"method={method}", "dataset.n_prompts=2", f"+out_dir={tmp_path}")
    assert cfg.target.name == "toy"  # the default target is the shipped toy world
    summary = run(cfg)
    tags = ["ar"] if method == "ar" else ["ar", method]
    assert list(summary["results"]) == tags
    records = read_records(tmp_path / "samples.jsonl")
    assert [r["method"] for r in records] == tags * 2
    for tag in tags:
        e = summary["results"][tag]
        assert 1.0 <= e["accepted_length"]["mean"] and e["latency_s"]["mean"] > 0
        assert 0.0 <= e["toy_clip"]["mean"] <= 1.0
        assert e["toy_fid"] is None and "n=2" in e["toy_fid_null_reason"]  # 2 images cannot fit a Gaussian
    assert "speedup" in summary["results"][tags[-1]] and (tmp_path / "grid.png").is_file()
