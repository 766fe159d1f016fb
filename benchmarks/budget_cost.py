"""What choosing each node's relaxation costs (``method=budget``, docs/methods.md section 2.1): decode
time on the toy world with the budgeted rule against UniformRSD (the same G* form with one fixed omega),
side by side in one run, eager and compiled, batch 1 and 16. The target drafts for itself
(``draft=self``: q = p), so every draft is accepted under both rules and both decode the same rounds,
the same forwards and the same tokens: the difference in time is the rule's own work (the 36-candidate
choice at every node, and its emitted distribution for the signals). Every prompt group is decoded
with both, interleaved, the order alternating per group; overhead = sum(budget) / sum(uniform) - 1 with
a paired bootstrap 95% interval over the groups (``coolsd.util.stats.ratio_ci``). Goal: < 3%.

    python benchmarks/budget_cost.py [--modes eager,compiled] [--batches 1,16] [--prompts 12]

Writes results/speed/budget_cost.{md,json}.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.cli.runner import compose  # noqa: E402
from coolsd.engine.decoding.rng import PerSampleRNG  # noqa: E402
from coolsd.engine.drafting import build_drafter  # noqa: E402
from coolsd.engine.loop import speculative_generate  # noqa: E402
from coolsd.engine.timing import cpu_name  # noqa: E402
from coolsd.job.generation import prompt_seed  # noqa: E402
from coolsd.util.records import write_json_atomic  # noqa: E402
from coolsd.util.stats import ratio_ci  # noqa: E402
from coolsd.worlds import load_world  # noqa: E402

METHODS = {"uniform_rsd": ("uniform_rsd", {"delta": 2.0}), "budget": ("budget", {"price": 2.0})}


def decode(world, method, cond, seeds) -> tuple[float, int]:
    """(loop seconds, target forwards of the batch)."""
    t = world.target
    drafter = build_drafter(method, world.drafter(), world.sampling, t.vocab_size)
    with torch.no_grad():
        res = speculative_generate(t, t.n_image_tokens, PerSampleRNG(list(seeds)), rule=method.rule, drafter=drafter,
                                   tree=method.tree, sampling=world.sampling, cond=cond, batch_size=len(seeds))
    return res.seconds, int(sum(res.target_forwards))


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompts", type=int, default=12, help="prompt groups per batch size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "speed")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    rows = []
    for mode in a.modes.split(","):
        cfg = compose("target=toy", "draft=self", f"dataset.n_prompts={max(batches) * a.prompts}",
                      f"compile={str(mode == 'compiled').lower()}")
        world = load_world(cfg)
        scenes = world.prompts(cfg)
        methods = {t: world.build_method(m, dict(p), "chain", 4) for t, (m, p) in METHODS.items()}
        for B in batches:
            t0 = time.perf_counter()
            cond = world.encode([s.caption for s in scenes[:B]])
            for t in methods:  # warm-up: every graph compiled before timing
                decode(world, methods[t], cond, [prompt_seed(0, i) for i in range(B)])
            print(f"[{mode} batch {B}] warm-up {time.perf_counter() - t0:.1f} s", flush=True)
            lat = {t: [] for t in methods}
            fwd = {t: [] for t in methods}
            for g in range(a.prompts):
                idx = range(g * B, (g + 1) * B)
                cond = world.encode([scenes[i].caption for i in idx])
                seeds = [prompt_seed(0, i) for i in idx]
                for t in (list(methods) if g % 2 == 0 else list(methods)[::-1]):
                    s, f = decode(world, methods[t], cond, seeds)
                    lat[t].append(s)
                    fwd[t].append(f)
            if fwd["budget"] != fwd["uniform_rsd"]:
                raise SystemExit(f"{mode} batch {B}: the two rules decoded different rounds ({fwd}); q = p should "
                                 "accept every draft under both")
            ci = ratio_ci(lat["budget"], lat["uniform_rsd"], paired=True)
            r = {"mode": mode, "batch": B, "ms_uniform": 1e3 * sum(lat["uniform_rsd"]) / len(lat["uniform_rsd"]) / B,
                 "ms_budget": 1e3 * sum(lat["budget"]) / len(lat["budget"]) / B,
                 "overhead": sum(lat["budget"]) / sum(lat["uniform_rsd"]) - 1,
                 "overhead_ci": [ci["lo"] - 1, ci["hi"] - 1] if "lo" in ci else None,
                 "target_forwards_per_image": sum(fwd["budget"]) / (a.prompts * B)}
            rows.append(r)
            print(f"{mode:8s} batch {B:2d}: {r['ms_uniform']:.1f} -> {r['ms_budget']:.1f} ms/image, "
                  f"{100 * r['overhead']:+.2f}%", flush=True)
    ci = lambda r: "-" if r["overhead_ci"] is None else "[{:+.1f}%, {:+.1f}%]".format(*(100 * x for x in r["overhead_ci"]))  # noqa: E731
    lines = [f"What the budgeted rule's choice costs on the toy world: UniformRSD (delta 2) and budget (price 2) side by "
             f"side, the target drafting for itself (every draft accepted under both: same rounds and tokens), "
             f"{a.prompts} prompt groups per batch size, chain L=4, {cpu_name()}, {a.threads} thread(s). Produced by "
             "`python benchmarks/budget_cost.py`. Goal: < 3%. Overhead: sum of decode times budget / uniform - 1; "
             "95% CI: paired bootstrap over the groups.", "",
             "| mode | batch | ms / image, UniformRSD | budget | overhead | 95% CI | target forwards / image |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['batch']} | {r['ms_uniform']:.1f} | {r['ms_budget']:.1f} | {100 * r['overhead']:+.1f}% | "
              f"{ci(r)} | {r['target_forwards_per_image']:.1f} |" for r in rows]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "budget_cost.md").write_text("\n".join(lines) + "\n")
    write_json_atomic({"cpu": cpu_name(), "threads": a.threads, "prompts": a.prompts, "rows": rows},
                      a.out / "budget_cost.json")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
