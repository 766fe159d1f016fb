"""benchmarks/gpu.py runs end to end (tiny shapes on the CPU): the numbers it commits come from
the production loop, and self-drafting accepts every drafted token."""
import json
from pathlib import Path

import numpy as np
import pytest
from factories import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_smoke_run(tmp_path, dynamo_only):
    """Both modes of benchmarks/gpu.py on tiny models. Its compiled mode runs Dynamo's graphs on the
    ``eager`` backend here (``dynamo_only``): the benchmark's own logic (warm-up, graph counts, the
    compiled-AR ratio) is what this checks (Inductor's code took ~85 of this test's ~90 s)."""
    bench = load_benchmark("gpu")
    out = bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "1", "--tree", "chain",
                      "--draft-length", "3", "--out", str(tmp_path)])
    for mode in ("eager", "compiled"):
        gen = out["modes"][mode]["generation"]
        assert gen["ar"]["accepted_length"] == 1.0 and gen["ar"]["speedup"] == 1.0
        for name in ("eagle_self", "coolsd2_self"):  # the target drafting for itself: whole chains accepted
            assert 3.5 < gen[name]["accepted_length"] <= 4.0
        assert gen["eagle_head"]["round_in_ar_steps"] > 0
        assert out["modes"][mode]["forwards_batch1"]["tree_tokens"] == 4
    assert out["modes"]["compiled"]["graphs_compiled_after_warmup"] == 0
    assert out["ar_compiled_vs_eager"] > 0 and out["bandwidth_gbs"] is None
    assert json.loads((tmp_path / "tiny_cpu.json").read_text())["image_tokens"] == 16
    assert "| eagle_self |" in (tmp_path / "tiny_cpu.md").read_text()
    assert bench.bandwidth_of("NVIDIA H200") == 4800 and bench.bandwidth_of("NVIDIA A100-SXM4-40GB") == 1555


def _load(name):
    return load_benchmark(name)


def test_the_demo_checks_list_what_a_tree_leaves_undefined_instead_of_failing():
    """On a tree (``--tree mc_sim_7b_63``) the exact distortion and the expected NLL are chain-only
    (None in the records, absent from the table): those checks are listed as not checked, the
    others still run."""
    checks = _load("toy_sweep").distortion_checks
    ci = _t_interval(0.01, 0.1)
    rec = {"step_tv": None, "target_nll": 1.0, "target_nll_expected": None}
    outputs = {t: ([{**rec, "step_tv": 0.0} if t in ("eagle", "sjd") else rec], None)
               for t in ("ar", "eagle", "sjd", "coolsd_2")}
    table = {"eagle": {"params": {"method": "eagle"}, "target_nll_minus_ar": ci},
             "sjd": {"params": {"method": "sjd"}, "target_nll_minus_ar": ci},
             "coolsd_2": {"params": {"method": "coolsd", "delta": 2.0}, "target_nll_minus_ar": ci}}
    lines = checks(outputs, table)
    assert "- ok: eagle: step_tv is exactly 0 on every image (max |step_tv| = 0)" in lines
    assert any(x.startswith("- not checked: coolsd: step_tv positive") for x in lines)
    assert any(x.startswith("- ok: sjd: NLL shift vs AR") for x in lines)
    assert any(x.startswith("- not checked: eagle: expected-NLL shift") for x in lines)
    assert sum(x.startswith("- not checked:") and "sampled NLL" in x for x in lines) == 4
    assert not any("FAILED" in x for x in lines)


def test_toy_throughput_smoke_run_and_the_batch_invariant_rows(tmp_path):
    """benchmarks/toy_throughput.py on 3 prompts (batch 2: a full batch and a remainder): every
    (batch, method, flag) row, and with ``batch_invariant`` the batch-2 images equal the batch-1
    images. ``--no-warmup``: the untimed warm-up batches change nothing but the timings."""
    rows = _load("toy_throughput").main(["--prompts", "3", "--batches", "1,2", "--no-warmup", "--out", str(tmp_path)])
    assert len(rows) == 2 * 3 * 2
    for (B, tag, inv), r in rows.items():
        assert r["images_per_s"] > 0 and r["accepted_length"] >= 1.0
        if inv:
            assert r["images_equal_batch1"], (B, tag)
    assert "| 2 | coolsd_2 | yes |" in (tmp_path / "table.md").read_text()


def test_toy_sweep_smoke_run(tmp_path):
    """benchmarks/toy_sweep.py (make demo) on 2 prompts: the table, plot, grid and page from one run folder."""
    _load("toy_sweep").main(["--prompts", "2", "--out", str(tmp_path / "out"), "--records", str(tmp_path / "rec")])
    table = (tmp_path / "out" / "table.md").read_text()
    assert all(f"| {tag} |" in table for tag in ("ar", "eagle", "coolsd_2", "sjd"))
    assert {"table.csv", "summary.json", "pareto.png", "grid.png", "page.html"} <= {p.name for p in (tmp_path / "out").iterdir()}
    page = (tmp_path / "out" / "page.html").read_text()
    assert page.count('<img class="sample"') == 2 * len(_load("toy_sweep").SWEEP)  # every method, every prompt
    assert json.loads((tmp_path / "rec" / "run.json").read_text())["target"] == "toy"


