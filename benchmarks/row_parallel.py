"""Row-parallel decoders (ZipAR, PJD; docs/methods.md sections 8.1, 8.2): tokens per target forward
and how far each is from the target, in the lab (exact) and on the toy world.

Lab: a tiny random LlamaGen GPT (dim 32, 2 layers, init std 0.2, seed 4, fp64, CFG 2) on a 3 x 3 grid
of 2 codes, so every one of the 512 images can be enumerated.

* ZipAR, exact (``coolsd.theory.row_parallel.zipar_exact``): its sequence distribution is the
  product of the distributions its queries draw from; TV to the target's, and E[sum of step TV],
  the signal the loop records per image (an upper bound of the TV), at every window. A 4 x 4 grid
  of 2 codes (65,536 images) too.
* PJD has no closed form (its schedule follows its acceptances): ``n`` samples through the loop,
  the TV of their histogram to the target's exact distribution, and the same statistic for ``n``
  exact samples of the target (20 repeats: the null band's mean and 95th percentile, what "lossless"
  looks like at this n), and the chi-square p-value against the target.

Toy world: AR, ZipAR at windows 1, 2, 4 (default), 6 and PJD at start 8 (default), 4 and 2 on the
same prompts and seeds at batch 1 (``coolsd.report.sweep.toy_sweep``): tokens per forward, the
speed-up paired by prompt against AR, toy_fid / toy_clip, and ZipAR's step TV.

    python benchmarks/row_parallel.py                    # about 15 min on 2 cores -> results/row_parallel/
    python benchmarks/row_parallel.py --quick --out /tmp/r
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.engine.decoding.rng import PerSampleRNG  # noqa: E402
from coolsd.engine.drafting import SamplingConfig  # noqa: E402
from coolsd.engine.loop import speculative_generate  # noqa: E402
from coolsd.engine.rows import PJDRows  # noqa: E402
from coolsd.models.llamagen import LlamaGenGPT, LlamaGenTarget, tiny  # noqa: E402
from coolsd.theory import chi_square_pvalue  # noqa: E402
from coolsd.theory.row_parallel import all_images, target_distributions, zipar_exact  # noqa: E402
from coolsd.util.records import write_json_atomic  # noqa: E402

CODES = 2


def lab_target(side: int, seed: int = 4) -> LlamaGenTarget:
    torch.manual_seed(seed)
    model = LlamaGenGPT(tiny(dim=32, n_layer=2, vocab_size=CODES, block_size=side * side), init_std=0.2)
    return LlamaGenTarget(model.to(torch.float64).eval(), cfg_scale=2.0)


def lab_cond(B: int) -> dict:
    g = torch.Generator().manual_seed(4)
    cfg = tiny()
    caption = torch.randn(1, cfg.cls_token_num, cfg.caption_dim, generator=g, dtype=torch.float64)
    mask = torch.zeros(1, cfg.cls_token_num, dtype=torch.bool)
    mask[:, -5:] = True
    return {"caption_embs": caption.expand(B, -1, -1).clone(), "emb_mask": mask.expand(B, -1).clone()}


def lab(n: int, side4: bool) -> dict:
    sampling = SamplingConfig()
    out = {"zipar": [], "pjd": []}
    for side in (3, 4) if side4 else (3,):
        target = lab_target(side)
        for w in range(1, side):
            x = zipar_exact(target, lab_cond, CODES, side, side, w, sampling)
            out["zipar"].append(x)
            print(f"zipar {side}x{side} window {w}: tokens/forward {x['tokens_per_forward']:.3f}  exact TV {x['tv']:.4f}"
                  f"  E[sum step TV] {x['expected_step_tv']:.4f}", flush=True)
    side = 3
    target = lab_target(side)
    imgs = all_images(CODES, side * side)
    p = target_distributions(target, lab_cond(len(imgs)), imgs, sampling)
    exact = p.gather(2, imgs.unsqueeze(-1))[..., 0].prod(1).numpy()
    rng = np.random.default_rng(0)
    null = [0.5 * np.abs(np.bincount(rng.choice(len(exact), n, p=exact / exact.sum()), minlength=len(exact)) / n
                         - exact).sum() for _ in range(20)]
    null_band = {"mean": float(np.mean(null)), "p95": float(np.quantile(null, 0.95))}
    weights = CODES ** torch.arange(side * side - 1, -1, -1)
    for start, keep in [(1, 0.5), (2, 0.5), (1, None), (2, None), (3, None)]:
        t0 = time.perf_counter()
        res = speculative_generate(target, side * side, PerSampleRNG(list(range(n))),
                                   drafter=PJDRows(3, start, side, CODES, keep_above=keep), sampling=sampling,
                                   cond=lab_cond(n), batch_size=n, distortion=False)
        counts = np.bincount((res.tokens * weights).sum(1).numpy(), minlength=len(exact))
        x = {"grid": f"{side}x{side}", "codes": CODES, "window": 3, "start": start, "keep_above": keep, "n": n,
             "tokens_per_forward": float(np.mean([side * side / f for f in res.target_forwards])),
             "sampled_tv": float(0.5 * np.abs(counts / n - exact).sum()), "null_tv": null_band,
             "chi_square_p": float(chi_square_pvalue(counts, exact)), "seconds": time.perf_counter() - t0}
        out["pjd"].append(x)
        print(f"pjd start {start} keep_above {keep}: tokens/forward {x['tokens_per_forward']:.3f}  sampled TV "
              f"{x['sampled_tv']:.4f} (null {null_band['mean']:.4f}, p95 {null_band['p95']:.4f})  chi2 p "
              f"{x['chi_square_p']:.3g}", flush=True)
    return out


def toy(prompts: int, records: Path) -> dict:
    from coolsd.report.sweep import sweep_frame, toy_sweep

    specs = [("ar", "ar", {})] + [(f"zipar_{w}", "zipar", {"window": w}) for w in (1, 2, 4, 6)] + \
            [(f"pjd_{c}", "pjd", {"start": c}) for c in (8, 4, 2)]
    res = toy_sweep(specs, prompts, records)
    df = sweep_frame(res["table"]).set_index("tag")
    rows = []
    for tag, *_ in specs:
        r = df.loc[tag]
        get = lambda k: None if k not in r or r[k] is None or r[k] != r[k] else float(r[k])  # noqa: E731
        rows.append({"tag": tag, **{k: get(k) for k in ("target_forwards", "target_forwards_lo", "target_forwards_hi",
                                                        "speedup", "speedup_lo", "speedup_hi", "step_tv",
                                                        "step_tv_lo", "step_tv_hi", "toy_fid", "toy_fid_lo",
                                                        "toy_fid_hi", "toy_clip", "toy_clip_lo", "toy_clip_hi")}})
    return {"env": {k: v for k, v in res["env"].items() if k != "records"}, "rows": rows}


def markdown(result: dict) -> str:
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    ci = lambda r, k, d=2: "-" if r.get(k) is None else f"{r[k]:.{d}f} [{f(r.get(k + '_lo'), d)}, {f(r.get(k + '_hi'), d)}]"  # noqa: E731
    md = ["# Row-parallel decoders: tokens per forward and distance to the target", "",
          "Made by `python benchmarks/row_parallel.py` (docstring: setup).", "",
          "## Lab, ZipAR (exact, every image enumerated)", "",
          "| grid | window | tokens / forward | TV to the target | E[sum of step TV] |", "|---|---|---|---|---|"]
    for x in result["lab"]["zipar"]:
        md.append(f"| {x['height']}x{x['width']} | {x['window']} | {f(x['tokens_per_forward'])} | {f(x['tv'], 4)} | "
                  f"{f(x['expected_step_tv'], 4)} |")
    md += ["", "## Lab, PJD (sampled: no closed form)", "",
           "| grid | window | start | keep_above | n | tokens / forward | sampled TV | null TV mean (p95) | chi-square p |",
           "|---|---|---|---|---|---|---|---|---|"]
    for x in result["lab"]["pjd"]:
        md.append(f"| {x['grid']} | {x['window']} | {x['start']} | {x['keep_above']} | {x['n']} | "
                  f"{f(x['tokens_per_forward'])} | {f(x['sampled_tv'], 4)} | {f(x['null_tv']['mean'], 4)} "
                  f"({f(x['null_tv']['p95'], 4)}) | {x['chi_square_p']:.3g} |")
    if "toy" in result:
        env = result["toy"]["env"]
        md += ["", f"## Toy world ({env['prompts']} prompts, batch {env['batch_size']}, {env['threads']} thread, "
               f"{env['cpu']})", "",
               "| method | target forwards / image | 64 / mean forwards | speed-up vs AR | step TV (sum/image) | toy_fid | toy_clip |",
               "|---|---|---|---|---|---|---|"]
        for r in result["toy"]["rows"]:
            tpf = None if r["target_forwards"] is None else 64 / r["target_forwards"]
            md.append(f"| {r['tag']} | {ci(r, 'target_forwards', 1)} | {f(tpf, 2)} | {ci(r, 'speedup')} | "
                      f"{ci(r, 'step_tv')} | {ci(r, 'toy_fid', 1)} | {ci(r, 'toy_clip')} |")
        md += ["", "PJD's step TV is '-': no closed form (docs/methods.md section 8.2); its distance is the lab's."]
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "row_parallel")
    ap.add_argument("--samples", type=int, default=4000, help="PJD samples in the lab")
    ap.add_argument("--prompts", type=int, default=120, help="toy-world prompts")
    ap.add_argument("--quick", action="store_true", help="a small run: 300 lab samples, 3x3 only, no toy world")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"lab": lab(300 if a.quick else a.samples, side4=not a.quick)}
    if not a.quick:
        result["toy"] = toy(a.prompts, ROOT / "outputs" / "row_parallel" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    write_json_atomic(result, a.out / "summary.json")
    (a.out / "README.md").write_text(markdown(result))
    print((a.out / "README.md").read_text())
    print(json.dumps({"wrote": str(a.out)}))


if __name__ == "__main__":
    main()
