"""The continuous targets through the runner (``python run.py target=toy_continuous method=cspd``
and ``target=mar_h``): records with CSpD's counters, images, summary with speed-up and toy
metrics, resume after an interruption, batch = single, the MAR adapter on tiny random
checkpoint files of the real classes (strict loading, the VAE decoding), and clear errors for
mismatched method/target and missing files."""
import json

import numpy as np
import pytest

from coolsd.cli.runner import run
from coolsd.toy.continuous import FILES, MANIFEST, load_toy_continuous
from factories import compose, load_benchmark, mar_overrides, toy_continuous_overrides


@pytest.fixture(scope="module")
def assets(toy_continuous_assets):
    return toy_continuous_assets


def _toy(assets, out, *extra):
    return compose("target=toy_continuous", "method=cspd", *toy_continuous_overrides(assets), "dataset.n_prompts=3",
                   "method.gamma=4", f"+out_dir={out}", *extra)


def _records(folder):
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


def test_toy_continuous_run_writes_records_counters_and_summary(assets, tmp_path):
    s = run(_toy(assets, tmp_path / "run"))
    recs = _records(tmp_path / "run")
    assert sorted({r["method"] for r in recs}) == ["ar", "cspd"] and len(recs) == 6
    for r in recs:
        assert (tmp_path / "run" / r["image"]).is_file()
        if r["method"] == "cspd":
            assert r["verified"] == r["drafted"] == 60 and r["target_forwards"] == 4 + 15  # 4 pre-filled, 15 rounds of 4
            assert 0 <= r["accepted"] <= r["verified"] and r["acceptance_rate"] == r["accepted"] / r["verified"]
            assert r["accepted_length"] == 64 / r["target_forwards"]
        else:
            assert r["target_forwards"] == 64 and r["acceptance_rate"] is None
    res = s["results"]
    assert set(res) == {"ar", "cspd"}
    for key in ("speedup", "acceptance_rate", "toy_fid", "toy_clip", "toy_fid_minus_ar", "fallbacks"):
        assert key in res["cspd"], key
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["head"]["steps"] == 4


def test_resume_and_batch_equal_an_uninterrupted_batch_1_run(assets, tmp_path):
    exact = ("method.mode=exact", "method.verify=prefix", "deterministic.batch_invariant=true")
    run(_toy(assets, tmp_path / "a", *exact))
    full = _records(tmp_path / "a")
    # an interrupted batch-3 run: only the first record written, then resumed
    b = tmp_path / "b"
    run(_toy(assets, b, *exact, "batch_size=3"))
    lines = (b / "samples.jsonl").read_text().splitlines()
    (b / "samples.jsonl").write_text(lines[0] + "\n")
    run(_toy(assets, b, *exact, "batch_size=3"))
    again = _records(b)
    key = lambda r: (r["method"], r["prompt_index"])  # noqa: E731
    assert sorted(map(key, again)) == sorted(map(key, full))
    timing = ("latency_s", "decode_s", "hardware", "batch_size", "image")
    for r1 in full:
        r2 = next(r for r in again if key(r) == key(r1))
        assert {k: v for k, v in r1.items() if k not in timing} == {k: v for k, v in r2.items() if k not in timing}


def test_draft_self_accepts_everything_and_reproduces_the_target_images(assets, tmp_path):
    # float32 rows of different batch shapes round alike under the flag (coolsd.engine.batch_invariant)
    s = run(_toy(assets, tmp_path / "self", "draft=self", "method.verify=prefix", "method.mode=exact",
                 "deterministic.batch_invariant=true"))
    assert s["results"]["cspd"]["acceptance_rate"]["mean"] == 1.0
    recs = _records(tmp_path / "self")
    from PIL import Image

    for r in recs:
        if r["method"] == "cspd":
            ar = next(x for x in recs if x["method"] == "ar" and x["prompt_index"] == r["prompt_index"])
            a, b = (np.asarray(Image.open(tmp_path / "self" / x["image"])) for x in (ar, r))
            assert np.array_equal(a, b)


