"""The lab job behind ``python run.py target=tabular``: one method on seeded random tabular
pairs, exact statistics beside sampled ones from the production loop."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from coolsd.theory.lab import EXACT_METHODS, _method, exact_stats, sample_stats
from coolsd.theory.stats import chi_square_pvalue
from coolsd.theory.sweep import lab_pairs

LOSSLESS = ("ar", "eagle", "sjd")


def run_lab(cfg, method_name: str, params: dict, tree: str, draft_length, out_dir: Path) -> dict:
    t = cfg.target
    pairs = list(lab_pairs(t.vocab, t.length, t.draft_mix, list(t.pairs)))
    # validate the whole configuration before any work
    _method(pairs[0][1], method_name, draft_length, tree, params)
    exact_ok = method_name in EXACT_METHODS and tree == "chain"
    rows = []
    for seed, P, Q in tqdm(pairs, desc=f"lab {method_name}", unit="pair"):
        s = sample_stats(P, Q, method_name, draft_length, t.n_samples, cfg.seed + seed, tree=tree, **params)
        if exact_ok:
            e = exact_stats(P, Q, method_name, draft_length, **params)
            ref, tv, al = e["distribution"], e["tv"], e["accepted_length"]
        elif method_name in LOSSLESS:  # no exact oracle for trees: lossless methods match the target
            ref, tv, al = P.sequence_distribution(), 0.0, float("nan")
        else:
            ref, tv, al = None, float("nan"), float("nan")
        half = 1.96 * s["rounds_std"] / math.sqrt(s["n"])
        rows.append({
            "pair": seed,
            "exact_tv": tv,
            "exact_accepted_length": al,
            "sampled_accepted_length": s["accepted_length"],
            "sampled_accepted_length_ci95": [P.N / (s["mean_rounds"] + half), P.N / max(s["mean_rounds"] - half, 1e-9)],
            "sampled_tv_to_target": s["tv_to_target"],
            "chi2_p_sampled_vs_exact": chi_square_pvalue(s["counts"], ref) if ref is not None else float("nan"),
            "n_samples": s["n"],
        })
    df = pd.DataFrame(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_dir / "lab.csv", index=False)
    summary = {"job": "theory_lab", "method": s["params"], "tree": tree, "draft_length": draft_length,
               "world": {k: t[k] for k in ("vocab", "length", "draft_mix", "concentration")}, "pairs": rows}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(df.drop(columns=["sampled_accepted_length_ci95"]).round(4).to_string(index=False))
    print(f"wrote {out_dir / 'summary.json'}")
    return summary
