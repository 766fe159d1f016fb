"""Lumina-mGPT through run.py's runner (coolsd.worlds.lumina) on tiny files in the official
layouts: prompt ids from a Chameleon-style text tokenizer, the whole job with self-drafting, and
the stop-before-work error listing every missing file."""
import json

import pytest

from coolsd.runner import run
from coolsd.worlds.lumina import TextPrompts
from factories import code_name, compose as _compose, lumina_overrides


@pytest.fixture(scope="module")
def files(lumina_files):
    return lumina_files


def test_prompt_ids_are_bos_template_and_separator(files):
    from tokenizers import Tokenizer

    enc = TextPrompts(Tokenizer.from_file(str(files["text_tokenizer"])), 768, 768)
    ids = enc.encode(["a red circle", "red"])
    assert ids[0][0] == 0 and ids[0][-1] == 26 and ids[0][-4:-1] == [30, 28, 29]
    assert ids[1][-2:] == [28, 26] and len(ids[0]) == len(ids[1]) + 2
    assert code_name(12) == "IMGIMGBCZ"


def _cfg(files, tmp_path, *extra):
    return _compose("target=lumina_mgpt", "dataset.n_prompts=2", f"+out_dir={tmp_path / 'run'}", *lumina_overrides(files),
                    *extra)


def test_run_py_job_on_tiny_lumina_files_with_self_drafting(files, tmp_path):
    summary = run(_cfg(files, tmp_path, "method=eagle", "tree=chain", "tree.draft_length=3"))
    res = summary["results"]
    assert set(res) == {"ar", "eagle"} and res["ar"]["accepted_length"]["mean"] == 1.0
    assert res["eagle"]["accepted_length"]["mean"] > 3.0  # the target drafting for itself: all accepted
    recs = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(recs) == 4 and all(r["target_forwards"] >= 1 for r in recs)
    assert (tmp_path / "run" / recs[0]["image"]).is_file() and summary["target"] == "lumina_mgpt"


def test_missing_lumina_files_are_listed_before_work(tmp_path):
    cfg = _compose("target=lumina_mgpt", "target.files.model=null", "target.files.vqgan=null",
                   "target.files.text_tokenizer=null", f"+out_dir={tmp_path / 'run'}")
    with pytest.raises(FileNotFoundError) as e:
        run(cfg)
    msg = str(e.value)
    for name, source in [("model", "Alpha-VLLM/Lumina-mGPT-7B-768"), ("vqgan", "vqgan.ckpt"),
                         ("text_tokenizer", "text_tokenizer.json")]:
        assert f"{name}: not set" in msg and source in msg
    assert not (tmp_path / "run").exists()
    with pytest.raises(FileNotFoundError, match="no EAGLE head for Lumina-mGPT"):
        run(_compose("target=lumina_mgpt", "draft=llamagen_xl", f"+out_dir={tmp_path / 'run'}"))
