"""CSpD on a continuous target, by default the toy continuous world (`make continuous-bench`;
`make paper-table1`: the continuous-SD paper's Table 1 grid, gamma 4 / 8 / 16 / 32 x batch 1 / 16 / 64 /
256, in its layout; `--target xar_h --override dataset=imagenet ...` on a GPU): acceptance rate, target
forwards saved and wall-clock speed-up for gamma in {4, 8, 16} at batch 1 and 16, for the
paper-faithful mode (parallel verification, the Sigma term, MAR's noiseless final step), the
official code's variant of it (inner temperature 42, continuous_sd.md 2.7 b) and the exact mode
(prefix verification, final-step noise with the smoothing s = --exact-std for target, draft and
the target alone), with toy_fid of every configuration and of the target alone. One run folder per (batch, mode) holds AR and the three gammas, interleaved per
batch of prompts, so every speed-up is a ratio measured side by side (docs/methods.md#6-evaluation-protocol).

Writes results/toy_continuous/{table.md, table.csv, speedup_table.md, summary.json, pareto.png,
pareto.pdf, grid.png}; per-sample records and images go to outputs/continuous_sweep/<time>/
(resumable with --records).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import pandas as pd
import torch

from coolsd.cli.runner import compose
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


def run_point(world, batch: int, mode: str, settings: dict, gammas, n: int, records: Path, seed: int, threads: int,
              overrides=("target=toy_continuous",)):
    """AR and every gamma of one mode in one run folder of the generation job (coolsd.job.generation)."""
    cspd = {f"cspd_g{g}": world.build_method("cspd", {"gamma": g, **settings}) for g in gammas}
    runs = {"ar": next(iter(cspd.values())).baseline(), **cspd}
    cfg = compose(*overrides, f"dataset.n_prompts={n}")
    identity = run_identity(world, runs, seed=seed, dataset=world.dataset(cfg), threads=threads, batch_size=batch)
    prompts = world.prompts(cfg)
    outputs, prompts, failures = run_shard(world, runs, prompts, records / f"b{batch}_{mode}", identity, seed=seed,
                                           batch_size=batch)
    return results_table(type(world), outputs, prompts, world.files()), outputs, failures


def rows_of(table: dict, batch: int, mode: str) -> list[dict]:
    ar_tf = table["ar"]["target_forwards"]["mean"]
    out = []
    for tag, e in table.items():
        p = e["params"]
        fid, dfid = e.get("toy_fid"), e.get("toy_fid_minus_ar")
        out.append({"batch": batch, "mode": mode, "config": tag, "gamma": p.get("gamma"),
                    "settings": {k: p[k] for k in ("mode", "verify", "inner_temperature", "final_std")
                                 if p.get(k) not in (None, 1.0)},
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
    head = ("| batch | mode | config | acceptance | target fwd | fwd saved | latency s | speed-up [95% CI] | "
            "toy_fid [CI] | toy_fid - AR [CI] |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r.batch} | {r.mode} | {r.config} | {_f(r.acceptance, 3)} | {_f(r.target_forwards, 1)} | "
             f"{_f(100 * r.forwards_saved, 0)}% | {_f(r.latency_s, 3)} | {_f(r.speedup)} [{_f(r.speedup_lo)}, {_f(r.speedup_hi)}] | "
             f"{_f(r.toy_fid, 1)} [{_f(r.toy_fid_lo, 1)}, {_f(r.toy_fid_hi, 1)}] | "
             f"{_f(r.toy_fid_minus_ar, 1)} [{_f(r.toy_fid_minus_ar_lo, 1)}, {_f(r.toy_fid_minus_ar_hi, 1)}] |"
             for r in df.itertuples()]
    return head + "\n".join(lines) + "\n"


def speedup_layout(df: pd.DataFrame) -> str:
    """The paper's Table 1 layout: per mode and gamma, acceptance and the speed-up per batch size."""
    sp = df[df.config != "ar"]
    batches = sorted(sp.batch.unique())
    out = []
    for mode, g in sp.groupby("mode", sort=False):
        settings = ", ".join(f"{k}={v}" for k, v in g.settings.iloc[0].items())
        out.append(f"**{mode}** ({settings})\n\n| gamma | acceptance | "
                   + " | ".join(f"bs={b}" for b in batches) + " |\n|---|---|" + "---|" * len(batches))
        for gamma, gg in sorted(g.groupby("gamma"), key=lambda x: -x[0]):
            acc = gg.acceptance.mean()  # per-batch values are the same samples up to rounding
            cells = [f"{_f(gg[gg.batch == b].speedup.iloc[0])}x" if (gg.batch == b).any() else "-" for b in batches]
            out.append(f"| {int(gamma)} | {_f(acc, 3)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gammas", default="4,8,16")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompts", default="16,64", help="prompts per batch size (comma-separated, as --batches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--exact-std", type=float, default=0.3, help="the exact mode's final-step std s")
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
    batches = [int(x) for x in a.batches.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")]
    if len(prompts) != len(batches):
        raise SystemExit("--prompts needs one count per batch size")
    records = a.records or ROOT / "outputs" / "continuous_sweep" / time.strftime("%Y-%m-%d_%H-%M-%S")
    torch.set_num_threads(a.threads)
    overrides = (f"target={a.target}", *([f"target.assets={a.assets}"] if a.assets else []), *a.override)
    cfg = compose(*overrides, "method=cspd")
    world = load_world(cfg)
    if not a.warmup:
        world.warmup = False  # this world object only (coolsd.worlds.base: World.warmup, read by coolsd.job.generation.run_methods)
    t0 = time.perf_counter()
    rows, tables, grids = [], {}, []
    for batch, n in zip(batches, prompts):
        for mode in a.modes.split(","):
            settings = {**MODES[mode], **({"final_std": a.exact_std} if mode == "exact" else {})}
            table, outputs, failures = run_point(world, batch, mode, settings, gammas, n, records, a.seed, a.threads,
                                                   overrides)
            tables[f"b{batch}_{mode}"] = {"table": table, "failures": failures}
            rows += rows_of(table, batch, mode)
            if batch == batches[-1]:  # one AR row per distinct target-only sampling (exact: smoothed)
                grids += [(f"{mode} {t}", outputs[t][1][:12]) for t in outputs if mode != "official" or t != "ar"]
    df = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    env = {"target": a.target, "overrides": list(overrides), "head": dataclasses.asdict(world.head), "gammas": gammas, "batches": batches,
           "modes": {m: {**MODES[m], **({"final_std": a.exact_std} if m == "exact" else {})} for m in a.modes.split(",")},
           "prompts": dict(zip(map(str, batches), prompts)), "threads": a.threads, "cpu": cpu_name(),
           "cores": os.cpu_count(), "torch": torch.__version__, "seed": a.seed, "warmup": a.warmup, "records": str(records),
           "generation_seconds": time.perf_counter() - t0, "files": world.files(),
           "speedup_reference": "ar (the target alone, sampled as the mode samples) in the same run folder, same prompts, "
                                "interleaved per batch (paired by prompt)"}
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
    save_png_atomic(method_grid(dict(grids), [f"prompt {i}" for i in range(max(len(g) for _, g in grids))]),
                    a.out / "grid.png")
    print(markdown(df))
    print(speedup_layout(df))
    print(f"wrote {a.out}/ (records: {records})")


if __name__ == "__main__":
    main()
