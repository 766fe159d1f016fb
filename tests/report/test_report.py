"""Reports: parquet consolidation, paired comparison, the Table 2 layout, Pareto plots."""
import json

import numpy as np
import pandas as pd
from pathlib import Path

import pytest
from scipy import stats

from coolsd.util.records import RecordWriter, read_records
from coolsd.report.compare import paired_comparison
from coolsd.report.consolidate import config_label, records_frame, summary_frame
from coolsd.report.paper import TABLE2, table2_rows
from coolsd.report.plots import pareto_plot
from coolsd.report.table2 import build_table, check_target, tag_of, write_tables

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _ci(m, h=0.1):
    return {"mean": m, "ci95": [m - h, m + h]}


def fake_table():
    out = {}
    for k, (tag, method, params) in enumerate(
            [(tag_of(r["method"], r["params"]), r["method"], r["params"]) for r in table2_rows("toy")]):
        out[tag] = {"params": {"method": method, **params}, "accepted_length": _ci(1 + k * 0.5), "latency_s": _ci(1.0 / (1 + k)),
                    "toy_clip": _ci(0.9 - 0.01 * k), "speedup": _ci(1 + k * 0.3), "target_forwards": _ci(64 / (1 + k)),
                    "toy_fid": {"fid": 10 + k, "lo": 9 + k, "hi": 11 + k},
                    "toy_clip_minus_ar": _ci(-0.01 * k), "toy_fid_minus_ar": {"diff": float(k), "lo": k - 1.0, "hi": k + 1.0},
                    "speedup_per_accepted_length": (1 + k * 0.3) / (1 + k * 0.5),
                    "speedup_vs_fastest_ar": _ci(0.5 + k * 0.15), "fastest_ar": "ar_compiled",
                    "target_nll_minus_ar": _ci(0.01 * k, 0.005), **({"step_tv": _ci(2.0 * k)} if k != 2 else {})}
    return out


