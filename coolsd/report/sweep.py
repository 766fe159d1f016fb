"""One interleaved sweep on the toy world: several method configurations and AR on the same
prompts at batch 1, so that every speed-up is a ratio measured side by side (METHODS.md 6).
Used by ``make demo`` (benchmarks/toy_sweep.py) and ``make paper-table2 TARGETS=toy``."""
from __future__ import annotations

import dataclasses
import os
import platform
import time
from pathlib import Path

import pandas as pd
import torch
from omegaconf import OmegaConf

from coolsd.drafting import SamplingConfig
from coolsd.methods import build_method
from coolsd.records import RecordWriter, claim_run_dir, resume_records
from coolsd.toy.assets import load_toy_world
from coolsd.job import run_methods
from coolsd.toy.job import summarize, toy_prompts

ROOT = Path(__file__).resolve().parents[2]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def toy_sweep(specs: list[tuple[str, str, dict]], prompts: int, records: Path, *, tree: str = "chain",
              draft_length: int = 4, seed: int = 0, assets=None) -> dict:
    """``specs``: (tag, method, params); must include ("ar", "ar", {}). Records and images go to
    ``records`` (resumable: an interrupted sweep continues where it stopped). Returns
    {"env", "table" (per tag, as ``coolsd.toy.job.summarize``), "outputs", "scenes"}."""
    if "ar" not in [t for t, *_ in specs]:
        raise ValueError("a sweep needs the AR baseline (tag 'ar') for its speed-ups")
    torch.set_num_threads(1)
    target_cfg = OmegaConf.load(ROOT / "conf" / "target" / "toy.yaml")  # the toy protocol: CFG, sampling
    sampling = SamplingConfig.resolve(target_cfg.sampling)
    world = load_toy_world(assets, cfg_scale=target_cfg.cfg_scale)
    methods = {tag: build_method(name, tree=tree, draft_length=draft_length, neighbours=world.neighbours, **p)
               for tag, name, p in specs}
    scenes = toy_prompts(prompts)
    identity = {"job": "toy_sweep", "methods": {t: m.describe() for t, m in methods.items()}, "seed": seed,
                "sampling": dataclasses.asdict(sampling), "cfg_scale": float(target_cfg.cfg_scale),
                "n_prompts": prompts, "assets": world.manifest["sha256"]}
    done = resume_records(records) if claim_run_dir(records, identity) else []
    t0 = time.perf_counter()
    outputs = run_methods(world, methods, sampling, scenes, seed, RecordWriter(records), list(range(len(scenes))),
                          done=done)
    env = {"target": "toy", "prompts": prompts, "tree": tree, "draft_length": draft_length, "threads": 1,
           "batch_size": 1, "sampling": dataclasses.asdict(sampling), "cfg_scale": float(target_cfg.cfg_scale),
           "cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
           "generation_seconds": time.perf_counter() - t0, "resumed_samples": len(done), "records": str(records),
           "speedup_reference": "ar on the same prompts, same machine, same run (paired by prompt)",
           "assets": world.manifest["sha256"]}
    return {"env": env, "table": summarize(world, outputs, scenes), "outputs": outputs, "scenes": scenes}


def sweep_frame(table: dict) -> pd.DataFrame:
    """One row per configuration: metric, metric_lo, metric_hi for every reported number (a
    mean with ``ci95``, an FID with ``lo``/``hi``, or a difference ``diff`` with ``lo``/``hi``)."""
    rows = []
    for tag, e in table.items():
        r = {"tag": tag, "family": e["params"]["method"], "params": e["params"]}
        for k, v in e.items():
            if not isinstance(v, dict):
                if isinstance(v, (int, float)) and k != "params":
                    r[k] = v
                continue
            if "mean" in v and "ci95" in v:
                r[k], (r[k + "_lo"], r[k + "_hi"]) = v["mean"], v["ci95"]
            elif "lo" in v and ("fid" in v or "diff" in v):
                r[k], r[k + "_lo"], r[k + "_hi"] = v.get("fid", v.get("diff")), v["lo"], v["hi"]
        rows.append(r)
    return pd.DataFrame(rows)


def ci_text(r, k: str, fmt: str = "{:.3f}") -> str:
    if k not in r or pd.isna(r[k]):
        return "-"
    return f"{fmt.format(r[k])} [{fmt.format(r[k + '_lo'])}, {fmt.format(r[k + '_hi'])}]"
