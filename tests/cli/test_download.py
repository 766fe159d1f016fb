"""Weights by hub id: ``target=llamagen_xl`` runs from a Hugging Face cache in the hub's own
layout (a temporary ``HF_HOME`` of tiny files, read offline by the real ``huggingface_hub``) with
no path or variable set; with the cache emptied it stops before any work, naming each file's hub
id and ``python -m coolsd.cli.download target=llamagen_xl``; the download command lists exactly the
world's own needs (``--dry-run``, offline and with the hub's sizes) and fetches those alone."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from coolsd.cli import download
from coolsd.cli.runner import run
from coolsd.util import hub
from coolsd.util.errors import InputError

from factories import compose, llamagen_tiny_settings, write_llamagen_hub_cache

ROOT = Path(__file__).resolve().parents[2]
VARS = ("LLAMAGEN_GPT", "LLAMAGEN_VQ", "FLAN_T5_XL", "LLAMAGEN_DRAFTER", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")
HUB_IDS = {"gpt": "hf://peizesun/llamagen_t2i/t2i_XL_stage1_256.pt", "vq": "hf://peizesun/llamagen_t2i/vq_ds16_t2i.pt",
           "t5": "hf://google/flan-t5-xl", "drafter": "hf://jadohu/llamagen_drafter"}
COMMAND = "python -m coolsd.cli.download target=llamagen_xl"


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """A temporary ``HF_HOME`` (its cache ``HF_HOME/hub``), offline, and none of the target's variables."""
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_llamagen_xl_runs_from_the_hub_cache_then_refuses_without_it(hf_home, llamagen_files, tmp_path):
    cache = write_llamagen_hub_cache(hf_home / "hub", llamagen_files)
    overrides = ["target=llamagen_xl", "method=coolsd", "dataset.n_prompts=2", *llamagen_tiny_settings()]
    cfg = compose(*overrides, f"+out_dir={tmp_path / 'run'}")
    assert cfg.target.files.gpt == HUB_IDS["gpt"] and cfg.draft.path == HUB_IDS["drafter"]  # no path set anywhere
    summary = run(cfg)
    assert summary["results"]["coolsd"]["accepted_length"]["mean"] >= 1.0
    world = json.loads((tmp_path / "run" / "run.json").read_text())["world"]
    # the fingerprints are the content's: the cached copies are the tiny files, named as downloaded copies are
    assert world["gpt"]["sha256"] == _sha(llamagen_files["gpt"]) and world["gpt"]["name"] == "t2i_XL_stage1_256.pt"
    assert world["vq"]["sha256"] == _sha(llamagen_files["vq"])
    assert world["t5"]["name"] == "flan-t5-xl" and world["drafter"]["name"] == "llamagen_drafter"

    shutil.rmtree(cache)  # the cache emptied: every file refused at once, before any work
    with pytest.raises(FileNotFoundError) as e:
        run(compose(*overrides, f"+out_dir={tmp_path / 'again'}"))
    lines = str(e.value).splitlines()
    assert lines[0] == "target 'llamagen_xl' cannot run: missing files"
    for name, ref in HUB_IDS.items():
        line = next(x for x in lines if x.strip().startswith(f"{name}: "))
        assert f"{ref} is not in the Hugging Face cache {hf_home / 'hub'}: run `{COMMAND}`" in line, line
    assert not (tmp_path / "again").exists()


def test_run_py_with_an_empty_cache_names_the_download_command(hf_home, tmp_path):
    """``python run.py target=llamagen_xl`` itself: exit status 2, one line a file, no traceback."""
    env = {**os.environ, "HF_HOME": str(hf_home)}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "target=llamagen_xl", "method=eagle",
                           f"hydra.run.dir={tmp_path / 'out'}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for name, ref in HUB_IDS.items():
        assert f"{name}: {ref} is not in the Hugging Face cache" in proc.stderr, proc.stderr[-2000:]
    assert f"run `{COMMAND}` (or set target.files.gpt=/path or $LLAMAGEN_GPT)" in proc.stderr


