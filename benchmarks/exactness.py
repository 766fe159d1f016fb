"""Are a method's tokens drawn from the target's conditionals? A randomised-PIT test on the toy
world's neural models ("nothing silently wrong"), beside the theory lab's exact tests.

The lab proves the verification engine exact on tabular models by enumeration. On a neural target
the sequence space is too large to enumerate, but exactness has a per-token form: a lossless
method emits each token x_t from p(. | x_<t), the target's conditional. Every emitted sequence is
rescored outside the loop (``coolsd.engine.signals.teacher_forced_probs``: the prefill, then one causal
forward, the way AR scores it), and each token gets its randomised PIT value
v_t = F(x_t-) + u p(x_t) under that conditional (``decoding.sampling.randomized_pit``, u from a
generator of its own). Under exactness all v are i.i.d. Uniform(0, 1); a drawing error of any
kind (a wrong q, a stale cache entry, an off-by-one position, a rule that is not lossless) moves
their distribution. Tested with Kolmogorov-Smirnov, over all tokens and per round depth, in two
token orders: ``rank`` (descending probability, where a bias towards likely or unlikely tokens,
the direction an NLL shift measures, moves the mean of v) and ``id``; the verdict is "exact"
unless the smallest p-value, Bonferroni-corrected, is below ``ALPHA`` (1e-3). Relaxed methods are
the negative controls: they must fail at the same n.

    python benchmarks/exactness.py                         # 800 prompts: ar eagle sjd mc_sjd, relaxed controls
    python benchmarks/exactness.py --prompts 64 --methods ar,eagle

Writes results/toy/exactness/{exactness.md, exactness.json, pit.png}.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats as sps

from coolsd.cli.runner import compose
from coolsd.engine.decoding.sampling import randomized_pit
from coolsd.engine.methods import method_info
from coolsd.engine.signals import teacher_forced_probs
from coolsd.engine.timing import cpu_name
from coolsd.job.generation import prompt_seed
from coolsd.util.records import write_json_atomic
from coolsd.util.stats import REAL, mean_ci
from coolsd.worlds import load_world

ROOT = Path(__file__).resolve().parents[1]
# tag: (method, params); the relaxed ones (not lossless in the method registry) are negative controls
METHODS = {
    "ar": ("ar", {}),
    "eagle": ("eagle", {}),
    "sjd": ("sjd", {}),
    "mc_sjd": ("mc_sjd", {}),
    "coolsd_2": ("coolsd", {"delta": 2.0}),
    "lantern_pp": ("lantern_pp", {"lam": 2.0, "k": 10}),
    "uniform_rsd_4": ("uniform_rsd", {"delta": 4.0}),
    "budget_null": ("budget", {"price": None}),  # an infinite price: the exact rule (docs/methods.md 2.1)
    "budget_0.5": ("budget", {"price": 0.5}),
}
ALPHA = 1e-3  # not exact: the smallest KS p-value, Bonferroni-corrected, is below this
ORDERS = ("rank", "id")


def pit_values(world, method, scenes, seed: int, batch: int, pit_seed: int, progress=None) -> dict:
    """{"rank", "id": v (n_tokens,), "depth": round depth of each token, "nll": per-image mean NLL}:
    each batch decoded as every run decodes it (``DiscreteWorld.generate_tokens``), then rescored."""
    g = torch.Generator().manual_seed(pit_seed)
    out = {o: [] for o in ORDERS} | {"depth": [], "nll": []}
    for s in range(0, len(scenes), batch):
        idx = list(range(s, min(s + batch, len(scenes))))
        res, cond = world.generate_tokens(method, [scenes[i] for i in idx], [prompt_seed(seed, i) for i in idx])
        with torch.no_grad():
            p = teacher_forced_probs(world.target, res.tokens, cond, world.sampling)
        u = torch.rand(res.tokens.shape, generator=g, dtype=torch.float64)
        for o in ORDERS:
            out[o].append(randomized_pit(p, res.tokens, u, o).reshape(-1).numpy())
        out["depth"].append(res.token_depth.reshape(-1).numpy())
        out["nll"].append(res.token_nll.mean(1).numpy())
        if progress:
            progress(len(idx))
    return {k: np.concatenate(v) for k, v in out.items()}


def summarise(v: dict, lossless: bool) -> dict:
    """KS p-values over all tokens and per round depth, in both orders; the verdict takes the smallest,
    Bonferroni-corrected for the number of tests. Per depth is a valid split: a token's depth is
    fixed by the round's earlier steps before the token is drawn, and an exact method draws it from
    p given its prefix at every depth (the accept / resample mixture is p)."""
    ks = {o: float(sps.kstest(v[o], "uniform").pvalue) for o in ORDERS}
    per_depth = {}
    for d in np.unique(v["depth"]).astype(int):
        m = v["depth"] == d
        per_depth[int(d)] = {"tokens": int(m.sum()), "mean_v_rank": float(v["rank"][m].mean()),
                             **{f"ks_{o}": float(sps.kstest(v[o][m], "uniform").pvalue) for o in ORDERS}}
    pvals = list(ks.values()) + [r[f"ks_{o}"] for r in per_depth.values() for o in ORDERS]
    p_min = min(1.0, min(pvals) * len(pvals))  # Bonferroni
    n = len(v["rank"])
    exact = p_min >= ALPHA
    verdict = ("exact" if exact else "NOT exact") + f" (Bonferroni p {p_min:.2g} over {len(pvals)} tests)"
    return {"tokens": n, "images": len(v["nll"]), "ks": ks, "mean_v_rank": float(v["rank"].mean()),
            "mean_v_rank_half_width": float(1.96 * np.sqrt(1 / 12 / n)), "mean_nll": float(v["nll"].mean()),
            "per_depth": per_depth, "tests": len(pvals), "p_bonferroni": p_min, "lossless": lossless,
            "exact": exact, "verdict": verdict, "as_expected": exact == lossless}


def _shift(r: dict) -> str:
    c = r.get("nll_minus_ar")
    if c is None or c["lo"] is None:
        return "-"
    return f"{c['mean']:+.4f} [{c['lo']:+.4f}, {c['hi']:+.4f}]"


def plot(values: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    grid = np.linspace(0, 1, 201)
    for tag, v in values.items():
        x = np.sort(v["rank"])
        ax.plot(grid, np.searchsorted(x, grid, side="right") / len(x) - grid, label=tag)
    n = min(len(v["rank"]) for v in values.values())
    band = 1.36 / np.sqrt(n)  # the KS 95% band at the smallest n
    ax.axhspan(-band, band, color="0.85", zorder=0, label="KS 95% band")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("PIT value v (rank order: 0 = the most likely token)")
    ax.set_ylabel("empirical CDF of v - uniform CDF")
    ax.set_title("Toy world: each emitted token's PIT under the teacher-forced target", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=800)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "toy" / "exactness")
    a = ap.parse_args(argv)
    tags = a.methods.split(",")
    unknown = [t for t in tags if t not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if a.prompts < 1 or a.batch < 1:
        ap.error("--prompts and --batch must be >= 1")
    torch.set_num_threads(a.threads)
    cfg = compose("target=toy", f"dataset.n_prompts={a.prompts}")
    world = load_world(cfg)
    scenes = world.prompts(cfg)
    from tqdm import tqdm

    values, rows = {}, {}
    for tag in tags:
        name, params = METHODS[tag]
        lossless = method_info(name).is_lossless(params)
        method = world.build_method(name, dict(params), "chain", 4)
        t0 = time.perf_counter()
        with tqdm(total=len(scenes), desc=tag, unit="img", leave=False) as bar:
            values[tag] = pit_values(world, method, scenes, a.seed, a.batch, pit_seed=a.seed + 1000, progress=bar.update)
        rows[tag] = summarise(values[tag], lossless) | {"seconds": time.perf_counter() - t0}
        if "ar" in values:  # the same prompts and per-prompt seeds: the NLL shift paired by prompt
            ci = mean_ci(values[tag]["nll"] - values["ar"]["nll"], domain=REAL, name=f"{tag} NLL - AR")
            rows[tag]["nll_minus_ar"] = {k: ci.get(k) for k in ("mean", "lo", "hi", "n")}
        r = rows[tag]
        print(f"{tag:12s} {r['tokens']} tokens: KS p rank {r['ks']['rank']:.3g}, id {r['ks']['id']:.3g}; "
              f"mean v (rank) {r['mean_v_rank']:.4f} (0.5 +- {r['mean_v_rank_half_width']:.4f}) -> {r['verdict']}"
              f"{'' if r['as_expected'] else '  UNEXPECTED'}", flush=True)
    lines = [f"# Exactness on the toy world: each emitted token's PIT under the teacher-forced target", "",
             f"`python benchmarks/exactness.py --prompts {a.prompts} --seed {a.seed} --batch {a.batch}` ({cpu_name()}, "
             f"{a.threads} thread). {a.prompts} prompts x 64 tokens per method, chain L = 4, the world's sampling "
             f"(CFG 3, temperature 1). A method is called exact unless the smallest Kolmogorov-Smirnov p-value "
             f"of its PIT values (all tokens and per round depth, both orders), Bonferroni-corrected, is below "
             f"{ALPHA:g}; the relaxed methods are negative controls (benchmarks/exactness.py).",
             "", "| method | lossless by design | tokens | KS p (rank order) | KS p (id order) | mean v, rank order "
             "(0.5 if exact) | mean NLL (nats / token) | NLL - AR, paired [95% CI] | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for tag, r in rows.items():
        lines.append(f"| {tag} | {'yes' if r['lossless'] else 'no'} | {r['tokens']} | {r['ks']['rank']:.3g} | "
                     f"{r['ks']['id']:.3g} | {r['mean_v_rank']:.4f} +- {r['mean_v_rank_half_width']:.4f} | "
                     f"{r['mean_nll']:.4f} | {_shift(r)} | {r['verdict']}{'' if r['as_expected'] else ' (UNEXPECTED)'} |")
    lines += ["", "Per round depth (0: drawn from p, the first token or a bonus / resampled token; 1-4: a draft "
              "verified at that depth): KS p (rank order), mean v.", "",
              "| method | " + " | ".join(f"depth {d}" for d in range(5)) + " |", "|---|" + "---|" * 5]
    for tag, r in rows.items():
        cells = [f"{r['per_depth'][d]['ks_rank']:.2g}, {r['per_depth'][d]['mean_v_rank']:.3f} "
                 f"({r['per_depth'][d]['tokens']})" if d in r["per_depth"] else "-" for d in range(5)]
        lines.append(f"| {tag} | " + " | ".join(cells) + " |")
    lines += ["", "pit.png: the empirical CDF of v (rank order) minus the uniform CDF per method, with the KS band."]
    a.out.mkdir(parents=True, exist_ok=True)
    plot(values, a.out / "pit.png")
    write_json_atomic({"cpu": cpu_name(), "prompts": a.prompts, "seed": a.seed, "batch": a.batch, "alpha": ALPHA,
                       "rows": rows}, a.out / "exactness.json")
    (a.out / "exactness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