def test_paper_table_matches_methods_md():
    """coolsd.report.paper's transcription of the paper's Table 2 is the table of docs/methods.md#7-reference-numbers."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text()
    for t, label, _, clip, fid, ir, tau, lat, sp in TABLE2:
        if clip is not None:
            assert f"| {label} | {clip:.4f} | {fid:.2f} | {ir:.4f} | {tau:.2f} | {lat:.2f} | {sp:.2f}x |" in text, label
    rows = table2_rows("llamagen_xl")
    assert [r["label"] for r in rows][1:] == ["Eagle-1", "LANTERN++ (lam=2, k=10)", "COOL-SD delta=1.1", "COOL-SD delta=2"]
    assert all(v is None for v in table2_rows("toy")[1]["paper"].values())


def test_table2_layout_names_toy_metrics_and_shows_no_false_difference(tmp_path):
    df = build_table("toy", fake_table())
    assert list(df["method"]) == [r["label"] for r in table2_rows("toy")]
    assert df["clip_score_ours_metric"].eq("toy_clip").all() and df["fid_ours_metric"].eq("toy_fid").all()
    assert df["clip_score_diff"].isna().all()  # toy_clip is not CLIP score: no difference to the paper
    assert df.loc[1, "accepted_length_ours"] == 1.5 and df.loc[1, "accepted_length_lo"] == pytest.approx(1.4)
    write_tables(df, tmp_path)
    md = (tmp_path / "table2.md").read_text()
    assert "clip_score: toy_clip" in md and "| toy | Eagle-1 | " in md and "CLIP ours (toy_clip)" in md
    assert "| 2.00 [1.90, 2.10] | +0.0100 [+0.0050, +0.0150] | - | - |" in md.splitlines()[5]  # Eagle-1's signals
    assert md.splitlines()[6].endswith("| - | +0.0200 [+0.0150, +0.0250] | - | - |")  # no step TV for that row
    assert pd.read_csv(tmp_path / "table2.csv").shape[0] == len(df)
    assert r"\begin{tabular}" in (tmp_path / "table2.tex").read_text()


def test_table2_shows_the_speedup_against_same_mode_ar_and_against_the_fastest_ar(tmp_path):
    df = build_table("toy", fake_table())
    assert df.loc[1, "speedup_ours"] == 1.3 and df.loc[1, "speedup_vs_fastest_ar"] == pytest.approx(0.65)
    assert df.loc[1, "speedup_vs_fastest_ar_lo"] == pytest.approx(0.55) and (df["fastest_ar"] == "ar_compiled").all()
    write_tables(df, tmp_path)
    md = (tmp_path / "table2.md").read_text()
    head = md.splitlines()[2]
    assert "| speed-up (same-mode AR) ours | speed-up (same-mode AR) paper (diff) | speed-up (fastest AR) ours |" in head
    assert "| 1.30 [1.20, 1.40] | - | 0.65 [0.55, 0.75] | 2.00 [1.90, 2.10] |" in md.splitlines()[5]  # Eagle-1
    assert "fastest AR: toy: ar_compiled" in md and "against its eager PyTorch AR" in md
    tex = (tmp_path / "table2.tex").read_text()
    assert "speed-up (fastest AR) ours" in tex and "& 0.65 {[}0.55, 0.75{]}" in tex


def test_real_targets_stop_before_work_naming_what_is_missing():
    with pytest.raises(ValueError, match=r"unknown target 'llamagen_xxl'.*configured targets: \[.*'toy'"):
        check_target("llamagen_xxl")
    with pytest.raises(ValueError, match="theory lab"):
        check_target("tabular")
    assert check_target("toy").__name__ == "ToyWorld"


def test_pareto_plot_writes_png_and_pdf(tmp_path):
    from coolsd.report.sweep import sweep_frame

    files = pareto_plot(sweep_frame(fake_table()), tmp_path / "p.png", ["toy_fid", "toy_clip", "fid"], "t")
    assert [f.suffix for f in files] == [".png", ".pdf"] and all(f.stat().st_size > 1000 for f in files)
    with pytest.raises(ValueError, match="none of the metrics"):
        pareto_plot(sweep_frame(fake_table()), tmp_path / "q.png", ["fid"], "t")
    df = sweep_frame(fake_table())  # a bootstrap interval that does not hold its point (FID's, biased up)
    df["toy_fid_lo"] = df["toy_fid"] + 1
    assert pareto_plot(df, tmp_path / "r.png", ["toy_fid"], "t")[0].stat().st_size > 1000


def _records(tmp_path, name, values, seeds=None):
    w = RecordWriter(tmp_path / name)
    for i, v in enumerate(values):
        for tag, x in v.items():
            w.append({"method": tag, "prompt_index": i, "seed": (seeds or range(len(values)))[i], "accepted_length": x,
                      "round_lengths": [1, 2]}, np.zeros((4, 4, 3), np.uint8), f"{tag}/{i:05d}.png")
    return read_records(w.path)


def test_paired_comparison_is_a_paired_t_test(tmp_path):
    r = np.random.default_rng(0)
    a, b = r.normal(3, 1, 30), r.normal(2.8, 1, 30)
    recs = _records(tmp_path, "run", [{"coolsd": x, "lantern_pp": y} for x, y in zip(a, b)])
    out = paired_comparison(recs, "coolsd", recs, "lantern_pp")
    ref = stats.ttest_rel(a, b)
    assert out["n"] == 30 and out["p_value"] == pytest.approx(ref.pvalue) and out["t"] == pytest.approx(ref.statistic)
    assert out["diff"]["mean"] == pytest.approx((a - b).mean())
    other = _records(tmp_path, "other", [{"lantern_pp": y} for y in b], seeds=list(range(100, 130)))
    with pytest.raises(ValueError, match="different seeds"):
        paired_comparison(recs, "coolsd", other, "lantern_pp")
    with pytest.raises(ValueError, match="no records of method 'eagle'"):
        paired_comparison(recs, "eagle", recs, "coolsd")


def test_records_of_many_runs_consolidate_to_parquet(tmp_path):
    _records(tmp_path / "multirun", "0_coolsd", [{"coolsd": 2.0}, {"coolsd": 3.0}])
    _records(tmp_path / "multirun", "1_eagle", [{"eagle": 1.5}])
    (tmp_path / "multirun" / "0_coolsd" / "run.json").write_text(json.dumps({"seed": 0}))
    df = records_frame([tmp_path / "multirun"])
    assert len(df) == 3 and df["run"].nunique() == 2
    assert json.loads(df.loc[0, "round_lengths"]) == [1, 2] and df["image_path"].map(lambda p: p.endswith(".png")).all()
    df.to_parquet(tmp_path / "t.parquet")
    assert pd.read_parquet(tmp_path / "t.parquet").equals(df)
    with pytest.raises(FileNotFoundError, match="no samples.jsonl"):
        records_frame([tmp_path / "multirun" / "0_coolsd" / "images"])


def _sweep_records(root, runs: dict, n: int):
    """A multirun-like folder: per run, AR and one method on the same n prompts (toy identity)."""
    r = np.random.default_rng(1)
    lat = {}
    for run, params in runs.items():
        w = RecordWriter(root / run)
        (root / run / "run.json").write_text(json.dumps({"target": "toy"}))
        for i in range(n):
            for p in ({"method": "ar", "drafter": "none", "tree": "none"}, params):
                x = float(r.uniform(0.5, 1.5))
                lat[(run, p["method"], i)] = x
                img = r.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                w.append({"method": p["method"], "params": p, "prompt_index": i, "seed": i, "accepted_length": 1.0 + i % 3,
                          "latency_s": x, "target_forwards": 64}, img, f"{p['method']}/{i:05d}.png")
    return lat


RUNS = {"0_coolsd": {"method": "coolsd", "drafter": "model", "tree": "chain4", "delta": 1.1, "rule": "scaled", "omega": [2, 1]},
        "1_coolsd": {"method": "coolsd", "drafter": "model", "tree": "chain4", "delta": 2.0, "rule": "scaled", "omega": [3, 1]}}


def test_summary_frame_pairs_speedups_with_ar_of_the_same_run(tmp_path):
    lat = _sweep_records(tmp_path / "mr", RUNS, 6)
    df = records_frame([tmp_path / "mr"])
    assert set(df["config"]) == {"ar", "coolsd delta=1.1 tree=chain4", "coolsd delta=2 tree=chain4"}
    assert config_label({"method": "lantern_pp", "lam": 2.0, "k": 10, "slope": None}) == "lantern_pp k=10 lam=2"
    s = summary_frame(df).set_index("tag")
    assert s.loc["ar", "n"] == 12 and s.loc["ar", "runs"] == 2
    for run, p in RUNS.items():
        ar = np.array([lat[(run, "ar", i)] for i in range(6)])
        m = np.array([lat[(run, "coolsd", i)] for i in range(6)])
        row = s.loc[config_label(p)]
        assert row["speedup"] == pytest.approx(ar.mean() / m.mean())  # AR of its own run, not of both
        assert row["speedup_lo"] < row["speedup"] < row["speedup_hi"]
        assert row["latency_s"] == pytest.approx(m.mean())
        assert row["speedup_vs_fastest_ar"] == row["speedup"]  # no compiled AR in these runs: the fastest is ar


def test_summary_frame_keeps_a_runs_compiled_ar_apart_and_takes_the_faster(tmp_path):
    lat = _sweep_records(tmp_path / "mr", RUNS, 6)
    rng = np.random.default_rng(2)
    fast = {}
    for k, run in enumerate(RUNS):  # run 0's compiled AR is faster than its ar, run 1's slower
        w = RecordWriter(tmp_path / "mr" / run)
        for i in range(6):
            fast[(run, i)] = lat[(run, "ar", i)] * (0.5 if k == 0 else 2.0) * float(rng.uniform(0.9, 1.1))
            w.append({"method": "ar_compiled", "params": {"method": "ar", "drafter": "none", "tree": "none",
                                                          "compiled": True},
                      "prompt_index": i, "seed": i, "accepted_length": 1.0, "latency_s": fast[(run, i)],
                      "target_forwards": 64})
    s = summary_frame(records_frame([tmp_path / "mr"])).set_index("tag")
    assert "ar compiled=True" in s.index and s.loc["ar", "n"] == 12  # never pooled with ar
    for k, (run, p) in enumerate(RUNS.items()):
        m = np.array([lat[(run, "coolsd", i)] for i in range(6)])
        ar = np.array([lat[(run, "ar", i)] for i in range(6)])
        ref = np.array([fast[(run, i)] for i in range(6)]) if k == 0 else ar
        row = s.loc[config_label(p)]
        assert row["speedup"] == pytest.approx(ar.mean() / m.mean())
        assert row["speedup_vs_fastest_ar"] == pytest.approx(ref.mean() / m.mean())


def test_notebook_runs_on_a_consolidated_table(tmp_path, monkeypatch):
    """Executes every code cell of notebooks/pareto_from_parquet.ipynb on a small sweep."""
    _sweep_records(tmp_path / "mr", RUNS, 4)
    records_frame([tmp_path / "mr"]).to_parquet(tmp_path / "runs.parquet")
    monkeypatch.setenv("COOLSD_TABLE", str(tmp_path / "runs.parquet"))
    monkeypatch.chdir(tmp_path)
    nb = json.loads((ROOT / "notebooks" / "pareto_from_parquet.ipynb").read_text())
    scope: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "notebook", "exec"), scope)
    s = scope["summary"].set_index("tag")
    assert {"speedup", "toy_clip"} <= set(s.columns) and s["toy_clip"].between(0, 1).all()
    assert (tmp_path / "pareto_from_parquet.png").stat().st_size > 10_000


def test_tracking_flattens_summaries_and_rejects_unknown_loggers():
    from coolsd.job.tracking import NullLogger, flatten_summary, make_logger

    flat = flatten_summary(fake_table())
    assert flat["eagle/accepted_length"] == 1.5 and flat["eagle/accepted_length_lo"] == pytest.approx(1.4)
    assert flat["ar/toy_fid"] == 10 and flat["ar/toy_fid_hi"] == 11 and flat["eagle/toy_fid_minus_ar"] == 1.0
    assert "ar/params" not in flat
    assert isinstance(make_logger(None, {}, "x"), NullLogger) and isinstance(make_logger({"name": "none"}, {}, "x"), NullLogger)
    with pytest.raises(ValueError, match="unknown logger 'tb'; valid: none, wandb"):
        make_logger({"name": "tb"}, {}, "x")


def _wandb_records(path):
    """Records of an offline run's ``run-*.wandb`` file: W&B's log format (a 7-byte ':W&B'
    header, 32 KiB blocks of chunks with a <crc32, length, type> header, type 1 = full,
    2/3/4 = first/middle/last), each payload a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if n == 0 and kind == 0:
            break
        buf += data[pos:pos + n]
        pos += n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r
            buf = b""


