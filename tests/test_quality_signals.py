"""Issue 15's quality signals through the job: every discrete record carries step_tv / step_kl,
target_nll, off_support and the per-token arrays; summaries carry paired differences to AR and
their resolution; distortion.png is drawn from the records."""
import json

import numpy as np
import pytest

from coolsd.metrics.token_maps import depth_curve, distortion_map, token_grid
from coolsd.runner import run
from coolsd.summary import paired_differences, resolution


def _records(folder):
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    from tests import factories

    out = {}
    for name, extra in {"eagle": ["method=eagle"], "coolsd": ["method=coolsd", "method.delta=2.0"],
                        "tree": ["method=coolsd", "tree=mc_sim_7b_63"],
                        "off": ["method=lantern_pp", "quality_signals=false"]}.items():
        folder = tmp_path_factory.mktemp(name)
        summary = run(factories.compose("target=toy", *extra, "dataset.n_prompts=4", "batch_size=4", f"+out_dir={folder}"))
        out[name] = (summary, _records(folder), folder)
    return out


def test_lossless_records_have_zero_distortion_and_relaxed_ones_positive(toy_runs):
    for name in ("eagle", "coolsd"):
        summary, recs, folder = toy_runs[name]
        for r in recs:
            n = len(r["token_tv"])
            assert n == len(r["token_depth"]) == 64 and abs(sum(r["token_tv"]) - r["step_tv"]) < 1e-3 * n
            assert r["target_nll"] > 0 and 0 <= r["off_support"] <= 1
            if r["method"] in ("ar", "eagle"):
                assert r["step_tv"] == 0.0 and r["step_kl"] == 0.0
            else:
                assert r["step_tv"] > 0 and r["step_kl"] > 0 and max(r["token_depth"]) == 4
        res = summary["results"][name]
        assert set(res["resolution"]) >= {"step_tv", "target_nll", "off_support", "toy_clip", "toy_fid"}
        assert res["target_nll_minus_ar"]["n"] == 4
        assert (folder / "distortion.png").stat().st_size > 0
    assert summary["results"]["ar"]["target_nll_minus_ar"]["mean"] == 0.0


def test_trees_report_likelihood_but_no_distortion(toy_runs):
    summary, recs, _ = toy_runs["tree"]
    for r in recs:
        if r["method"] == "coolsd":
            assert r["step_tv"] is None and r["token_tv"] is None and r["target_nll"] > 0
    assert "step_tv" not in summary["results"]["coolsd"] and "target_nll_minus_ar" in summary["results"]["coolsd"]


def test_paired_differences_pair_by_prompt_and_resolution_is_the_half_width():
    ar = [{"prompt_index": i, "x": float(i)} for i in range(5)]
    rows = [{"prompt_index": i, "x": float(i) + 1 + 0.1 * (i % 2)} for i in reversed(range(5))]
    d = paired_differences(("x", "absent"), ar, rows)["x_minus_ar"]
    assert set(paired_differences(("x", "absent"), ar, rows)) == {"x_minus_ar"}
    assert abs(d["mean"] - 1.04) < 1e-12 and d["n"] == 5
    r = resolution({"x_minus_ar": d, "fid_minus_ar": {"diff": 1.0, "lo": -2.0, "hi": 3.0}, "x": d})
    assert r == {"x": pytest.approx((d["ci95"][1] - d["ci95"][0]) / 2), "fid": 2.5}


def test_distortion_map_and_depth_curve():
    recs = [{"token_tv": [0.1, 0.2, 0.0, 0.4], "token_depth": [1, 2, 0, 1]},
            {"token_tv": [0.3, 0.0, 0.0, 0.2], "token_depth": [1, 0, 0, 2]}, {"token_tv": None, "token_depth": None}]
    np.testing.assert_allclose(distortion_map(recs), [[0.2, 0.1], [0.0, 0.3]])
    c = depth_curve(recs)
    assert c["depth"] == [1, 2] and c["count"] == [3, 2]
    np.testing.assert_allclose(c["mean_tv"], [(0.1 + 0.4 + 0.3) / 3, (0.2 + 0.2) / 2])
    assert token_grid(256) == (16, 16) and token_grid(12) is None
    assert distortion_map([{"token_tv": None}]) is None and depth_curve([{"token_tv": [0.0], "token_depth": [0]}]) is None


def test_quality_signals_false_records_none_and_says_so(toy_runs):
    summary, recs, folder = toy_runs["off"]
    assert summary["quality_signals"] is False  # part of the run's identity (run.json) and summary
    assert all("step_tv" not in r and "target_nll" not in r and "token_tv" not in r for r in recs)
    assert "step_tv" not in summary["results"]["lantern_pp"] and not (folder / "distortion.png").exists()
