"""Table 2 on a real target (``make paper-table2 TARGETS=llamagen_xl``): the rows of the paper's
table run as the sweep ``experiments/experiment/table2_<target>.yaml`` defines them (tree,
COCO prompts, one run per row with AR as its own row), on one loaded target, then the image
metrics of every run from its records and PNGs (``coolsd.cli.evaluate``). Speed-ups pair each row
with the AR run on the same prompts and seeds (docs/methods.md#6-evaluation-protocol): ``speedup``
with its ``ar``, ``speedup_vs_fastest_ar`` with the faster of its ``ar`` and ``ar_compiled`` (the
compiled AR the AR row times beside itself on CUDA, ``fastest_ar``).

Everything a run needs is checked before any work: the target's and drafter's files, the COCO
captions, and the metric weights and reference images.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from coolsd.cli.evaluate import evaluate_run
from coolsd.cli.runner import compose
from coolsd.job.generation import run_job
from coolsd.report.paper import table2_rows, tag_of
from coolsd.util.records import read_records
from coolsd.job.summary import AR, FASTEST_AR, FASTEST_AR_REFERENCE, fastest_ar, speedup_against
from coolsd.worlds import load_world, world_class

ROOT = Path(__file__).resolve().parents[2]


def row_configs(target: str, prompts: int, records: Path, overrides=()) -> list[tuple[str, object]]:
    """(row tag, composed job config) per Table 2 row (tags as ``tag_of``), from the target's
    experiment file; each run writes to ``records / <row file name>``."""
    exp = ROOT / "experiments" / "experiment" / f"table2_{target}.yaml"
    if not exp.is_file():
        raise ValueError(f"no Table 2 sweep for target {target!r} ({exp.relative_to(ROOT)} is missing)")
    rows = str(OmegaConf.load(exp).hydra.sweeper.params["+row"]).split(",")
    labels = [tag_of(r["method"], r["params"]) for r in table2_rows(target)]
    if len(rows) != len(labels):
        raise ValueError(f"{exp.name} lists {len(rows)} rows, the paper's table {len(labels)}")
    return [(label, compose(f"+experiment=table2_{target}", f"+row={row}", f"dataset.n_prompts={prompts}",
                            f"+out_dir={records / row}", *overrides)) for label, row in zip(labels, rows)]


def sweep_missing_inputs(cfg, metrics: dict) -> list[str]:
    """Files the sweep lacks: its world's list (target, drafter, COCO captions), then metrics."""
    out = list(world_class(cfg.target.name).missing_files(cfg))
    for name, (path, source) in metrics.items():
        if not path or not Path(os.fspath(path)).exists():
            out.append(f"{name}: {path or 'not set'} -- {source}")
    return out


def real_table2_sweep(target: str, prompts: int, records: Path, scorers: dict, overrides=(), device=None,
                      configs=None, world=None) -> dict:
    """Runs every row through the generation job on one loaded world, then the metrics.
    ``scorers``: keyword arguments of ``evaluate_run`` (``scorers``: {metric: ``Scorer``}, ``protocol``,
    optionally ``parti_tsv``); ``configs``: (tag, job config) rows (default: Table 2's, ``row_configs``; one of
    them AR); ``world``: the loaded world to run them on (default: loaded from the first config);
    returns {"env", "table", "runs"}."""
    configs = configs or row_configs(target, prompts, records, overrides)
    world = world or load_world(configs[0][1])
    t0 = time.perf_counter()
    summaries, dirs = {}, {}
    for label, cfg in configs:
        dirs[label] = Path(cfg.out_dir)
        summaries[label] = run_job(cfg, dirs[label], world=world)["results"][cfg.method.name]
    gen_s = time.perf_counter() - t0
    ar_label = next(label for label, cfg in configs if cfg.method.name == "ar")
    # the AR row's run holds ar and, where it timed the fastest AR (fastest_ar), ar_compiled: kept apart by tag
    ar_runs = {t: [r for r in read_records(dirs[ar_label] / "samples.jsonl") if r["method"] == t] for t in (AR, FASTEST_AR)}
    fastest = fastest_ar(ar_runs)
    table = {}
    for label, cfg in configs:
        recs = sorted((r for r in read_records(dirs[label] / "samples.jsonl") if r["method"] == cfg.method.name),
                      key=lambda r: r["prompt_index"])
        e = dict(summaries[label])
        e["speedup"] = speedup_against(ar_runs[AR], recs)
        e["speedup_vs_fastest_ar"], e["fastest_ar"] = speedup_against(ar_runs[fastest], recs), fastest
        metrics = evaluate_run(dirs[label], **scorers)["per_method"].get(cfg.method.name, {})
        e.update({m: metrics[m] for m in scorers["scorers"] if m in metrics})
        table[label] = e
    env = {"target": target, "prompts": prompts, "device": str(world.device), "batch_size": 1, "generation_seconds": gen_s,
           "records": str(records), "speedup_reference": "the AR row: same prompts, seeds and machine, same sweep",
           "fastest_ar": fastest, "fastest_ar_reference": FASTEST_AR_REFERENCE,
           "files": world.files()}
    return {"env": env, "table": table, "runs": {k: str(v) for k, v in dirs.items()}}
