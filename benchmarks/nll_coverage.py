"""Is a lossless method's NLL-shift interval calibrated? A pre-registered coverage check.

The toy sweep (``make demo``, 120 prompts, seed 0) reports EAGLE's paired NLL shift against AR,
``target_nll_minus_ar``, with a Student-t 95% interval (``coolsd.util.stats.mean_ci``). EAGLE is
lossless, so the shift's expectation is 0 and its interval should miss 0 in about 1 run of 20;
the committed sweep's interval is one such miss or a bias. One run cannot tell which. This script
asks the question many times at the sweep's own n:

    python benchmarks/nll_coverage.py            # 20 blocks of 120 prompts, seed 2, batch 16

Protocol, fixed before the run (commit 1 of this script; the numbers are not tuned afterwards):
one run folder, ``run.py method=<method> target=toy dataset.n_prompts=blocks * block seed=<seed>``
with AR beside it on the same prompts and per-prompt seeds (the job's baseline), seed 2 (0 is the
sweep's, 1 the n = 1,000 control's). Prompts are cut by index into ``blocks`` disjoint blocks of
``block`` prompts; each block is one sweep-sized replicate, and gets the sweep's interval for the
paired shift of ``target_nll`` (sampled) and of ``target_nll_expected`` (its Rao-Blackwellised
form). Under "no bias and a calibrated interval", the number of blocks whose interval misses 0 is
Binomial(blocks, 0.05); the verdict is "calibrated" unless that count's upper tail
P(X >= misses) is below 0.05 (at 20 blocks: 4 or more misses), and the pooled shift over all
prompts is reported with its interval beside it. Batch 16 is for speed: batching changes BLAS
blocking, not what is sampled. The decision rule is the same for both NLL forms and for any
``--method`` (a relaxed method's shift is not 0, so there it measures power, not coverage).

Writes results/toy/nll_coverage/{coverage.md, coverage.json}; the run folder is kept (resumable:
an interrupted run continues where it stopped).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from scipy import stats as sps

from coolsd.engine.timing import cpu_name
from coolsd.util.records import read_records, write_json_atomic
from coolsd.util.stats import REAL, mean_ci

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("target_nll", "target_nll_expected")
ALPHA = 0.05  # the interval's level is 1 - ALPHA; the verdict's test is at ALPHA too


def paired_shifts(records: list[dict], method: str, metric: str) -> dict[int, float]:
    """{prompt index: metric(method) - metric(ar)} over the prompts both have."""
    by = {m: {r["prompt_index"]: r[metric] for r in records if r["method"] == m} for m in (method, "ar")}
    return {i: by[method][i] - by["ar"][i] for i in sorted(by[method].keys() & by["ar"].keys())}


def coverage(shift: dict[int, float], blocks: int, block: int) -> dict:
    """Each block's interval, the misses, the binomial tail and the pooled interval."""
    rows = []
    for b in range(blocks):
        x = [shift[i] for i in range(b * block, (b + 1) * block) if i in shift]
        if len(x) < block:
            raise ValueError(f"block {b}: {len(x)} of {block} prompts have both records; rerun to finish the run")
        ci = mean_ci(x, domain=REAL, name=f"block {b}")
        rows.append({"block": b, "mean": ci["mean"], "lo": ci["lo"], "hi": ci["hi"],
                     "contains_0": bool(ci["lo"] <= 0.0 <= ci["hi"])})
    misses = sum(not r["contains_0"] for r in rows)
    tail = float(sps.binom.sf(misses - 1, blocks, ALPHA))  # P(X >= misses)
    pooled = mean_ci(list(shift.values()), domain=REAL, name="pooled")
    return {"blocks": rows, "misses": misses, "expected_misses": blocks * ALPHA, "p_upper_tail": tail,
            "verdict": "calibrated" if tail >= ALPHA else "miscalibrated or biased",
            "pooled": {k: pooled[k] for k in ("mean", "lo", "hi", "half_width", "n")}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--block", type=int, default=120, help="prompts per block (the toy sweep's n)")
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--run-dir", type=Path, default=ROOT / "outputs" / "nll_coverage")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "toy" / "nll_coverage")
    a = ap.parse_args(argv)
    if a.blocks < 1 or a.block < 2:
        ap.error("--blocks must be >= 1 and --block >= 2 (an interval needs two prompts)")
    n = a.blocks * a.block
    run_dir = a.run_dir / f"{a.method}_seed{a.seed}_n{n}"
    cmd = [sys.executable, str(ROOT / "run.py"), f"method={a.method}", "target=toy", f"dataset.n_prompts={n}",
           f"batch_size={a.batch}", f"seed={a.seed}", f"hydra.run.dir={run_dir}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    records = read_records(run_dir / "samples.jsonl")
    result = {"method": a.method, "blocks": a.blocks, "block": a.block, "seed": a.seed, "batch": a.batch,
              "cpu": cpu_name(), "command": " ".join(["python"] + cmd[1:]),
              "metrics": {m: coverage(paired_shifts(records, a.method, m), a.blocks, a.block) for m in METRICS}}
    lines = [f"# {a.method}'s NLL shift against AR: interval coverage at the toy sweep's n", "",
             f"`python benchmarks/nll_coverage.py --method {a.method} --blocks {a.blocks} --block {a.block} "
             f"--seed {a.seed} --batch {a.batch}` ({cpu_name()}). One run of {n} prompts (seed {a.seed}, AR beside "
             f"it on the same prompts and per-prompt seeds), cut by prompt index into {a.blocks} disjoint blocks "
             f"of {a.block}: each block is one sweep-sized replicate with the sweep's paired Student-t 95% "
             f"interval. Pre-registered rule (the script's docstring): the interval is called calibrated unless "
             f"P(Binomial({a.blocks}, 0.05) >= misses) < 0.05.", "",
             "| quantity (method - AR, nats / token) | blocks whose CI misses 0 | expected | P(X >= misses) "
             "| verdict | pooled mean [95% CI], n |", "|---|---|---|---|---|---|"]
    for m, c in result["metrics"].items():
        p = c["pooled"]
        lines.append(f"| {m} | {c['misses']} of {a.blocks} | {c['expected_misses']:.1f} | {c['p_upper_tail']:.3f} "
                     f"| {c['verdict']} | {p['mean']:+.4f} [{p['lo']:+.4f}, {p['hi']:+.4f}], {p['n']} |")
    lines += ["", "Per block (sampled `target_nll` shift; * = the interval misses 0):", "",
              "| block | mean | 95% CI |", "|---|---|---|"]
    lines += [f"| {r['block']}{'' if r['contains_0'] else ' *'} | {r['mean']:+.4f} | [{r['lo']:+.4f}, {r['hi']:+.4f}] |"
              for r in result["metrics"]["target_nll"]["blocks"]]
    a.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(result, a.out / "coverage.json")
    (a.out / "coverage.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