def _claims():
    mod = load_benchmark("claims")
    return mod


def test_claims_compare_interpolates_b_and_pairs_by_prompt():
    """benchmarks/claims.py: A's point against B interpolated at A's accepted length, paired per prompt;
    the verdict follows the CIs (lower is better for distortion)."""

    c = _claims()
    tau = {"eagle": 2.0, "uniform_rsd_1.5": 2.5, "uniform_rsd_2.0": 3.0, "uniform_rsd_3.0": 3.5, "uniform_rsd_5.0": 4.0,
           **{t: 2.75 + 0.5 * i for i, (t, *_) in enumerate(c.CURVES["coolsd exp (mean)"])}}
    assert c.bracket(2.75, c.curve_points("uniform_rsd", tau), tau) == ("uniform_rsd_1.5", "uniform_rsd_2.0", 0.5)
    assert c.bracket(4.5, c.curve_points("uniform_rsd", tau), tau) is None
    rng = np.random.default_rng(0)
    n = 60
    noise = rng.normal(size=n)
    per_prompt = {m: {} for m in c.METRICS if m != "toy_fid"}
    for t in tau:  # B's distortion grows with accepted length; A sits 0.5 below B's line, with shared prompt noise
        base = 2.0 * (tau[t] - 2.0) + noise
        for m in per_prompt:
            per_prompt[m][t] = base - (0.5 if t.startswith("coolsd") else 0.0)
    feats = {t: rng.normal(size=(n, 3)) for t in tau}
    rows = c.compare("coolsd exp (mean)", "uniform_rsd", tau, per_prompt, feats, rng.normal(size=(n, 3)))
    assert [r["a"] for r in rows] == [t for t, *_ in c.CURVES["coolsd exp (mean)"]][:3]  # the 4th is past B's range
    for r in rows:
        assert abs(r["step_tv"]["mean"] + 0.5) < 1e-9 and r["step_tv"]["ci95"][1] - r["step_tv"]["ci95"][0] < 1e-9
    assert c.verdict(rows, "step_tv").startswith("supported")
    assert c.verdict(rows, "toy_clip").startswith("contradicted")  # higher is better there
    assert c.verdict([], "step_tv").startswith("not comparable")
    assert c.verdict([{"step_tv": {"ci95": [-1.0, 1.0]}}], "step_tv") == "unresolved at this n"


def test_nll_coverage_counts_misses_against_the_binomial_tail():
    """benchmarks/nll_coverage.py: blocks by prompt index, the paired shift per block, the misses of
    0 and the pre-registered verdict (P(Binomial(blocks, 0.05) >= misses) < 0.05 -> not calibrated)."""
    c = _load("nll_coverage")
    rng = np.random.default_rng(0)
    n, blocks, block = 200, 20, 10
    ar = rng.normal(size=n)
    records = [{"method": "ar", "prompt_index": i, "v": float(ar[i])} for i in range(n)]
    unbiased = [{"method": "eagle", "prompt_index": i, "v": float(ar[i] + rng.normal())} for i in range(n)]
    shift = c.paired_shifts(records + unbiased[::-1], "eagle", "v")  # pairing by index, not by order
    assert list(shift) == list(range(n)) and abs(shift[7] - (unbiased[7]["v"] - ar[7])) < 1e-12
    res = c.coverage(shift, blocks, block)
    assert res["verdict"] == "calibrated" and res["misses"] <= 3 and res["pooled"]["n"] == n
    assert [r["block"] for r in res["blocks"]] == list(range(blocks))
    biased = c.coverage({i: v + 1.5 for i, v in shift.items()}, blocks, block)  # a shift of 1.5 sd per prompt
    assert biased["misses"] >= 10 and biased["verdict"] == "miscalibrated or biased" and biased["p_upper_tail"] < 0.05
    for misses, tail in ((0, 1.0), (4, 0.0159)):  # the rule's threshold at 20 blocks: 4 misses
        assert abs(float(c.sps.binom.sf(misses - 1, 20, c.ALPHA)) - tail) < 1e-4
    with pytest.raises(ValueError, match="block 19"):
        c.coverage({i: v for i, v in shift.items() if i != n - 1}, blocks, block)


