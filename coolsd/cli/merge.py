"""Join the shards of a run (``coolsd.job.shards``) into the records and summary one process would
have written:
    python -m coolsd.cli.merge outputs/toy/coolsd/<time>_<hash>           # shards in one folder
    python -m coolsd.cli.merge <folder> --from <other folder> ...          # shards copied from elsewhere
    python -m coolsd.cli.merge <folder> --partial                          # report what is there

Checks before writing anything: every folder holds a run of the same configuration (its
``run.json``, input files' content fingerprints included: a folder whose shards ran on other
weights is refused, naming the file), every shard file has the run's shard count, no shard is
still being written (its lock, ``coolsd.util.records.RunLock``, names the holder), a sample present in
two shards is the same sample, and (unless ``--partial``) every (method, prompt) pair is present,
else an error lists the missing prompts, every record file reads (``read_records``: a corrupted line is
named) and every record's image is there and decodes. Writes ``samples.jsonl`` (prompt order, methods
in run order) and ``summary.json`` atomically; shard files stay as they are. A refusal is one line
(``MergeError`` and the project's other input errors; exit status 2 from the command line) and writes
nothing.

Where the shards logged to W&B (``logger=wandb``: the folder keeps their settings,
``coolsd.job.tracking.WANDB_FILE``), the merged summary is logged too, as one more run of their group
(``log_merged``): its numbers, ``summary/table``, the Pareto charts and ``pareto.png`` (speed-up
against each quality signal, 95% CIs; also written to the folder). ``--no-wandb`` skips it; a W&B
failure there is a warning (``summary.json`` is written first).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

from coolsd.cli.runner import one_line_errors, verbose
from coolsd.job.generation import TIMING_KEYS, collect, kept_images
from coolsd.job.shards import SHARD_FILE
from coolsd.job.summary import summarize, summary_lines, write_distortion_figure, write_summary_markdown
from coolsd.job.tracking import folder_logger, quality_metrics, summary_rows
from coolsd.prompts import load_prompts
from coolsd.util.errors import InputError
from coolsd.util.loading import MissingInputFile
from coolsd.util.records import (
    RunLock,
    describe_identity_diff,
    image_problems,
    images_mismatch,
    read_records,
    write_json_atomic,
)
from coolsd.worlds import world_class


class MergeError(InputError, ValueError):
    """The shards given cannot be merged as they are (another configuration, shard count or
    sample; missing prompts or images; a shard still being written): one line, exit status 2."""


def _identity(folder: Path) -> dict:
    path = folder / "run.json"
    if not folder.is_dir():
        raise MissingInputFile(f"{folder} does not exist{' (a file)' if folder.exists() else ''}: give the run folder "
                               "whose shards to merge (the +out_dir of its shards, or a folder of a multirun)")
    if not path.is_file():
        raise MissingInputFile(f"{folder} holds no run.json: not a run folder of python run.py; give the folder its "
                               "shards were written to")
    try:
        ident = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise MergeError(f"{path} is not a run identity ({' '.join(str(e).split())[:100]}); the folder's run.json is "
                         "corrupted: rerun its shards into a new folder") from None
    if not isinstance(ident, dict) or not {"target", "settings", "world"} <= set(ident):
        raise MergeError(f"{path} was written by an older coolsd (before the world registry): merge it with that "
                         "version, or rerun the shards into a new folder")
    return ident


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def shard_files(folder: Path, count: int) -> list[Path]:
    """The record files of a run's shards present in ``folder``; refused if one is still being
    written (its lock is held) or belongs to another shard count."""
    files = sorted(folder.glob("samples.shard-*.jsonl")) if count > 1 else [folder / "samples.jsonl"]
    for f in files:
        m = SHARD_FILE.match(f.name)
        if m and int(m.group(2)) != count:
            raise MergeError(f"{f} belongs to a run of {int(m.group(2))} shards, but {folder}/run.json says {count}: "
                             "the shard count changed between runs of this folder")
        if (who := RunLock.held_by(folder, f.name)) is not None:
            raise MergeError(f"{f} is still being written by {who}; merge when its shard has finished")
    return [f for f in files if f.exists()]


def merge(folder, sources=(), partial: bool = False, track: bool = True) -> dict:
    folder = Path(folder)
    ident = _identity(folder)
    for src in map(Path, sources):
        other = _identity(src)
        if other != ident:
            raise MergeError(f"{src} holds a run of another configuration than {folder} "
                             f"({describe_identity_diff(ident, other)}); only shards of one run can be merged")
    count = int(ident.get("shards", 1))
    methods = list(ident["methods"])
    d = ident["dataset"]
    prompts = range(int(d["offset"]), int(d["offset"]) + int(d["n_prompts"]))
    by_key: dict = {}
    merged = set()  # names of the shard files that contributed records
    for src in [folder, *map(Path, sources)]:
        for f in shard_files(src, count):
            records = read_records(f)
            if records:
                merged.add(f.name)
            for r in records:
                key = (r["method"], r["prompt_index"])
                if key in by_key:
                    a = {k: v for k, v in by_key[key][0].items() if k not in TIMING_KEYS}
                    b = {k: v for k, v in r.items() if k not in TIMING_KEYS}
                    if a != b:
                        raise MergeError(f"two different samples for method {key[0]!r}, prompt {key[1]} (in {src}); "
                                         "shards of one run never overlap")
                    continue
                by_key[key] = (r, src)
    if not by_key:
        files = f"samples.shard-*-of-{count:03d}.jsonl" if count > 1 else "samples.jsonl"
        raise MergeError(f"{folder} holds no records of its run ({count} shard(s): {files}"
                         f"{', nor the folders given with --from' if sources else ''}): nothing to merge; run its "
                         "shards first (python run.py ... shard.index=K shard.count=N into this folder)")
    for src in {src for _, src in by_key.values()}:  # every image there, before anything is written
        recs = [r for r, s in by_key.values() if s == src]
        if bad := image_problems(src, recs):
            raise MergeError(f"{src}: {images_mismatch(bad, recs)}")
    missing = sorted({p for t in methods for p in prompts if (t, p) not in by_key})
    if missing and not partial:
        raise MergeError(f"{folder}: {len(missing)} of {len(prompts)} prompts are incomplete ({_ranges(missing)}); "
                         "rerun their shards (they resume), or pass --partial to report what is there")
    for (_, _), (r, src) in by_key.items():  # images of shards written elsewhere
        if src != folder and "image" in r and not (folder / r["image"]).exists():
            (folder / r["image"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / r["image"], folder / r["image"])
    complete = [p for p in prompts if all((t, p) in by_key for t in methods)]
    records = [by_key[(t, p)][0] for p in complete for t in methods]
    tmp = folder / "samples.jsonl.partial"
    tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in records))
    tmp.replace(folder / "samples.jsonl")
    failed = {t: [p for p in complete if "error" in by_key[(t, p)][0]] for t in methods}
    ok = [p for p in complete if not any(p in v for v in failed.values())]  # compared where all succeeded
    summary = summarize_records(folder, ident, {k: r for k, (r, _) in by_key.items()}, ok,
                                {t: v for t, v in failed.items() if v})
    summary.update(merged_shards=len(merged), shards=count, prompts_complete=len(complete), prompts_missing=missing)
    write_json_atomic(summary, folder / "summary.json")
    write_summary_markdown(world_class(summary["target"]), summary["results"], report_lines(summary), folder)
    write_distortion_figure(summary, {t: [by_key[(t, p)][0] for p in ok] for t in methods}, folder)
    if track:
        log_merged(folder, ident, summary)
    return summary


def log_merged(folder: Path, ident: dict, summary: dict) -> None:
    """The merged summary to the tracker the shards of ``folder`` used (nothing where they used
    none): its W&B run ``merged`` in their group (``coolsd.job.tracking.wandb_run_id``), with
    ``pareto.png`` (``coolsd.report.plots.pareto_plot``, speed-up against each quality signal)
    written to ``folder`` and logged beside the charts. A failure prints one warning: the
    summary is on disk already (``COOLSD_VERBOSE=1`` adds the traceback)."""
    try:
        logger = folder_logger(folder, ident, f"{ident['target']}/{ident.get('method', '?')}/{folder.name}")
        if logger is None:
            return
        # deferred: pandas and matplotlib load only for a merge whose shards logged to W&B
        from coolsd.report.plots import pareto_plot
        from coolsd.report.sweep import sweep_frame  # deferred: as above

        results = summary["results"]
        figures = []
        quality = quality_metrics(summary_rows(results))
        if quality and any("speedup" in e for e in results.values()):
            figures = pareto_plot(sweep_frame(results), folder / "pareto.png", quality,
                                  f"{ident['target']}: quality vs speed-up ({folder.name})", xs=("speedup",))[:1]
        logger.start(ident, folder, None)
        logger.log_results(results, figures)
        logger.finish()
    except Exception as e:
        if verbose():
            traceback.print_exc()
        why = " ".join(str(e).split())[:300] or type(e).__name__
        print(f"warning: {folder}/summary.json is written, but logging it to W&B failed ({type(e).__name__}: {why}); "
              "run the merge again to log it, or pass --no-wandb", file=sys.stderr)


def summarize_records(folder: Path, ident: dict, records: dict, prompts: list[int], failures: dict) -> dict:
    """The run's summary from merged records, by the code the one-process job uses
    (``coolsd.job.summary.summarize``), the world's quality included (the toy worlds read their
    images back)."""
    world_cls = world_class(ident["target"])
    outputs = collect(world_cls, ident["methods"], records, folder, prompts, {}, kept_images(world_cls))
    ds, offset = ident["dataset"], int(ident["dataset"].get("offset", 0))
    chosen = [None] * len(prompts)
    if prompts and world_cls.quality_reads_images:  # the prompts themselves (toy scenes) only where quality reads them
        if ds.get("name") == "prompts":  # a prompt file: run.json holds its fingerprint, not its place; records its texts
            text = {p: r for (_, p), r in records.items()}
            chosen = [SimpleNamespace(caption=text[p]["caption"], index=p, prompt_id=text[p].get("prompt_id"))
                      for p in prompts]
        else:
            pool = load_prompts({**ds, "n_prompts": max(prompts) + 1 - offset})
            chosen = [pool[p - offset] for p in prompts]
    summary = summarize(world_cls, ident, outputs, chosen, failures)
    summary["speedup_reference"] += " (merged shards)"
    return summary


def report_lines(summary: dict) -> list[str]:
    """What a merge prints and keeps in summary.md: the summary table, then the shards merged."""
    return summary_lines(world_class(summary["target"]), summary["results"]) + [
        f"merged {summary['merged_shards']} of {summary['shards']} shard(s): {summary['prompts_complete']} complete "
        "prompts" + (f", {len(summary['prompts_missing'])} missing" if summary["prompts_missing"] else "")]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--from", dest="sources", type=Path, nargs="*", default=[], help="other folders with shards of this run")
    ap.add_argument("--partial", action="store_true", help="summarise the complete prompts even if some are missing")
    ap.add_argument("--no-wandb", action="store_true", help="do not log the merged summary to the shards' W&B group")
    a = ap.parse_args(argv)
    s = merge(a.run, a.sources, a.partial, track=not a.no_wandb)
    print("\n".join(report_lines(s)) + f" -> {a.run}/summary.json, summary.md")
    return s


if __name__ == "__main__":
    with one_line_errors():
        main()
