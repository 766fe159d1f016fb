"""Toy-world throughput at batch 1, 4 and 16 on the CPU: images per second and
accepted length of AR, EAGLE-1 and COOL-SD (delta 2), every configuration on the same prompts
and seeds in one run (a batch equals its prompts run alone, so only the timings differ), with
and without ``deterministic.batch_invariant`` (coolsd.engine.batch_invariant): its cost, measured side
by side, and a check that its batches write the batch-1 images bit for bit.

    python benchmarks/toy_throughput.py            # -> results/toy_throughput/{table.md,summary.json}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from coolsd.cli.runner import compose  # noqa: E402
from coolsd.engine.batch_invariant import batch_invariant  # noqa: E402
from coolsd.engine.timing import cpu_name  # noqa: E402
from coolsd.job.generation import prompt_seed  # noqa: E402
from coolsd.worlds import load_world  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "toy_throughput")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the untimed warm-up batches (smoke runs: the first timed batch of each "
                         "configuration then carries its first-call costs; never for committed numbers)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = compose("target=toy", f"dataset.n_prompts={a.prompts}")
    world = load_world(cfg)
    methods = {"ar": world.build_method("ar", {}), "eagle": world.build_method("eagle", {}, "chain", 4),
               "coolsd_2": world.build_method("coolsd", {"delta": 2.0}, "chain", 4)}
    scenes = world.prompts(cfg)
    seeds = [prompt_seed(0, i) for i in range(a.prompts)]
    batches = [int(b) for b in a.batches.split(",")]
    rows, images = {}, {}
    for B in batches:
        for inv in (False, True):
            with batch_invariant(inv):
                if a.warmup:  # at this batch size, excluded from the timings
                    for m in methods.values():
                        world.generate(m, scenes[:B], seeds[:B])
                for tag, m in methods.items():
                    sec, taus, imgs = 0.0, [], []  # generation time: the loop's latency_s (decoding excluded, docs/methods.md#6-evaluation-protocol)
                    for s in range(0, a.prompts, B):
                        out = world.generate(m, scenes[s:s + B], seeds[s:s + B])
                        sec += out[0].fields["latency_s"]
                        taus += [x.fields["accepted_length"] for x in out]
                        imgs += [x.image for x in out]
                    images[(B, tag, inv)] = np.stack(imgs)
                    rows[(B, tag, inv)] = {"batch_size": B, "method": tag, "batch_invariant": inv,
                                           "images_per_s": a.prompts / sec, "seconds": sec,
                                           "accepted_length": sum(taus) / len(taus)}
                    print(rows[(B, tag, inv)], flush=True)
    for (B, tag, inv), r in rows.items():
        r["throughput_vs_ar_same_batch"] = r["images_per_s"] / rows[(B, "ar", inv)]["images_per_s"]
        r["throughput_vs_batch1_same_method"] = r["images_per_s"] / rows[(batches[0], tag, inv)]["images_per_s"]
        r["throughput_vs_default_kernels"] = r["images_per_s"] / rows[(B, tag, False)]["images_per_s"]
        # the images of this batch size equal the batch-1 images bit for bit (guaranteed with the flag)
        r["images_equal_batch1"] = bool(np.array_equal(images[(B, tag, inv)], images[(batches[0], tag, inv)]))
    env = {"prompts": a.prompts, "threads": a.threads, "warmup": a.warmup, "cpu": cpu_name(), "cores": os.cpu_count(),
           "torch": torch.__version__, "tree": "chain", "draft_length": 4, "cfg_scale": world.cfg_scale}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps({"env": env, "rows": list(rows.values())}, indent=1))
    md = [f"Toy world, {a.prompts} prompts, CPU {env['cpu']} ({a.threads} thread), chain L=4, CFG {env['cfg_scale']}; "
          "every configuration on the same prompts and seeds in one run; images / s of generation (the loop's "
          "latency_s: prompt encoding and decoding excluded); batch invariant = "
          "`deterministic.batch_invariant=true` (coolsd.engine.batch_invariant)."
          + ("" if a.warmup else " No warm-up (--no-warmup, a smoke run): timings include first-call costs."), "",
          "| batch | method | batch invariant | images / s | accepted length | vs AR (same batch) | "
          "vs batch 1 (same method) | vs default kernels | images = batch 1 |",
          "|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['batch_size']} | {r['method']} | {'yes' if r['batch_invariant'] else 'no'} | {r['images_per_s']:.2f} | "
           f"{r['accepted_length']:.2f} | {r['throughput_vs_ar_same_batch']:.2f}x | "
           f"{r['throughput_vs_batch1_same_method']:.2f}x | {r['throughput_vs_default_kernels']:.2f}x | "
           f"{'yes' if r['images_equal_batch1'] else 'no'} |" for r in rows.values()]
    (a.out / "table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return rows


if __name__ == "__main__":
    main()
