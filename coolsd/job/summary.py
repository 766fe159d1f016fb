"""A run's summary from its records, the same code for a one-process run (``coolsd.job.generation``) and for
merged shards (``coolsd.cli.merge``): per method tag, the world's record metrics as mean [95% CI]
over prompts, throughput, the speed-up against ``ar`` paired by prompt (docs/methods.md#6-evaluation-protocol) and the
world's quality numbers; the printed table and the labelled image grid.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from coolsd.metrics.registry import known_metric
from coolsd.metrics.token_maps import distortion_figure
from coolsd.util.image_grid import method_grid
from coolsd.util.records import save_png_atomic, write_json_atomic, write_text_atomic
from coolsd.util.stats import FLOAT_NOISE, FRACTION, NULL_REASON, POSITIVE, REAL, UNSCORED, mean_ci, ratio_ci

SPEEDUP_REFERENCE = "ar on the same prompts, same machine, same run (same batch size)"
# The AR baselines a run may time. ``ar``: AR in the run's own mode (eager, or compiled under
# compile=true), the reference of ``speedup``. ``ar_compiled``: AR on the run's compiled twin (static KV
# cache, CUDA graphs on CUDA; ``fastest_ar``, coolsd.job.generation), timed beside an eager run on the same
# prompts. The two are never pooled: each is its own tag, and ``speedup_vs_fastest_ar`` takes the one
# with the lower mean latency whole.
AR, FASTEST_AR = "ar", "ar_compiled"
FASTEST_AR_REFERENCE = ("speedup_vs_fastest_ar: mean latency of the fastest AR this run timed / mean method latency, "
                        "paired by prompt; the fastest AR is the one of ar (same mode as the run) and ar_compiled "
                        "(compiled AR: static KV cache, CUDA graphs on CUDA; timed on CUDA unless fastest_ar=false) "
                        "with the lower mean latency, named by fastest_ar; where only one ran it is that one, and "
                        "the column equals speedup")
# where each summarised record quantity that is no registered metric lives, (domain, lower bound),
# for its interval (coolsd.util.stats); a registered metric's is its entry's (``MetricInfo.domain``);
# a key in neither is real-valued (Student-t), e.g. target_nll and every difference
METRIC_DOMAINS = {
    **dict.fromkeys(("latency_s", "decode_s", "images_per_s", "target_forwards", "draft_forwards",
                     "resample_rounds", "fallbacks"), (POSITIVE, 0.0)),
    **dict.fromkeys(("accepted_length", "exact_accepted_length", "sampled_accepted_length"), (POSITIVE, 1.0)),
    **dict.fromkeys(("acceptance_rate", "exact_tv", "sampled_tv_to_target", "chi2_p_sampled_vs_exact"), (FRACTION, 0.0)),
}



def metric_ci(key: str, values) -> dict:
    """``mean_ci`` of a record quantity with the interval of its domain and its float noise: a
    registered metric's (``MetricInfo.domain`` / ``noise``), else ``METRIC_DOMAINS`` and
    ``stats.FLOAT_NOISE``."""
    m = known_metric(key)
    domain, lower = m.domain if m is not None else METRIC_DOMAINS.get(key, (REAL, 0.0))
    noise = m.noise if m is not None and m.noise is not None else FLOAT_NOISE
    return mean_ci(values, domain=domain, lower=lower, name=key, noise=noise)


def results_table(world_cls, outputs: dict, prompts: list, files: dict) -> dict:
    """{tag: {"params", <record metric>: mean_ci, "images_per_s", "speedup",
    "speedup_per_accepted_length", "speedup_vs_fastest_ar", "fastest_ar", <quality>}} from
    ``outputs`` {tag: (records, images)} (empty where no prompt was completed by every method);
    ``files``: the world's ``files()``. ``speedup`` is against ``ar`` (AR in the run's own mode);
    ``speedup_vs_fastest_ar`` against the AR tag of the lower mean latency (``fastest_ar``), which
    is ``ar`` itself where ``ar_compiled`` did not run or was slower."""
    outputs = {tag: out for tag, out in outputs.items() if out[0]}
    fastest = fastest_ar({tag: rows for tag, (rows, _) in outputs.items()})
    table = {}
    for tag, (rows, _) in outputs.items():
        e = {"params": rows[0]["params"]}
        for key in world_cls.record_metrics:
            vals = [r[key] for r in rows if r.get(key) is not None]
            if vals:
                e[key] = metric_ci(key, vals)
        if "ar" in outputs:
            e.update(paired_differences(world_cls.paired_metrics, outputs["ar"][0], rows))
        peak = _peak_memory(rows)
        if peak is not None:  # CUDA runs: the most device memory any of this method's batches held
            e["peak_memory_gib"] = peak
        if world_cls.makes_images:  # throughput at the run's batch size: images per second of generation
            e["images_per_s"] = metric_ci("images_per_s", [r.get("batch_size", 1) / r["latency_s"] for r in rows])
        if "ar" in outputs and "latency_s" in rows[0]:
            e["speedup"] = speedup_against(outputs["ar"][0], rows)
            if "accepted_length" in e:
                e["speedup_per_accepted_length"] = e["speedup"]["mean"] / e["accepted_length"]["mean"]
            # the same without the quality signals' work (timed apart in eager rounds): the signals are the
            # harness's measurement, not the method's cost; both speed-ups side by side from the same run
            bare = [[r["latency_s"] - r["signal_s"] if r.get("signal_s") is not None else None for r in rs]
                    for rs in (outputs["ar"][0], rows)]
            if all(x is not None for x in bare[0] + bare[1]):
                e["speedup_without_signals"] = ratio_ci(bare[0], bare[1], paired=True)
        if fastest is not None and "latency_s" in rows[0]:  # equals speedup where ar is the fastest (or only) AR
            e["speedup_vs_fastest_ar"] = speedup_against(outputs[fastest][0], rows)
            e["fastest_ar"] = fastest
        table[tag] = e
    for tag, q in (world_cls.quality(outputs, prompts, files) if outputs else {}).items():
        table[tag].update(q)
    for e in table.values():
        if any(k.endswith(MINUS_AR) for k in e):
            e["resolution"] = resolution(e)
    return table


def fastest_ar(rows_by_tag: dict) -> Optional[str]:
    """The tag of the AR baseline (``ar``, ``ar_compiled``) with the lowest mean latency among those
    in ``rows_by_tag`` {tag: records}; None where none ran (or its records hold no latency). A tie
    goes to ``ar``."""
    timed = [t for t in (AR, FASTEST_AR) if rows_by_tag.get(t) and all("latency_s" in r for r in rows_by_tag[t])]
    return min(timed, key=lambda t: float(np.mean([r["latency_s"] for r in rows_by_tag[t]])), default=None)


def speedup_against(ref_rows: list, rows: list) -> dict:
    """mean reference latency / mean latency (``ratio_ci``): paired by prompt where both hold the same
    prompts (every run's tags do: they are compared on the prompts all completed), else each side
    resampled on its own."""
    ref = {r["prompt_index"]: r["latency_s"] for r in ref_rows}
    if sorted(ref) == sorted(r["prompt_index"] for r in rows):
        return ratio_ci([ref[r["prompt_index"]] for r in rows], [r["latency_s"] for r in rows], paired=True)
    return ratio_ci(list(ref.values()), [r["latency_s"] for r in rows])


MINUS_AR = "_minus_ar"


def paired_differences(keys, ar_rows: list, rows: list) -> dict:
    """{``<key>_minus_ar``: mean_ci of (method - ar) over the prompts both have a value for}: the
    same prompt and seed on both sides, so the prompt-to-prompt spread cancels."""
    out = {}
    for key in keys:
        ar = {r["prompt_index"]: r[key] for r in ar_rows if r.get(key) is not None}
        diffs = [r[key] - ar[r["prompt_index"]] for r in rows if r.get(key) is not None and r["prompt_index"] in ar]
        if diffs:
            out[key + MINUS_AR] = mean_ci(diffs, name=key + MINUS_AR)
    return out


def resolution(entry: dict) -> dict:
    """{metric: half-width of its paired 95% CI against ar}: the smallest difference this run could
    tell from zero (a reader sees whether n was large enough for the difference of interest);
    a difference without an interval (n = 1) is left out."""
    out = {}
    for k, v in entry.items():
        if k.endswith(MINUS_AR) and isinstance(v, dict) and ("ci95" in v or "lo" in v):
            lo, hi = (v["ci95"] if "ci95" in v else (v["lo"], v["hi"]))
            out[k[: -len(MINUS_AR)]] = (hi - lo) / 2
    return out


def _peak_memory(rows: list) -> Optional[float]:
    """The largest ``peak_memory_gib`` of the records (each its batch's peak device memory, CUDA
    only), None where no record has one (CPU runs, records of older runs): the peak over the
    run's generation, since every batch's window starts at the memory already held."""
    vals = [r["peak_memory_gib"] for r in rows if r.get("peak_memory_gib") is not None]
    return max(vals) if vals else None


def summarize(world_cls, identity: dict, outputs: dict, prompts: list, failures: dict) -> dict:
    """The summary.json of a run: its identity's settings, where it ran (``peak_memory_gib``: the
    peak device memory of its generation on CUDA, ``torch.cuda.max_memory_allocated`` in GiB over
    the records' batches, warm-up excluded; null on the CPU), which AR was the fastest
    (``fastest_ar``, ``FASTEST_AR_REFERENCE``) and ``results_table`` (each method's own
    ``peak_memory_gib`` on CUDA)."""
    rows = [r for recs, _ in outputs.values() for r in recs]
    hardware = sorted({r["hardware"] for r in rows if "hardware" in r})
    methods = identity["methods"]
    results = results_table(world_cls, outputs, prompts, identity["world"])
    fastest = next((e["fastest_ar"] for e in results.values() if "fastest_ar" in e), None)
    return {"target": identity["target"],
            **({"method": methods[identity["method"]]} if identity.get("method") in methods else {}),
            "methods": methods, "n_prompts": len(prompts), **identity["settings"], "device": identity["device"],
            "hardware": hardware[0] if len(hardware) == 1 else hardware, "threads": identity["threads"],
            "peak_memory_gib": _peak_memory(rows),
            "batch_size": identity.get("batch_size", 1),
            **({"batch_invariant": True} if identity.get("batch_invariant") else {}),
            "speedup_reference": SPEEDUP_REFERENCE,
            **({"fastest_ar": fastest, "fastest_ar_reference": FASTEST_AR_REFERENCE} if fastest else {}),
            "failures": failures, **_compile_summary(rows), "results": results}


def _compile_summary(rows: list) -> dict:
    """``compile=true`` runs: graphs compiled after the warm-up, summed over the records (goal 0:
    a graph compiled mid-run puts its compile time into a latency)."""
    if not any("compilations" in r for r in rows):
        return {}
    return {"compile": {"graphs_compiled_after_warmup": int(sum(r.get("compilations", 0) for r in rows))}}


def _cell(v, digits: int, null_reason: Optional[str] = None) -> str:
    """A summary value as "mean [lo, hi]"; "mean (n=1: no CI)" without an interval; "-" for
    null, "- (n too small)" where its reason is the sample size (the reason is printed below)."""
    if v is None:
        return "- (n too small)" if null_reason else "-"
    if "no_ci" in v:
        return f"{v['mean']:.{digits}f} ({v['no_ci']})"
    if "fid" in v:
        return f"{v['fid']:.{digits}f} [{v['lo']:.{digits}f}, {v['hi']:.{digits}f}]"
    return f"{v['mean']:.{digits}f} [{v['ci95'][0]:.{digits}f}, {v['ci95'][1]:.{digits}f}]"


def _cells(entry: dict, cols) -> list[str]:
    """A method's row of the summary table: a cell per presentation column."""
    return [_cell(entry.get(c.key), c.digits, entry.get(c.key + NULL_REASON)) for c in cols]


def summary_lines(world_cls, table: dict, outputs: Optional[dict] = None) -> list[str]:
    """The printed table: one row per method with the world's columns; worlds with
    ``presentation.per_prompt`` add one row per prompt of those record fields."""
    w = max([12] + [len(t) + 1 for t in table])
    cols = world_cls.presentation.columns
    lines = [f"{'method':<{w}} " + " ".join(f"{c.header:<24}" for c in cols).rstrip()]
    for tag, e in table.items():
        lines.append(f"{tag:<{w}} " + " ".join(f"{cell:<24}" for cell in _cells(e, cols)).rstrip())
    reasons = {(c.key, e[c.key + NULL_REASON]) for e in table.values() for c in cols
               if e.get(c.key) is None and e.get(c.key + NULL_REASON)}
    lines += [f"{key}: null: {why}" for key, why in sorted(reasons)]
    unscored = next((e[UNSCORED] for e in table.values() if e.get(UNSCORED)), None)
    if unscored:  # a world's quality metrics left prompts out (coolsd.worlds.toy.toy_quality): said, never silent
        shown = ", ".join(map(str, unscored["prompt_indices"])) + (", ..." if unscored["n"] > len(unscored["prompt_indices"])
                                                                   else "")
        lines.append(f"quality metrics over {unscored['of'] - unscored['n']} of {unscored['of']} prompts: "
                     f"{unscored['n']} not scored (prompts {shown}): {unscored['why']}")
    res = {tag: e["resolution"] for tag, e in table.items() if tag != "ar" and e.get("resolution")}
    if res:
        lines += ["", "resolution: half-width of the paired 95% CI against ar (a smaller difference is not resolved at this n)"]
        lines += [f"{tag:<{w}} " + ", ".join(f"{k} ±{v:.3g}" for k, v in r.items()) for tag, r in res.items()]
    if world_cls.presentation.per_prompt and outputs:
        keys = world_cls.presentation.per_prompt
        lines += ["", f"{'method':<{w}} {'prompt':>6} " + " ".join(f"{k:>{max(len(k), 8)}}" for k in keys)]
        for tag, (rows, _) in outputs.items():
            for r in rows:
                cells = [f"{r[k]:>{max(len(k), 8)}.4f}" if isinstance(r[k], float) else f"{r[k]:>{max(len(k), 8)}}"
                         for k in keys]
                lines.append(f"{tag:<{w}} {r['prompt_index']:>6} " + " ".join(cells))
    return lines


def summary_markdown(world_cls, table: dict, notes: list[str]) -> str:
    """summary.md: the printed table (``summary_lines``'s method rows) as a Markdown table, then the
    printed notes under it (null reasons, resolution, speed-up reference, ...) as they were printed."""
    cols = world_cls.presentation.columns
    md = ["| method | " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    md += [f"| {tag} | " + " | ".join(_cells(e, cols)) + " |" for tag, e in table.items()]
    while notes and not notes[0].strip():
        notes = notes[1:]
    return "\n".join(md) + ("\n\n```text\n" + "\n".join(notes) + "\n```" if notes else "") + "\n"


def write_summary_markdown(world_cls, table: dict, lines: list[str], out_dir: Path) -> None:
    """summary.md beside summary.json from the printed ``lines`` (``summary_lines`` first), atomically."""
    write_text_atomic(summary_markdown(world_cls, table, lines[1 + len(table):]), out_dir / "summary.md")


GRID_COLUMNS = 8


def run_grid(outputs: dict, reference: Optional[np.ndarray] = None, captions: Sequence[str] = ()
             ) -> Optional[np.ndarray]:
    """The first ``GRID_COLUMNS`` prompts' images of every method (and the reference renders, where
    the world draws them): a column per method under its tag, a row per prompt beside its caption
    (``captions``, in prompt order; ``coolsd.util.image_grid.method_grid``). None without images."""
    images = {tag: imgs[:GRID_COLUMNS] for tag, (_, imgs) in outputs.items() if imgs is not None and len(imgs)}
    if not images:
        return None
    if reference is not None:
        images["reference"] = reference[:GRID_COLUMNS]
    n = max(len(v) for v in images.values())
    captions = [str(c) for c in captions][:n]
    return method_grid(images, captions + [f"prompt {i}" for i in range(len(captions), n)])


def write_outputs(world_cls, summary: dict, outputs: dict, out_dir: Path, reference=None, captions=()) -> list[str]:
    """summary.json, grid.png (``run_grid``: ``captions`` are the prompts') and distortion.png
    (per-token distortion maps and depth curves, where the records have them), atomically; returns
    the printed lines."""

    write_json_atomic(summary, out_dir / "summary.json")
    grid = run_grid(outputs, reference, captions)
    if grid is not None:
        save_png_atomic(grid, out_dir / "grid.png")
    wrote = "summary.json, summary.md, samples.jsonl" + (", images/, grid.png" if grid is not None else "")
    if write_distortion_figure(summary, {tag: recs for tag, (recs, _) in outputs.items()}, out_dir):
        wrote += ", distortion.png"
    lines = summary_lines(world_cls, summary["results"], outputs)
    if summary.get("fastest_ar"):
        lat = {t: e["latency_s"]["mean"] for t, e in summary["results"].items()
               if t in (AR, FASTEST_AR) and "latency_s" in e}
        lines.append(f"speed-up (fastest AR): against {summary['fastest_ar']} ("
                     + ", ".join(f"{t} {v:.4g} s" for t, v in lat.items()) + " mean latency)")
    if "compile" in summary:
        c = summary["compile"]
        mode = "compile=true" if summary.get("compiled") else f"{FASTEST_AR} (compiled AR beside this eager run)"
        lines.append(f"{mode}: {c['graphs_compiled_after_warmup']} graphs compiled after the warm-up (goal 0)"
                     + (f"; warm-up {c['warmup_s']:.1f} s, excluded from latency" if "warmup_s" in c else ""))
    if summary.get("peak_memory_gib") is not None:
        per = ", ".join(f"{t} {e['peak_memory_gib']:.2f}" for t, e in summary["results"].items()
                        if "peak_memory_gib" in e)
        lines.append(f"peak device memory over generation: {summary['peak_memory_gib']:.2f} GiB"
                     + (f" ({per})" if per else ""))
    lines.append(f"wrote {out_dir}/{wrote}")
    if world_cls.presentation.next_step:
        lines[-1] += "; " + world_cls.presentation.next_step.format(out_dir=out_dir)
    write_summary_markdown(world_cls, summary["results"], lines, out_dir)
    return lines


def write_distortion_figure(summary: dict, records_by_tag: dict, out_dir: Path) -> bool:
    """distortion.png: each method's per-token distortion map and depth curve
    (``coolsd.metrics.token_maps``); False (nothing written) where no record has per-token values."""

    title = f"{summary['target']}: exact per-token distortion, {summary['n_prompts']} prompts"
    return distortion_figure(records_by_tag, Path(out_dir) / "distortion.png", title) is not None
