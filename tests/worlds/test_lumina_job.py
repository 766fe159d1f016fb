"""Lumina-mGPT through run.py's runner (coolsd.worlds.lumina) on tiny files in the official
layouts: prompt ids from a Chameleon-style text tokenizer, the whole job with self-drafting and
with the EAGLE drafter (draft=lumina_mgpt: eagle, lantern_pp and coolsd through the world's one
generate path; greedy speculative = greedy AR), the stop-before-work error listing every missing
file (the drafter folder with its source), and the pixels' upstream truncation."""
import json

import pytest

from coolsd.cli.runner import run
from coolsd.worlds.lumina import TextPrompts
import factories
from factories import code_name, compose as _compose, lumina_overrides
from target_contract import TargetContract


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
    over = lumina_overrides(files)
    if "draft=self" in extra:
        over = [o for o in over if not o.startswith("draft.")]
    return _compose("target=lumina_mgpt", "dataset.n_prompts=2", f"+out_dir={tmp_path / 'run'}", *over, *extra)


def test_run_py_job_on_tiny_lumina_files_with_self_drafting(files, tmp_path):
    summary = run(_cfg(files, tmp_path, "draft=self", "method=eagle", "tree=chain", "tree.draft_length=3"))
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


def test_coolsd_without_files_lists_the_drafter_folder_with_its_source(tmp_path, monkeypatch):
    """python run.py target=lumina_mgpt method=coolsd method.delta=1.1 without files: every input,
    the drafter folder included (its key, environment variable and source), before any work."""
    import subprocess
    import sys
    from pathlib import Path

    for v in ("LUMINA_MGPT", "CHAMELEON_VQGAN", "CHAMELEON_TEXT_TOKENIZER", "LUMINA_DRAFTER"):
        monkeypatch.delenv(v, raising=False)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "run.py", "target=lumina_mgpt", "method=coolsd", "method.delta=1.1",
                           f"hydra.run.dir={tmp_path / 'h'}", "dataset=toy"], cwd=root, capture_output=True, text=True)
    assert proc.returncode != 0
    err = proc.stderr
    assert "drafter: not set (set draft.path=/path or $LUMINA_DRAFTER)" in err, err[-2000:]
    assert "jadohu/LANTERN issue #1" in err and "trained_drafters" in err
    assert "python -m coolsd.cli.train_drafter target=lumina_mgpt" in err
    assert "model: hf://Alpha-VLLM/Lumina-mGPT-7B-768 is not in the Hugging Face cache" in err and "Traceback" not in err
    cfg = _compose("target=lumina_mgpt", "draft=self")
    from coolsd.worlds.lumina import LuminaWorld

    assert not any("drafter" in m for m in LuminaWorld.missing_files(cfg))  # self-drafting needs no folder


def test_eagle_lantern_pp_and_coolsd_run_through_the_world_and_greedy_eagle_equals_ar(files):
    """draft=lumina_mgpt on the tiny files: the world's one generate path drafts with the EAGLE
    head; greedy EAGLE verification gives AR's images exactly (same batch shape); lantern_pp and
    coolsd run through the same loop."""
    import numpy as np

    from coolsd.models.eagle.lumina import LuminaEagleDrafter
    from types import SimpleNamespace

    from coolsd.worlds import load_world

    world = load_world(_compose("target=lumina_mgpt", "sampling.temperature=0", *lumina_overrides(files)))
    assert isinstance(world.drafter(), LuminaEagleDrafter) and world.target.prefill_features == "all"
    assert set(world.files()) == {"model", "vqgan", "text_tokenizer", "drafter"}
    prompts = [SimpleNamespace(caption=c) for c in ["a red circle", "red"]]
    ar = world.generate(world.build_method("ar", {}), prompts, [0, 1])
    eagle = world.generate(world.build_method("eagle", {}, tree="mc_sim_7b_63"), prompts, [0, 1])
    for a, e in zip(ar, eagle):
        assert np.array_equal(a.image, e.image) and sum(e.fields["round_lengths"]) == 15
    for name, params in (("lantern_pp", {"lam": 2.0, "k": 3}), ("coolsd", {"delta": 1.1})):
        out = world.generate(world.build_method(name, params, tree="mc_sim_7b_63"), prompts, [0, 1])
        assert all(sum(s.fields["round_lengths"]) == 15 and s.image.shape == ar[0].image.shape for s in out)


