"""Image metrics of a finished (or partial) run, from its records and PNGs (docs/methods.md#6-evaluation-protocol), so a
metric is added without regenerating:
    python -m coolsd.cli.evaluate outputs/llamagen_xl/coolsd/<time>_<hash> --metrics clip_score,fid,image_reward
    python -m coolsd.cli.evaluate <run> --protocol sjd --clip <clip-vit-base-patch16> --inception <pt_inception.pth>
    python -m coolsd.cli.evaluate <parti run> --protocol sjd --parti-tsv PartiPrompts.tsv --metrics clip_score

Per method tag of the run: CLIP score (mean [95% CI] over images), ImageReward (same), FID
against the cached statistics of the COCO val2017 reference images (bootstrap interval over the
generated images). ``--protocol`` picks how CLIP score and FID are computed (``lantern``, the
default: clean-fid FID, CLIP ViT-B/32 raw cosine with "A photo depicts "; ``sjd``: pytorch-fid
FID, torchmetrics CLIPScore ViT-B/16 x100; ``coolsd.metrics.protocols``). Written to
``<run>/metrics.json`` (atomically) with the per-sample scores; every metric's entry names its
protocol. Every input the requested metrics need under that protocol (the run folder, its records
and images, CLIP folder, Inception weights, COCO val2017 images, PartiPrompts TSV, ImageReward files) is checked
before any network loads, and every missing one is listed at once with the flag that sets it and
its environment variable (``metric_missing_inputs``). Without the flag or the variable, an input
that is on the Hugging Face hub (the CLIP folders, ImageReward's files) defaults to its hub id
(``HUB_DEFAULTS``), read from the local hub cache, never downloaded here: ``python -m
coolsd.cli.download metrics=...`` fetches it.

Device and precision (``coolsd.metrics.numerics``): ``--device`` defaults to ``cuda`` when
``torch.cuda.is_available()``, else ``cpu``, and the choice is printed first and recorded in
``metrics.json``; ``--device cuda`` on a machine without CUDA is refused before any work. Every
metric network runs in float32 with TF32 off (``numerics.ieee_fp32``), so GPU features agree
with CPU features to float32 rounding, and the cached FID reference statistics are keyed by the
device type and that precision too (``coolsd.metrics.reference``): a cache made on the CPU is
never read on the GPU, nor one made under one precision under another.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from coolsd.cli.runner import one_line_errors
from coolsd.engine import plugins
from coolsd.metrics.clip_score import snapshot_dir
from coolsd.metrics.image_prep import load_rgb
from coolsd.metrics.numerics import check_device, default_device, metric_numerics
from coolsd.metrics.protocols import PARTI_SOURCE, check_parti_captions, check_protocol, read_parti_prompts
from coolsd.metrics.registry import (
    PROTOCOLS,
    EvalContext,
    InputSpec,
    Scorer,
    evaluate_metrics,
    every_input_spec,
    metric,
    protocol_inputs,
)
from coolsd.util import hub
from coolsd.util.errors import ConfigError, InputError
from coolsd.util.records import image_problems, images_mismatch, read_records, write_json_atomic
from coolsd.worlds.files import DOWNLOAD, Need, require_inputs

CHUNK = 64  # images decoded and scored at once
PARTI = InputSpec("--parti-tsv", "PartiPrompts.tsv: the run was generated on PartiPrompts (CLIP-like metrics only)",
                  "PartiPrompts TSV", PARTI_SOURCE, optional=True)


RUN_RECORDS = "samples.jsonl"  # a run's (or a merged run's) records; evaluate reads them, never writes them


def run_folder_problems(run_dir: Path) -> list[str]:
    """What keeps the run folder from being evaluated, in lines for ``require_inputs``: none where
    it is not a folder (its ``Need`` says so), else its records unreadable (a corrupted line) or
    absent (unmerged shards named), or their images missing or undecodable (how many, the first few)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    try:
        records = read_records(run_dir / RUN_RECORDS)
    except InputError as e:
        return [f"run records: {e}"]
    if not records:
        shards = sorted(p.name for p in run_dir.glob("samples.shard-*.jsonl"))
        how = (f"it holds {len(shards)} unmerged shard file(s): merge them first (python -m coolsd.cli.merge {run_dir})"
               if shards else "is it a run folder of python run.py?")
        return [f"run records: {run_dir} holds no records ({RUN_RECORDS}); {how}"]
    bad = image_problems(run_dir, records)
    return [f"run images: {run_dir}: {images_mismatch(bad, records)}"] if bad else []


