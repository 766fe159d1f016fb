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


# run.json keys that are not run-level settings: the methods are labelled by their own parameters, and
# the shard count changes neither the samples nor their timing
NOT_SETTINGS = ("methods", "method", "shards")
# config groups that hold no setting of what ran: the method's (its resolved parameters stand for
# them), the shard's, the logger's and Hydra's
NOT_RUN_GROUPS = ("method", "shard", "logger", "hydra")
# config groups that configure drafting only: the AR baseline ran the same with any of them
DRAFTING_GROUPS = ("tree", "draft")
# a label's values are cut to this many characters (a weight fingerprint, a path)
LABEL_VALUE_CHARS = 20


def flatten(tree: dict) -> dict:
    """{dotted key: value} of a nested dict (pandas' ``json_normalize``); a list becomes its JSON
    text (a hashable value)."""
    flat = pd.json_normalize(tree).to_dict("records")[0] if tree else {}
    return {k: json.dumps(v) if isinstance(v, list) else v for k, v in flat.items()}


def run_settings(folder: Path) -> tuple[dict, list[str]]:
    """(settings, set_keys) of a run folder: every run-level setting as {dotted key: value}, from its
    identity (``run.json``: target, weight fingerprints, sampling, seed, prompts, device, threads)
    and, for a run of ``run.py``, its resolved config (``.hydra/config.yaml``, without the method's
    group: its resolved parameters are in the records); ``set_keys``: the keys its command line set
    (``.hydra/overrides.yaml``), in their order. Both empty for a folder with neither file."""
    folder = Path(folder)
    settings: dict = {}
    config = folder / ".hydra" / "config.yaml"
    if config.is_file():
        cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=False)
        settings.update(flatten({k: v for k, v in cfg.items() if k not in NOT_RUN_GROUPS}))
    ident = folder / "run.json"
    if ident.is_file():
        settings.update(flatten({k: v for k, v in json.loads(ident.read_text()).items() if k not in NOT_SETTINGS}))
    set_keys = []
    overrides = folder / ".hydra" / "overrides.yaml"
    if overrides.is_file():
        for item in OmegaConf.to_container(OmegaConf.load(overrides)):
            key = str(item).split("=", 1)[0].lstrip("+~")
            if key.split(".")[0] not in NOT_RUN_GROUPS and key in settings:
                set_keys.append(key)
    return settings, set_keys


def _shown_value(v) -> str:
    """A value as a label shows it: floats in their shortest form, long text cut."""
    text = f"{v:g}" if isinstance(v, float) else str(v)
    return text if len(text) <= LABEL_VALUE_CHARS else text[: LABEL_VALUE_CHARS - 1] + "\u2026"


def _same_as(v) -> str:
    """Equal for values that mean the same setting: 2 and 2.0 (a command line's int, a default's float)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(float(v))
    return json.dumps(v, sort_keys=True, default=str)


def configuration_labels(configs: list[dict]) -> list[str]:
    """One label per configuration: its method's name, then ``key=value`` for the fewest keys that
    tell it apart from the other configurations. ``configs``: each {"params": the method's resolved
    parameters (``describe()``), "settings", "set_keys" (``run_settings``), "prompts": what identifies
    its prompt set, "where": its run folder as shown}.

    Keys are tried in this order: the method's parameters, the settings the command line set, the
    other settings, the prompt set, the run folder (shown as ``@ folder``). A key is taken only where
    it splits a group of configurations that read alike so far, and shows only on the configurations
    of the groups it splits: in a sweep ``method=coolsd method.delta=1.1,2`` the labels are ``ar``,
    ``coolsd delta=1.1`` and ``coolsd delta=2``; in ``method=coolsd,lantern_pp,sjd`` the method names."""
    params = [{k: v for k, v in c["params"].items() if k not in DERIVED_PARAMS} for c in configs]
    keys = [("params", k) for p in params for k in p]
    keys += [("settings", k) for c in configs for k in c["set_keys"]]
    keys += [("settings", k) for c in configs for k in c["settings"]]
    keys = list(dict.fromkeys(keys)) + [("prompts", None), ("where", None)]

    def value(i: int, source: str, key):
        if source == "params":
            return params[i].get(key)
        return configs[i]["settings"].get(key) if source == "settings" else configs[i][source]

    groups = [(c["params"].get("method", "?"),) for c in configs]
    parts: list[list[str]] = [[] for _ in configs]
    for source, key in keys:
        if len(set(groups)) == len(configs):
            break
        vals = [value(i, source, key) for i in range(len(configs))]
        split = {g for g in set(groups) if len({_same_as(v) for v, h in zip(vals, groups) if h == g}) > 1}
        if not split:
            continue
        for i, g in enumerate(groups):
            if g in split:
                parts[i].append(f"@ {vals[i]}" if source == "where" else
                                f"prompts={_shown_value(vals[i])}" if source == "prompts" else
                                f"{key}={_shown_value(vals[i])}")
        groups = [g + (_same_as(v),) for g, v in zip(groups, vals)]
    return [" ".join([g[0], *p]) for g, p in zip(groups, parts)]


def baseline_identity(config: dict) -> str:
    """What an AR baseline ran on, as text: its parameters, its run's settings but the drafting
    groups', and its prompt set. Two ARs with the same identity generated the same images."""
    settings = {k: v for k, v in config["settings"].items() if k.split(".")[0] not in DRAFTING_GROUPS}
    return _same_as([{k: _same_as(v) for k, v in config["params"].items()},
                     {k: _same_as(v) for k, v in settings.items()}, config["prompts"]])


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
