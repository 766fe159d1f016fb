"""The lab's answer on relaxation by budget (docs/methods.md section 2.1): does choosing each node's
relaxation from its own p and q beat every FIXED per-depth schedule at equal distortion?

On seeded tabular pairs (``coolsd.theory.sweep.lab_pairs``: V = 4, N = 5, chains of L = 4), all exact
(``coolsd.theory.exact.ChainOracle``, no sampling), for each point: accepted length (tokens per target
forward), the expected summed per-token TV (``step_tv``, what a budget is set on) and the sequence TV:

* the budgeted rule at several prices, KL cost and TV cost (``method=budget``);
* UniformRSD and COOL-SD's schedules at several deltas (``coolsd.theory.sweep.CURVES``);
* EVERY fixed per-depth schedule omega_1..omega_L over the grid ``GRID`` (|GRID|^L schedules): the best
  fixed schedule at each distortion level is their frontier;
* mixing exact verification and full relaxation over a run's images (the chord between the TV price's
  two points), against every curve at its own points.

For each budgeted point it reports the best accepted length fixed schedules reach at the same step TV
(and at the same sequence TV): the upper concave envelope of their points, since a run may mix two
schedules over its images, and the difference. The verdict line is computed from those numbers.

    python benchmarks/budget_lab.py [--seeds 0 1 2] [--quick]      # -> results/budget_lab/
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.theory import exact_stats  # noqa: E402
from coolsd.theory.exact import ChainOracle  # noqa: E402
from coolsd.theory.sweep import CURVES, lab_pairs  # noqa: E402
from coolsd.theory.stats import total_variation  # noqa: E402

GRID = (1.0, 1.5, 2.0, 3.0, 5.0, 64.0)  # per-depth omegas of the searched fixed schedules (64: nearly blind acceptance)
PRICES_KL = (0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.0, 4.0)
PRICES_TV = (0.5, 1.5)  # below 1: the largest acceptance at every node; above 1: exact (docs/methods.md 2.1)
SCHEDULE_CURVES = ("uniform_rsd", "coolsd exp (mean)", "coolsd toward_one", "coolsd linear")
FIXED = "fixed schedule (searched)"


def _point(curve, seed, param, st) -> dict:
    return {"curve": curve, "seed": seed, "param": param, "accepted_length": st["accepted_length"],
            "step_tv": st["expected_step_tv"], "step_kl": st["expected_step_kl"], "tv": st["tv"]}


def fixed_schedules(P, Q, L: int, grid) -> list[dict]:
    """Every omega_1..omega_L in grid^L through the oracle's G* chain (its ``uniform_rsd`` step reads
    omega[d - 1] at depth d, so any per-depth schedule runs as one)."""
    target = P.sequence_distribution()
    out = []
    for omega in itertools.product(grid, repeat=L):
        o = ChainOracle(P, Q, "uniform_rsd", {}, np.array(omega), None, L)
        dist, rounds = o.solve()
        step_tv, step_kl = o.expected_distortion()
        out.append({"omega": list(omega), "accepted_length": P.N / rounds, "step_tv": step_tv, "step_kl": step_kl,
                    "tv": total_variation(dist, target)})
    return out


def best_at(fixed: pd.DataFrame, budget: float, key: str) -> tuple[float, str]:
    """The best accepted length fixed schedules reach at ``key`` = budget: the upper concave envelope of
    their (key, accepted length) points, interpolated at the budget (a run may mix two schedules over its
    images, so every point between two schedules is reachable), and the schedules it mixes."""
    pts = sorted(zip(fixed[key], fixed["accepted_length"], fixed["omega"].map(str)))
    hull: list = []
    for x, y, o in pts:  # Andrew's monotone chain, upper hull
        while len(hull) >= 2 and (hull[-1][0] - hull[-2][0]) * (y - hull[-2][1]) - \
                (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) >= 0:
            hull.pop()
        hull.append((x, y, o))
    top = max(range(len(hull)), key=lambda i: hull[i][1])
    hull = hull[: top + 1]  # the rising part: more distortion buys more acceptance
    xs = [h[0] for h in hull]
    if budget > xs[-1] + 1e-12:  # beyond what the curve reaches: no comparison at equal distortion
        return float("nan"), "beyond its range"
    if budget >= xs[-1]:
        return hull[-1][1], hull[-1][2]
    i = int(np.searchsorted(xs, budget, side="right"))
    if i == 0:
        return hull[0][1], hull[0][2]
    (x0, y0, o0), (x1, y1, o1) = hull[i - 1], hull[i]
    t = (budget - x0) / (x1 - x0) if x1 > x0 else 0.0
    return y0 + t * (y1 - y0), o0 if t == 0 else f"{o0} / {o1} ({t:.2f})"


def run(seeds, L: int, grid, vocab: int, length: int, mix: float) -> pd.DataFrame:
    """Every lab point: the schedule curves, the budgeted rule's prices, every fixed schedule."""
    points = []
    for seed, P, Q in lab_pairs(vocab, length, mix, seeds):
        t0 = time.perf_counter()
        for r in fixed_schedules(P, Q, L, grid):
            points.append({"curve": FIXED, "seed": seed, "param": json.dumps(r["omega"]),
                           **{k: r[k] for k in ("accepted_length", "step_tv", "step_kl", "tv")}})
        print(f"seed {seed}: {len(grid) ** L} fixed schedules in {time.perf_counter() - t0:.0f} s", flush=True)
        for curve in SCHEDULE_CURVES:
            for method, params in CURVES[curve]:
                points.append(_point(curve, seed, params["delta"], exact_stats(P, Q, method, L, **params)))
        for p in PRICES_KL:
            points.append(_point("budget kl", seed, p, exact_stats(P, Q, "budget", L, price=p, cost="kl")))
        for p in PRICES_TV:
            points.append(_point("budget tv", seed, p, exact_stats(P, Q, "budget", L, price=p, cost="tv")))
    return pd.DataFrame(points)


