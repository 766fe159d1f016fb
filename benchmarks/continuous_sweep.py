"""CSpD and DiSA on a continuous target, by default the toy continuous world (`make continuous-bench`;
`make paper-table1`: the continuous-SD paper's Table 1 grid, gamma 4 / 8 / 16 / 32 x batch 1 / 16 / 64,
in its layout; `--target mar_h --override dataset=imagenet ...` on a GPU): acceptance rate, target
forwards saved and wall-clock speed-up per gamma and batch size, for the paper-faithful mode
(parallel verification, the Sigma term, MAR's noiseless final step), the official code's variant of
it (inner temperature 42, continuous_sd.md 2.7 b) and the exact mode (prefix verification,
final-step noise with the smoothing s = --exact-std for target, draft and the target alone), with
toy_fid of every configuration and of the target alone. With ``--disa UPPER,LOWER``: DiSA alone and
DiSA + CSpD at every gamma (docs/methods.md#52-disa). One run folder per (batch, mode) holds AR and
every configuration, interleaved per batch of prompts, so every speed-up is a ratio measured side by
side (docs/methods.md#6-evaluation-protocol). Every CSpD row is shown beside the target alone with as
many target forwards (docs/methods.md#53-the-equal-forwards-baseline), run in a folder of its own
beside the mode's AR on the same prompts and seeds (``--no-equal-forwards``: not).

Writes results/toy_continuous/{table.md, table.csv, speedup_table.md, summary.json, pareto.png,
pareto.pdf, equal_forwards.png, grid.png}; per-sample records and images go to
outputs/continuous_sweep/<time>/ (resumable with --records: a finished folder is summarised again
without generating).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import pandas as pd
import torch

from coolsd.cli.runner import compose
from coolsd.engine.continuous.flow import FlowConfig
from coolsd.engine.timing import cpu_name
from coolsd.job.generation import run_identity, run_shard
from coolsd.job.summary import results_table
from coolsd.util.image_grid import method_grid
from coolsd.report.plots import pareto_plot
from coolsd.report.sweep import ROOT, sweep_frame
from coolsd.util.records import save_png_atomic, write_json_atomic
from coolsd.worlds import load_world

# mode name -> cspd settings; "exact"'s final_std (the smoothing s) is set by --exact-std
MODES = {"paper": dict(mode="paper", verify="parallel"),
         "official": dict(mode="paper", verify="parallel", inner_temperature=42.0),
         "exact": dict(mode="exact", verify="prefix")}


def point_methods(world, settings: dict, gammas, disa: dict | None) -> dict:
    """{tag: method} of one run folder: ``ar`` (the target alone, sampled as the mode samples), CSpD at
    every gamma, and with ``disa`` (head_steps / lower_steps / anneal) DiSA alone and DiSA + CSpD at
    every gamma (draft, target and their baseline annealed alike: docs/methods.md#52-disa)."""
    cspd = {f"cspd_g{g}": world.build_method("cspd", {"gamma": g, **settings}) for g in gammas}
    runs = {"ar": next(iter(cspd.values())).baseline(), **cspd}
    if disa:
        both = {f"disa_cspd_g{g}": world.build_method("cspd", {"gamma": g, **settings, **disa}) for g in gammas}
        runs["disa"] = dataclasses.replace(next(iter(both.values())).baseline(), name="disa")
        runs.update(both)
    return runs


def equal_forwards_iter(world, forwards: float) -> int | None:
    """The AR steps (``method.num_iter``) of the target alone with as many target forwards as a run
    that took ``forwards`` on average (rounded); None where that is the target's one-token-a-step run.
    A flow model's num_iter must give a unit that divides its cell: the nearest valid count."""
    n, head, c = max(1, round(forwards)), world.head, world.target.config
    if isinstance(head, FlowConfig):
        return min(head.num_iters(c.cell_len, c.n_cells), key=lambda v: (abs(v - n), -v))
    return None if n >= c.seq_len and head.num_iter is None else n


def equal_forwards_methods(world, runs: dict, table: dict) -> dict:
    """{row tag: (baseline tag, method)}: for each CSpD row, the target alone sampled as that row's
    baseline samples (``baseline()``: the mode's final step, DiSA's annealing) with ``num_iter`` = the
    row's mean target forwards (docs/methods.md#53-the-equal-forwards-baseline); ("ar", None) where
    that is the mode's own ``ar``, run beside the row already."""
    out = {}
    for tag, m in runs.items():
        if m.alone or tag not in table:
            continue
        n = equal_forwards_iter(world, table[tag]["target_forwards"]["mean"])
        if n is None and m.anneal is None:  # as many forwards as the mode's own ar: that is the baseline
            out[tag] = ("ar", None)
            continue
        base = dataclasses.replace(m.baseline(), num_iter=n)
        name = f"{'disa' if m.anneal else 'ar'}_nf{n if n is not None else 'L'}" + ("_exact" if base.final_noise else "")
        out[tag] = (name, base)
    return out


def run_point(world, batch: int, mode: str, runs: dict, n: int, records: Path, seed: int, threads: int,
              overrides=("target=toy_continuous",)):
    """``runs`` {tag: method} in one run folder of the generation job (coolsd.job.generation): every
    method on the same prompts and seeds, interleaved per batch, so every speed-up against its ``ar``
    is a ratio measured side by side."""
    cfg = compose(*overrides, f"dataset.n_prompts={n}")
    identity = run_identity(world, runs, seed=seed, dataset=world.dataset(cfg), threads=threads, batch_size=batch)
    prompts = world.prompts(cfg)
    outputs, prompts, failures = run_shard(world, runs, prompts, records / f"b{batch}_{mode}", identity, seed=seed,
                                           batch_size=batch)
    return results_table(type(world), outputs, prompts, world.files()), outputs, failures


def rows_of(table: dict, batch: int, mode: str, equal: dict | None = None, of: dict | None = None) -> list[dict]:
    """One row per tag; ``equal`` {row tag: its equal-forwards baseline's tag}; ``of`` {baseline tag:
    the row tags it stands beside} (the rows of an equal-forwards folder)."""
    ar_tf = table["ar"]["target_forwards"]["mean"]
    out = []
    for tag, e in table.items():
        p = e["params"]
        fid, dfid = e.get("toy_fid"), e.get("toy_fid_minus_ar")
        out.append({"batch": batch, "mode": mode, "config": tag, "gamma": p.get("gamma"),
                    "settings": {k: p[k] for k in ("mode", "verify", "inner_temperature", "final_std")
                                 if p.get(k) not in (None, 1.0)},
                    "head": {k: p[k] for k in ("head_steps", "lower_steps", "anneal", "num_iter") if p.get(k) is not None},
                    "equal_forwards": (equal or {}).get(tag), "equal_forwards_of": (of or {}).get(tag),
                    "acceptance": e.get("acceptance_rate", {}).get("mean"),
                    "target_forwards": e["target_forwards"]["mean"],
                    "forwards_saved": 1 - e["target_forwards"]["mean"] / ar_tf,
                    "draft_forwards": e.get("draft_forwards", {}).get("mean"),
                    "latency_s": e["latency_s"]["mean"], "images_per_s": e["images_per_s"]["mean"],
                    "speedup": e["speedup"]["mean"], "speedup_lo": e["speedup"]["ci95"][0],
                    "speedup_hi": e["speedup"]["ci95"][1],
                    "toy_fid": fid["fid"] if fid else None, "toy_fid_lo": fid["lo"] if fid else None,
                    "toy_fid_hi": fid["hi"] if fid else None,
                    "toy_fid_minus_ar": dfid["diff"] if dfid else None,
                    "toy_fid_minus_ar_lo": dfid["lo"] if dfid else None, "toy_fid_minus_ar_hi": dfid["hi"] if dfid else None,
                    "fallbacks": e.get("fallbacks", {}).get("mean"), "resample_rounds": e.get("resample_rounds", {}).get("mean")})
    return out


def _f(x, p=2):
    return "-" if x is None or pd.isna(x) else f"{x:.{p}f}"


def markdown(df: pd.DataFrame) -> str:
    head = ("| batch | mode | config | head | acceptance | target fwd | fwd saved | latency s | speed-up [95% CI] | "
            "toy_fid [CI] | toy_fid - AR [CI] | equal-forwards baseline |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r.batch} | {r.mode} | {r.config} | {_head(r.head)} | {_f(r.acceptance, 3)} | {_f(r.target_forwards, 1)} | "
             f"{_f(100 * r.forwards_saved, 0)}% | {_f(r.latency_s, 3)} | {_f(r.speedup)} [{_f(r.speedup_lo)}, {_f(r.speedup_hi)}] | "
             f"{_f(r.toy_fid, 1)} [{_f(r.toy_fid_lo, 1)}, {_f(r.toy_fid_hi, 1)}] | "
             f"{_f(r.toy_fid_minus_ar, 1)} [{_f(r.toy_fid_minus_ar_lo, 1)}, {_f(r.toy_fid_minus_ar_hi, 1)}] | "
             f"{_equal_cell(r)} |"
             for r in df.itertuples()]
    return head + "\n".join(lines) + "\n"


def _head(h) -> str:
    return ", ".join(f"{k}={v}" for k, v in h.items()) if isinstance(h, dict) and h else "target's"


def _equal_cell(r) -> str:
    if isinstance(r.equal_forwards, str):
        return r.equal_forwards
    if not isinstance(r.equal_forwards_of, list):
        return "-"
    return r.equal_forwards_of[0] if r.config == "ar" else f"of {', '.join(r.equal_forwards_of)}"


def _fid_delta(r) -> str:
    if r is None or r.toy_fid_minus_ar is None or pd.isna(r.toy_fid_minus_ar):
        return "-"
    return f"{_f(r.toy_fid_minus_ar, 0)} [{_f(r.toy_fid_minus_ar_lo, 0)}, {_f(r.toy_fid_minus_ar_hi, 0)}]"


def quality_batch(df: pd.DataFrame) -> int:
    """The batch size with the most prompts (the narrowest toy_fid intervals; the larger on a tie)."""
    n_of = dict(zip(df.batch, df.n)) if "n" in df else {}
    return max(df.batch.unique(), key=lambda b: (n_of.get(b, 0), b))


def baselines(df: pd.DataFrame):
    """row -> the row of its equal-forwards baseline (None where it has none): a row of an
    equal-forwards folder by (batch, tag), or the mode's own ``ar`` where that is the baseline."""
    equal = {(r.batch, r.config): r for r in df[df.equal_forwards_of.notna()].itertuples() if r.config != "ar"}
    own_ar = {(r.batch, r.mode): r for r in df[df.equal_forwards_of.isna() & (df.config == "ar")].itertuples()}
    return lambda r: (own_ar.get((r.batch, r.mode)) if r.equal_forwards == "ar"
                      else equal.get((r.batch, r.equal_forwards)) if isinstance(r.equal_forwards, str) else None)


def speedup_layout(df: pd.DataFrame) -> str:
    """The paper's Table 1 layout: per mode and configuration (with DiSA: DiSA alone first; CSpD per
    gamma; with DiSA: DiSA + CSpD per gamma), acceptance, target forwards and the speed-up per batch size, beside
    the target alone with as many forwards (its speed-up per batch size) and both quality costs
    (toy_fid - AR with its CI at the batch size with the most prompts)."""
    main = df[df.equal_forwards_of.isna() & (df.config != "ar")]
    baseline_of = baselines(df)
    batches = sorted(main.batch.unique())
    q = quality_batch(df)
    with_equal = main.equal_forwards.notna().any()
    out = []
    for mode, g in main.groupby("mode", sort=False):
        settings = ", ".join(f"{k}={v}" for k, v in g[g.gamma.notna()].settings.iloc[0].items())
        cols = ["config", "acceptance", "target fwd"] + [f"bs={b}" for b in batches]
        if with_equal:
            cols += ["equal-fwd AR"] + [f"bs={b}" for b in batches]
        cols += [f"toy_fid - AR [CI] (bs={q})"] + (["equal-fwd AR: toy_fid - AR [CI]"] if with_equal else [])
        out.append(f"**{mode}** ({settings})\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
        order = sorted(g.config.unique(), key=lambda c: (c.startswith("disa_cspd"), c != "disa",
                                                         -(g[g.config == c].gamma.fillna(0).iloc[0])))
        for config in order:
            gg = g[g.config == config]
            rows = {r.batch: r for r in gg.itertuples()}
            cells = [config, _f(gg.acceptance.mean(), 3), _f(gg.target_forwards.mean(), 1)]
            cells += [f"{_f(rows[b].speedup)}x" if b in rows else "-" for b in batches]
            eq = {b: baseline_of(r) for b, r in rows.items() if isinstance(r.equal_forwards, str)}
            if with_equal:
                names = list(dict.fromkeys(r.config for r in eq.values() if r is not None))
                cells += [" / ".join(names) if names else "-"]
                cells += [f"{_f(eq[b].speedup)}x" if eq.get(b) is not None else "-" for b in batches]
            cells += [_fid_delta(rows.get(q))]
            if with_equal:
                cells += [_fid_delta(eq.get(q))]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def equal_forwards_plot(df: pd.DataFrame, path: Path, title: str) -> bool:
    """Speed-up against toy_fid - AR (95% CIs) at the batch size with the most prompts, one panel per
    mode: each CSpD / DiSA + CSpD row (filled) joined to the target alone with as many forwards (open
    marker), DiSA alone (square). A row left of and not below its open marker is slower for no
    quality gained: the draft bought nothing over fewer AR steps. False where toy_fid is null."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from coolsd.report.plots import DPI, place_labels

    q = quality_batch(df)
    at = df[(df.batch == q) & df.toy_fid_minus_ar.notna()]
    main = at[at.equal_forwards_of.isna() & (at.config != "ar")]
    if main.empty:
        return False
    baseline_of = baselines(at)
    modes = list(dict.fromkeys(main["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.4), squeeze=False, dpi=DPI)
    labels = {}  # axes -> its points' (x, y, tag)
    for ax, mode in zip(axes[0], modes):
        pts = labels[ax] = []

        def point(r, style, color):  # a bootstrap interval need not hold its point: bars clipped at 0
            x, y = r.speedup, r.toy_fid_minus_ar
            ax.errorbar([x], [y], xerr=[[max(0.0, x - r.speedup_lo)], [max(0.0, r.speedup_hi - x)]],
                        yerr=[[max(0.0, y - r.toy_fid_minus_ar_lo)], [max(0.0, r.toy_fid_minus_ar_hi - y)]],
                        fmt=style, color=color, capsize=2, mfc="white" if style == "o" and color == "0.4" else color)
            pts.append((r.speedup, r.toy_fid_minus_ar, r.config))

        for r in main[main["mode"] == mode].itertuples():
            color = "C1" if r.config.startswith("disa") else "C0"
            base = baseline_of(r)
            if base is not None:
                ax.plot([r.speedup, base.speedup], [r.toy_fid_minus_ar, base.toy_fid_minus_ar], color="0.6", lw=0.8)
                if not any(t == base.config for *_, t in pts):
                    point(base, "o", "0.4")
            point(r, "s" if r.config == "disa" else "o", color)
        ax.axhline(0, color="0.3", lw=0.6)
        ax.axvline(1, color="0.3", lw=0.6)
        ax.set_xlabel("speed-up against AR (same prompts and seeds)")
        ax.set_ylabel("toy_fid - AR (lower is better)")
        ax.set_title(f"{mode} (bs={q}, {int(main.n.iloc[0])} prompts)")
        ax.grid(alpha=0.3)
        ax.margins(0.15)
    fig.suptitle(title + "\nfilled: CSpD (blue), DiSA and DiSA + CSpD (orange); open grey: the target alone with as many forwards")
    fig.tight_layout()
    fig.canvas.draw()
    for ax, pts in labels.items():
        xs, ys, texts = zip(*pts)
        place_labels(ax, list(xs), list(ys), list(texts))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gammas", default="4,8,16")
    ap.add_argument("--exact-gammas", default=None, help="the exact mode's gammas (default: --gammas); exact "
                                                          "prefix verification costs several AR runs a gamma")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompts", default="16,64", help="prompts per batch size (comma-separated, as --batches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--exact-std", type=float, default=0.3, help="the exact mode's final-step std s")
    ap.add_argument("--disa", default=None, metavar="UPPER,LOWER",
                    help="add DiSA alone and DiSA + CSpD at every gamma: the head's steps annealed from UPPER to LOWER "
                         "(docs/methods.md#52-disa), e.g. 20,5 on the toy world's 20-step head, 50,5 on MAR")
    ap.add_argument("--disa-anneal", default="linear", help="DiSA's strategy (linear, cosine, constant, two-stage)")
    ap.add_argument("--no-equal-forwards", dest="equal_forwards", action="store_false",
                    help="skip the target alone with as many target forwards as each CSpD row (method.num_iter)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "toy_continuous")
    ap.add_argument("--records", type=Path, default=None)
    ap.add_argument("--assets", default=None, help="toy continuous weights folder (default: the shipped ones)")
    ap.add_argument("--target", default="toy_continuous", help="a continuous target (toy_continuous, mar_h, xar_h, ...)")
    ap.add_argument("--override", action="append", default=[],
                    help="a run.py override for the target (repeatable), e.g. dataset=imagenet target.flow.unit=1")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="no untimed warm-up batch per run folder (smoke runs: the first timed batch of each "
                         "method then carries its first-call costs; never for committed numbers)")
    a = ap.parse_args(argv)
    gammas = [int(x) for x in a.gammas.split(",")]
    exact_gammas = [int(x) for x in a.exact_gammas.split(",")] if a.exact_gammas else gammas
    batches = [int(x) for x in a.batches.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")]
    modes = a.modes.split(",")
    if len(prompts) != len(batches):
        raise SystemExit("--prompts needs one count per batch size")
    if unknown := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; valid: {', '.join(MODES)}")
    disa = None
    if a.disa:
        try:
            upper, lower = (int(x) for x in a.disa.split(","))
        except ValueError:
            raise SystemExit(f"--disa takes UPPER,LOWER head steps (e.g. 20,5), got {a.disa!r}") from None
        disa = {"anneal": a.disa_anneal, "head_steps": upper, "lower_steps": lower}
    records = a.records or ROOT / "outputs" / "continuous_sweep" / time.strftime("%Y-%m-%d_%H-%M-%S")
    torch.set_num_threads(a.threads)
    overrides = (f"target={a.target}", *([f"target.assets={a.assets}"] if a.assets else []), *a.override)
    cfg = compose(*overrides, "method=cspd")
    world = load_world(cfg)
    if not a.warmup:
        world.warmup = False  # this world object only (coolsd.worlds.base: World.warmup, read by coolsd.job.generation.run_methods)
    settings_of = {m: {**MODES[m], **({"final_std": a.exact_std} if m == "exact" else {})} for m in modes}
    t0 = time.perf_counter()
    rows, tables, grids = [], {}, []
    done_equal = {}  # (batch, the baseline's record params) -> its row: run once, shared by the modes sampling alike
    for batch, n in zip(batches, prompts):
        for mode in modes:
            runs = point_methods(world, settings_of[mode], exact_gammas if mode == "exact" else gammas, disa)
            table, outputs, failures = run_point(world, batch, mode, runs, n, records, a.seed, a.threads, overrides)
            tables[f"b{batch}_{mode}"] = {"table": table, "failures": failures}
            equal = equal_forwards_methods(world, runs, table) if a.equal_forwards else {}
            key = lambda m: (batch, json.dumps(m.describe(), sort_keys=True))  # noqa: E731
            todo = {t: m for t, m in equal.values() if m is not None and key(m) not in done_equal}
            for r, (t, m) in equal.items():  # a baseline another mode ran: this mode's rows join its list
                if m is not None and t not in todo:
                    done_equal[key(m)]["equal_forwards_of"].append(f"{r} ({mode})")
            if todo:  # the baselines in a folder of their own, beside the mode's AR (same prompts and seeds)
                eq_runs = {"ar": runs["ar"], **todo}
                eq_table, eq_out, eq_fail = run_point(world, batch, f"{mode}_nf", eq_runs, n, records, a.seed,
                                                      a.threads, overrides)
                tables[f"b{batch}_{mode}_nf"] = {"table": eq_table, "failures": eq_fail}
                of = {"ar": ["the folder's speed-up reference"],
                      **{t: [r for r, (bt, _) in equal.items() if bt == t] for t in todo}}
                rows += rows_of({t: eq_table[t] for t in ["ar", *todo] if t in eq_table}, batch, mode, of=of)
                done_equal.update({key(m): next(r for r in reversed(rows) if r["config"] == t) for t, m in todo.items()})
            rows += rows_of(table, batch, mode, equal={r: bt for r, (bt, _) in equal.items()})
            if batch == batches[-1]:  # one AR row per distinct target-only sampling (exact: smoothed)
                grids += [(f"{mode} {t}", outputs[t][1][:12]) for t in outputs if mode != "official" or t != "ar"]
    df = pd.DataFrame(rows)
    df["n"] = df.batch.map(dict(zip(batches, prompts)))
    a.out.mkdir(parents=True, exist_ok=True)
    env = {"target": a.target, "overrides": list(overrides), "head": dataclasses.asdict(world.head), "gammas": gammas,
           "exact_gammas": exact_gammas, "batches": batches, "disa": disa, "equal_forwards": a.equal_forwards,
           "modes": settings_of, "prompts": dict(zip(map(str, batches), prompts)), "threads": a.threads,
           "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "seed": a.seed, "warmup": a.warmup,
           "records": str(records), "generation_seconds": time.perf_counter() - t0, "files": world.files(),
           "speedup_reference": "ar (the target alone, sampled as the mode samples) in the same run folder, same prompts, "
                                "interleaved per batch (paired by prompt)",
           "equal_forwards_reference": "the target alone sampled as the row's baseline (the mode's final step, DiSA's "
                                       "annealing) with method.num_iter = the row's mean target forwards, rounded; in "
                                       "its own folder beside the mode's ar on the same prompts and seeds"}
    write_json_atomic({"env": env, "rows": rows, "runs": tables}, a.out / "summary.json")
    df.to_csv(a.out / "table.csv", index=False)
    (a.out / "table.md").write_text(markdown(df))
    (a.out / "speedup_table.md").write_text(speedup_layout(df))
    plot = sweep_frame({f"{k} {t}": {**e, "params": {"method": k}} for k, v in tables.items() for t, e in v["table"].items()})
    if "toy_fid" in plot and plot["toy_fid"].notna().any():
        pareto_plot(plot, a.out / "pareto.png", ["toy_fid"], f"CSpD on {a.target} (families: batch_mode)",
                    xs=("acceptance_rate", "speedup"))
    else:  # coolsd.metrics.fid.fid_sample_size_reason
        print("pareto.png not drawn: toy_fid is null at these prompt counts (too few for the feature covariance)")
    if a.equal_forwards and not equal_forwards_plot(df, a.out / "equal_forwards.png", f"CSpD and DiSA on {a.target}"):
        print("equal_forwards.png not drawn: toy_fid is null at these prompt counts")
    save_png_atomic(method_grid(dict(grids), [f"prompt {i}" for i in range(max(len(g) for _, g in grids))]),
                    a.out / "grid.png")
    print(markdown(df))
    print(speedup_layout(df))
    print(f"wrote {a.out}/ (records: {records})")


if __name__ == "__main__":
    main()
