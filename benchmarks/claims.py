"""`make claims`: the COOL-SD paper's claims tested on the toy world at equal accepted length, next to the theory lab's exact answer at tabular scale.

Claims (each "A beats B": at the accepted length A reaches, A's quality loss is smaller than B's):
  1. annealing beats uniform: COOL-SD's annealed omega (exp, mean-normalised) vs UniformRSD;
  2. G* improves LANTERN++: LANTERN++ with G* resampling vs its own resampling;
  3. COOL-SD beats LANTERN++.
Other schedules (exp_geomean, linear, toward_one) are compared to UniformRSD as well.

Protocol: the toy world, ``--prompts`` prompts (>= 500), chain L = 4, delta / lambda sweeps of
every method and AR in ONE run folder (same prompts, same seeds), batched (quality, not speed, is
measured here). For each point a of curve A, curve B is interpolated linearly in accepted length
between its two bracketing points (b0, b1; EAGLE, the delta = lambda = 1 point, starts every
lossless-at-1 curve): per prompt, y_B(i) = (1 - w) y_b0(i) + w y_b1(i) with w from the mean
accepted lengths (their CIs are narrow at this n; their uncertainty is not propagated), and the
difference y_a(i) - y_B(i) is paired by prompt (mean, Student-t 95% CI). toy_fid is a set
statistic: its difference FID(a) - [(1 - w) FID(b0) + w FID(b1)] gets a paired bootstrap over
prompts. Metrics: ``step_tv`` / ``step_kl`` (exact distortion summed over the image,
docs/distortion.md), ``target_nll`` (the target's NLL of what was emitted), ``target_nll_expected``
(its exact expectation given what preceded each draw: the same mean, less noise), toy_clip, toy_fid.

Verdict per claim and metric: "supported" if some comparison favours A with a CI excluding 0 and
none favours B; "contradicted" if the reverse; "mixed" if both happen; "unresolved at this n" if no
CI excludes 0. Writes results/claims/{claims.md, summary.json, table.csv, sweep.png}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from coolsd.engine import plugins
from coolsd.engine.methods import check_method
from coolsd.metrics.toy import caption_attributes, paired_fid_contrast_ci, toy_clip_scores
from coolsd.report.sweep import ROOT, toy_sweep
from coolsd.theory.sweep import N_SAMPLED, parse_curve, run_sweep as lab_sweep
from coolsd.toy.scenes import render_batch
from coolsd.util.records import write_json_atomic
from coolsd.util.stats import mean_ci
from coolsd.worlds.toy import toy_extractor

DELTAS = (1.5, 2.0, 3.0, 5.0)
LAMS = (1.5, 2.0, 3.0, 5.0)
K = 10
# curve -> [(tag, method, params)]; EAGLE (omega = 1, lambda = 1) is the first point of the curves it starts
CURVES = {
    "uniform_rsd": [(f"uniform_rsd_{d}", "uniform_rsd", {"delta": d}) for d in DELTAS],
    "coolsd exp (mean)": [(f"coolsd_exp_{d}", "coolsd", {"delta": d, "schedule": "exp"}) for d in DELTAS],
    "coolsd exp_geomean": [(f"coolsd_geo_{d}", "coolsd", {"delta": d, "schedule": "exp_geomean"}) for d in DELTAS],
    "coolsd linear": [(f"coolsd_lin_{d}", "coolsd", {"delta": d, "schedule": "linear"}) for d in DELTAS],
    "coolsd toward_one": [(f"coolsd_t1_{d}", "coolsd", {"delta": d, "schedule": "toward_one"}) for d in DELTAS],
    "lantern_pp": [(f"lantern_pp_{lam}", "lantern_pp", {"lam": lam, "k": K}) for lam in LAMS],
    "lantern_pp +G*": [(f"lantern_pp_gstar_{lam}", "lantern_pp", {"lam": lam, "k": K, "resample": "gstar"})
                       for lam in LAMS],
}
STARTS_AT_EAGLE = ("uniform_rsd", "coolsd toward_one", "lantern_pp", "lantern_pp +G*")
# (claim, curve A, curve B); the lab's curve names for the same comparison
CLAIMS = [
    ("annealing beats uniform (COOL-SD exp vs UniformRSD)", "coolsd exp (mean)", "uniform_rsd"),
    ("G* improves LANTERN++", "lantern_pp +G*", "lantern_pp"),
    ("COOL-SD beats LANTERN++", "coolsd exp (mean)", "lantern_pp"),
    ("exp_geomean beats uniform", "coolsd exp_geomean", "uniform_rsd"),
    ("linear beats uniform", "coolsd linear", "uniform_rsd"),
    ("toward_one beats uniform", "coolsd toward_one", "uniform_rsd"),
]
LAB_CURVES = {"lantern_pp": "lantern_pp k=2", "lantern_pp +G*": "lantern_pp k=2 +G*"}
METRICS = {"step_tv": -1, "step_kl": -1, "target_nll": -1, "target_nll_expected": -1, "toy_clip": +1,
           "toy_fid": -1}  # sign: higher is better


def curve_points(curve: str, tau: dict, curves: dict = CURVES) -> list[str]:
    """The curve's tags in increasing accepted length (EAGLE first where the curve starts there)."""
    tags = (["eagle"] if curve in STARTS_AT_EAGLE else []) + [t for t, *_ in curves[curve]]
    return sorted(tags, key=lambda t: tau[t])


