"""Speed of the decode loop, eager and compiled: what a round costs against what its
forwards cost, on the toy world (CPU), every configuration side by side in one run.

For each mode (eager, ``compile=true``) and method (AR, EAGLE-1, COOL-SD delta 2, SJD) on the
same prompts and seeds, interleaved per prompt so machine noise hits all alike:

* latency per image (the loop's ``latency_s``; decoding to pixels excluded, docs/methods.md#6-evaluation-protocol) and
  the paired speed-up against AR **in the same mode** (eager vs eager, compiled vs compiled),
  plus the compiled-vs-eager AR ratio, so no method is flattered by a slow baseline;
* speed-up / accepted length, and a round's cost in AR steps;
* the forwards measured ALONE in the same mode and process: t_ar (one target token, CFG),
  t_tree (the chain-4 tree: root + 4 nodes), t_draft (each drafter forward of a round: the
  context forward then one per level), the prefill; from them the round's forward time, the
  share of a round spent outside model forwards, and the ceiling
  speed-up / accepted length <= t_ar / (t_tree + draft forwards per round x t_draft);
* compilations: warm-up seconds (excluded from latency) and graphs compiled after warm-up.

    python benchmarks/speed.py                      # -> results/speed/{table.md,summary.json}
    python benchmarks/speed.py --prompts 4 --batches 1 --out /tmp/speed   # a quick look
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.cli.runner import compose  # noqa: E402
from coolsd.engine.compiled import compile_count  # noqa: E402
from coolsd.engine.decoding.trees import make_tree  # noqa: E402
from coolsd.engine.timing import cpu_name  # noqa: E402
from coolsd.job.generation import prompt_seed  # noqa: E402
from coolsd.util.stats import ratio_ci  # noqa: E402
from coolsd.worlds import load_world  # noqa: E402

METHODS = {"ar": ("ar", {}), "eagle": ("eagle", {}), "coolsd_2": ("coolsd", {"delta": 2.0}), "sjd": ("sjd", {})}
DRAFT_LENGTH = 4


def _paired(num, den) -> tuple[float, list]:
    r = ratio_ci(num, den, paired=True)
    return r["mean"], r["ci95"]


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


@torch.no_grad()
def forward_costs(world, repeats: int = 200) -> dict:
    """Each forward of a chain-4 round alone, in ms (median), at batch 1 with the committed
    sequence half way through the image: target AR step, tree, prefill; drafter context forward
    (5 entries) and its three level forwards."""
    target, drafter = world.target, world.drafter()
    cond = world.encode(["a red circle"])
    n = target.n_image_tokens // 2
    none = (torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, dtype=torch.long))

    def setup():
        out = target.begin(cond, 1)
        pos = torch.arange(n).unsqueeze(0)
        target.forward(torch.zeros(1, n, dtype=torch.long), pos, torch.ones(n, n, dtype=torch.bool).tril())
        target.commit(torch.arange(n).unsqueeze(0), torch.tensor([n]))
        return out

    prefill = setup()
    tree = make_tree("chain", DRAFT_LENGTH)
    tok1, tok5 = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, tree.n_nodes + 1, dtype=torch.long)
    pos1, pos5 = torch.tensor([[n]]), n + tree.depth.unsqueeze(0)

    def ar():
        target.forward(tok1, pos1, torch.ones(1, 1, dtype=torch.bool))
        target.commit(*none)

    def tree_fwd():
        target.forward(tok5, pos5, tree.ancestors)
        target.commit(*none)

    costs = {"t_ar_ms": _median_ms(ar, repeats), "t_tree_ms": _median_ms(tree_fwd, repeats),
             "t_prefill_ms": _median_ms(lambda: target.begin(cond, 1), max(repeats // 10, 5))}
    setup()
    step = target.forward(tok5, pos5, tree.ancestors)
    target.commit(*none)
    hidden = step.hidden  # (1, 5, 2, H) under CFG: realistic features
    drafter.begin(cond, 1, prefill)
    C = tree.max_depth + 1
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    drafter.forward(tok5, pos5, causal, hidden)  # a first context, committed
    drafter.commit(torch.arange(C).unsqueeze(0), torch.tensor([C]))
    level_attend = [torch.ones(1, p + 1, dtype=torch.bool) for p in range(tree.max_depth - 1)]
    times = {"ctx": [], "level": []}

    def round_of_drafts():
        t0 = time.perf_counter()
        drafter.forward(tok5, pos5 + C, causal, hidden)
        times["ctx"].append(time.perf_counter() - t0)
        drafter.commit(*none)
        for d, att in enumerate(level_attend):
            t0 = time.perf_counter()
            drafter.forward(tok1, pos1 + C + d, att, hidden[:, :1])
            times["level"].append(time.perf_counter() - t0)
        drafter.commit(*none)

    for _ in range(repeats):
        round_of_drafts()
    costs["t_draft_ctx_ms"] = 1e3 * statistics.median(times["ctx"][5:])
    costs["t_draft_level_ms"] = 1e3 * statistics.median(times["level"][5:])
    costs["t_draft_ms"] = (costs["t_draft_ctx_ms"] + len(level_attend) * costs["t_draft_level_ms"]) / (1 + len(level_attend))
    return costs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "speed")
    ap.add_argument("--profile-prompts", type=int, default=8, help="cProfile COOL-SD on this many prompts per mode")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    worlds, methods, warmup, costs = {}, {}, {}, {}
    for mode in modes:
        cfg = compose("target=toy", f"dataset.n_prompts={a.prompts}", f"compile={str(mode == 'compiled').lower()}")
        worlds[mode] = w = load_world(cfg)
        methods[mode] = {tag: w.build_method(name, p, "chain", None if name == "sjd" else DRAFT_LENGTH)
                         for tag, (name, p) in METHODS.items()}
    scenes = worlds[modes[0]].prompts(cfg)
    seeds = [prompt_seed(0, i) for i in range(a.prompts)]
    for mode in modes:  # warm-up: every method at every batch size the run uses (compiles every graph)
        n0, t0 = compile_count(), time.perf_counter()
        sizes = sorted({min(B, a.prompts) for B in batches} | {a.prompts % B for B in batches if a.prompts % B})
        for B in sizes:
            for m in methods[mode].values():
                worlds[mode].generate(m, scenes[:B], seeds[:B])
        costs[mode] = forward_costs(worlds[mode])
        warmup[mode] = {"warmup_s": time.perf_counter() - t0, "graphs_compiled_in_warmup": compile_count() - n0}
        print(mode, warmup[mode], {k: round(v, 3) for k, v in costs[mode].items()}, flush=True)
    n_before = compile_count()
    lat = {}  # (mode, B, tag) -> per-batch latency list, accepted lengths, rounds, draft forwards
    for B in batches:
        for s in range(0, a.prompts, B):
            for mode in modes:
                for tag, m in methods[mode].items():
                    out = worlds[mode].generate(m, scenes[s:s + B], seeds[s:s + B])
                    r = lat.setdefault((mode, B, tag), {"latency": [], "tau": [], "rounds": [], "draft_forwards": []})
                    r["latency"].append(out[0].fields["latency_s"] / len(out))  # per image
                    r["tau"] += [x.fields["accepted_length"] for x in out]
                    r["rounds"].append(max(len(x.fields["round_lengths"]) for x in out))
                    r["draft_forwards"].append(out[0].fields["draft_forwards"])
    recompiles = compile_count() - n_before
    rows = []
    for (mode, B, tag), r in lat.items():
        base = lat[(mode, B, "ar")]
        ratio, (lo, hi) = _paired(base["latency"], r["latency"])
        tau = statistics.fmean(r["tau"])
        c = costs[mode]
        rounds = statistics.fmean(r["rounds"])
        per_round = statistics.fmean(r["draft_forwards"]) / rounds
        batch_lat = statistics.fmean(r["latency"]) * B
        round_ms = 1e3 * batch_lat / rounds
        row = {"mode": mode, "batch_size": B, "method": tag, "latency_ms": 1e3 * statistics.fmean(r["latency"]),
               "speedup": ratio, "speedup_ci": [lo, hi], "accepted_length": tau, "speedup_per_accepted_length": ratio / tau,
               "round_ms": round_ms, "round_in_ar_steps": round_ms / (1e3 * statistics.fmean(base["latency"]) * B
                                                                      / statistics.fmean(base["rounds"])),
               "draft_forwards_per_round": per_round}
        if B == 1 and tag in ("ar", "eagle", "coolsd_2"):
            # a round's forwards measured alone (prefill excluded from the round's share)
            fwd = c["t_ar_ms"] if tag == "ar" else c["t_tree_ms"] + per_round * c["t_draft_ms"]
            loop_round = 1e3 * (batch_lat - c["t_prefill_ms"] / 1e3) / rounds
            row.update({"round_forwards_ms": fwd, "round_over_forwards": loop_round / fwd,
                        "outside_forwards_share": 1 - fwd / loop_round,
                        "ceiling_speedup_per_accepted_length": c["t_ar_ms"] / fwd})
        rows.append(row)
    ar_modes = {}
    if "eager" in modes and "compiled" in modes:
        for B in batches:
            ratio, (lo, hi) = _paired(lat[("eager", B, "ar")]["latency"], lat[("compiled", B, "ar")]["latency"])
            ar_modes[B] = {"compiled_vs_eager_ar": ratio, "ci": [lo, hi]}
    env = {"prompts": a.prompts, "threads": a.threads, "cpu": cpu_name(), "cores": os.cpu_count(),
           "torch": torch.__version__, "tree": "chain", "draft_length": DRAFT_LENGTH,
           "cfg_scale": worlds[modes[0]].cfg_scale}
    summary = {"env": env, "forward_costs_ms": costs, "warmup": warmup, "graphs_compiled_after_warmup": recompiles,
               "ar_compiled_vs_eager": ar_modes, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (a.out / "table.md").write_text(markdown(summary))
    if a.profile_prompts:
        k = min(a.profile_prompts, a.prompts)
        (a.out / "profile.md").write_text("\n".join(
            profile(worlds[mode], methods[mode]["coolsd_2"], scenes[:k], seeds[:k], mode, env) for mode in modes))
    print(markdown(summary))
    return summary


def profile(world, method, scenes, seeds, mode: str, env: dict, top: int = 18) -> str:
    """cProfile of COOL-SD (chain 4) at batch 1: the functions with the most own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for s, seed in zip(scenes, seeds):
        world.generate(method, [s], [seed])
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    body = text.getvalue()
    body = body[body.index("ncalls"):] if "ncalls" in body else body
    body = body.replace(str(ROOT) + "/", "").replace(str(Path(torch.__file__).parents[1]) + "/", "")
    return (f"## {mode}: COOL-SD delta 2, chain 4, {len(scenes)} prompts at batch 1 ({env['cpu']}, "
            f"{env['threads']} thread; cProfile adds its own per-call cost)\n\n```\n{body.strip()}\n```\n")


