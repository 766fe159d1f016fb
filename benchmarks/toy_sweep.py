"""The toy sweep behind `make demo`: every method on the same toy prompts at batch 1 on CPU,
methods interleaved per prompt, against AR from the same run. Writes results/toy/
{table.md, table.csv, summary.json, pareto.png, pareto.pdf, grid.png}.

Issue #3 goals read off this table: eagle accepted length >= 2.0; coolsd (delta=2) accepted
length >= 1.2x eagle's; eagle speed-up > 1.0; speed-up / accepted length per method; toy_fid of
eagle within noise of AR; the quality cost of relaxed methods with its CI.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import pandas as pd
import torch

from coolsd.drafting import SamplingConfig
from coolsd.methods import build_method
from coolsd.records import RecordWriter, save_png_atomic, write_json_atomic
from coolsd.toy.assets import load_toy_world
from coolsd.toy.job import make_grid, run_methods, summarize, toy_prompts
from coolsd.toy.world import render_batch

# (tag, method, params); one shared tree for every drafting method (fairness)
SWEEP = [
    ("ar", "ar", {}),
    ("eagle", "eagle", {}),
    ("lantern_pp", "lantern_pp", {"lam": 2.0, "k": 10}),
    ("uniform_rsd_2", "uniform_rsd", {"delta": 2.0}),
    ("coolsd_1.1", "coolsd", {"delta": 1.1}),
    ("coolsd_2", "coolsd", {"delta": 2.0}),
    ("coolsd_3", "coolsd", {"delta": 3.0}),
    ("sjd", "sjd", {"window": 8}),
]


def plot(df: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for row, metric in enumerate(["toy_fid", "toy_clip"]):
        for col, x in enumerate(["accepted_length", "speedup"]):
            ax = axes[row, col]
            for family, g in df.groupby("family", sort=False):
                g = g.sort_values(x)
                ax.errorbar(g[x], g[metric], yerr=[g[metric] - g[metric + "_lo"], g[metric + "_hi"] - g[metric]],
                            xerr=[g[x] - g[x + "_lo"], g[x + "_hi"] - g[x]], fmt="o-" if len(g) > 1 else "o",
                            capsize=2, label=family)
                for _, r in g.iterrows():
                    ax.annotate(r["tag"], (r[x], r[metric]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel({"accepted_length": "accepted length (tokens / round)", "speedup": "speed-up over AR (CPU, batch 1)"}[x])
            ax.set_ylabel(metric + (" (lower is better)" if metric == "toy_fid" else " (higher is better)"))
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Toy world: quality against acceleration (95% CIs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=150)
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--draft-length", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/toy"))
    ap.add_argument("--assets", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    world = load_toy_world(a.assets)
    methods = {tag: build_method(name, tree=a.tree, draft_length=a.draft_length, neighbours=world.neighbours, **p)
               for tag, name, p in SWEEP}
    scenes = toy_prompts(a.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        outputs = run_methods(world, methods, SamplingConfig(), scenes, a.seed, RecordWriter(Path(tmp)), 0)
    table = summarize(world, outputs, scenes)
    rows = []
    for tag, e in table.items():
        r = {"tag": tag, "family": e["params"]["method"]}
        for k in ("accepted_length", "latency_s", "toy_clip", "speedup"):
            r[k], (r[k + "_lo"], r[k + "_hi"]) = e[k]["mean"], e[k]["ci95"]
        r["toy_fid"], r["toy_fid_lo"], r["toy_fid_hi"] = e["toy_fid"]["fid"], e["toy_fid"]["lo"], e["toy_fid"]["hi"]
        r["speedup_per_accepted_length"] = e["speedup_per_accepted_length"]
        r["target_forwards"] = None
        rows.append(r)
    df = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "table.csv", index=False)
    env = {"prompts": a.prompts, "tree": a.tree, "draft_length": a.draft_length, "threads": 1, "batch_size": 1,
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "assets": world.manifest["sha256"]}
    write_json_atomic({"env": env, "results": table}, a.out / "summary.json")

    def ci(r, k, fmt="{:.3f}"):
        return f"{fmt.format(r[k])} [{fmt.format(r[k + '_lo'])}, {fmt.format(r[k + '_hi'])}]"

    lines = [f"Toy world, {a.prompts} prompts, batch 1, CPU 1 thread, tree `{a.tree}`"
             f"{f' (L={a.draft_length})' if a.tree == 'chain' else ''}; mean [95% CI] over prompts; "
             "toy_fid with a bootstrap CI; speed-up against AR from the same run.", "",
             "| method | accepted length | latency (s) | speed-up | speed-up / acc. length | toy_clip | toy_fid |",
             "|---|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        lines.append(f"| {r['tag']} | {ci(r, 'accepted_length', '{:.2f}')} | {ci(r, 'latency_s', '{:.3f}')} | "
                     f"{ci(r, 'speedup', '{:.2f}')} | {r['speedup_per_accepted_length']:.2f} | {ci(r, 'toy_clip')} | "
                     f"{ci(r, 'toy_fid', '{:.1f}')} |")
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    plot(df, a.out / "pareto.png")
    save_png_atomic(make_grid([outputs[t][1][:10] for t in outputs] + [render_batch(scenes[:10])]), a.out / "grid.png")
    print("\n".join(lines))
    print(json.dumps({"wrote": str(a.out)}))


if __name__ == "__main__":
    main()