def run_images(run_dir: Path) -> dict[str, list[dict]]:
    """Records with images, by method tag, in prompt order (``run_folder_problems`` first: every
    image exists and decodes). Reads the record file only: a truncated last line is skipped, never
    rewritten (a run may still be appending)."""
    run_dir = Path(run_dir)
    require_inputs("python -m coolsd.cli.evaluate", run_folder_problems(run_dir) if run_dir.is_dir() else
                   [f"run folder: {run_dir} is not a folder; give a folder written by python run.py"])
    records = read_records(run_dir / RUN_RECORDS)
    by_tag: dict[str, list[dict]] = {}
    for r in records:
        if "image" in r:
            by_tag.setdefault(r["method"], []).append(r)
    return {t: sorted(rs, key=lambda r: r["prompt_index"]) for t, rs in by_tag.items()}


def evaluate_run(run_dir, scorers: dict, protocol: str = "lantern", parti_tsv=None) -> dict:
    """Metrics of every method tag of a run. ``scorers``: {metric name: ``Scorer``} (``build_scorers``);
    ``protocol`` is recorded with every number, and a scorer that computes another protocol's recipe
    is refused (the label must be what computed the number); ``parti_tsv``: the run's prompts are
    checked to be that PartiPrompts file's, and a metric that cannot score PartiPrompts (FID: no
    reference images) is refused."""
    check_protocol(protocol)
    for name, sc in scorers.items():
        if sc.protocol is not None and sc.protocol != protocol:
            raise ValueError(f"the {name} scorer computes the {sc.protocol!r} protocol, not {protocol!r}; build the "
                             f"scorers with build_scorers(..., protocol={protocol!r})")
    run_dir = Path(run_dir)
    by_tag = run_images(run_dir)
    if parti_tsv is not None:
        cannot = [metric(n).header for n in scorers if "parti" not in metric(n).prompt_sets]
        if cannot:
            raise ValueError(f"{', '.join(cannot)} on PartiPrompts: it has no reference images (the SJD papers report "
                             "only CLIP score there); use --metrics clip_score")
        check_parti_captions(by_tag, read_parti_prompts(parti_tsv), parti_tsv)
    out = {"run": str(run_dir), "protocol": protocol, "per_method": {}, "per_sample": {}}
    pixels = {n: sc for n, sc in scorers.items() if sc.pixels}
    for tag, recs in by_tag.items():
        paths = [run_dir / r["image"] for r in recs]
        captions = [r["caption"] for r in recs]
        res, samples = {"n": len(recs)}, {"prompt_index": [r["prompt_index"] for r in recs]}
        values: dict[str, list] = {n: [] for n in scorers}
        for s in range(0, len(paths), CHUNK) if pixels else ():  # each PNG decoded once
            imgs = [load_rgb(p) for p in paths[s:s + CHUNK]]
            for n, sc in pixels.items():
                values[n].append(sc.score(imgs, captions[s:s + CHUNK]))
        for n, sc in scorers.items():
            v = np.concatenate(values[n]) if sc.pixels else sc.score(paths, captions)
            entry, per_sample = sc.summarize(np.asarray(v))
            if entry is not None:
                res[n] = {**entry, "protocol": protocol}
            if per_sample is not None:
                samples[n] = per_sample
        out["per_method"][tag] = res
        out["per_sample"][tag] = samples
    return out


def build_scorers(metrics, *, device=None, cache_dir=Path("outputs/cache"), fid_resamples: int = 100,
                  protocol: str = "lantern", **inputs) -> dict[str, Scorer]:
    """{name: ``Scorer``} of the named metrics under ``protocol``, every network loaded (and the FID
    reference statistics computed or read from the cache) once, on ``device`` (None:
    ``numerics.default_device()``, cuda when available). ``inputs``: every input's value by its
    destination name (``clip``, ``inception``, ``coco_images``, ...; local paths); an input not given
    takes its default (``InputSpec.default``: the torch hub cache of the Inception weights)."""
    device = default_device() if device is None else device
    proto = PROTOCOLS.get(check_protocol(protocol))
    values = dict(inputs)
    for name in metrics:
        for spec in protocol_inputs(proto, metric(name)):
            values[spec.dest] = spec.resolve(values.get(spec.dest))
    ctx = EvalContext(proto, values, device, Path(cache_dir), fid_resamples)
    return {name: metric(name).build(ctx) for name in metrics}