def markdown(s: dict) -> str:
    e = s["env"]
    md = [f"Toy world, {e['prompts']} prompts, CPU {e['cpu']} ({e['threads']} thread), chain L={e['draft_length']} "
          f"(SJD: its window), CFG {e['cfg_scale']}; eager and compiled (`compile=true`) side by side in one run, "
          "interleaved per prompt; speed-up = paired latency ratio against AR **in the same mode** [95% CI]; "
          "latency per image of generation (the loop's latency_s; decoding excluded).", "",
          "| mode | batch | method | ms / image | speed-up | accepted length | speed-up / acc. length | "
          "round, AR steps | round / its forwards alone | outside forwards | ceiling |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        f = (lambda k, fmt: fmt.format(r[k]) if k in r else "")
        md.append(f"| {r['mode']} | {r['batch_size']} | {r['method']} | {r['latency_ms']:.1f} | {r['speedup']:.2f}x "
                  f"[{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}] | {r['accepted_length']:.2f} | "
                  f"{r['speedup_per_accepted_length']:.2f} | {r['round_in_ar_steps']:.2f} | "
                  f"{f('round_over_forwards', '{:.2f}x')} | {f('outside_forwards_share', '{:.0%}')} | "
                  f"{f('ceiling_speedup_per_accepted_length', '{:.2f}')} |")
    md += ["", "Forwards alone (median ms, batch 1): " + "; ".join(
        f"{mode}: " + ", ".join(f"{k[2:-3]} {v:.3f}" for k, v in c.items()) for mode, c in s["forward_costs_ms"].items())]
    md += ["", "Warm-up (excluded from latency): " + "; ".join(
        f"{mode} {w['warmup_s']:.1f} s, {w['graphs_compiled_in_warmup']} graphs" for mode, w in s["warmup"].items())
        + f". Graphs compiled after warm-up: {s['graphs_compiled_after_warmup']}."]
    for B, v in s["ar_compiled_vs_eager"].items():
        md.append(f"AR compiled vs eager at batch {B}: {v['compiled_vs_eager_ar']:.2f}x [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}].")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
