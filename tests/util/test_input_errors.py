"""Every input file a run needs is checked before any model loads (one
list, each entry with its config key or flag, its environment variable and its source), and any
failure while reading a file is one ``coolsd.util.errors.InputFileError`` naming the file, what was
expected and where the right one comes from (never a raw parser error or torch's advice).
Tiny official-layout files from tests/factories.py (the session fixtures of conftest.py)."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import factories
from coolsd.util.errors import InputFileError
from coolsd.util.loading import BadInputFile, read_json, reading, torch_load
from coolsd.cli.runner import run

ROOT = Path(__file__).resolve().parents[2]
ENV_VARS = ("COCO_CAPTIONS", "COCO_VAL_IMAGES", "LLAMAGEN_GPT", "LLAMAGEN_VQ", "FLAN_T5_XL", "LLAMAGEN_DRAFTER",
            "CLIP_DIR", "INCEPTION_WEIGHTS", "IMAGEREWARD_CKPT", "IMAGEREWARD_MED_CONFIG", "IMAGEREWARD_PYTHON")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


def refused(cfg, out: Path) -> str:
    """Run ``cfg``: it must stop with one InputFileError, writing nothing; its message, one line
    per entry (no traceback text, no torch advice)."""
    with pytest.raises(InputFileError) as e:
        run(cfg)
    msg = str(e.value)
    assert not (out / "run.json").exists() and not (out / "samples.jsonl").exists()
    for noise in ("Traceback", "weights_only=False", "file an issue", "Error(s) in loading state_dict"):
        assert noise not in msg, (noise, msg)
    return msg


def without(overrides: list, *keys) -> list:
    """``overrides`` less those setting ``keys`` (so the config's default, an environment variable, applies)."""
    return [o for o in overrides if o.split("=", 1)[0] not in keys]


# ------------------------------------------------------------------ item 2: the up-front list
def test_coco_captions_are_in_the_up_front_list_of_a_real_target(compose, world_overrides, tmp_path, monkeypatch):
    """dataset=coco2017val without $COCO_CAPTIONS: listed with the target's missing files, before
    any model loads (load is never called), with its key, variable and source."""
    from coolsd.worlds.llamagen import LlamaGenWorld

    monkeypatch.setattr(LlamaGenWorld, "load", classmethod(lambda cls, cfg: pytest.fail("a model loaded")))
    out = tmp_path / "out"
    cfg = compose(*world_overrides("llamagen_xl"), "dataset=coco2017val", "dataset.n_prompts=2", f"+out_dir={out}")
    msg = refused(cfg, out)
    assert "COCO captions: not set (set dataset.captions=/path or $COCO_CAPTIONS)" in msg
    assert "annotations_trainval2017.zip" in msg
    # one list: with the GPT missing too (from its environment variable), both are named at once
    monkeypatch.setenv("LLAMAGEN_GPT", "/nowhere/gpt.pt")
    cfg = compose(*without(world_overrides("llamagen_xl"), "target.files.gpt"), "dataset=coco2017val",
                  f"dataset.captions={tmp_path / 'no_captions.json'}", f"+out_dir={out}")
    msg = refused(cfg, out)
    assert "gpt: /nowhere/gpt.pt does not exist (set target.files.gpt=/path or $LLAMAGEN_GPT)" in msg
    assert f"COCO captions: {tmp_path / 'no_captions.json'} does not exist (set dataset.captions=/path)" in msg


def test_up_front_list_checks_kinds_and_folder_contents(compose, world_overrides, llamagen_files, tmp_path,
                                                        monkeypatch):
    """A file where a folder is expected, a drafter folder without its weights: named before loading."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    monkeypatch.setenv("FLAN_T5_XL", str(llamagen_files["gpt"]))
    monkeypatch.setenv("LLAMAGEN_DRAFTER", str(drafter))
    out = tmp_path / "out"
    cfg = compose(*without(world_overrides("llamagen_xl"), "target.files.t5", "draft.path"), "method=eagle",
                  f"+out_dir={out}")
    msg = refused(cfg, out)
    assert f"t5: {llamagen_files['gpt']} is a file, expected a folder (set target.files.t5=/path or $FLAN_T5_XL)" in msg
    assert f"drafter: {drafter} lacks pytorch_model.bin or model.safetensors (set draft.path=/path or " \
           f"$LLAMAGEN_DRAFTER)" in msg


def test_run_py_exits_2_with_the_list_and_writes_nothing(world_overrides, tmp_path):
    """The console path: exit status 2, the list without a traceback, no run folder content."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *world_overrides("llamagen_xl"), "dataset=coco2017val",
                           "dataset.n_prompts=2", f"hydra.run.dir={out}"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "COCO captions: not set (set dataset.captions=/path or $COCO_CAPTIONS)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (out / "run.json").exists()


# ------------------------------------------------------------------ item 3: one readable load error
OVERRIDES = {"llamagen_xl": factories.llamagen_overrides, "lumina_mgpt": factories.lumina_overrides,
             "mar_h": factories.mar_overrides}


def refused_on(compose, target: str, files: dict, tmp_path: Path, *overrides) -> str:
    """``refused`` for ``target`` on its (corrupted) tiny ``files``, one prompt."""
    out = tmp_path / "out"
    return refused(compose(f"target={target}", *OVERRIDES[target](files), "dataset.n_prompts=1", *overrides,
                           f"+out_dir={out}"), out)


def _copy(files: dict, d: Path) -> dict:
    """A private copy of a world's tiny files (folders too), to corrupt one of them."""
    out = {}
    for k, v in files.items():
        if isinstance(v, Path):
            out[k] = d / v.name
            (shutil.copytree if v.is_dir() else shutil.copy)(v, out[k])
    return out


@pytest.mark.parametrize("which, bad, expect, source", [
    ("model", b"\xff" * 64, "safetensors weight file of Lumina-mGPT-7B-768", "huggingface.co/Alpha-VLLM/Lumina-mGPT"),
    ("text_tokenizer", b"", "Chameleon's text tokenizer", "Anole-7b-v0.1"),
    ("vqgan", os.urandom(256), "Chameleon's VQGAN checkpoint", "Anole-7b-v0.1"),
])
def test_lumina_unreadable_files_are_one_error_naming_the_file(which, bad, expect, source, compose, lumina_files,
                                                                tmp_path):
    files = _copy(lumina_files, tmp_path)
    path = files["model"] / "model.safetensors" if which == "model" else files[which]
    path.write_bytes(bad)
    msg = refused_on(compose, "lumina_mgpt", files, tmp_path)
    assert str(path) in msg and expect in msg and source in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("which", ["gpt", "vq"])
def test_llamagen_weight_file_of_random_bytes_names_it(which, compose, llamagen_files, tmp_path):
    files = _copy(llamagen_files, tmp_path)
    files[which].write_bytes(os.urandom(512))
    msg = refused_on(compose, "llamagen_xl", files, tmp_path, "method=ar")
    assert f"{files[which]} is not a readable PyTorch weight file" in msg and "peizesun/llamagen_t2i" in msg


@pytest.mark.parametrize("config, expect", [
    ("", "JSONDecodeError"),
    ("[]", "holds a JSON list"),
    (json.dumps({"hidden": 32, "layers": 1}), "KeyError: 'num_attention_heads'"),
])
def test_eagle_drafter_config_errors_name_the_file(config, expect, compose, llamagen_files, tmp_path):
    files = _copy(llamagen_files, tmp_path)
    (files["drafter"] / "config.json").write_text(config)
    msg = refused_on(compose, "llamagen_xl", files, tmp_path, "method=eagle")
    assert f"cannot read {files['drafter'] / 'config.json'} as a LANTERN drafter config.json" in msg
    assert expect in msg and "jadohu/llamagen_drafter" in msg and "\n" not in msg


def test_eagle_drafter_weights_of_another_model_name_the_file(compose, llamagen_files, tmp_path):
    files = _copy(llamagen_files, tmp_path)
    weights = files["drafter"] / "pytorch_model.bin"
    sd = torch.load(weights, weights_only=True)
    torch.save({**{k: v for k, v in list(sd.items())[1:]}, "lm_head.extra": torch.zeros(2)}, weights)
    msg = refused_on(compose, "llamagen_xl", files, tmp_path, "method=eagle")
    assert f"{weights} does not fit EagleHead (missing keys: {next(iter(sd))}; unexpected keys: lm_head.extra)" in msg


@pytest.mark.parametrize("which", ["target", "vae"])
def test_mar_weight_file_of_random_bytes_names_it(which, compose, mar_files, tmp_path):
    files = _copy(mar_files, tmp_path)
    files[which].write_bytes(os.urandom(300))
    msg = refused_on(compose, "mar_h", files, tmp_path, "method=cspd")
    assert f"{files[which]} is not a readable PyTorch weight file" in msg


def test_loading_helpers_wrap_once_and_pass_own_errors_through(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(BadInputFile, match=r"cannot read .*x\.json as a thing \(JSONDecodeError: .*from the shop$"):
        read_json(p, "a thing", "the shop")
    with pytest.raises(InputFileError, match=r"a thing not found: \(path not set\); download it from the shop"):
        read_json(None, "a thing", "the shop")
    own = InputFileError("already readable")
    with pytest.raises(InputFileError) as e, reading(p, "a thing", "the shop"):
        raise own
    assert e.value is own
    import argparse

    torch.save({"args": argparse.Namespace(a=1)}, tmp_path / "ns.pt")
    with pytest.raises(BadInputFile, match=r"pickles a argparse.Namespace object.*expected weights from the shop") as e:
        torch_load(tmp_path / "ns.pt", "weights", "the shop")
    assert isinstance(e.value, ValueError) and "weights_only=False" not in str(e.value)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(BadInputFile, match="EOFError: empty or truncated file"):
        torch_load(tmp_path / "empty.pt", "weights", "the shop")


# ------------------------------------------------------------------ coolsd.cli.evaluate: its own flags
def test_evaluate_lists_every_missing_input_with_its_flag(tmp_path, monkeypatch):
    from coolsd.cli.evaluate import main

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # no cached Inception weights
    run_dir = tmp_path / "run"
    with pytest.raises(InputFileError) as e:
        main([str(run_dir), "--metrics", "clip_score,fid,image_reward", "--ir-med-config", str(tmp_path / "med.json")])
    msg = str(e.value)
    for line in ("run folder: ", "CLIP model folder: hf://openai/clip-vit-base-patch32 is not in the Hugging Face cache",
                 "(or set --clip /path or $CLIP_DIR)",
                 "Inception weights: ", "(set --inception /path or $INCEPTION_WEIGHTS)",
                 "COCO val2017 images: not set (set --coco-images /path or $COCO_VAL_IMAGES)",
                 "ImageReward checkpoint: hf://THUDM/ImageReward/ImageReward.pt is not in the Hugging Face cache",
                 "run `python -m coolsd.cli.download metrics=clip_score,fid,image_reward` (or set --ir-checkpoint "
                 "/path or $IMAGEREWARD_CKPT)",
                 f"ImageReward med_config: {tmp_path / 'med.json'} does not exist (set --ir-med-config"):
        assert line in msg, (line, msg)
    assert "dataset.images" not in msg and "metrics.image_reward" not in msg
    assert f"run folder: {run_dir} does not exist (give it as the first argument)" in msg and not run_dir.exists()


def test_evaluate_cli_prints_the_list_without_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "coolsd.cli.evaluate", str(tmp_path / "run"), "--metrics", "clip_score"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and time.perf_counter() - t0 < 30, proc.stderr
    assert proc.stderr.startswith("error: python -m coolsd.cli.evaluate cannot run: missing files")
    assert "--clip" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