def input_env(protocol: str, flag: str):
    """The environment variable of a flag's default under a protocol (None: none)."""
    spec = _spec(protocol, flag)
    return None if spec is None else spec.env


def _spec(protocol: str, flag: str):
    """The ``InputSpec`` of ``flag`` under ``protocol``: the protocol's own, else a metric's (None: none)."""
    proto = PROTOCOLS.get(protocol)
    if flag in proto.inputs:
        return proto.inputs[flag]
    specs = every_input_spec().get(flag, [])
    return specs[0] if specs else (PARTI if flag == PARTI.flag else None)


def input_flags() -> dict[str, tuple[str, list[str]]]:
    """flag -> (help, the metrics that read it) over every registered metric and protocol, in order."""
    out: dict[str, tuple[str, list[str]]] = {}
    specs = every_input_spec()
    for name in evaluate_metrics():
        for i in metric(name).inputs:
            flag = i.flag if isinstance(i, InputSpec) else i
            spec = i if isinstance(i, InputSpec) else specs[flag][0]
            out.setdefault(flag, (spec.help, []))[1].append(name)
    out[PARTI.flag] = (PARTI.help, [n for n in evaluate_metrics() if "parti" in metric(n).prompt_sets])
    return out


def fill_defaults(a) -> None:
    """Every input flag not given: from its environment variable under ``a.protocol``, else its hub id."""
    for flag in input_flags():
        spec = _spec(a.protocol, flag)
        dest = flag.lstrip("-").replace("-", "_")
        if getattr(a, dest, None) is None:
            setattr(a, dest, (os.environ.get(spec.env) if spec.env else None) or spec.hub)


def download_command(protocol: str, wanted) -> str:
    """The command that fetches the hub inputs of the ``wanted`` metrics under ``protocol``."""
    return f"{DOWNLOAD} metrics={','.join(wanted)}" + (f" protocol={protocol}" if protocol != "lantern" else "")


def input_needs(a, wanted) -> list:
    """The ``Need`` of every input the ``wanted`` metrics read under ``a.protocol`` (``a``: the
    parsed arguments, defaults from the environment already filled in)."""
    proto = PROTOCOLS.get(getattr(a, "protocol", "lantern"))
    needs = [Need("run folder", "give it as the first argument", a.run, "a folder written by python run.py",
                  None, True)]
    specs = [s for name in wanted for s in protocol_inputs(proto, metric(name))]
    if getattr(a, "parti_tsv", None) is not None:
        specs.append(PARTI)
    seen = set()
    for spec in specs:
        if spec.flag in seen:
            continue
        seen.add(spec.flag)
        value = spec.resolve(getattr(a, spec.dest, None))
        if value is None and spec.optional:  # its documented default (this interpreter, a COCO run)
            continue
        if spec.folder and value is not None and not hub.is_hub(value):
            value = snapshot_dir(value)  # a hub cache's model folder: its snapshot
        needs.append(Need(spec.name, spec.flag, value, spec.source, spec.env, spec.folder, spec.contains, spec.fetch))
    return needs


def metric_missing_inputs(a, wanted) -> list[str]:
    """One line per unusable input of the requested metrics, each naming its flag and variable."""
    download = download_command(getattr(a, "protocol", "lantern"), wanted)
    return [p for n in input_needs(a, wanted) if (p := n.problem(download)) is not None]


def use_local_inputs(a, wanted) -> None:
    """Every hub value among the inputs (checked first) replaced by its cached local path."""
    for n in input_needs(a, wanted):
        if hub.is_hub(n.path):
            setattr(a, n.key[2:].replace("-", "_"), str(n.local()))


def choose_device(device) -> tuple[str, str]:
    """(device, why): ``--device`` as given, checked to exist here (``numerics.check_device``: a
    ``ConfigError`` naming the flag and the fix), or the default, cuda when available."""

    if device is not None:
        return check_device(device, "--device"), "--device"
    device = default_device()
    return device, "default: " + ("CUDA is available" if device == "cuda" else "no CUDA on this machine")


def _point(entry: dict) -> tuple[float, float, float]:
    """(value, lo, hi) of a summary entry: a mean with its interval, or FID with its bootstrap interval."""
    return entry.get("mean", entry.get("fid")), entry["lo"], entry["hi"]


