"""Toy-world throughput at batch 1, 4 and 16 on the CPU (issue #6): images per second and
accepted length of AR, EAGLE-1 and COOL-SD (delta 2), every configuration on the same prompts
and seeds in one run (a batch equals its prompts run alone, so only the timings differ).

    python benchmarks/toy_throughput.py            # -> results/toy_throughput/{table.md,summary.json}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.drafting import SamplingConfig  # noqa: E402
from coolsd.job import generate_batch, prompt_seed  # noqa: E402
from coolsd.methods import build_method  # noqa: E402
from coolsd.report.sweep import cpu_name  # noqa: E402
from coolsd.toy.assets import load_toy_world  # noqa: E402
from coolsd.toy.job import toy_prompts  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "toy_throughput")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = OmegaConf.load(ROOT / "conf" / "target" / "toy.yaml")
    world = load_toy_world(cfg_scale=cfg.cfg_scale)
    sampling = SamplingConfig.resolve(cfg.sampling)
    methods = {"ar": build_method("ar"), "eagle": build_method("eagle", tree="chain", draft_length=4),
               "coolsd_2": build_method("coolsd", tree="chain", draft_length=4, delta=2.0)}
    scenes = toy_prompts(a.prompts)
    seeds = [prompt_seed(0, i) for i in range(a.prompts)]
    batches = [int(b) for b in a.batches.split(",")]
    rows = {}
    for B in batches:
        for tag, m in methods.items():  # warm-up at this batch size, excluded
            generate_batch(world, m, sampling, [s.caption for s in scenes[:B]], seeds[:B])
        for tag, m in methods.items():
            t0, taus = time.perf_counter(), []
            for s in range(0, a.prompts, B):
                res = generate_batch(world, m, sampling, [x.caption for x in scenes[s:s + B]], seeds[s:s + B])
                taus += [res.accepted_length(b) for b in range(len(res.round_lengths))]
            sec = time.perf_counter() - t0
            rows[(B, tag)] = {"batch_size": B, "method": tag, "images_per_s": a.prompts / sec, "seconds": sec,
                              "accepted_length": sum(taus) / len(taus)}
            print(rows[(B, tag)], flush=True)
    for (B, tag), r in rows.items():
        r["throughput_vs_ar_same_batch"] = r["images_per_s"] / rows[(B, "ar")]["images_per_s"]
        r["throughput_vs_batch1_same_method"] = r["images_per_s"] / rows[(batches[0], tag)]["images_per_s"]
    env = {"prompts": a.prompts, "threads": a.threads, "cpu": cpu_name(), "cores": os.cpu_count(),
           "torch": torch.__version__, "tree": "chain", "draft_length": 4, "cfg_scale": float(cfg.cfg_scale)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps({"env": env, "rows": list(rows.values())}, indent=1))
    md = [f"Toy world, {a.prompts} prompts, CPU {env['cpu']} ({a.threads} thread), chain L=4, CFG {env['cfg_scale']}; "
          "every configuration on the same prompts and seeds in one run.", "",
          "| batch | method | images / s | accepted length | vs AR (same batch) | vs batch 1 (same method) |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['batch_size']} | {r['method']} | {r['images_per_s']:.2f} | {r['accepted_length']:.2f} | "
           f"{r['throughput_vs_ar_same_batch']:.2f}x | {r['throughput_vs_batch1_same_method']:.2f}x |" for r in rows.values()]
    (a.out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return rows


if __name__ == "__main__":
    main()