def test_mismatched_method_and_target_are_errors_before_work(assets, tmp_path):
    with pytest.raises(ValueError, match="method=cspd does not run on discrete targets.*discrete targets: ar, budget, coolsd"):
        run(compose("target=toy", "method=cspd", f"+out_dir={tmp_path}"))
    with pytest.raises(ValueError, match="method=coolsd does not run on continuous targets.*continuous targets: ar, cspd"):
        run(compose("target=toy_continuous", "method=coolsd", f"+out_dir={tmp_path}"))
    with pytest.raises(ValueError, match="method.verify='tree' is invalid: valid: parallel, prefix"):
        run(_toy(assets, tmp_path, "method.verify=tree"))
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['delta'\]"):
        run(_toy(assets, tmp_path, "+method.delta=2"))


def test_corrupted_toy_continuous_weights_are_an_error(assets, tmp_path):
    import shutil

    d = tmp_path / "assets"
    shutil.copytree(assets, d)
    with open(d / FILES["draft"], "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="corrupted .*make toy-continuous-assets"):
        load_toy_continuous(d)
    (d / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="make toy-continuous-assets"):
        load_toy_continuous(d)


def test_mar_target_runs_on_tiny_checkpoint_files(mar_files, tmp_path):
    cfg = compose("target=mar_h", "method=cspd", *mar_overrides(mar_files), "dataset.n_prompts=2", "method.gamma=4",
                  f"+out_dir={tmp_path / 'run'}")
    s = run(cfg)
    recs = _records(tmp_path / "run")
    assert len(recs) == 4 and {r["caption"] for r in recs} == {"imagenet class 0", "imagenet class 1"}
    from PIL import Image

    assert Image.open(tmp_path / "run" / recs[0]["image"]).size == (8, 8)  # 4x4 tokens, VAE stride 2
    assert s["target"] == "mar_h" and "speedup" in s["results"]["cspd"]


def test_mar_missing_files_are_named_before_work(tmp_path, monkeypatch):
    for var in ("MAR_H", "MAR_B", "MAR_VAE"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose("target=mar_h", "method=cspd", "dataset=imagenet", "target.device=cpu", f"+out_dir={tmp_path}")
    with pytest.raises(FileNotFoundError) as e:
        run(cfg)
    msg = str(e.value)
    assert "checkpoint: not set" in msg and "vae: not set" in msg and "draft.files.checkpoint" in msg
    assert "LTH14/mar" in msg


def test_continuous_runs_join_the_parquet_table_and_its_summary(assets, tmp_path):
    from coolsd.report.consolidate import records_frame, summary_frame

    run(_toy(assets, tmp_path / "runs" / "paper"))
    run(_toy(assets, tmp_path / "runs" / "exact", "method.mode=exact", "method.verify=prefix"))
    df = records_frame([tmp_path / "runs"])
    assert set(df["config"]) == {"ar", "ar final_noise=True",
                                 "cspd gamma=4 inner_temperature=1 max_rounds=100 mode=paper prefill=0.05 verify=parallel",
                                 "cspd gamma=4 inner_temperature=1 max_rounds=100 mode=exact prefill=0.05 verify=prefix"}
    s = summary_frame(df).set_index("tag")
    for tag in s.index:
        if tag.startswith("cspd"):  # paired with the AR of its own run
            assert 0 < s.loc[tag, "speedup"] and s.loc[tag, "acceptance_rate"] >= 0
            assert s.loc[tag, "target_forwards"] == 19 or "prefix" in tag


def test_continuous_benchmark_smoke_run(assets, tmp_path):
    """benchmarks/continuous_sweep.py end to end on tiny weights: its tables come from the runs
    (``--no-warmup``: the untimed warm-up batches change nothing but the timings); with ``--disa``
    DiSA alone and DiSA + CSpD beside CSpD, and every CSpD row beside the target alone with as many
    target forwards (method.num_iter), sampled as the row's baseline."""

    bench = load_benchmark("continuous_sweep")
    bench.main(["--assets", str(assets), "--prompts", "2,2", "--batches", "1,2", "--gammas", "4", "--modes",
                "paper,exact", "--disa", "6,2", "--no-warmup", "--out", str(tmp_path / "out"),
                "--records", str(tmp_path / "rec")])
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    main = {(r["batch"], r["mode"], r["config"]) for r in rows if r["equal_forwards_of"] is None}
    assert main == {(b, m, c) for b in (1, 2) for m in ("paper", "exact") for c in ("ar", "cspd_g4", "disa",
                                                                                     "disa_cspd_g4")}
    by = {(r["batch"], r["mode"], r["config"]): r for r in rows}
    for b in (1, 2):
        r = by[b, "paper", "cspd_g4"]  # parallel: 4 pre-filled, then one target forward per 4 drafts
        assert r["target_forwards"] == 4 + 15 and abs(r["forwards_saved"] - (1 - 19 / 64)) < 1e-9
        assert r["equal_forwards"] == "ar_nf19" and by[b, "paper", "disa_cspd_g4"]["equal_forwards"] == "disa_nf19"
        eq = by[b, "paper", "ar_nf19"]  # the target alone in 19 MaskGIT steps, its own folder beside AR
        assert eq["target_forwards"] == 19 and eq["head"] == {"num_iter": 19} and eq["equal_forwards_of"] == ["cspd_g4"]
        assert by[b, "paper", "disa_nf19"]["head"] == {"head_steps": 6, "lower_steps": 2, "anneal": "linear",
                                                       "num_iter": 19}
        assert by[b, "paper", "disa"]["head"] == {"head_steps": 6, "lower_steps": 2, "anneal": "linear"}
        x = by[b, "exact", "cspd_g4"]  # prefix: random forwards; its baseline samples the smoothed final step
        assert x["equal_forwards"] == f"ar_nf{round(x['target_forwards'])}_exact"
        assert by[b, "exact", x["equal_forwards"]]["settings"] == {"final_std": 0.3}
    layout = (tmp_path / "out" / "speedup_table.md").read_text()
    assert "| config | acceptance | target fwd | bs=1 | bs=2 | equal-fwd AR | bs=1 | bs=2 |" in layout
    assert "| cspd_g4 | " in layout and "| ar_nf19 | " in layout and "| disa_cspd_g4 | " in layout
    # 2 prompts are too few for toy_fid's feature covariance: null, so no toy_fid Pareto plot
    assert all(r["toy_fid"] is None for r in rows) and not (tmp_path / "out" / "pareto.png").exists()
    assert not (tmp_path / "out" / "equal_forwards.png").exists()
    assert (tmp_path / "out" / "grid.png").is_file()
    # the equal-forwards figure on these rows given toy_fid differences, one interval not holding its point
    import pandas as pd

    df = pd.read_csv(tmp_path / "out" / "table.csv", converters={k: _cell for k in ("equal_forwards_of", "settings",
                                                                                 "head")})
    df["toy_fid_minus_ar"] = range(len(df))
    df["toy_fid_minus_ar_lo"], df["toy_fid_minus_ar_hi"] = df.toy_fid_minus_ar - 3, df.toy_fid_minus_ar + 3
    df.loc[df.index[-1], "toy_fid_minus_ar_lo"] = df.toy_fid_minus_ar.iloc[-1] + 1
    assert bench.equal_forwards_plot(df, tmp_path / "ef.png", "smoke") and (tmp_path / "ef.png").stat().st_size > 10_000
    layout = bench.speedup_layout(df)
    assert "| cspd_g4 | " in layout and " [-3, 3] |" not in layout.split("| cspd_g4 | ")[0]


def _cell(text: str):
    """A list or dict cell of table.csv (written from Python objects); empty: None."""
    import ast

    return ast.literal_eval(text) if text.startswith(("[", "{")) else None
