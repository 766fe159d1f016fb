"""benchmarks/xar_cspd_distortion.py --quick (8 seeds): every setting is in the table; the exact
prefix mode's teacher-forced residuals look N(0, 1); parallel verification with every step in one
round and no prefill (docs/design/xar_cspd.md section 4, control (iii)) is detected as distorted,
by the residuals and by the same-seed energy distance against the lossless rows' level. Thresholds
have wide margins (the quick run is deterministic but small)."""
import json
from pathlib import Path

import numpy as np
import pytest
from factories import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _load():
    bench = load_benchmark("xar_cspd_distortion")
    return bench


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("xar_distortion")
    bench = _load()
    bench.main(["--quick", "--out", str(out)])
    return bench, out, json.loads((out / "table.json").read_text())


def _row(rows, unit, verify, mode, gamma):
    (r,) = [r for r in rows if r["sampler"] == "cspd" and (r["unit"], r["verify"], r["mode"], r["gamma"])
            == (unit, verify, mode, gamma)]
    return r


def test_the_table_has_every_setting(quick):
    bench, out, data = quick
    rows, table = data["rows"], (out / "table.md").read_text()
    assert {p.name for p in out.iterdir()} >= {"table.md", "table.json", "distortion.png"}
    assert bench.settings(1) == [(v, m, g) for v, m in bench.SCHEDULES for g in (1, 2, 4, 16)]
    assert bench.settings(4) == [(v, m, g) for v, m in bench.SCHEDULES for g in (1, 2, 4)]
    for unit in (1, 4):
        steps = 16 // unit
        got = [(r["verify"], r["mode"], r["gamma"]) for r in rows if r["unit"] == unit and r["sampler"] == "cspd"]
        assert got == bench.settings(unit)
        assert {r["sampler"] for r in rows if r["unit"] == unit} == {"target_only", "draft_only", "cspd"}
        for verify, mode, gamma in got:
            assert f"| {unit} | {steps} | cspd | {verify} | {mode} | {gamma} |" in table
        assert [z["unit"] for z in data["null"]] == [1, 4]
    for r in rows:
        assert r["n_resid"] == data["meta"]["n_seeds"] * 16 * 4
        if r["sampler"] == "cspd":
            assert 0.1 < r["acceptance_rate"] < 0.9
            steps = 16 // r["unit"]
            if r["verify"] == "parallel":  # one target call per round of gamma steps
                assert r["target_forwards_per_image"] == -(-steps // r["gamma"])


def test_lossless_rows_have_standard_normal_residuals(quick):
    _, _, data = quick
    lossless = [r for r in data["rows"] if r["sampler"] == "target_only" or r["verify"] == "prefix"
                or (r["verify"], r["mode"], r["gamma"]) == ("parallel", "exact", 1)]
    assert len(lossless) == 2 + 4 + 3 + 2
    for r in lossless:  # 512 values: the std's standard error is 0.03
        assert abs(r["resid_std"] - 1) < 0.15, r
        assert abs(r["resid_mean"]) < 0.15, r
        assert r["resid_ks_p"] > 1e-4, r


def test_parallel_mode_with_one_round_is_detected_as_distorted(quick):
    """Control (iii): gamma = n_steps, prefill 0 at unit 1 (the target verifies every step given
    nothing)."""
    _, _, data = quick
    rows = data["rows"]
    bad = _row(rows, 1, "parallel", "exact", 16)
    assert bad["prefill"] == 0.0
    assert bad["resid_ks_p"] < 1e-6 and bad["resid_std"] > 1.3
    lossless = [r for r in rows if r["unit"] == 1 and r["sampler"] == "cspd"
                and (r["verify"] == "prefix" or r["gamma"] == 1) and r["mode"] == "exact"]
    level = max(abs(r["E2_paired"]) for r in lossless)  # what no distortion gives for the same-seed E2
    assert bad["E2_paired"] > 5 * level and bad["E2_paired_ci95"][0] > 0
    assert all(r["E2_paired_ci95"][0] < 0 < r["E2_paired_ci95"][1] or abs(r["E2_paired"]) < 0.005 for r in lossless)


def test_energy_distance_helpers_match_the_definition():
    bench = _load()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 3)), rng.normal(size=(6, 3)) + 0.5

    def d(a, b):
        return np.linalg.norm(a[:, None] - b[None], axis=-1)

    off = ~np.eye(6, dtype=bool)
    want = 2 * d(x, y)[off].mean() - d(x, x)[off].mean() - d(y, y)[off].mean()
    assert bench.energy_distance_sq(x, y) == pytest.approx(want, rel=1e-12)
    u = np.random.default_rng(3).random((4, 6)) < 0.5  # swap_null's draws
    for k, null in enumerate(bench.swap_null(x, y, 4, seed=3)):
        a, b = np.where(u[k][:, None], x, y), np.where(u[k][:, None], y, x)
        assert null == pytest.approx(bench.energy_distance_sq(a, b), rel=1e-12)
    boot = bench.bootstrap_e2(x, x.copy(), 50, seed=1)  # identical pairs: 0 in every resample
    assert np.allclose(boot, 0, atol=1e-12)