def bracket(t_a: float, points: list[str], tau: dict):
    """(b0, b1, w): B's points bracketing accepted length t_a and the interpolation weight; None outside."""
    for b0, b1 in zip(points, points[1:]):
        if tau[b0] <= t_a <= tau[b1] and tau[b1] > tau[b0]:
            return b0, b1, (t_a - tau[b0]) / (tau[b1] - tau[b0])
    return None


def compare(a_curve: str, b_curve: str, tau: dict, per_prompt: dict, feats: dict, ref, curves: dict = CURVES) -> list[dict]:
    """One row per point of A inside B's accepted-length range: the paired difference A - B(interp)."""
    rows = []
    b_points = curve_points(b_curve, tau, curves)
    for a in curve_points(a_curve, tau, curves):
        if a == "eagle" or (br := bracket(tau[a], b_points, tau)) is None:
            continue
        b0, b1, w = br
        row = {"a": a, "accepted_length": tau[a], "b0": b0, "b1": b1, "w": w}
        for m in METRICS:
            if m == "toy_fid":  # FID(a) - [(1 - w) FID(b0) + w FID(b1)], on the same resampled prompts
                c = paired_fid_contrast_ci(feats, {a: 1.0, b0: -(1 - w), b1: -w}, ref)
                row[m] = {"mean": c["diff"], "ci95": [c["lo"], c["hi"]], "n": c["n"]}
            elif all(per_prompt[m].get(t) is not None for t in (a, b0, b1)):
                y = per_prompt[m]
                row[m] = mean_ci(y[a] - ((1 - w) * y[b0] + w * y[b1]))
        rows.append(row)
    return rows


def verdict(rows: list[dict], metric: str) -> str:
    rows = [r[metric]["ci95"] for r in rows if metric in r]
    if not rows:
        return "not comparable (accepted lengths do not overlap)"
    lower_better = METRICS[metric] < 0
    favour_a = sum(1 for lo, hi in rows if (hi < 0 if lower_better else lo > 0))
    favour_b = sum(1 for lo, hi in rows if (lo > 0 if lower_better else hi < 0))
    if favour_a and favour_b:
        return "mixed"
    if favour_a:
        return f"supported ({favour_a} of {len(rows)} points)"
    if favour_b:
        return f"contradicted ({favour_b} of {len(rows)} points)"
    return "unresolved at this n"


