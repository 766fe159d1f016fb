"""GPU speed of the LlamaGen-XL target: per-token latency of the target and of an
EAGLE-1 drafter step at batch 1, the memory-bandwidth bound, and speculative speed-ups, all
measured side by side in one run with device syncs and warm-up excluded (docs/methods.md#6-evaluation-protocol), in
each mode: eager and compiled (``compile=true``: torch.compile, CUDA graphs via
``reduce-overhead``). Speed-ups are against AR in the same mode; the compiled-vs-eager AR ratio
is reported, and a round's cost in AR steps (EAGLE-1 head with random weights: its accepted
length means nothing, its cost is real).

    python benchmarks/gpu.py                           # random weights of the real shapes (GPT-XL)
    python benchmarks/gpu.py --gpt t2i_XL_stage1_256.pt  # the real checkpoint if present
    python benchmarks/gpu.py --tiny --device cpu       # a smoke run (tests use it)
    python benchmarks/gpu.py --modes eager             # skip the compiled path

Goals: AR time per token <= 3x the time to read the weights once (bytes / peak bandwidth);
speed-up / accepted length >= 0.85 with a trained drafter. Without one, the target drafts for
itself (``self``): every draft is accepted, so accepted length is the tree depth + 1 and the
speed-up shows the engine's overhead against that ceiling (drafting costs a full target step
here, so speed-up / accepted length is far below what a 1-layer drafter gives). With random
weights the distributions are near uniform, which does not change the cost of a forward.
Writes results/gpu/<name>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.engine.compiled import compile_count  # noqa: E402
from coolsd.engine.decoding.rng import PerSampleRNG  # noqa: E402
from coolsd.engine.drafting import SamplingConfig, build_drafter  # noqa: E402
from coolsd.engine.loop import speculative_generate  # noqa: E402
from coolsd.engine.methods import build_method  # noqa: E402
from coolsd.engine.timing import device_sync  # noqa: E402
from coolsd.models.eagle.model import EagleDrafter, EagleHead  # noqa: E402
from coolsd.models.llamagen import GPT_XL, LlamaGenGPT, LlamaGenTarget, tiny  # noqa: E402

# peak HBM bandwidth, GB/s (vendor figures), by a substring of torch.cuda.get_device_name()
BANDWIDTH_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
                 "A100-SXM4-40GB": 1555, "A100": 1555, "L40S": 864, "A10G": 600, "RTX 4090": 1008}


def bandwidth_of(name: str) -> float | None:
    return next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)


def timed(fn, sync, repeats: int) -> list[float]:
    fn()  # warm-up, excluded
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gpt", default=None, help="t2i_XL_stage1_256.pt (default: random weights of its shapes)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run on any machine)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", default="mc_sim_7b_63", help="a named tree, or chain (with --draft-length)")
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="peak memory bandwidth (default: by GPU name)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "gpu")
    ap.add_argument("--name", default=None)
    a = ap.parse_args(argv)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = tiny() if a.tiny else GPT_XL
    torch.manual_seed(0)
    if a.gpt:
        from coolsd.models.llamagen import load_gpt

        gpt = load_gpt(a.gpt, cfg, dtype, dev)
    else:
        with torch.device(dev):
            gpt = LlamaGenGPT(cfg)
    gpt = gpt.to(dtype).eval().requires_grad_(False)
    head = EagleHead.from_target(gpt, seed=0).to(dev, dtype).eval()
    sync = device_sync(dev)
    g = torch.Generator().manual_seed(0)
    cond = {"caption_embs": torch.randn(1, cfg.cls_token_num, cfg.caption_dim, generator=g).to(dev, dtype),
            "emb_mask": torch.ones(1, cfg.cls_token_num, dtype=torch.bool, device=dev)}
    cond["emb_mask"][0, : cfg.cls_token_num // 3] = False  # a left-padded caption
    sampling = SamplingConfig(temperature=1.0, top_k=min(2000, cfg.vocab_size), top_p=1.0)
    N = cfg.block_size
    tree_kw = {"tree": a.tree, **({"draft_length": a.draft_length} if a.tree == "chain" else {})}
    modes = a.modes.split(",")
    by_mode = {mode: measure(mode == "compiled", gpt, head, cond, sampling, N, tree_kw, sync, a.repeats, dev, dtype)
               for mode in modes}
    weight_bytes = sum(p.numel() * p.element_size() for p in gpt.parameters())
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    bw = a.bandwidth_gbs or (bandwidth_of(gpu) if dev.type == "cuda" else None)
    bound = weight_bytes / (bw * 1e9) if bw else None
    for r in by_mode.values():
        r["ar_per_token_over_bound"] = r["generation"]["ar"]["seconds_per_token"] / bound if bound else None
    first = by_mode[modes[0]]
    out = {"device": gpu, "torch": torch.__version__, "dtype": a.dtype, "weights": a.gpt or "random (real shapes)" if
           not a.tiny else "random (tiny shapes)", "gpt_params": sum(p.numel() for p in gpt.parameters()),
           "weight_bytes": weight_bytes, "bandwidth_gbs": bw, "bandwidth_bound_s_per_token": bound,
           "image_tokens": N, "cfg_scale": 3.0, "tree": tree_kw, "repeats": a.repeats, "modes": by_mode,
           # the first mode's numbers at the top level (the layout of the eager-only runs, before the compiled path)
           "forwards_batch1": first["forwards_batch1"], "generation": first["generation"],
           "ar_per_token_over_bound": first["ar_per_token_over_bound"],
           "note": "*_self: the drafter is the target itself (no trained drafter), so its accepted length is the "
                   "ceiling depth + 1 and each draft step costs a target step; eagle_head: a random-weight EAGLE-1 head "
                   "(accepted length near 1; its round cost in AR steps is what a trained head would cost)"}
    if "eager" in by_mode and "compiled" in by_mode:
        out["ar_compiled_vs_eager"] = (by_mode["eager"]["generation"]["ar"]["seconds_per_image"]
                                       / by_mode["compiled"]["generation"]["ar"]["seconds_per_image"])
    a.out.mkdir(parents=True, exist_ok=True)
    name = a.name or ("tiny_" if a.tiny else "llamagen_xl_") + dev.type
    (a.out / f"{name}.json").write_text(json.dumps(out, indent=1))
    lines = [f"# GPU benchmark: LlamaGen {'tiny' if a.tiny else 'GPT-XL'} ({out['weights']}), {gpu}, {a.dtype}", "",
             f"- weights {weight_bytes / 1e9:.2f} GB; bandwidth {bw} GB/s; bound {bound * 1e3:.2f} ms/token" if bound else
             f"- weights {weight_bytes / 1e9:.3f} GB; bandwidth unknown (pass --bandwidth-gbs)"]
    if "ar_compiled_vs_eager" in out:
        lines.append(f"- AR compiled vs eager: {out['ar_compiled_vs_eager']:.2f}x")
    for mode, r in by_mode.items():
        f, res = r["forwards_batch1"], r["generation"]
        lines += ["", f"## {mode}", "",
                  f"- AR: {res['ar']['seconds_per_token'] * 1e3:.2f} ms/token"
                  + (f" = {r['ar_per_token_over_bound']:.2f}x the bandwidth bound (goal <= 3)" if bound else ""),
                  f"- one forward at batch 1 (CFG doubled): AR step {f['ar_step_s'] * 1e3:.2f} ms, tree verify "
                  f"({f['tree_tokens']} tokens) {f['tree_verify_s'] * 1e3:.2f} ms, EAGLE drafter step "
                  f"{f['drafter_step_s'] * 1e3:.2f} ms; graphs compiled after warm-up: {r['graphs_compiled_after_warmup']}",
                  "", "| method | s / image | accepted length | speed-up (same mode) | speed-up / accepted length | "
                  "round, AR steps |", "|---|---|---|---|---|---|"]
        lines += [f"| {k} | {v['seconds_per_image']:.3f} | {v['accepted_length']:.2f} | {v['speedup']:.2f} | "
                  f"{v['speedup_per_accepted_length']:.2f} | {v['round_in_ar_steps']:.2f} |" for k, v in res.items()]
    (a.out / f"{name}.md").write_text("\n".join(lines + ["", out["note"]]) + "\n")
    print("\n".join(lines))
    return out


def measure(compile: bool, gpt, head, cond, sampling, N: int, tree_kw: dict, sync, repeats: int, dev, dtype) -> dict:
    """One mode: generation (AR, self-drafting EAGLE and COOL-SD, an EAGLE head) and single forwards."""
    cfg = gpt.config

    def target():
        return LlamaGenTarget(gpt, cfg_scale=3.0, compile=compile)

    def gen(method, drafter_model):
        t = target()
        drafter = build_drafter(method, drafter_model, sampling, cfg.vocab_size)
        with torch.no_grad():
            return speculative_generate(t, N, PerSampleRNG([0]), rule=method.rule, drafter=drafter, tree=method.tree,
                                        sampling=sampling, cond=cond, batch_size=1, sync=sync)

    n0 = compile_count()
    results, runs, warm = {}, {}, {}
    plan = [("ar", build_method("ar"), lambda t: None),
            ("eagle_self", build_method("eagle", **tree_kw), lambda t: target()),
            ("coolsd2_self", build_method("coolsd", delta=2.0, **tree_kw), lambda t: target()),
            ("eagle_head", build_method("eagle", **tree_kw),
             lambda t: EagleDrafter(head, gpt.output.weight, 3.0, compile=compile))]
    for name, method, drafter_of in plan:  # warm-up (compiles every graph), excluded
        t0 = time.perf_counter()
        gen(method, drafter_of(None))
        warm[name] = time.perf_counter() - t0
    n1 = compile_count()
    for name, method, drafter_of in plan:
        runs[name] = [gen(method, drafter_of(None)) for _ in range(repeats)]
    n2 = compile_count()
    ar_s = statistics.median(r.seconds for r in runs["ar"])
    ar_round = ar_s / statistics.mean(len(r.round_lengths[0]) for r in runs["ar"])
    for name, rs in runs.items():
        s = statistics.median(r.seconds for r in rs)
        tau = statistics.mean(r.accepted_length(0) for r in rs) if name != "ar" else 1.0
        rounds = statistics.mean(len(r.round_lengths[0]) for r in rs)
        results[name] = {"seconds_per_image": s, "seconds_per_token": s / N, "accepted_length": tau,
                         "speedup": ar_s / s, "speedup_per_accepted_length": ar_s / s / tau,
                         "round_in_ar_steps": s / rounds / ar_round}

    # single forwards at batch 1 (each warmed up by ``timed``): one AR decode step, one verification forward
    # of the tree, one drafter step
    t = target()
    none = (torch.zeros(1, 0, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev))
    with torch.no_grad():
        t.begin(cond, 1)
        one = torch.zeros(1, 1, dtype=torch.long, device=dev)
        step_ar = timed(lambda: (t.forward(one, torch.zeros(1, 1, dtype=torch.long, device=dev),
                                           torch.ones(1, 1, dtype=torch.bool, device=dev)), t.commit(*none)),
                        sync, repeats * 5)
        tree = build_method("eagle", **tree_kw).tree
        m = tree.n_nodes + 1
        toks = torch.zeros(1, m, dtype=torch.long, device=dev)
        pos = tree.depth.to(dev).expand(1, -1)
        anc = tree.ancestors.to(dev)
        step_tree = timed(lambda: (t.forward(toks, pos, anc), t.commit(*none)), sync, repeats * 5)
        d = EagleDrafter(head, gpt.output.weight, 3.0, compile=compile)
        d.begin(cond, 1)
        feats = torch.zeros(1, 1, 2, cfg.dim, dtype=dtype, device=dev)
        step_draft = timed(lambda: (d.forward(one, torch.zeros(1, 1, dtype=torch.long, device=dev),
                                              torch.ones(1, 1, dtype=torch.bool, device=dev), feats),
                                    d.commit(*none)), sync, repeats * 5)
    forwards = {"ar_step_s": statistics.median(step_ar), "tree_verify_s": statistics.median(step_tree),
                "tree_tokens": m, "drafter_step_s": statistics.median(step_draft),
                "drafter_over_target_step": statistics.median(step_draft) / statistics.median(step_ar)}
    return {"generation": results, "forwards_batch1": forwards, "warmup_s": warm,
            "graphs_compiled_in_warmup": n1 - n0, "graphs_compiled_after_warmup": n2 - n1}


if __name__ == "__main__":
    main()
