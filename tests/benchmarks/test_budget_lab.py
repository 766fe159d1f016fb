"""benchmarks/budget_lab.py --quick: every fixed schedule of the grid and every budgeted point are
exact lab points; the comparison envelope is what mixtures of fixed schedules reach (never below the
best single schedule at no more distortion, never above the best overall); the verdict lines exist."""
import json
from pathlib import Path

import pandas as pd
from factories import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    bench = load_benchmark("budget_lab")
    return bench


def test_quick_run(tmp_path):
    bench = _bench()
    bench.main(["--quick", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["draft_length"] == 2 and len(data["verdict"]) >= 2
    pts = pd.read_csv(tmp_path / "points.csv")
    fixed = pts[pts["curve"] == "fixed schedule (searched)"]
    assert len(fixed) == len(data["grid"]) ** 2
    # the all-ones schedule is exact verification: no distortion
    assert fixed.loc[fixed["param"] == "[1.0, 1.0]", "step_tv"].abs().max() < 1e-12
    cmp = pd.read_csv(tmp_path / "comparison.csv")
    assert {"budget kl", "budget tv"} <= set(cmp["curve"])
    vs_fixed = cmp[(cmp["equal"] == "step_tv") & (cmp["versus"] == bench.FIXED)].dropna(subset=["gain"])
    assert len(vs_fixed) >= 6  # NaN: a budgeted point past the most distorting fixed schedule
    for _, r in vs_fixed.iterrows():
        single = fixed.loc[fixed["step_tv"] <= r["budget_step_tv"] + 1e-12, "accepted_length"].max()
        assert single - 1e-12 <= r["versus_accepted_length"] <= fixed["accepted_length"].max() + 1e-12


def test_the_envelope_interpolates_between_schedules():
    bench = _bench()
    fixed = pd.DataFrame({"omega": [[1.0], [2.0], [9.0]], "step_tv": [0.0, 1.0, 2.0],
                          "accepted_length": [1.0, 1.2, 3.0]})
    al, mix = bench.best_at(fixed, 1.0, "step_tv")  # (1.0, 1.2) lies under the chord from (0, 1) to (2, 3)
    assert abs(al - 2.0) < 1e-12 and "/" in mix
    assert bench.best_at(fixed, 2.0, "step_tv")[0] == 3.0
    assert bench.best_at(fixed, 5.0, "step_tv")[1] == "beyond its range"  # no comparison past the curve's reach
