"""The per-token quality signals through the job: every discrete record carries step_tv / step_kl,
target_nll, off_support and the per-token arrays; summaries carry paired differences to AR and
their resolution; distortion.png is drawn from the records."""
import json

import numpy as np
import pytest

from coolsd.metrics.token_maps import depth_curve, distortion_map, token_grid
from coolsd.cli.runner import run
from coolsd.job.summary import paired_differences, resolution


def _records(folder):
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    from tests import factories

    out = {}
    # (overrides, prompts): the record-level tests of "tree" and "off" need no paired statistics
    # over 4 prompts, 2 (one batch) show what every record and the summary carry
    for name, (extra, n) in {"eagle": (["method=eagle"], 4), "coolsd": (["method=coolsd", "method.delta=2.0"], 4),
                             "tree": (["method=coolsd", "tree=mc_sim_7b_63"], 2),
                             "off": (["method=lantern_pp", "quality_signals=false"], 2)}.items():
        folder = tmp_path_factory.mktemp(name)
        summary = run(factories.compose("target=toy", *extra, f"dataset.n_prompts={n}", "batch_size=4", f"+out_dir={folder}"))
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
        assert set(res["resolution"]) >= {"step_tv", "target_nll", "off_support", "toy_clip"}
        # 4 prompts: too few for the feature covariance (coolsd.metrics.fid.fid_sample_size_reason)
        assert res["toy_fid_minus_ar"] is None and "toy_fid" not in res["resolution"]
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


@pytest.fixture(scope="module")
def toy_world():
    from coolsd.worlds import load_world
    from tests import factories

    return load_world(factories.compose("target=toy"))


def _toy_signals(world, method: str, params: dict, n: int = 24, batch: int = 8):
    """(per-token sampled NLL, per-token expected NLL, per-token H(p) at the token's parent) on
    ``n`` toy prompts; H(p) = what the expected NLL would be if every token were drawn from p."""
    import torch

    from coolsd.engine.decoding.rng import PerSampleRNG
    from coolsd.engine.drafting import build_drafter
    from coolsd.engine.loop import speculative_generate
    from coolsd.toy.scenes import sample_scenes

    m = world.build_method(method, dict(params), "chain", 4)
    t = world.target
    out = []
    for start in range(0, n, batch):
        scenes = sample_scenes(batch, 777 + start)
        drafter = build_drafter(m, world.drafter() if m.drafter == "model" else None, world.sampling, t.vocab_size)
        with torch.no_grad():
            res = speculative_generate(t, t.n_image_tokens, PerSampleRNG(list(range(start, start + batch))),
                                       rule=m.rule, drafter=drafter, tree=m.tree, sampling=world.sampling,
                                       cond=world.encode([s.caption for s in scenes]), batch_size=batch)
        out.append((res.token_nll, res.token_nll_expected))
    return torch.cat([a for a, _ in out]).double(), torch.cat([b for _, b in out]).double()


def _z(x):
    """Mean of the per-image sums of x over its standard error (tokens of an image are martingale
    differences, so the per-image sums are independent with mean 0 under the null)."""
    s = x.sum(1)
    return float(s.mean() / (s.std() / len(s) ** 0.5))


@pytest.mark.parametrize("method, params", [("ar", {}), ("eagle", {}), ("coolsd", {"delta": 3.0}),
                                            ("lantern_pp", {"lam": 2.0, "k": 10}), ("sjd", {"window": 8})])
def test_sampled_nll_is_within_noise_of_its_exact_expectation_on_the_toy_world(toy_world, method, params):
    """token_nll - token_nll_expected has mean 0 given everything before the draw, for every method,
    iff the loop emits each token from the pi it reports (docs/distortion.md, Expected NLL): on the
    neural toy target, where the lab's oracle cannot reach. 24 prompts x 64 tokens, |z| < 4.5."""
    nll, xnll = _toy_signals(toy_world, method, params)
    assert bool(xnll.isfinite().all())
    assert abs(_z(nll - xnll)) < 4.5, (method, float((nll - xnll).mean()))


def test_a_wrong_emitted_distribution_is_caught_by_the_nll_identity(toy_world, monkeypatch):
    """The negative control of the test above: the same COOL-SD (delta 3) run with its reported pi
    replaced by p (what a lossless rule would emit: ``rules.emitted_mixture`` patched) fails the
    identity (64 prompts: z > 4.5), so the test has the power to see a wrong pi."""
    from coolsd.engine.decoding import rules

    monkeypatch.setattr(rules, "emitted_mixture", lambda p, accepted, residual: p)
    nll, xnll = _toy_signals(toy_world, "coolsd", {"delta": 3.0}, n=64, batch=16)
    assert _z(nll - xnll) > 4.5, float((nll - xnll).mean())