def lab_answer(a_curve: str, b_curve: str, lab: pd.DataFrame, col: str) -> str:
    """The exact lab's answer (tabular pairs, no noise) on column ``col`` (``tv``: sequence TV to the
    target; ``expected_step_tv``: the expectation of a run's step_tv): at each A point inside B's
    accepted-length range, the sign of col(a) - col_B(interpolated), per pair."""
    a_name, b_name = LAB_CURVES.get(a_curve, a_curve), LAB_CURVES.get(b_curve, b_curve)
    wins = losses = 0
    for _, g in lab.groupby("seed"):
        base = g[g.curve == "eagle"]
        A = pd.concat([base, g[g.curve == a_name]]).sort_values("accepted_length")
        B = pd.concat([base, g[g.curve == b_name]]).sort_values("accepted_length")
        for _, r in A.iterrows():
            if r.curve == "eagle" or not B.accepted_length.min() <= r.accepted_length <= B.accepted_length.max():
                continue
            y_b = np.interp(r.accepted_length, B.accepted_length, B[col])
            wins += r[col] < y_b - 1e-12
            losses += r[col] > y_b + 1e-12
    if not wins + losses:
        return "no overlap"
    word = "supported" if wins and not losses else "contradicted" if losses and not wins else "mixed"
    return f"{word} (A lower at {wins}, higher at {losses} points)"


def _fmt(v, d=3) -> str:
    if v is None:
        return "-"
    return f"{v['mean']:+.{d}f} [{v['ci95'][0]:+.{d}f}, {v['ci95'][1]:+.{d}f}]"


