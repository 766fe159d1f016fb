"""Paired comparison of two methods on the same prompts (the paper's t-test of accepted length,
COOL-SD against LANTERN++): per-prompt differences, their mean with a 95% t-interval, and the
paired t-test p-value. Records must cover the same prompts with the same seeds.

    python -m coolsd.report.compare RUN_A:coolsd_2 RUN_B:lantern_pp --metric accepted_length
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from scipy import stats

from coolsd.util.records import read_records
from coolsd.util.stats import mean_ci


def _by_prompt(records: list[dict], method: str, metric: str) -> dict[int, tuple[int, float]]:
    out = {}
    for r in records:
        if r.get("method") != method:
            continue
        if metric not in r:
            raise KeyError(f"records of {method!r} have no {metric!r}; have {sorted(r)}")
        out[r["prompt_index"]] = (r["seed"], float(r[metric]))
    if not out:
        raise ValueError(f"no records of method {method!r}")
    return out


def paired_comparison(records_a: list[dict], method_a: str, records_b: list[dict], method_b: str,
                      metric: str = "accepted_length") -> dict:
    """a - b per prompt over the prompts both runs hold (same seed required)."""
    a, b = _by_prompt(records_a, method_a, metric), _by_prompt(records_b, method_b, metric)
    common = sorted(a.keys() & b.keys())
    if len(common) < 2:
        raise ValueError(f"need >= 2 prompts in both runs, have {len(common)} in common")
    bad = [i for i in common if a[i][0] != b[i][0]]
    if bad:
        raise ValueError(f"prompts {bad[:5]} were generated with different seeds: not a paired comparison")
    x = np.array([a[i][1] for i in common])
    y = np.array([b[i][1] for i in common])
    t = stats.ttest_rel(x, y)
    return {"metric": metric, "a": method_a, "b": method_b, "n": len(common),
            "mean_a": float(x.mean()), "mean_b": float(y.mean()), "diff": mean_ci(x - y),
            "t": float(t.statistic), "p_value": float(t.pvalue)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="RUN_DIR:METHOD_TAG")
    ap.add_argument("b", help="RUN_DIR:METHOD_TAG")
    ap.add_argument("--metric", default="accepted_length")
    args = ap.parse_args(argv)
    parts = []
    for spec in (args.a, args.b):
        run, _, tag = spec.rpartition(":")
        if not run or not tag:
            ap.error(f"{spec!r}: expected RUN_DIR:METHOD_TAG")
        parts.append((read_records(Path(run) / "samples.jsonl"), tag))
    r = paired_comparison(parts[0][0], parts[0][1], parts[1][0], parts[1][1], args.metric)
    d = r["diff"]
    print(f"{r['metric']}: {r['a']} {r['mean_a']:.4f} vs {r['b']} {r['mean_b']:.4f} over {r['n']} prompts; "
          f"difference {d['mean']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}], paired t = {r['t']:.2f}, p = {r['p_value']:.3g}")


if __name__ == "__main__":
    main()
