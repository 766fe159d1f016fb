"""What the per-token quality signals (docs/signals.md) cost: decode time on the toy world with them
(``speculative_generate(distortion=True)``: exact distortion, target NLL, off-support, depth) and
without, side by side in one run. Every prompt group is decoded twice with the same seeds,
interleaved, the order alternating per group so drift hits both alike; overhead = sum(latency on) /
sum(latency off) - 1 over the groups with a paired bootstrap 95% interval over the groups
(``coolsd.util.stats.ratio_ci``), the same for the loop thread's CPU time (at 1 thread the loop's own
work: on a shared machine wall time also holds other tenants' time), and the paired per-group
median beside it. Goal: < 5%.
Beside them, the minor page faults per run (this thread's, Linux): fresh memory from the OS, a
cost of large temporary tensors that the signal work is sized to avoid (coolsd.engine.loop).

    python benchmarks/signal_overhead.py                       # eager and compiled, batch 1 and 16
    python benchmarks/signal_overhead.py --modes eager --prompts 8

Writes results/speed/signal_overhead.{md,json}.
"""
from __future__ import annotations

import argparse
import statistics
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
from coolsd.util.stats import ratio_ci
from coolsd.worlds import load_world

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "coolsd_2": ("coolsd", {"delta": 2.0}),
    "uniform_rsd_2": ("uniform_rsd", {"delta": 2.0}),
    "lantern_pp": ("lantern_pp", {"lam": 2.0, "k": 10}),
    "lantern_pp_gstar": ("lantern_pp", {"lam": 2.0, "k": 10, "resample": "gstar"}),
    "eagle": ("eagle", {}),
}