def test_an_env_var_or_a_path_still_wins_over_the_hub_default(hf_home, llamagen_files, monkeypatch):
    monkeypatch.setenv("LLAMAGEN_GPT", str(llamagen_files["gpt"]))
    cfg = compose("target=llamagen_xl", f"target.files.t5={llamagen_files['t5']}")
    assert cfg.target.files.gpt == str(llamagen_files["gpt"]) and cfg.target.files.t5 == str(llamagen_files["t5"])
    from coolsd.worlds.llamagen import LlamaGenWorld

    missing = "\n".join(LlamaGenWorld.missing_files(cfg))
    assert "gpt:" not in missing and "t5:" not in missing and HUB_IDS["vq"] in missing


def test_dry_run_offline_lists_the_worlds_own_needs_without_sizes(hf_home, capsys):
    assert download.main(["target=llamagen_xl", "metrics=clip_score", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name, ref in HUB_IDS.items():
        assert f"{name} (" in out and ref in out
    assert "hf://openai/clip-vit-base-patch32" in out and "sizes unknown: offline (HF_HUB_OFFLINE)" in out
    assert "t5 (target.files.t5): hf://google/flan-t5-xl  [*.json, spiece.model, *.safetensors or *.bin;" in out
    assert not (hf_home / "hub").exists()  # nothing fetched, nothing written
    with pytest.raises(InputError, match="^HF_HUB_OFFLINE is set: unset it to download"):
        download.main(["target=llamagen_xl"])
    with pytest.raises(InputError, match=r"nothing to fetch: give target=<name>"):
        download.main(["--dry-run"])
    with pytest.raises(InputError, match=r"^target=nope: In 'config': Could not find 'target/nope'$"):
        download.main(["target=nope", "--dry-run"])
    with pytest.raises(InputError, match=r"^metrics: unknown metric\(s\) \['clip'\]; valid: clip_score, fid, hpsv2, image_reward$"):
        download.main(["metrics=clip", "--dry-run"])


def test_download_fetches_exactly_the_files_with_the_hubs_sizes(hf_home, monkeypatch, capsys):
    """Online (the hub API faked at its one call, ``HfApi.model_info``): the dry run prints the sizes
    the hub gives; a download fetches each file alone and each folder with its patterns only (one
    weight format: the first the repo has)."""
    import huggingface_hub

    repos = {"peizesun/llamagen_t2i": {"t2i_XL_stage1_256.pt": 3_100_000_000, "vq_ds16_t2i.pt": 288_000_000,
                                       "t2i_XL_stage2_512.pt": 3_100_000_000},
             "google/flan-t5-xl": {"config.json": 1_000, "spiece.model": 792_000,
                                   "model-00001-of-00002.safetensors": 9e9, "model.safetensors.index.json": 50_000,
                                   "pytorch_model-00001-of-00002.bin": 9e9, "tf_model.h5": 11e9},
             "jadohu/llamagen_drafter": {"config.json": 600, "pytorch_model.bin": 400_000_000, "README.md": 10}}

    def model_info(self, repo_id, revision=None, files_metadata=False, **kw):
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f, size=int(b)) for f, b in repos[repo_id].items()])

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    assert download.main(["target=llamagen_xl", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "gpt (target.files.gpt): hf://peizesun/llamagen_t2i/t2i_XL_stage1_256.pt  [1 file, 3.10 GB]" in out
    assert "spiece.model  792.00 KB" in out and "tf_model.h5" not in out and ".bin" not in out.split("drafter")[0]
    assert "pytorch_model.bin  400.00 MB" in out and "README.md" not in out

    fetched = []
    monkeypatch.setattr(hub, "fetch", lambda ref, file, pats: fetched.append((str(ref), file, pats)) or Path("/x"))
    assert download.main(["target=llamagen_xl"]) == 0
    assert fetched == [(HUB_IDS["gpt"], True, []), (HUB_IDS["vq"], True, []),
                       (HUB_IDS["t5"], False, ["*.json", "spiece.model", "*.safetensors"]),
                       (HUB_IDS["drafter"], False, ["config.json", "pytorch_model.bin"])]
