"""One interleaved sweep on the toy world: several method configurations and AR on the same
prompts at batch 1 in one run folder of the generation job, so that every speed-up is a ratio
measured side by side (docs/methods.md#6-evaluation-protocol). Used by ``make demo`` (benchmarks/toy_sweep.py) and
``make paper-table2 TARGETS=toy``; ``sweep_frame`` turns any summary table into plot rows."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pandas as pd
import torch

from coolsd.cli.runner import compose
from coolsd.engine.timing import cpu_name
from coolsd.job.generation import run_identity, run_shard
from coolsd.job.summary import results_table
from coolsd.worlds import load_world

ROOT = Path(__file__).resolve().parents[2]


def toy_sweep(specs: list[tuple[str, str, dict]], prompts: int, records: Path, *, tree: str = "chain",
              draft_length: int = 4, seed: int = 0, assets=None, batch_size: int = 1, threads: int = 1) -> dict:
    """``specs``: (tag, method, params); must include ("ar", "ar", {}). Records and images go to
    ``records`` (resumable: an interrupted sweep continues where it stopped), through the
    generation job (``coolsd.job.generation``), at batch 1 on one thread unless told otherwise (a quality
    sweep, ``make claims``, runs batched). Returns {"env", "table" (per tag, as
    ``coolsd.job.summary.results_table``), "outputs", "scenes", "world"}."""
    if "ar" not in [t for t, *_ in specs]:
        raise ValueError("a sweep needs the AR baseline (tag 'ar') for its speed-ups")
    torch.set_num_threads(threads)
    cfg = compose("target=toy", f"dataset.n_prompts={prompts}", f"seed={seed}",
                  *([f"target.assets={assets}"] if assets else []))  # the toy protocol: CFG, sampling
    world = load_world(cfg)
    methods = {tag: world.build_method(name, p, tree, draft_length) for tag, name, p in specs}
    identity = run_identity(world, methods, seed=seed, dataset=world.dataset(cfg), threads=threads,
                            batch_size=batch_size)
    t0 = time.perf_counter()
    outputs, scenes, failures = run_shard(world, methods, world.prompts(cfg), records, identity, seed=seed,
                                          batch_size=batch_size)
    settings = world.settings()
    env = {"target": "toy", "prompts": prompts, "tree": tree, "draft_length": draft_length, "threads": threads,
           "batch_size": batch_size, **settings, "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
           "generation_seconds": time.perf_counter() - t0, "records": str(records),
           "speedup_reference": "ar on the same prompts, same machine, same run (paired by prompt)",
           "assets": world.files()["assets"], "failures": failures}
    return {"env": env, "table": results_table(type(world), outputs, scenes, world.files()), "outputs": outputs,
            "scenes": scenes, "world": world}


def sweep_frame(table: dict) -> pd.DataFrame:
    """One row per configuration: metric, metric_lo, metric_hi for every reported number (a
    mean with ``ci95``, an FID with ``lo``/``hi``, or a difference ``diff`` with ``lo``/``hi``;
    a mean without an interval, n = 1, has NaN bounds)."""
    rows = []
    for tag, e in table.items():
        r = {"tag": tag, "family": e["params"]["method"], "params": e["params"]}
        for k, v in e.items():
            if not isinstance(v, dict):
                if isinstance(v, (int, float)) and k != "params":
                    r[k] = v
                continue
            if "mean" in v:
                r[k], (r[k + "_lo"], r[k + "_hi"]) = v["mean"], v.get("ci95", (float("nan"), float("nan")))
            elif "lo" in v and ("fid" in v or "diff" in v):
                r[k], r[k + "_lo"], r[k + "_hi"] = v.get("fid", v.get("diff")), v["lo"], v["hi"]
        rows.append(r)
    return pd.DataFrame(rows)


def ci_text(r, k: str, fmt: str = "{:.3f}") -> str:
    if k not in r or pd.isna(r[k]):
        return "-"
    if pd.isna(r[k + "_lo"]):
        return f"{fmt.format(r[k])} (no CI)"
    return f"{fmt.format(r[k])} [{fmt.format(r[k + '_lo'])}, {fmt.format(r[k + '_hi'])}]"
