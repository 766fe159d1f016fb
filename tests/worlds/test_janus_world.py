"""Janus-Pro through run.py's runner (coolsd.worlds.janus) on a tiny transformers-format folder
(``factories.write_janus_files``: the model tests' tiny model, saved with ``save_pretrained``, and a
word-level tokenizer.json): prompt ids, the stop-before-work listing of the missing folder
(in-process and from the command line), the image grid checked against ``target.image_size``, the
whole job with ``ar``, ``sjd``, self-drafted ``coolsd`` / ``eagle`` (greedy self-drafted EAGLE =
greedy AR, image for image) and the row-parallel ``zipar`` / ``pjd``, and the pixels' upstream truncation."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coolsd.cli.runner import run
import factories
from factories import JANUS_SIDE as SIDE, JANUS_TOKENS as TOKENS, compose, janus_overrides
from target_contract import TargetContract

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(janus_files):
    return janus_files  # conftest: factories.write_janus_files, built once a session


def overrides(folder) -> list[str]:
    """The tiny folder as ``target=janus_pro`` (CPU, float32, 4 x 4 tokens of 2 px: 8 px)."""
    return ["target=janus_pro", *janus_overrides(folder)]


def _cfg(folder, tmp_path, *extra):
    return compose(*overrides(folder), "dataset.n_prompts=2", f"+out_dir={tmp_path / 'run'}", *extra)


def test_prompt_ids_and_the_world_files(folder):
    from coolsd.worlds import load_world

    world = load_world(compose(*overrides(folder), "draft=self"))
    ids = world.encode(["a red circle", "red"])
    assert ids[0][0] == TOKENS.bos and ids[0][-1] == TOKENS.boi and ids[0][1:3] == [6, 8]  # <|User|> :
    assert ids[0][-3:-1] == [7, 8] and len(ids[0]) == len(ids[1]) + 2  # <|Assistant|> :
    assert set(world.files()) == {"model"} and world.drafter() is not world.target
    assert world.target.n_image_tokens == SIDE * SIDE and world.cfg_scale == 5.0
    assert world.settings()["sampling"] == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    assert world.codebook().shape == (32, 8)
    with pytest.raises(ValueError, match=r"target.image_size=12 is not the checkpoint's 4 x 4 .*image_size=8"):
        load_world(compose(*overrides(folder), "target.image_size=12"))


def test_run_py_job_with_ar_sjd_and_self_drafting(folder, tmp_path):
    """ar, sjd and coolsd (draft=self) through the one job: images and records; greedy EAGLE drafted by
    the target itself equals AR image for image."""
    s1 = run(_cfg(folder, tmp_path / "sjd", "method=sjd"))
    assert set(s1["results"]) == {"ar", "sjd"} and s1["target"] == "janus_pro"
    recs = [json.loads(x) for x in (tmp_path / "sjd" / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all((tmp_path / "sjd" / "run" / r["image"]).is_file() for r in recs)
    assert all(sum(r["round_lengths"]) == SIDE * SIDE - 1 for r in recs)
    s2 = run(_cfg(folder, tmp_path / "coolsd", "draft=self", "method=coolsd", "method.delta=1.1"))
    assert set(s2["results"]) == {"ar", "coolsd"} and s2["results"]["coolsd"]["accepted_length"]["mean"] > 1.0

    from types import SimpleNamespace

    from coolsd.worlds import load_world

    world = load_world(compose(*overrides(folder), "draft=self", "sampling.temperature=0"))
    prompts = [SimpleNamespace(caption=c) for c in ["a red circle", "red"]]
    ar = world.generate(world.build_method("ar", {}), prompts, [0, 1])
    eagle = world.generate(world.build_method("eagle", {}, tree="chain", draft_length=4), prompts, [0, 1])
    for a, e in zip(ar, eagle):
        assert a.image.shape == (8, 8, 3) and a.image.dtype == np.uint8
        assert np.array_equal(a.image, e.image) and max(e.fields["round_lengths"]) == 5


@pytest.mark.parametrize("method", ["zipar", "pjd"])
def test_run_py_job_with_row_parallel_methods(folder, tmp_path, method):
    """ZipAR and PJD run on Janus-Pro through the one job (JanusWorld.row_parallel): every image
    token drawn, ZipAR at its default window (half the 4-token rows) in 2 W + (H - 2) w forwards."""
    s = run(_cfg(folder, tmp_path, f"method={method}", "baseline=false"))
    assert set(s["results"]) == {method}
    recs = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(sum(r["round_lengths"]) == SIDE * SIDE - 1 for r in recs)
    if method == "zipar":
        assert all(r["target_forwards"] == 2 * SIDE + (SIDE - 2) * (SIDE // 2) for r in recs)


def test_missing_folder_is_listed_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("JANUS_PRO", raising=False)
    cfg = compose("target=janus_pro", "target.files.model=null", "method=sjd", f"+out_dir={tmp_path / 'run'}")
    with pytest.raises(FileNotFoundError) as e:
        run(cfg)
    msg = str(e.value)
    assert "model: not set (set target.files.model=/path) -- https://huggingface.co/deepseek-community/Janus-Pro-1B" \
        in msg
    assert msg.count("\n") == 1 and not (tmp_path / "run").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="lacks config.json, tokenizer.json, model.safetensors or "
                                                "model.safetensors.index.json"):
        run(compose("target=janus_pro", f"target.files.model={empty}", f"+out_dir={tmp_path / 'run'}"))


def test_run_py_without_files_names_the_hub_folder_in_one_line(tmp_path, monkeypatch):
    """python run.py target=janus_pro_7b (nothing cached, no $JANUS_PRO_7B): one error line naming the
    hub id, the cache and the download command; no traceback, no run folder."""
    monkeypatch.delenv("JANUS_PRO_7B", raising=False)
    proc = subprocess.run([sys.executable, "run.py", "target=janus_pro_7b", "method=sjd", "dataset=toy",
                           f"hydra.run.dir={tmp_path / 'h'}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0
    err = proc.stderr
    assert "model: hf://deepseek-community/Janus-Pro-7B is not in the Hugging Face cache" in err, err[-2000:]
    assert "python -m coolsd.cli.download target=janus_pro_7b" in err and "Traceback" not in err
    assert not (tmp_path / "h").exists()


def test_pixels_are_truncated_as_upstream_not_rounded():
    """generation_inference.py: np.clip((dec + 1) / 2 * 255, 0, 255) assigned into a uint8 array."""
    import torch

    from coolsd.worlds.janus import JanusWorld

    class Fixed:
        def decode_raw(self, tokens):
            return torch.tensor([0.0, 0.999, 1.0, -1.0, 1.7, -1.2, 0.2, -0.3]).view(1, 1, 2, 4).expand(1, 3, 2, 4)

    world = object.__new__(JanusWorld)
    world.target = Fixed()
    u8 = world.decode_uint8(torch.zeros(1, 4, dtype=torch.long))
    assert u8.shape == (1, 2, 4, 3) and u8.dtype == np.uint8
    x = np.array([0.0, 0.999, 1.0, -1.0, 1.7, -1.2, 0.2, -0.3], dtype=np.float32)
    assert u8[0, :, :, 0].ravel().tolist() == np.clip((x + 1) / 2 * 255, 0, 255).astype(np.uint8).tolist()
    assert u8[0, :, :, 0].ravel().tolist() == [127, 254, 255, 0, 255, 0, 153, 89]


class TestJanusContract(TargetContract):
    """The world contract (tests/target_contract.py) on the tiny Janus-Pro folder, for both sizes."""

    runs = {"janus_pro": ["method=coolsd", "draft=self"], "janus_pro_7b": ["method=sjd"]}
    files_fixture = "janus_files"
    files = staticmethod(factories.write_janus_files)
    overrides = staticmethod(factories.janus_overrides)