def compare(points: pd.DataFrame) -> pd.DataFrame:
    """Each budgeted point against what every comparison curve reaches at its distortion (``best_at``:
    the curve's upper concave envelope), at equal summed step TV and at equal sequence TV."""
    rows = []
    for seed, d in points.groupby("seed"):
        for _, b in d[d["curve"].str.startswith("budget")].iterrows():
            for versus in (FIXED, *SCHEDULE_CURVES):
                ref = d[d["curve"] == versus].assign(omega=lambda x: x["param"])
                if versus != FIXED:  # a schedule curve's delta = 1 point, where it has one, is EAGLE: (0, AL of EAGLE)
                    ref = pd.concat([ref, d[(d["curve"] == FIXED) & (d["param"] == json.dumps([1.0] * _depth(d)))]
                                     .assign(omega=lambda x: x["param"])])
                for key in ("step_tv", "tv"):
                    al, omega = best_at(ref, float(b[key]), key)
                    rows.append({"seed": seed, "curve": b["curve"], "price": b["param"], "versus": versus,
                                 "equal": key, "budget_accepted_length": b["accepted_length"], "budget_" + key: b[key],
                                 "versus_accepted_length": al, "versus_point": omega,
                                 "gain": b["accepted_length"] - al})
    return pd.DataFrame(rows)


def chord_gains(points: pd.DataFrame) -> pd.DataFrame:
    """Mixing exact verification and the budgeted rule's fullest relaxation over a run's images (its
    two TV-price points: a fraction t of the images at each) reaches, at step TV t * TV_max, the chord
    between them. Its accepted length minus each schedule curve's at that curve's own points."""
    rows = []
    for seed, d in points.groupby("seed"):
        tv = d[d["curve"] == "budget tv"].sort_values("step_tv")
        (x0, y0), (x1, y1) = tv[["step_tv", "accepted_length"]].iloc[0], tv[["step_tv", "accepted_length"]].iloc[-1]
        for curve in (FIXED, *SCHEDULE_CURVES, "budget kl"):
            for _, r in d[d["curve"] == curve].iterrows():
                if r["step_tv"] <= 1e-9 or r["step_tv"] > x1:
                    continue
                chord = y0 + (y1 - y0) * (r["step_tv"] - x0) / (x1 - x0)
                rows.append({"seed": seed, "versus": curve, "point": r["param"], "step_tv": r["step_tv"],
                             "versus_accepted_length": r["accepted_length"], "mix_accepted_length": chord,
                             "gain": chord - r["accepted_length"]})
    return pd.DataFrame(rows)


def _depth(d: pd.DataFrame) -> int:
    return len(json.loads(d.loc[d["curve"] == FIXED, "param"].iloc[0]))


