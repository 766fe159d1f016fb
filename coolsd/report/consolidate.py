"""All per-sample records of a set of runs (or a multirun folder) in one parquet table, with
each run's folder and resolved identity, so that metrics and plots are recomputed from records
and images without regenerating (``python -m coolsd.report.consolidate multirun/... -o t.parquet``)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from coolsd.job.summary import metric_ci
from coolsd.util.records import read_records
from coolsd.util.stats import ratio_ci

# parameters a method derives from the user's (or that name its parts), left out of its label
DERIVED_PARAMS = ("method", "drafter", "rule", "omega")


def find_runs(roots) -> list[Path]:
    """Run folders (holding samples.jsonl) under the given folders, sorted."""
    runs = set()
    for root in map(Path, roots):
        if not root.exists():
            raise FileNotFoundError(f"run folder {root} does not exist")
        runs.update(p.parent for p in root.rglob("samples.jsonl"))
    return sorted(runs)


def config_label(params: dict) -> str:
    """A configuration's name across runs: the method and its resolved user parameters (sorted),
    e.g. ``coolsd delta=1.1 normalize=mean nu=0.7 schedule=exp tree=chain4``. Two runs get the
    same label exactly when they ran the same method configuration."""
    name = params.get("method", "?")
    rest = {k: v for k, v in params.items() if k not in DERIVED_PARAMS and v is not None and v != "none"}
    return " ".join([name] + [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(rest.items())])


def records_frame(roots) -> pd.DataFrame:
    """One row per sample: the record's fields (lists and dicts as JSON text), ``run`` (its
    folder), ``config`` (``config_label`` of its parameters; the record's ``method`` is only a
    tag inside its run) and ``image_path`` (absolute)."""
    runs = find_runs(roots)
    if not runs:
        raise FileNotFoundError(f"no samples.jsonl under {', '.join(map(str, roots))}")
    rows = []
    for run in runs:
        ident = run / "run.json"
        ident_text = ident.read_text() if ident.exists() else None
        for r in read_records(run / "samples.jsonl"):
            row = {k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in r.items()}
            row.update(run=str(run), run_identity=ident_text, config=config_label(r.get("params") or {"method": r["method"]}),
                       image_path=str(run / r["image"]) if "image" in r else None)
            rows.append(row)
    return pd.DataFrame(rows)


def summary_frame(df: pd.DataFrame, metrics=("accepted_length", "latency_s", "target_forwards", "acceptance_rate")
                  ) -> pd.DataFrame:
    """One row per configuration (``config``) of a consolidated table: for each metric its mean
    and 95% CI over samples (columns m, m_lo, m_hi; the interval of its domain,
    ``coolsd.job.summary.metric_ci``; NaN bounds with one sample), and ``speedup`` = mean AR latency / mean
    latency with a paired bootstrap CI, where AR (the run's one ``ar`` configuration; for CSpD's
    exact mode ``ar final_noise=True``) ran in the same run on the same prompts (docs/methods.md#6-evaluation-protocol).
    Columns ``tag`` (= config) and ``family`` (the method) fit ``pareto_plot``."""
    rows = []
    is_ar = df["config"].str.split(" ").str[0] == "ar"
    ar = df[is_ar].set_index(["run", "prompt_index"])["latency_s"]
    if ar.index.duplicated().any():
        raise ValueError("a run holds more than one AR configuration: speed-ups would be ambiguous")
    for config, g in df.groupby("config", sort=False):
        r = {"tag": config, "family": config.split(" ")[0], "n": len(g), "runs": g["run"].nunique()}
        for k in metrics:
            if k in g and g[k].notna().all():
                c = metric_ci(k, g[k])
                r[k], r[k + "_lo"], r[k + "_hi"] = c["mean"], c.get("lo", float("nan")), c.get("hi", float("nan"))
        keys = list(zip(g["run"], g["prompt_index"]))
        if "latency_s" in g and all(key in ar.index for key in keys):
            s = ratio_ci(ar.loc[keys].to_numpy(), g["latency_s"].to_numpy(), paired=True)
            r["speedup"], (r["speedup_lo"], r["speedup_hi"]) = s["mean"], s.get("ci95", (float("nan"),) * 2)
        rows.append(r)
    return pd.DataFrame(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders or folders containing runs (multirun/...)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="parquet file to write")
    a = ap.parse_args(argv)
    df = records_frame(a.runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".partial")
    df.to_parquet(tmp, index=False)
    tmp.replace(a.out)
    print(f"{len(df)} samples from {df['run'].nunique()} run(s) -> {a.out}")


if __name__ == "__main__":
    main()