def test_pixels_are_truncated_as_upstream_not_rounded():
    """chameleon_vae_ori/image_tokenizer.py: clamp, then (x * 255).astype(np.uint8) (truncation).
    0.5 -> 127 (rounding: 128), 0.999 -> 254 (255), out-of-range values clamp first."""
    import numpy as np
    import torch

    from coolsd.worlds.lumina import LuminaWorld

    class Fixed:
        def decode(self, tokens):
            return torch.tensor([0.5, 0.999, 1.0, 0.0, 1.7, -0.2, 0.2, 0.3]).view(1, 1, 2, 4).expand(1, 3, 2, 4)

    world = object.__new__(LuminaWorld)
    world.target = Fixed()
    u8 = world.decode_uint8(torch.zeros(1, 4, dtype=torch.long))
    assert u8.shape == (1, 2, 4, 3) and u8.dtype == np.uint8
    x = np.array([0.5, 0.999, 1.0, 0.0, 1.0, 0.0, 0.2, 0.3], dtype=np.float32)
    assert u8[0, :, :, 0].ravel().tolist() == (x * 255).astype(np.uint8).tolist() == [127, 254, 255, 0, 255, 0, 51, 76]


def test_paper_table2_for_lumina_runs_every_paper_row_and_the_paper_column(files, tmp_path):
    """make paper-table2 TARGETS=lumina_mgpt on tiny files: every row of
    experiments/experiment/table2_lumina_mgpt.yaml (AR, Eagle-1 with the Lumina drafter,
    LANTERN++ lam=2 k=10, COOL-SD delta=1.1, SJD) runs with its metrics, and the table shows
    the paper's numbers beside ours (numbers meaningless here: the layout is what is tested)."""
    from pathlib import Path

    from coolsd.report.paper import table2_rows
    from coolsd.report.real_sweep import real_table2_sweep
    from coolsd.report.table2 import build_table, write_tables
    from factories import CAPTIONS_FIXTURE, tiny_metric_scorers

    scorers = tiny_metric_scorers(tmp_path)
    res = real_table2_sweep("lumina_mgpt", 2, tmp_path / "records", scorers,
                            [*lumina_overrides(files), f"dataset.captions={CAPTIONS_FIXTURE}"])
    table = res["table"]
    assert list(table) == ["ar", "eagle", "lantern_pp_2_10", "coolsd_1.1", "sjd"]
    assert table["ar"]["speedup"]["mean"] == 1.0
    for tag, e in table.items():
        assert {"clip_score", "fid", "latency_s", "accepted_length"} <= set(e), tag
        run_json = json.loads((Path(res["runs"][tag]) / "run.json").read_text())
        assert run_json["methods"].keys() == {e["params"]["method"]}  # AR is its own row
    cfg = json.loads((Path(res["runs"]["eagle"]) / "run.json").read_text())
    assert "mc_sim_7b_63" in json.dumps(cfg["methods"]) and "drafter" in json.dumps(cfg)
    df = build_table("lumina_mgpt", table)
    assert list(df["method"]) == [r["label"] for r in table2_rows("lumina_mgpt")]
    assert list(df["method"])[:4] == ["AR", "Eagle-1", "LANTERN++ (lam=2, k=10)", "COOL-SD delta=1.1"]
    assert list(df["accepted_length_paper"])[:4] == [1.00, 2.76, 2.99, 3.11]
    write_tables(df, tmp_path)
    md = (tmp_path / "table2.md").read_text()
    for label, paper in [("AR", "28.99"), ("Eagle-1", "2.37"), ("LANTERN++ (lam=2, k=10)", "2.99"),
                         ("COOL-SD delta=1.1", "3.11"), ("SJD", "2.06")]:
        line = next(x for x in md.splitlines() if x.startswith(f"| lumina_mgpt | {label} |"))
        assert f"{paper} (" in line, line  # the paper's value with our difference


def test_paper_table2_lumina_lists_everything_missing_before_work(tmp_path, monkeypatch):
    from coolsd.report.table2 import main

    for v in ("LUMINA_MGPT", "CHAMELEON_VQGAN", "CHAMELEON_TEXT_TOKENIZER", "LUMINA_DRAFTER", "COCO_CAPTIONS",
              "CLIP_DIR", "COCO_VAL_IMAGES", "INCEPTION_WEIGHTS"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(SystemExit) as e:
        main(["--targets", "lumina_mgpt", "--records", str(tmp_path / "rec"), "--inception", str(tmp_path / "no.pth")])
    msg = str(e.value)
    for part in ("lumina_mgpt: model: hf://Alpha-VLLM/Lumina-mGPT-7B-768", "drafter: not set (set draft.path=/path or $LUMINA_DRAFTER)",
                 "jadohu/LANTERN issue #1", "COCO captions", "CLIP model folder", "Inception weights"):
        assert part in msg, part
    assert not (tmp_path / "rec").exists()


class TestLuminaContract(TargetContract):
    """The world contract (tests/target_contract.py) on tiny Lumina-mGPT files: the model folder,
    vqgan.ckpt, the text tokenizer and the EAGLE drafter folder."""

    runs = {"lumina_mgpt": ["method=eagle", "tree=chain", "tree.draft_length=3"]}
    files_fixture = "lumina_files"
    files = staticmethod(factories.write_lumina_files)
    overrides = staticmethod(factories.lumina_overrides)