def main(argv=None) -> dict:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--include", action="append", default=[])
    plugins.load(pre.parse_known_args(argv)[0].include)  # metrics and protocols from outside the package first
    metrics, protocols = evaluate_metrics(), PROTOCOLS.names()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder (samples.jsonl + images/)")
    ap.add_argument("--metrics", default="clip_score,fid", help=f"comma-separated, of {', '.join(metrics)}")
    ap.add_argument("--protocol", default="lantern", help=f"how CLIP score and FID are computed: {' | '.join(protocols)} "
                    "(coolsd.metrics.protocols)")
    ap.add_argument("--include", action="append", default=[], metavar="PATH",
                    help="register metrics (and protocols) from this file or folder first (docs/add_metric.md)")
    for flag, (text, users) in input_flags().items():
        envs = sorted({e for p in protocols if (e := input_env(p, flag))})
        ap.add_argument(flag, default=None, help=f"{text} [{', '.join('$' + e for e in envs) or 'no variable'}; "
                                                 f"for {', '.join(users)}]")
    ap.add_argument("--cache-dir", type=Path, default=Path("outputs/cache"))
    ap.add_argument("--device", default=None, help="where the metric networks run (default: cuda when "
                    "torch.cuda.is_available(), else cpu); TF32 is off either way (coolsd.metrics.numerics)")
    ap.add_argument("--fid-resamples", type=int, default=100)
    a = ap.parse_args(argv)
    a.device, why = choose_device(a.device)  # before any input is read: a missing CUDA is refused first
    print(f"metrics on {a.device} ({why}), float32 with TF32 off")
    check_protocol(a.protocol)
    proto = PROTOCOLS.get(a.protocol)
    fill_defaults(a)  # the protocol's environment variables, else the hub ids
    wanted = [m.strip() for m in a.metrics.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(metrics))
    if unknown:
        raise ConfigError(f"unknown metric(s) {unknown}; valid: {', '.join(metrics)}")
    if a.parti_tsv is not None:
        if "parti" not in proto.prompt_sets:
            have = [p for p in protocols if "parti" in PROTOCOLS.get(p).prompt_sets]
            raise ConfigError(f"--parti-tsv is a prompt set of --protocol {' / '.join(have)} ({a.protocol} evaluates on "
                              f"COCO only)")
        cannot = [metric(m).header for m in wanted if "parti" not in metric(m).prompt_sets]
        if cannot:
            raise ConfigError(f"no {', '.join(cannot)} on PartiPrompts (no reference images; the SJD papers report only "
                              "CLIP score there): use --metrics clip_score")
    # every missing input at once, the run folder's records and images included, before loading anything
    require_inputs("python -m coolsd.cli.evaluate", metric_missing_inputs(a, wanted) + run_folder_problems(a.run))
    use_local_inputs(a, wanted)
    specs = {s.dest: s for m in wanted for s in protocol_inputs(proto, metric(m))}
    inputs = {d: getattr(a, d) for d in specs}
    scorers = build_scorers(wanted, device=a.device, cache_dir=a.cache_dir, fid_resamples=a.fid_resamples,
                            protocol=a.protocol, **inputs)
    result = evaluate_run(a.run, scorers, protocol=a.protocol, parti_tsv=a.parti_tsv)
    named = {d: (str(v) if v is not None else None if specs[d].default is None else f"default: {specs[d].resolve(v)}")
             for d, v in inputs.items()}
    result["protocol"] = {"name": a.protocol, "metrics": wanted, **named,
                          "prompts": "PartiPrompts " + str(a.parti_tsv) if a.parti_tsv else "COCO 2017 val",
                          "device": a.device, "numerics": metric_numerics(a.device),
                          **{m: proto.description[m] for m in wanted if m in proto.description}}
    write_json_atomic(result, a.run / "metrics.json")
    for tag, r in result["per_method"].items():
        parts = []
        for m in wanted:
            if m in r:
                info, (v, lo, hi) = metric(m), _point(r[m])
                parts.append(f"{info.header} {info.fmt(v)} [{info.fmt(lo)}, {info.fmt(hi)}]")
        print(f"{tag:<14} n={r['n']:<5} " + "  ".join(parts))
    print(f"protocol {a.protocol}; wrote {a.run / 'metrics.json'}")
    return result


if __name__ == "__main__":
    with one_line_errors():
        main()