def verdict(cmp: pd.DataFrame) -> list[str]:
    lines = []
    for (curve, versus, key), g in cmp.groupby(["curve", "versus", "equal"], sort=False):
        g = g[g["budget_" + key] > 1e-9]  # the exact points (distortion 0) compare nothing
        beyond = int(g["gain"].isna().sum())
        g = g.dropna(subset=["gain"])
        if g.empty:
            continue
        wins = int((g["gain"] > 1e-6).sum())
        lines.append(f"- {curve} vs {versus}, at equal {'summed step TV' if key == 'step_tv' else 'sequence TV'}: "
                     f"more accepted length at {wins} of {len(g)} points (pairs x prices); gain median "
                     f"{g['gain'].median():+.4f}, min {g['gain'].min():+.4f}, max {g['gain'].max():+.4f} tokens per forward"
                     + (f" ({beyond} more beyond the curve's range)" if beyond else ""))
    return lines


def chord_verdict(ch: pd.DataFrame) -> list[str]:
    lines = []
    for versus, g in ch.groupby("versus", sort=False):
        lines.append(f"- mixing exact and fully relaxed images vs {versus}, at equal summed step TV: more accepted "
                     f"length at {int((g['gain'] > 1e-6).sum())} of {len(g)} of its points; gain median "
                     f"{g['gain'].median():+.4f}, min {g['gain'].min():+.4f}, max {g['gain'].max():+.4f} tokens per forward")
    return lines


def md_table(df: pd.DataFrame) -> list[str]:
    cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in df.itertuples(index=False)]
    return ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)] + ["| " + " | ".join(c) + " |" for c in cells]


def plot(points: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(points["seed"].unique())
    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 4.2), squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        d = points[points["seed"] == seed]
        fx = d[d["curve"] == "fixed schedule (searched)"]
        ax.scatter(fx["step_tv"], fx["accepted_length"], s=4, c="0.8", label="every fixed schedule")
        xs = np.linspace(0, fx["step_tv"].max(), 200)
        env = [best_at(fx.assign(omega=fx["param"]), x, "step_tv")[0] for x in xs]
        ax.plot(xs, env, "-", c="0.3", lw=1, label="fixed schedules, mixed over images (envelope)")
        for curve, g in d[d["curve"] != FIXED].groupby("curve", sort=False):
            g = g.sort_values("step_tv")
            style = "s" if curve == "budget tv" else ("o-" if curve.startswith("budget") else ".--")
            ax.plot(g["step_tv"], g["accepted_length"], style, ms=5 if curve == "budget tv" else 4,
                    label=curve + (" (exact; fully relaxed)" if curve == "budget tv" else ""))
        ax.set_title(f"pair {seed}", fontsize=10)
        ax.set_xlabel("expected summed step TV per sequence (exact)")
        ax.set_ylabel("accepted length (tokens / forward)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="one pair, chains of 2, a 3-value grid (the tests)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "budget_lab")
    ap.add_argument("--points", type=Path, default=None, help="summarise this points.csv again instead of computing it")
    a = ap.parse_args(argv)
    L, grid, vocab, length = (2, GRID[:2] + GRID[-1:], 3, 3) if a.quick else (4, GRID, 4, 5)
    seeds = a.seeds[:1] if a.quick else a.seeds
    t0 = time.perf_counter()
    points = pd.read_csv(a.points) if a.points else run(seeds, L, grid, vocab, length, 0.4)
    cmp = compare(points)
    chord = chord_gains(points)
    a.out.mkdir(parents=True, exist_ok=True)
    points.to_csv(a.out / "points.csv", index=False)
    cmp.to_csv(a.out / "comparison.csv", index=False)
    chord.to_csv(a.out / "mixing.csv", index=False)
    plot(points, a.out / "budget_lab.png")
    lines = verdict(cmp) + chord_verdict(chord)
    summary = {"pairs": seeds, "vocab": vocab, "length": length, "draft_length": L, "grid": list(grid),
               "prices_kl": list(PRICES_KL), "prices_tv": list(PRICES_TV),
               **({"points_from": str(a.points)} if a.points else {"seconds": time.perf_counter() - t0}),
               "verdict": lines}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = cmp[(cmp["equal"] == "step_tv") & (cmp["versus"].isin([FIXED, "uniform_rsd", "coolsd exp (mean)"]))][
        ["seed", "curve", "price", "versus", "budget_accepted_length", "budget_step_tv", "versus_accepted_length",
         "versus_point", "gain"]]
    md = ["# Relaxation by budget in the exact lab", "",
          f"Pairs {seeds} (V={vocab}, N={length}, chains of {L}), every fixed schedule over {list(grid)}^{L}; "
          "all exact. Gain: the budgeted rule's accepted length minus what the other curve reaches at the same "
          "distortion (its upper concave envelope: a run may mix two of its settings over its images).", "",
          *lines, "", *md_table(table)]
    (a.out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