def test_wandb_offline_run_contains_the_logged_keys(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from coolsd.job.tracking import make_logger

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"name": "wandb", "project": "coolsd-test", "mode": "offline", "dir": str(tmp_path), "n_images": 2}
    log = make_logger(cfg, {"method": {"name": "coolsd", "delta": 2.0}}, "test")
    log.log_summary(fake_table())
    log.log_images("eagle", np.zeros((3, 8, 8, 3), np.uint8), ["a", "b", "c"])
    log.finish()
    files = list(tmp_path.rglob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    import time

    from google.protobuf.message import DecodeError

    want = {"eagle/accepted_length", "eagle/accepted_length_lo", "ar/toy_fid_hi", "eagle/toy_fid_minus_ar",
            "eagle/speedup", "eagle/speedup_vs_fastest_ar", "eagle/speedup_vs_fastest_ar_lo"}
    # W&B's service process may still be flushing the file after finish() (seen under load: a
    # truncated record, or the summary not written yet): read again until it holds the summary
    for attempt in range(120):
        summary, history, config = set(), set(), {}
        try:
            for r in _wandb_records(files[0]):
                kind = r.WhichOneof("record_type")
                if kind == "summary":
                    summary |= {u.key or u.nested_key[0] for u in r.summary.update}
                elif kind == "history":
                    history |= {u.key or u.nested_key[0] for u in r.history.item}
                elif kind == "run":
                    config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        except DecodeError:
            if attempt == 119:
                raise
        if want <= summary:
            break
        time.sleep(0.25)
    assert want <= summary
    assert "samples/eagle" in history
    assert config["method"] == {"name": "coolsd", "delta": 2.0}
