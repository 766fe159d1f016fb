"""Intervals that respect their quantity's domain: fractions stay in [0, 1],
positive quantities above their bound, toy_fid is null with a reason where n is too small for the
feature covariance, no scipy warning, and the printed table says where n is too small for a CI."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy import stats

from coolsd.util.stats import FRACTION, POSITIVE, REAL, mean_ci, ratio_ci, wilson_interval


def _coverage(draw, truth: float, reps: int, **kw) -> float:
    hits = [(c["lo"] <= truth <= c["hi"]) for c in (mean_ci(draw(), **kw) for _ in range(reps))]
    return float(np.mean(hits))


# ---- each interval: domain, degenerate inputs, coverage -----------------------------------------------
def test_real_is_the_student_t_interval():
    x = np.random.default_rng(3).normal(size=12)
    c = mean_ci(x)
    lo, hi = stats.t.interval(0.95, 11, loc=x.mean(), scale=stats.sem(x))
    assert c["interval"] == "t" and c["ci95"] == pytest.approx([lo, hi]) and c["half_width"] == pytest.approx((hi - lo) / 2)
    rng = np.random.default_rng(4)
    assert _coverage(lambda: rng.normal(size=5), 0.0, 600) == pytest.approx(0.95, abs=0.035)


@pytest.mark.parametrize("domain", [REAL, POSITIVE, FRACTION])
def test_one_value_has_no_interval_and_equal_values_a_zero_width_one(domain):
    assert mean_ci([0.4], domain=domain) == {"mean": 0.4, "n": 1, "no_ci": "n=1: no CI"}
    c = mean_ci([0.4] * 5, domain=domain)
    assert c["lo"] == c["mean"] == c["hi"] == pytest.approx(0.4) and c["half_width"] == 0


def test_positive_stays_above_its_bound_where_t_does_not():
    latency = [0.05, 0.06, 0.05, 2.0]  # one slow prompt: the t-interval goes below 0 s
    assert mean_ci(latency)["lo"] < 0
    c = mean_ci(latency, domain=POSITIVE)
    assert c["interval"] == "log" and 0 < c["lo"] < c["mean"] < c["hi"]
    acc = [1.0, 1.0, 1.0, 4.0]  # accepted length >= 1
    assert mean_ci(acc)["lo"] < 1
    c = mean_ci(acc, domain=POSITIVE, lower=1.0)
    assert 1 < c["lo"] < c["mean"] < c["hi"]
    zeros = mean_ci([0.0, 0.0, 0.0], domain=POSITIVE)  # a lossless method's summed TV: exactly 0
    assert zeros["ci95"] == [0.0, 0.0]
    # coverage of the mean on right-skewed data (Gamma(4), mean 4) at a small n
    rng = np.random.default_rng(0)
    assert _coverage(lambda: rng.gamma(4.0, 1.0, 8), 4.0, 800, domain=POSITIVE) == pytest.approx(0.95, abs=0.035)


def test_fraction_uses_wilson_on_counts_and_logit_otherwise():
    # 0/1 data are binomial counts: Wilson (0 of 10 successes: [0, 0.2775], a textbook value)
    c = mean_ci([0.0] * 10, domain=FRACTION)
    assert c["interval"] == "wilson" and c["lo"] == 0 and c["hi"] == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((1 - 0.2775, 1.0), abs=1e-4)
    assert mean_ci([1.0] * 4, domain=FRACTION)["lo"] > 0.4  # never empty at the boundary
    # toy_clip-like scores (k of 5 attributes): the t-interval leaves [0, 1], the logit one does not
    clip = [1.0, 1.0, 0.6, 1.0]
    assert mean_ci(clip)["hi"] > 1
    c = mean_ci(clip, domain=FRACTION)
    assert c["interval"] == "logit" and 0 <= c["lo"] < c["mean"] < c["hi"] <= 1
    rng = np.random.default_rng(1)
    assert _coverage(lambda: rng.binomial(5, 0.8, 6) / 5, 0.8, 800, domain=FRACTION) >= 0.92
    assert _coverage(lambda: rng.binomial(1, 0.3, 20) * 1.0, 0.3, 800, domain=FRACTION) >= 0.92
    assert _coverage(lambda: rng.beta(2, 1, 5), 2 / 3, 800, domain=FRACTION) == pytest.approx(0.95, abs=0.035)


@pytest.mark.parametrize("values,domain,match", [([0.1, -0.2], POSITIVE, "latency_s: a quantity >= 0"),
                                                 ([0.5, 1.2], FRACTION, r"latency_s: a fraction in \[0, 1\]"),
                                                 ([0.5, float("nan")], REAL, "latency_s: 1 of 2 values are not finite")])
def test_values_outside_the_domain_are_an_error_naming_them(values, domain, match):
    with pytest.raises(ValueError, match=match):
        mean_ci(values, domain=domain, name="latency_s")


def test_ratio_is_a_positive_seeded_bootstrap():
    rng = np.random.default_rng(2)
    den = rng.uniform(0.01, 2.0, 4)
    num = den * rng.uniform(0.5, 3.0, 4)
    c = ratio_ci(num, den, paired=True)
    assert c["interval"] == "bootstrap" and 0 < c["lo"] <= c["mean"] <= c["hi"] and c == ratio_ci(num, den, paired=True)
    assert ratio_ci(num, den, paired=True, seed=1) != c
    assert ratio_ci([2.0], [1.0]) == {"mean": 2.0, "n": 1, "no_ci": "n=1: no CI"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # BCa's jackknife is 0/0 for ar against itself: percentile, no warning
        same = ratio_ci(den, den, paired=True)
    assert same["ci95"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="positive"):
        ratio_ci([1.0, 0.0], [1.0, 1.0])


# ---- a 4-prompt toy summary --------------------------------------------------------------------------
def test_four_prompt_toy_summary_respects_domains_and_says_where_n_is_too_small():
    from coolsd.job.summary import results_table, summary_lines
    from coolsd.toy.load_assets import ASSETS_DIR, FILES, check_manifest
    from coolsd.toy.scenes import render_batch, sample_scenes
    from coolsd.worlds.toy import FEATURES, ToyWorld

    scenes = sample_scenes(4, seed=11)
    truth = render_batch(scenes)
    wrong = render_batch(sample_scenes(4, seed=12))
    images = {"ar": truth, "coolsd": np.concatenate([truth[:3], wrong[3:]])}  # one prompt drawn badly

    def records(tag, latency):
        return [{"params": {"method": tag}, "prompt_index": i, "accepted_length": 1.0 if tag == "ar" else a,
                 "latency_s": t, "decode_s": 0.01, "target_forwards": 64, "step_tv": 0.0 if tag == "ar" else 2.0 + i,
                 "step_kl": 0.0, "target_nll": 3.0 + 0.1 * i, "off_support": 0.0 if tag == "ar" else 0.01 * i}
                for i, (a, t) in enumerate(zip([2.0, 3.0, 2.5, 4.0], latency))]

    outputs = {"ar": (records("ar", [0.5, 0.6, 0.5, 3.0]), images["ar"]),  # skewed: the t-interval crosses 0
               "coolsd": (records("coolsd", [0.05, 0.06, 0.05, 2.0]), images["coolsd"])}
    files = {"assets_dir": None, "assets": {FEATURES: check_manifest(ASSETS_DIR)["sha256"][FILES["features"]]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no LinAlgWarning (nor any other) on the way
        table = results_table(ToyWorld, outputs, scenes, files)
    for tag, e in table.items():
        assert 0 <= e["toy_clip"]["lo"] <= e["toy_clip"]["mean"] <= e["toy_clip"]["hi"] <= 1
        assert e["latency_s"]["lo"] > 0 and e["speedup"]["lo"] > 0 and e["images_per_s"]["lo"] > 0
        assert e["accepted_length"]["lo"] >= 1 and 0 <= e["off_support"]["lo"] and e["off_support"]["hi"] <= 1
        assert e["toy_fid"] is None and e["toy_fid_null_reason"].startswith("n=4 images")
        assert e["toy_fid_minus_ar"] is None and "toy_fid" not in e.get("resolution", {})
    assert mean_ci([0.05, 0.06, 0.05, 2.0])["lo"] < 0  # what the latency column would have said before
    lines = summary_lines(ToyWorld, table)
    assert all("- (n too small)" in line for line in lines[1:3])
    assert any(line.startswith("toy_fid: null: n=4 images") and "run more than" in line for line in lines)
    one = {tag: (recs[:1], imgs[:1]) for tag, (recs, imgs) in outputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lines = summary_lines(ToyWorld, results_table(ToyWorld, one, scenes[:1], files))
    assert "(n=1: no CI)" in lines[1] and "(n=1: no CI)" in lines[2]


# ---- the p-value behind a t-interval, Holm's correction of a family -------------------------------------
def test_t_test_p_is_the_one_sample_t_test_its_interval_inverts():
    from coolsd.util.stats import t_test_p

    x = np.random.default_rng(5).normal(0.2, 1.0, size=40)
    c = mean_ci(x)
    assert t_test_p(c) == pytest.approx(stats.ttest_1samp(x, 0.0).pvalue)
    assert (t_test_p(c) < 0.05) == (not c["lo"] <= 0 <= c["hi"])
    assert t_test_p(mean_ci([0.0, 0.0, 0.0])) == 1.0 and t_test_p(mean_ci([1.0, 1.0])) == 0.0
    with pytest.raises(ValueError, match="Student-t interval"):
        t_test_p(mean_ci([0.5, 0.7], domain=FRACTION))


def test_holm_adjusted_p_values():
    """Holm's step-down values, checked by hand: sorted [0.005, 0.01, 0.03, 0.04] times [4, 3, 2, 1]
    = [0.02, 0.03, 0.06, 0.04], running maximum [0.02, 0.03, 0.06, 0.06], in the input's order."""
    from coolsd.util.stats import holm_adjusted

    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm_adjusted([]).size == 0
    with pytest.raises(ValueError, match=r"p-values in \[0, 1\]"):
        holm_adjusted([0.1, 1.5])