def _minor_faults() -> float:
    """This thread's minor page faults so far (NaN where getrusage has no per-thread count)."""
    try:
        import resource
        return float(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
    except (ImportError, AttributeError, OSError):
        return float("nan")


def _ci(r: dict, key: str = "overhead_ci") -> str:
    return "-" if r[key] is None else "[{:+.1f}%, {:+.1f}%]".format(*(100 * x for x in r[key]))


def decode(world, method, cond, seeds, signals: bool) -> tuple[float, float, float, float]:
    """(loop seconds, seconds of it spent on the signals: eager rounds time their deferred sink,
    ``GenerationResult.extra["signal_s"]``, NaN where not timed (compiled rounds); minor page
    faults during the call; the calling thread's CPU seconds during the call, which at 1 thread
    is the loop's work without the time other tenants of a shared machine take from it)."""
    t = world.target
    drafter = build_drafter(method, world.drafter() if method.drafter == "model" else None, world.sampling, t.vocab_size)
    f0, c0 = _minor_faults(), time.thread_time()
    with torch.no_grad():
        res = speculative_generate(t, t.n_image_tokens, PerSampleRNG(list(seeds)), rule=method.rule, drafter=drafter,
                                   tree=method.tree, sampling=world.sampling, cond=cond, batch_size=len(seeds),
                                   distortion=signals)
    cpu = time.thread_time() - c0
    return res.seconds, res.extra.get("signal_s", 0.0 if not signals else float("nan")), _minor_faults() - f0, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompts", type=int, default=12, help="prompt groups per batch size")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "speed")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    tags = a.methods.split(",")
    unknown = [t for t in tags if t not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    rows = []
    for mode in a.modes.split(","):
        cfg = compose("target=toy", f"dataset.n_prompts={max(batches) * a.prompts}", f"compile={str(mode == 'compiled').lower()}")
        world = load_world(cfg)
        scenes = world.prompts(cfg)
        methods = {t: world.build_method(METHODS[t][0], dict(METHODS[t][1]), "chain", 4) for t in tags}
        for B in batches:
            t0 = time.perf_counter()
            cond = world.encode([s.caption for s in scenes[:B]])
            for t in tags:  # warm-up: every graph of both variants compiled before timing
                for on in (True, False):
                    decode(world, methods[t], cond, [prompt_seed(0, i) for i in range(B)], on)
            print(f"[{mode} batch {B}] warm-up {time.perf_counter() - t0:.1f} s", flush=True)
            lat = {t: {True: [], False: []} for t in tags}
            faults = {t: {True: [], False: []} for t in tags}
            cpu = {t: {True: [], False: []} for t in tags}
            timed = {t: [] for t in tags}  # seconds inside the signals, runs with them on
            for g in range(a.prompts):
                idx = range(g * B, (g + 1) * B)
                cond = world.encode([scenes[i].caption for i in idx])
                seeds = [prompt_seed(0, i) for i in idx]
                for t in tags:
                    for on in ((True, False) if g % 2 == 0 else (False, True)):
                        seconds, signal_s, n_faults, cpu_s = decode(world, methods[t], cond, seeds, on)
                        lat[t][on].append(seconds)
                        cpu[t][on].append(cpu_s)
                        faults[t][on].append(n_faults)
                        if on:
                            timed[t].append(signal_s)
            for t in tags:
                on, off = lat[t][True], lat[t][False]
                ci = ratio_ci(on, off, paired=True)
                cpu_ci = ratio_ci(cpu[t][True], cpu[t][False], paired=True)
                r = {"mode": mode, "batch": B, "method": t, "ms_off": 1e3 * sum(off) / len(off) / B,
                     "ms_on": 1e3 * sum(on) / len(on) / B, "overhead": sum(on) / sum(off) - 1,
                     "overhead_ci": [ci["lo"] - 1, ci["hi"] - 1] if "lo" in ci else None,
                     "cpu_overhead": sum(cpu[t][True]) / sum(cpu[t][False]) - 1,
                     "cpu_overhead_ci": [cpu_ci["lo"] - 1, cpu_ci["hi"] - 1] if "lo" in cpu_ci else None,
                     "paired_median": statistics.median(x / y - 1 for x, y in zip(on, off)),
                     "timed_share": sum(timed[t]) / sum(on),  # NaN for compiled rounds (not timed inside)
                     "faults_on": statistics.median(faults[t][True]), "faults_off": statistics.median(faults[t][False])}
                rows.append(r)
                print(f"{mode:8s} batch {B:2d} {t:18s} {r['ms_off']:7.1f} -> {r['ms_on']:7.1f} ms/image  "
                      f"{100 * r['overhead']:+6.2f}% {_ci(r)}, CPU time {100 * r['cpu_overhead']:+6.2f}% "
                      f"{_ci(r, 'cpu_overhead_ci')} (paired median {100 * r['paired_median']:+6.2f}%, "
                      f"timed inside {100 * r['timed_share']:.2f}%, page faults a run {r['faults_on']:.0f} on, "
                      f"{r['faults_off']:.0f} off)", flush=True)
    lines = [f"Per-token quality signals on the toy world: decode time with and without, side by side, "
             f"{a.prompts} prompt groups per batch size, chain L=4, {cpu_name()}, {a.threads} thread(s). Produced by "
             "`python benchmarks/signal_overhead.py`. Goal: < 5%. Overhead: sum of decode times with / without - 1 over "
             "the groups; 95% CI: a paired bootstrap over the groups (`coolsd.util.stats.ratio_ci`). CPU-time overhead: the "
             "same with the loop thread's CPU time (`time.thread_time`; 1 thread: the loop's own work, without the "
             "time a shared machine's other tenants take). 'timed inside': in eager mode the loop times its "
             "own signal work (the deferred sink, `GenerationResult.extra['signal_s']`) as a share of the decode time "
             "of the same runs: the same cost without the run-to-run noise of a difference of two timings "
             "(compiled rounds compute the signals inside the compiled graph: not timed there). Page faults: "
             "the median minor page faults of a run (the loop's thread) with and without the signals.", "",
             "| mode | batch | method | ms / image without | with | overhead | 95% CI | CPU-time overhead | 95% CI "
             "| paired median | timed inside | page faults with / without |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['batch']} | {r['method']} | {r['ms_off']:.1f} | {r['ms_on']:.1f} | "
              f"{100 * r['overhead']:+.1f}% | {_ci(r)} | {100 * r['cpu_overhead']:+.1f}% | {_ci(r, 'cpu_overhead_ci')} | "
              f"{100 * r['paired_median']:+.1f}% | "
              + ("-" if r["timed_share"] != r["timed_share"] else f"{100 * r['timed_share']:.2f}%")
              + f" | {r['faults_on']:.0f} / {r['faults_off']:.0f} |" for r in rows]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "signal_overhead.md").write_text("\n".join(lines) + "\n")
    write_json_atomic({"cpu": cpu_name(), "threads": a.threads, "prompts": a.prompts, "rows": rows},
                      a.out / "signal_overhead.json")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