def plot(tau: dict, table: dict, path: Path, curves: dict = CURVES) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["step_tv", "target_nll_expected_minus_ar", "toy_clip", "toy_fid"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.2), layout="constrained")
    for ax, m in zip(axes, metrics):
        for curve in curves:
            pts = [t for t in curve_points(curve, tau, curves) if table[t].get(m) is not None]  # toy_fid: null below full rank
            if not pts:
                continue
            ys = [table[t][m].get("mean", table[t][m].get("fid")) for t in pts]
            lo = [table[t][m]["ci95"][0] if "ci95" in table[t][m] else table[t][m]["lo"] for t in pts]
            hi = [table[t][m]["ci95"][1] if "ci95" in table[t][m] else table[t][m]["hi"] for t in pts]
            ax.errorbar([tau[t] for t in pts], ys, yerr=[np.subtract(ys, lo), np.subtract(hi, ys)], fmt="o-", ms=3,
                        capsize=2, label=curve)
        ax.set_xlabel("accepted length (tokens / round)")
        ax.set_ylabel(m)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Toy world: quality against accepted length (95% CIs); lower is better except toy_clip")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select_curves(a) -> tuple[dict, list, list]:
    """(curves, claims, the lab's extra curves) of the command line: the built-in curves (``--only``),
    then each ``--curve`` of a registered method (``--include`` registers outside ones), claimed to
    beat every ``--versus`` curve. A bad name or value stops here, before any generation."""
    plugins.load(a.include)
    unknown = [c for c in [*(a.only or []), *a.versus] if c not in CURVES]
    if unknown:
        raise SystemExit(f"unknown curve(s) {unknown}; built-in curves: {', '.join(CURVES)}")
    curves = {c: pts for c, pts in CURVES.items() if a.only is None or c in a.only}
    claims = [c for c in CLAIMS if c[1] in curves and c[2] in curves]
    extra = []
    for k, words in enumerate(a.curve):
        try:
            label, points = parse_curve(words)
            for params in points:
                check_method(words[0], "discrete", params)
        except ValueError as e:
            raise SystemExit(f"--curve {' '.join(words)}: {e}") from None
        curves[label] = [(f"{words[0]}_c{k}_{i}", words[0], params) for i, params in enumerate(points)]
        extra.append((label, words[0], points))
        for b in a.versus:
            curves.setdefault(b, CURVES[b])
            claims.append((f"{label} beats {b}", label, b))
    return curves, claims, extra


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "claims")
    ap.add_argument("--records", type=Path, default=None, help="per-sample records (pass an old folder to resume)")
    ap.add_argument("--include", action="append", default=[], metavar="PATH",
                    help="register methods from this file or folder first (docs/add_method.md)")
    ap.add_argument("--curve", nargs="+", action="append", default=[], metavar="NAME KEY=V1,V2",
                    help="add a curve of any registered method, e.g. --curve coolsd delta=1.5,2 schedule=linear; it is tested "
                         "against every curve of --versus (claim: it beats them)")
    ap.add_argument("--versus", nargs="+", default=["uniform_rsd", "coolsd exp (mean)"], metavar="CURVE",
                    help="the built-in curves an added curve is compared with")
    ap.add_argument("--only", nargs="+", default=None, metavar="CURVE",
                    help="run only these built-in curves (and the claims between them); default: every curve")
    ap.add_argument("--lab-sampled", type=int, default=N_SAMPLED,
                    help="sequences per sampled point of the exact lab's sweep (its sampled curves)")
    a = ap.parse_args(argv)
    curves, claims, extra = select_curves(a)
    specs = [("ar", "ar", {}), ("eagle", "eagle", {})] + [s for pts in curves.values() for s in pts]
    records = a.records or ROOT / "outputs" / "claims" / time.strftime("%Y-%m-%d_%H-%M-%S")
    res = toy_sweep(specs, a.prompts, records, seed=a.seed, batch_size=a.batch_size, threads=a.threads)
    table, outputs, scenes, world = res["table"], res["outputs"], res["scenes"], res["world"]
    tau = {t: e["accepted_length"]["mean"] for t, e in table.items()}

    extractor = toy_extractor(world.files())
    attrs = caption_attributes(scenes)
    ref = extractor(render_batch(scenes))
    feats, per_prompt = {}, {m: {} for m in METRICS if m != "toy_fid"}
    for tag, (recs, imgs) in outputs.items():
        f, preds = extractor.features_and_predictions(imgs)
        feats[tag], per_prompt["toy_clip"][tag] = f, toy_clip_scores(preds, attrs)
        for m in ("step_tv", "step_kl", "target_nll", "target_nll_expected"):
            vals = [r.get(m) for r in recs]
            per_prompt[m][tag] = None if any(v is None for v in vals) else np.asarray(vals, dtype=np.float64)

    # the lab curves the claims compare (all of them without --only)
    compared = {LAB_CURVES.get(c, c) for _, A, B in claims for c in (A, B)}
    lab = lab_sweep(n_sampled=a.lab_sampled, extra=extra, curves=compared)
    results = []
    for claim, A, B in claims:
        rows = compare(A, B, tau, per_prompt, feats, ref, curves)
        results.append({"claim": claim, "A": A, "B": B, "rows": rows,
                        "verdicts": {m: verdict(rows, m) for m in METRICS},
                        "lab": {c: lab_answer(A, B, lab, c) for c in ("expected_step_tv", "tv")}})

    env = res["env"]
    # decode time from the records themselves (a batch's latency, shared by its records), so that a resumed
    # invocation reports the whole run's generation, not its own
    decode_min = sum(r["latency_s"] / r.get("batch_size", 1) for recs, _ in outputs.values() for r in recs) / 60
    lines = ["# The paper's claims, tested on the toy world", "",
             f"{a.prompts} prompts, chain L = 4, batch {a.batch_size}, {env['cpu']}; every configuration and AR in one run "
             f"(same prompts and seeds); {decode_min:.0f} min of decoding. Produced by `make claims` "
             "(benchmarks/claims.py, whose docstring gives the protocol). A beats B means: at the accepted length A "
             "reaches, A's quality loss is smaller than B's (B interpolated in accepted length, differences paired by "
             "prompt, 95% CIs). step_tv / step_kl: the exact distortion of each emitted token's distribution, summed over "
             "the image (docs/distortion.md; it bounds the sequence-level TV / KL); target_nll: the target's NLL of what "
             "was emitted (nats / token); target_nll_expected: its exact expectation given what preceded each draw "
             "(-sum pi log p; the same mean without the draw's noise, docs/distortion.md); toy metrics as in coolsd.metrics.toy. The lab column is the exact answer on "
             "tabular models (coolsd.theory.sweep: V = 4, N = 5, L = 4, 3 pairs): on the expectation of step_tv "
             "and on the sequence TV to the target, no noise.", "",
             "| claim | step_tv | step_kl | target_nll | target_nll_expected | toy_clip | toy_fid | exact lab: E step_tv "
             "| exact lab: sequence TV |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        v = r["verdicts"]
        lines.append(f"| {r['claim']} | {v['step_tv']} | {v['step_kl']} | {v['target_nll']} | "
                     f"{v['target_nll_expected']} | {v['toy_clip']} | "
                     f"{v['toy_fid']} | {r['lab']['expected_step_tv']} | {r['lab']['tv']} |")
    for r in results:
        lines += ["", f"## {r['claim']}: A = {r['A']}, B = {r['B']}", "",
                  "| A point | accepted length | B interpolated between | step_tv A - B | step_kl A - B | target_nll A - B "
                  "| target_nll_expected A - B | toy_clip A - B | toy_fid A - B |", "|---|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['a']} | {row['accepted_length']:.2f} | {row['b0']} .. {row['b1']} (w {row['w']:.2f}) | "
                         f"{_fmt(row.get('step_tv'))} | {_fmt(row.get('step_kl'))} | {_fmt(row.get('target_nll'), 4)} | "
                         f"{_fmt(row.get('target_nll_expected'), 4)} | {_fmt(row.get('toy_clip'))} | {_fmt(row.get('toy_fid'), 1)} |")
        if not r["rows"]:
            lines.append("| (no point of A inside B's accepted-length range) | | | | | | | | |")
    lines += ["", "## Every configuration", "", "| tag | accepted length | step_tv | target_nll - AR | "
              "target_nll_expected - AR | toy_clip | toy_fid |", "|---|---|---|---|---|---|---|"]
    for t, e in table.items():
        g = lambda k, d=3: (f"{e[k]['mean']:.{d}f} [{e[k]['ci95'][0]:.{d}f}, {e[k]['ci95'][1]:.{d}f}]"  # noqa: E731
                            if k in e and "ci95" in e[k] else "-")
        fid = e.get("toy_fid")
        fid = f"{fid['fid']:.1f} [{fid['lo']:.1f}, {fid['hi']:.1f}]" if fid else "-"
        lines.append(f"| {t} | {g('accepted_length', 2)} | {g('step_tv', 2)} | {g('target_nll_minus_ar', 4)} | "
                     f"{g('target_nll_expected_minus_ar', 4)} | {g('toy_clip')} | {fid} |")
    lines += ["", "![quality against accepted length](sweep.png)"]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "claims.md").write_text("\n".join(lines) + "\n")
    write_json_atomic({"env": env, "claims": results, "results": table}, a.out / "summary.json")
    pd.DataFrame([{"claim": r["claim"], "a": row["a"], "accepted_length": row["accepted_length"], "b0": row["b0"],
                   "b1": row["b1"], "w": row["w"], **{f"{m}_diff": row[m]["mean"] for m in METRICS if m in row},
                   **{f"{m}_lo": row[m]["ci95"][0] for m in METRICS if m in row},
                   **{f"{m}_hi": row[m]["ci95"][1] for m in METRICS if m in row}}
                  for r in results for row in r["rows"]]).to_csv(a.out / "table.csv", index=False)
    plot(tau, table, a.out / "sweep.png", curves)
    print("\n".join(lines[: 6 + len(results)]))
    print(json.dumps({"wrote": str(a.out), "records": str(records)}))


if __name__ == "__main__":
    main()
