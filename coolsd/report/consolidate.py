"""All per-sample records of a set of runs (or a multirun folder) in one parquet table, with
each run's folder and resolved identity, so that metrics and plots are recomputed from records
and images without regenerating (``python -m coolsd.report.consolidate multirun/... -o t.parquet``).
With ``--wandb`` the sweep's summary table and its Pareto plot (speed-up against each quality
signal, 95% CIs) go to W&B as well (``log_sweep``)."""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from coolsd.job.summary import FASTEST_AR, metric_ci
from coolsd.job.tracking import WANDB_FILE, make_logger, quality_metrics, summary_rows
from coolsd.report.plots import pareto_plot
from coolsd.report.sweep import ROOT, sweep_frame
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
    latency with a paired bootstrap CI, where AR (the run's one ``ar`` configuration in its own mode; for
    CSpD's exact mode ``ar final_noise=True``) ran in the same run on the same prompts (docs/methods.md#6-evaluation-protocol);
    ``speedup_vs_fastest_ar`` the same against the run's fastest AR (``_fastest_ar_latency``).
    Columns ``tag`` (= config) and ``family`` (the method) fit ``pareto_plot``."""
    rows = []
    # the same-mode AR; a run's compiled AR beside it (tag ar_compiled) is a configuration of its own
    is_ar = (df["config"].str.split(" ").str[0] == "ar") & (df["method"] != FASTEST_AR)
    ar = df[is_ar].set_index(["run", "prompt_index"])["latency_s"]
    if ar.index.duplicated().any():
        raise ValueError("a run holds more than one AR configuration: speed-ups would be ambiguous")
    refs = {"speedup": ar, "speedup_vs_fastest_ar": _fastest_ar_latency(df, ar)}
    for config, g in df.groupby("config", sort=False):
        r = {"tag": config, "family": config.split(" ")[0], "n": len(g), "runs": g["run"].nunique()}
        for k in metrics:
            if k in g and g[k].notna().all():
                c = metric_ci(k, g[k])
                r[k], r[k + "_lo"], r[k + "_hi"] = c["mean"], c.get("lo", float("nan")), c.get("hi", float("nan"))
        keys = list(zip(g["run"], g["prompt_index"]))
        for name, ref in refs.items():
            if "latency_s" in g and all(key in ref.index for key in keys):
                s = ratio_ci(ref.loc[keys].to_numpy(), g["latency_s"].to_numpy(), paired=True)
                r[name], (r[name + "_lo"], r[name + "_hi"]) = s["mean"], s.get("ci95", (float("nan"),) * 2)
        rows.append(r)
    return pd.DataFrame(rows)


def _fastest_ar_latency(df: pd.DataFrame, ar: pd.Series) -> pd.Series:
    """(run, prompt_index) -> latency of each run's fastest AR: its ``ar_compiled`` where that ran
    with a lower mean latency than its same-mode AR ``ar`` (or alone), else ``ar``; never a mix of the
    two within a run."""
    compiled = df[df["method"] == FASTEST_AR].set_index(["run", "prompt_index"])["latency_s"]
    parts = []
    for run in dict.fromkeys([*ar.index.get_level_values(0), *compiled.index.get_level_values(0)]):
        same, comp = (s[s.index.get_level_values(0) == run] for s in (ar, compiled))
        parts.append(comp if len(comp) and (not len(same) or comp.mean() < same.mean()) else same)
    return pd.concat(parts) if parts else ar


def sweep_results(runs) -> dict:
    """{label: summary entry} over the runs' ``summary.json`` (a run without one is skipped): each
    method configuration of each run, labelled by ``config_label`` (a label several runs share gets
    its folder's name appended). Each speed-up stays the one against its own run's AR."""
    entries = []
    for run in map(Path, runs):
        path = run / "summary.json"
        if path.is_file():
            for tag, e in json.loads(path.read_text())["results"].items():
                entries.append((config_label(e.get("params") or {"method": tag}), run, e))
    counts = Counter(label for label, _, _ in entries)
    return {(label if counts[label] == 1 else f"{label} [{run.name}]"): e for label, run, e in entries}


def log_sweep(runs, figure: Path, logger_cfg=None) -> list[Path]:
    """The sweep of ``runs`` to W&B, as one run of group ``reports`` (``logger.group`` if set):
    ``summary/table`` (one row per configuration, ``sweep_results``), the ``pareto/<signal>``
    charts and ``figure`` (``pareto_plot``: speed-up against each quality signal with 95% CIs,
    written there, logged as ``figures/<stem>``). W&B settings: ``logger_cfg``, else those the
    runs' shards used (a run's ``wandb.json``), else ``conf/logger/wandb.yaml``. Returns the figures."""
    runs = [Path(r) for r in runs]
    results = sweep_results(runs)
    if not results:
        raise FileNotFoundError(f"none of the {len(runs)} run folder(s) holds a summary.json: summarise each first "
                                "(python -m coolsd.cli.merge <run folder>)")
    if logger_cfg is None:
        kept = [r / WANDB_FILE for r in runs if (r / WANDB_FILE).is_file()]
        if kept:
            logger_cfg = json.loads(kept[0].read_text())
        else:
            logger_cfg = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "logger" / "wandb.yaml"))
    name = f"sweep/{Path(os.path.commonpath([str(r.resolve()) for r in runs])).name}"
    logger = make_logger(logger_cfg, {}, name)
    quality = quality_metrics(summary_rows(results))
    figures = pareto_plot(sweep_frame(results), figure, quality, f"{name}: quality vs speed-up",
                          xs=("speedup",))[:1] if quality else []
    logger.start_report(runs, name)
    logger.log_results(results, figures)
    logger.finish()
    return figures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders or folders containing runs (multirun/...)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="parquet file to write")
    ap.add_argument("--wandb", action="store_true", help="also log the sweep's summary table and Pareto plot to W&B "
                    "(settings: the runs' wandb.json, else conf/logger/wandb.yaml)")
    a = ap.parse_args(argv)
    df = records_frame(a.runs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_name(a.out.name + ".partial")
    df.to_parquet(tmp, index=False)
    tmp.replace(a.out)
    print(f"{len(df)} samples from {df['run'].nunique()} run(s) -> {a.out}")
    if a.wandb:
        figures = log_sweep(find_runs(a.runs), a.out.with_name(a.out.stem + "_pareto.png"))
        print("sweep logged to W&B" + (f"; Pareto plot -> {figures[0]}" if figures else ""))


if __name__ == "__main__":
    main()
