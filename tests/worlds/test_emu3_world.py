"""Emu3-Gen through run.py's runner (``coolsd.worlds.emu3``) on a tiny Emu3-Gen-hf folder
(``factories.write_emu3_files``: transformers' own classes, random weights): the prompt ids
against ``Emu3Processor``, the pixels against transformers' decode and the image processor's
postprocess, the stop-before-work listing of the missing folder (in the runner and from
``python run.py``), and whole jobs (AR, SJD, self-drafted EAGLE) that write images and records."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coolsd.cli.runner import run
import factories
from factories import EMU3_GRID as GRID, EMU3_IMAGE_AREA as IMAGE_AREA, EMU3_SPECIAL, compose, emu3_overrides
from target_contract import TargetContract

ROOT = Path(__file__).resolve().parents[2]
N = GRID * GRID
EOS, EOI, EOL, EOF = (EMU3_SPECIAL[t] for t in ("<|extra_204|>", "<|image end|>", "<|extra_200|>", "<|extra_201|>"))
UPSTREAM_NEGATIVE = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, "
                     "worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, "
                     "blurry.")  # BAAI's image_generation.py and transformers' Emu3 docs


@pytest.fixture(scope="module")
def folder(emu3_files):
    return emu3_files  # conftest: factories.write_emu3_files, built once a session


@pytest.fixture(scope="module")
def world(folder):
    from coolsd.worlds import load_world

    return load_world(compose("target=emu3", *emu3_overrides(folder)))


def processor(folder):
    from transformers import AutoTokenizer, Emu3ImageProcessor, Emu3Processor

    return Emu3Processor(Emu3ImageProcessor.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder)))


@pytest.mark.parametrize("negative_header", [True, False])
def test_prompt_ids_are_emu3_processors(folder, negative_header):
    """``encode`` = ``Emu3Processor(text=caption + positive, return_for_image_generation=True)``
    (BOS, text, ``<|image start|>4*4<|image token|>``); the negative prompt with the header as
    BAAI's original formats it, or without as the transformers docs' example does."""
    from coolsd.worlds import load_world

    world = load_world(compose("target=emu3", *emu3_overrides(folder), f"target.negative_header={negative_header}"))
    p, pos, neg = processor(folder), world.encoder.positive, world.encoder.negative
    assert pos == " masterpiece, film grained, best quality."
    for caption, cond in zip(["a red circle", "red"], world.encode(["a red circle", "red"])):
        ref = p(text=[caption + pos], return_for_image_generation=True, image_area=IMAGE_AREA)
        assert list(cond.ids) == ref["input_ids"][0] and ref["image_sizes"] == [[GRID, GRID]]
        assert list(cond.negative) == neg
    text = compose("target=emu3").target.negative_prompt
    assert text == UPSTREAM_NEGATIVE
    ref = p(text=[text], return_for_image_generation=True, image_area=IMAGE_AREA) if negative_header else p(text=[text])
    assert neg == ref["input_ids"][0]


def test_pixels_are_transformers_decode_through_the_image_processor(world, folder):
    """``decode_uint8`` = the model card's ``decode_image_tokens`` of the generated ids, then
    ``processor.postprocess`` (unnormalise, x 255, clip, truncate), as upstream saves images."""
    codes = torch.randint(0, 32, (2, N), generator=torch.Generator().manual_seed(0))
    seq = torch.cat([world.target.codes.to_bpe(codes).view(2, GRID, GRID), torch.full((2, GRID, 1), EOL)], 2)
    seq = torch.cat([seq.view(2, -1), torch.tensor([[EOF, EOI, EOS]] * 2)], 1)
    hf = world.target.model.hf
    pixels = hf.decode_image_tokens(image_tokens=seq, height=GRID, width=GRID)
    ref = processor(folder).postprocess(list(pixels.float()), return_tensors="PIL.Image.Image")["pixel_values"]
    u8 = world.decode_uint8(codes)
    assert u8.shape == (2, 2 * GRID, 2 * GRID, 3) and u8.dtype == np.uint8
    assert np.array_equal(u8, np.stack([np.asarray(im) for im in ref]))
    assert world.codebook().shape == (32, 4) and world.files()["model"]


def test_missing_folder_is_listed_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("EMU3_GEN", raising=False)
    cfg = compose("target=emu3", "target.files.model=null", f"+out_dir={tmp_path / 'run'}")
    with pytest.raises(FileNotFoundError) as e:
        run(cfg)
    msg = str(e.value)
    assert "target 'emu3' cannot run: missing files" in msg
    assert "model: not set (set target.files.model=/path) -- https://huggingface.co/BAAI/Emu3-Gen-hf" in msg
    assert not (tmp_path / "run").exists()
    # python run.py target=emu3 with nothing set: the hub id, not in the (test's empty) cache, in one line
    proc = subprocess.run([sys.executable, "run.py", "target=emu3", "dataset=toy", f"hydra.run.dir={tmp_path / 'h'}"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "model: hf://BAAI/Emu3-Gen-hf is not in the Hugging Face cache" in proc.stderr
    assert "python -m coolsd.cli.download target=emu3" in proc.stderr and not (tmp_path / "h").exists()


def test_bad_sizes_and_tokenizers_are_one_line_errors(tmp_path):
    from types import SimpleNamespace

    from coolsd.worlds.emu3 import Emu3Prompts, Emu3World

    assert Emu3World.image_tokens(compose("target=emu3")) == 90 * 90  # upstream's 720 x 720
    for extra, msg in [("target.ratio=square", "target.ratio='square' is invalid: ratio must be 'W:H'"),
                       ("target.image_area=10", "target.image_area=10 gives a 0x0 token grid")]:
        with pytest.raises(ValueError, match=msg):
            Emu3World.image_tokens(compose("target=emu3", extra))
    with pytest.raises(ValueError, match="the tokenizer lacks boi_token, image_wrapper_token"):
        Emu3Prompts(SimpleNamespace(bos_token="<s>"), GRID, GRID, "", "", True)


def _job(folder, tmp_path, *extra):
    return run(compose("target=emu3", "dataset.n_prompts=2", f"+out_dir={tmp_path / 'run'}",
                       *emu3_overrides(folder), *extra))


def test_run_py_jobs_write_images_and_records(folder, tmp_path):
    """Tiny jobs through the runner: SJD and EAGLE with the target drafting for itself, each beside
    its AR baseline, write a PNG and a record per prompt and method."""
    summary = _job(folder, tmp_path / "sjd", "method=sjd")
    assert set(summary["results"]) == {"ar", "sjd"} and summary["target"] == "emu3"
    assert summary["results"]["ar"]["accepted_length"]["mean"] == 1.0
    summary = _job(folder, tmp_path / "eagle", "draft=self", "method=eagle", "tree=chain", "tree.draft_length=3")
    res = summary["results"]
    assert set(res) == {"ar", "eagle"} and res["eagle"]["accepted_length"]["mean"] > 3.0  # all drafts accepted
    for sub in ("sjd", "eagle"):
        out = tmp_path / sub / "run"
        recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        assert len(recs) == 4 and all(r["target_forwards"] >= 1 for r in recs)
        from PIL import Image

        assert all(Image.open(out / r["image"]).size == (2 * GRID, 2 * GRID) for r in recs)
    with pytest.raises(ValueError, match="draft=self"):
        _job(folder, tmp_path / "none", "method=eagle")


class TestEmu3Contract(TargetContract):
    """The world contract (tests/target_contract.py) on the tiny Emu3-Gen-hf folder."""

    runs = {"emu3": ["method=eagle", "draft=self", "tree=chain", "tree.draft_length=3"]}
    files_fixture = "emu3_files"
    files = staticmethod(factories.write_emu3_files)
    overrides = staticmethod(factories.emu3_overrides)
