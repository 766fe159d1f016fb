"""What a round's randomness costs: the time spent drawing uniforms (``coolsd.engine.decoding.rng``:
counter-based Philox streams pooled on the target's device) as a share of the decode time, on the
toy world, eager, 1 thread, at batch 1 and 16, for every method of the toy sweep and the field's
parallel decoders. Every ``uniform`` call of the loop and its drafter is timed with the host clock
(the CPU runs synchronously: the clock brackets the work itself); the share is summed draw time /
summed loop time over the prompts. Goal: < 2% of a round.

    python benchmarks/rng_cost.py                    # 16 prompts, batch 1 and 16
    python benchmarks/rng_cost.py --prompts 32 --batches 1,16

Writes results/speed/rng_cost.{md,json}.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from coolsd.cli.runner import compose
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.drafting import build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.timing import cpu_name
from coolsd.job.generation import prompt_seed
from coolsd.util.records import write_json_atomic
from coolsd.worlds import load_world

ROOT = Path(__file__).resolve().parents[1]
METHODS = {  # tag: (method, params)
    "ar": ("ar", {}),
    "eagle": ("eagle", {}),
    "coolsd_2": ("coolsd", {"delta": 2.0}),
    "uniform_rsd_2": ("uniform_rsd", {"delta": 2.0}),
    "lantern_pp": ("lantern_pp", {"lam": 2.0, "k": 10}),
    "sjd": ("sjd", {}),
    "mc_sjd_maximal": ("mc_sjd", {"coupling": "maximal"}),
    "mc_sjd_gumbel": ("mc_sjd", {"coupling": "gumbel"}),
    "sjd_pac": ("sjd_pac", {}),
    "gsd": ("gsd", {}),
}


class TimedRNG(PerSampleRNG):
    """PerSampleRNG whose draws are timed (refills of the pool and random-access draws included)."""

    seconds = 0.0
    calls = 0

    def uniform(self, *shape: int) -> torch.Tensor:
        return self._timed(super().uniform, *shape)

    def indexed(self, keys, index, count) -> torch.Tensor:
        return self._timed(super().indexed, keys, index, count)

    def _timed(self, draw, *args) -> torch.Tensor:
        t0 = time.perf_counter()
        u = draw(*args)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return u


def measure(world, method, cond, seeds) -> tuple[float, float, int, int]:
    """(loop seconds, seconds drawing uniforms, draw calls, rounds of the longest sample)."""
    t = world.target
    rng = TimedRNG(seeds)
    drafter = build_drafter(method, world.drafter() if method.drafter == "model" else None, world.sampling,
                            t.vocab_size, grid_width=8)
    with torch.no_grad():
        res = speculative_generate(t, t.n_image_tokens, rng, rule=method.rule, drafter=drafter, tree=method.tree,
                                   sampling=world.sampling, cond=cond, batch_size=len(seeds))
    return res.seconds, rng.seconds, rng.calls, max(len(r) for r in res.round_lengths)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=str(ROOT / "results" / "speed" / "rng_cost"))
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    tags = a.methods.split(",")
    unknown = sorted(set(tags) - set(METHODS))
    if unknown:
        ap.error(f"--methods: unknown {unknown}; valid: {','.join(METHODS)}")
    torch.set_num_threads(1)
    cfg = compose("target=toy", f"dataset.n_prompts={a.prompts}")
    world = load_world(cfg)
    scenes = world.prompts(cfg)
    rows = []
    for B in batches:
        for tag in tags:
            name, params = METHODS[tag]
            m = world.build_method(name, params, "chain", 4)  # the toy sweep's tree (L = 4)
            loop = draw = 0.0
            calls = rounds = 0
            measure(world, m, world.encode([scenes[0].caption] * B), [0] * B)  # warm-up, excluded
            for s in range(0, a.prompts, B):
                group = scenes[s: s + B]
                if len(group) < B:
                    break
                sec, d, c, r = measure(world, m, world.encode([x.caption for x in group]),
                                       [prompt_seed(0, s + i) for i in range(B)])
                loop, draw, calls, rounds = loop + sec, draw + d, calls + c, rounds + r
            rows.append({"method": tag, "batch": B, "loop_s": loop, "rng_s": draw, "share": draw / loop,
                         "draws_per_round": calls / rounds, "us_per_round": 1e6 * draw / rounds,
                         "round_ms": 1e3 * loop / rounds})
            print(f"batch {B:2d} {tag:16s} randomness {100 * draw / loop:5.2f}% of decode time "
                  f"({1e6 * draw / rounds:6.1f} us of a {1e3 * loop / rounds:6.2f} ms round)", flush=True)
    out = {"cpu": cpu_name(), "threads": 1, "prompts": a.prompts, "world": "toy", "mode": "eager", "rows": rows}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, path.with_suffix(".json"))
    lines = [f"# A round's randomness: toy world, eager, 1 thread ({out['cpu']}), {a.prompts} prompts", "",
             "Time drawing uniforms (counter-based Philox streams, `coolsd.engine.decoding.rng`) as a share of the decode "
             "time, summed over the prompts; goal < 2%.", "",
             "| batch | method | randomness share | us a round | round (ms) | draws a round |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['method']} | {100 * r['share']:.2f}% | {r['us_per_round']:.1f} | "
              f"{r['round_ms']:.2f} | {r['draws_per_round']:.1f} |" for r in rows]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out


if __name__ == "__main__":
    main()
