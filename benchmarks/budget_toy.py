"""Is the budget met on the toy world? ``method=budget method.tv_per_image=B`` tunes its price image by
image (docs/methods.md section 2.1); this runs it at several budgets B on the same prompts and seeds as
AR and a fixed price, and reports, per budget, the mean summed step TV per image with its 95% CI
against B (all images, and the second half, after the price has settled), the accepted length, and the
price's path (a plot).

    python benchmarks/budget_toy.py [--prompts 300] [--budgets 2 4 8] [--batch-size 25]   # -> results/budget_toy/
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.report.sweep import toy_sweep  # noqa: E402
from coolsd.util.records import read_records, write_json_atomic  # noqa: E402
from coolsd.util.stats import mean_ci  # noqa: E402



def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--budgets", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    ap.add_argument("--batch-size", type=int, default=25)
    ap.add_argument("--rate", type=float, default=1.0, help="the controller's step (method.rate)")
    ap.add_argument("--start-price", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "budget_toy")
    ap.add_argument("--records", type=Path, default=None)
    a = ap.parse_args(argv)
    START_PRICE, RATE = a.start_price, a.rate
    specs = [("ar", "ar", {}), (f"budget_price_{START_PRICE:g}", "budget", {"price": START_PRICE})]
    specs += [(f"budget_tv_{b:g}", "budget", {"price": START_PRICE, "tv_per_image": b, "rate": RATE}) for b in a.budgets]
    records = a.records or ROOT / "outputs" / "budget_toy" / time.strftime("%Y-%m-%d_%H-%M-%S")
    t0 = time.perf_counter()
    res = toy_sweep(specs, a.prompts, records, batch_size=a.batch_size, threads=a.threads)
    recs = read_records(records / "samples.jsonl")
    rows = []
    for tag, _, params in specs[1:]:
        mine = sorted((r for r in recs if r["method"] == tag), key=lambda r: r["prompt_index"])
        tv = np.array([r["step_tv"] for r in mine])
        half = tv[len(tv) // 2:]
        row = {"tag": tag, "tv_per_image": params.get("tv_per_image"), "n": len(tv),
               "mean_step_tv": mean_ci(list(tv)), "mean_step_tv_second_half": mean_ci(list(half)),
               "accepted_length": res["table"][tag]["accepted_length"],
               "price": [r.get("budget_price", params["price"]) for r in mine]}
        if row["tv_per_image"] is not None:
            b = row["tv_per_image"]
            last = row["price"][-1] * np.exp(RATE * np.mean((tv[-a.batch_size:] - b) / b))  # after the last batch
            row["predicted"] = b * (1 + a.batch_size * np.log(last / row["price"][0]) / (RATE * len(tv)))
            row["met"] = bool(row["mean_step_tv"]["ci95"][0] <= b <= row["mean_step_tv"]["ci95"][1])
            row["met_second_half"] = bool(row["mean_step_tv_second_half"]["ci95"][0] <= b
                                          <= row["mean_step_tv_second_half"]["ci95"][1])
        rows.append(row)
    a.out.mkdir(parents=True, exist_ok=True)
    env = {**res["env"], "start_price": START_PRICE, "rate": RATE, "seconds": time.perf_counter() - t0}
    write_json_atomic({"env": env, "rows": rows}, a.out / "summary.json")
    ci = lambda m: f"{m['mean']:.2f} [{m['ci95'][0]:.2f}, {m['ci95'][1]:.2f}]"  # noqa: E731
    md = ["# Is the budget met? (toy world)", "",
          f"{a.prompts} prompts, chain L = 4, batch {a.batch_size}, {env['cpu']}; start price {START_PRICE}, rate "
          f"{RATE}; the price moves after each batch by rate x the batch's mean relative excess (a batch shares one "
          "price). Over K images in batches of b the mean is exactly budget x (1 + b log(last / first price) / (rate K)) "
          "(docs/methods.md 2.1): the column 'predicted' gives that, from the first and last price. Produced by "
          "`python benchmarks/budget_toy.py`.", "",
          "| configuration | budget (summed step TV / image) | mean step TV / image [95% CI] | predicted | second half | "
          "inside the CI? (all / second half) | accepted length | price: first, last |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = f"{'yes' if r['met'] else 'no'} / {'yes' if r['met_second_half'] else 'no'}" if "met" in r else "-"
        pred = "-" if r["tv_per_image"] is None else f"{r['predicted']:.2f}"
        md.append(f"| {r['tag']} | {r['tv_per_image'] if r['tv_per_image'] is not None else '- (fixed price)'} | "
                  f"{ci(r['mean_step_tv'])} | {pred} | {ci(r['mean_step_tv_second_half'])} | {met} | "
                  f"{ci(r['accepted_length'])} | {r['price'][0]:.3g}, {r['price'][-1]:.3g} |")
    (a.out / "README.md").write_text("\n".join(md) + "\n")
    _plot(rows, a.out / "price.png")
    print("\n".join(md))
    return {"rows": rows, "env": env}


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for r in rows:
        if r["tv_per_image"] is not None:
            ax.plot(r["price"], label=f"budget {r['tv_per_image']:g} TV / image")
    ax.set_yscale("log")
    ax.set_xlabel("image (prompt order)")
    ax.set_ylabel("price the image was generated at")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    main()