def test_signal_overhead_smoke_run(tmp_path):
    """benchmarks/signal_overhead.py on 2 prompt groups at batch 1 (eager): a row per method with the
    paired intervals around its wall-time and CPU-time overheads and the loop's own timing of the signal work."""
    c = _load("signal_overhead")
    c.main(["--modes", "eager", "--batches", "1", "--prompts", "2", "--methods", "eagle,lantern_pp",
            "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "signal_overhead.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["eagle", "lantern_pp"]
    for r in rows:
        for key in ("overhead", "cpu_overhead"):  # wall time and the loop thread's CPU time
            lo, hi = r[f"{key}_ci"]
            assert lo <= r[key] <= hi
        assert r["ms_on"] > 0 and r["ms_off"] > 0
        assert 0 < r["timed_share"] < 1  # eager rounds time their signal work
    assert "| eager | 1 | lantern_pp |" in (tmp_path / "signal_overhead.md").read_text()
    with pytest.raises(SystemExit):  # a one-line usage error before any world is loaded
        c.main(["--modes", "eager", "--methods", "eagle,no_such_method", "--out", str(tmp_path)])


def _t_interval(mean: float, half_width: float, n: int = 120) -> dict:
    """A ``mean_ci`` t-interval with this mean and 95% half-width (``std`` solved from it)."""
    from scipy import stats

    sd = half_width * n ** 0.5 / stats.t.ppf(0.975, n - 1)
    return {"mean": mean, "ci95": [mean - half_width, mean + half_width], "std": sd, "n": n, "interval": "t"}


def _sweep_checks(nll_shift: dict, n_methods: int = 10) -> list[str]:
    """``distortion_checks`` of a synthetic sweep: eagle's NLL shift vs AR is ``nll_shift``, every
    other zero-mean check is exactly 0 (sampled NLL = its expectation; shifts 0 with zero width)."""
    rec = [{"step_tv": 0.0, "target_nll": 1.5, "target_nll_expected": 1.5}] * 120
    tags = ["ar", "eagle", "sjd"] + [f"m{k}" for k in range(n_methods - 3)]
    zero = _t_interval(0.0, 0.0)
    table = {t: {"params": {"method": t}, "target_nll_minus_ar": zero, "target_nll_expected_minus_ar": zero}
             for t in ("eagle", "sjd")}
    table["eagle"]["target_nll_minus_ar"] = nll_shift
    return _load("toy_sweep").distortion_checks({t: (rec, None) for t in tags}, table)


def test_a_check_says_whether_its_interval_contains_0():
    """Each zero-mean check states what its interval shows: an interval that misses 0 reads
    "excludes 0", never the goal's "contains 0"."""
    lines = _sweep_checks(_t_interval(-0.0300, 0.0272))
    eagle = next(x for x in lines if ": eagle: NLL shift vs AR" in x)
    assert "-0.0300 [-0.0572, -0.0028]" in eagle and "95% interval excludes 0" in eagle and "contains 0" not in eagle
    sjd = next(x for x in lines if ": sjd: NLL shift vs AR" in x)
    assert "95% interval contains 0" in sjd and "excludes 0" not in sjd


def test_the_zero_mean_checks_are_one_holm_family_stated_in_the_output():
    """14 checks of a mean of 0, one of which misses 0 at p ~ 0.03, is what chance gives: Holm's
    adjusted p (14 x 0.03 > 0.05) keeps it ok, while its own interval is still reported as excluding
    0. A check far outside (p ~ 1e-6) fails, and only a failure makes the demo's exit status 1
    (``failed_checks``). A line states the family's size, the correction and the level."""
    sweep = _load("toy_sweep")
    lines = _sweep_checks(_t_interval(0.03, 0.0272))
    family = next(x for x in lines if "Holm" in x and "family" in x)
    assert "14 checks" in family and "family-wise level 0.05" in family
    eagle = next(x for x in lines if ": eagle: NLL shift vs AR" in x)
    assert eagle.startswith("- ok: eagle") and "excludes 0" in eagle and "Holm-adjusted p = 0.4" in eagle
    assert sweep.failed_checks(lines) == []
    real = _sweep_checks(_t_interval(0.1, 0.04))
    assert [f.split(" +")[0] for f in sweep.failed_checks(real)] == ["- FAILED: eagle: NLL shift vs AR"]


def test_the_demo_checks_fail_where_a_lossless_method_misses_0_by_far_and_count_every_zero_mean_check():
    """``distortion_checks`` on synthetic records: the NLL identity of a method whose sampled NLL sits
    far from its expectation fails (and is the only failure); every interval check is in the family."""
    checks = _load("toy_sweep")
    rng = np.random.default_rng(0)
    rec = lambda shift: [{"step_tv": 0.0, "target_nll": e + shift + rng.normal(0, 0.1), "target_nll_expected": e}
                         for e in rng.uniform(1, 2, 120)]
    outputs = {"ar": (rec(0.0), None), "eagle": (rec(0.0), None), "sjd": (rec(0.2), None)}
    zero = _t_interval(0.0, 0.05)
    table = {t: {"params": {"method": t}, "target_nll_minus_ar": zero, "target_nll_expected_minus_ar": zero}
             for t in ("eagle", "sjd")}
    lines = checks.distortion_checks(outputs, table)
    assert "7 checks" in next(x for x in lines if "Holm" in x)
    failed = checks.failed_checks(lines)
    assert len(failed) == 1 and failed[0].startswith("- FAILED: sjd: sampled NLL - expected NLL")
