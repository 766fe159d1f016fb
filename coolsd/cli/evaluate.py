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
from coolsd.metrics.clip_score import CLIP_HF_REPO, ClipScorer, snapshot_dir
from coolsd.metrics.clip_torchmetrics import SJD_CLIP_HF_REPO, TorchmetricsClipScorer
from coolsd.metrics.fid import bootstrap_fid_ci
from coolsd.metrics.image_prep import load_rgb
from coolsd.metrics.image_reward import INSTALL, SOURCE as IR_SOURCE, ImageRewardScorer
from coolsd.metrics.inception import FID_PROTOCOLS, InceptionFeatureExtractor, default_inception_path
from coolsd.metrics.numerics import check_device, default_device, metric_numerics
from coolsd.metrics.protocols import (
    DESCRIPTION,
    INPUTS,
    PARTI_SOURCE,
    PROTOCOLS,
    check_parti_captions,
    check_protocol,
    read_parti_prompts,
)
from coolsd.metrics.reference import COCO_IMAGES_SOURCE, coco_image_files, reference_statistics
from coolsd.util import hub
from coolsd.util.errors import ConfigError, InputError
from coolsd.util.records import image_problems, images_mismatch, read_records, write_json_atomic
from coolsd.util.stats import mean_ci
from coolsd.worlds.files import DOWNLOAD, Need, file_identity, require_inputs

METRICS = ("clip_score", "fid", "image_reward")


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


def evaluate_run(run_dir, *, clip=None, image_reward=None, inception=None, reference=None,
                 fid_resamples: int = 100, protocol: str = "lantern", parti_tsv=None) -> dict:
    """Metrics of every method tag of a run. ``clip``: a ``ClipScorer`` (lantern) or
    ``TorchmetricsClipScorer`` (sjd); ``image_reward``: an ``ImageRewardScorer``; ``inception`` +
    ``reference`` = (mu, sigma, n): FID. Each is optional (a metric whose scorer is None is not
    computed). ``protocol`` is recorded with every number; ``parti_tsv``: the run's prompts are
    checked to be that PartiPrompts file's (no FID on PartiPrompts: it has no reference images)."""


    check_protocol(protocol)
    fid_owner = {v["protocol"]: k for k, v in FID_PROTOCOLS.items()}.get(getattr(inception, "protocol", None))
    for what, owner in (("CLIP scorer", getattr(clip, "protocol", None)), ("FID extractor", fid_owner)):
        if owner is not None and owner != protocol:  # the label must be what computed the number
            raise ValueError(f"the {what} computes the {owner!r} protocol, not {protocol!r}; build the scorers "
                             f"with build_scorers(..., protocol={protocol!r})")
    run_dir = Path(run_dir)
    by_tag = run_images(run_dir)
    if parti_tsv is not None:
        if inception is not None:
            raise ValueError("FID on PartiPrompts: it has no reference images (the SJD papers report only CLIP "
                             "score there); use --metrics clip_score")
        check_parti_captions(by_tag, read_parti_prompts(parti_tsv), parti_tsv)
    out = {"run": str(run_dir), "protocol": protocol, "per_method": {}, "per_sample": {}}
    tagged = {"protocol": protocol}
    for tag, recs in by_tag.items():
        paths = [run_dir / r["image"] for r in recs]
        captions = [r["caption"] for r in recs]
        res, samples = {"n": len(recs)}, {"prompt_index": [r["prompt_index"] for r in recs]}
        scores, feats = [], []
        if clip is not None or inception is not None:  # each PNG decoded once, 64 at a time
            for s in range(0, len(paths), 64):
                imgs = [load_rgb(p) for p in paths[s:s + 64]]
                if clip is not None:
                    scores.append(clip.score(imgs, captions[s:s + 64]))
                if inception is not None:
                    feats.append(inception(imgs))
        if clip is not None:
            sc = np.concatenate(scores)
            res["clip_score"], samples["clip_score"] = {**mean_ci(sc), **tagged}, sc.tolist()
            if protocol == "sjd":  # CLIPScore.compute(): the mean of 100 cos, clamped at 0
                res["clip_score"]["torchmetrics_value"] = max(float(sc.mean()), 0.0)
        if image_reward is not None:
            sc = image_reward.score(paths, captions)
            res["image_reward"], samples["image_reward"] = mean_ci(sc), sc.tolist()
        if inception is not None:
            mu_r, sig_r, n_ref = reference
            feats = np.concatenate(feats)
            if len(feats) >= 2:
                res["fid"] = {**bootstrap_fid_ci(feats, mu_r, sig_r, n_resamples=fid_resamples), "n_ref": n_ref,
                              **tagged}
        out["per_method"][tag] = res
        out["per_sample"][tag] = samples
    return out


def build_scorers(metrics, *, clip=None, inception=None, coco_images=None, ir_checkpoint=None, ir_med_config=None,
                  ir_python=None, device=None, cache_dir=Path("outputs/cache"), fid_resamples: int = 100,
                  protocol: str = "lantern") -> dict:
    """The keyword arguments of ``evaluate_run`` for the named metrics under ``protocol``, every
    network loaded (and the FID reference statistics computed or read from the cache) once, on
    ``device`` (None: ``numerics.default_device()``, cuda when available)."""

    device = default_device() if device is None else device
    kw = {"fid_resamples": fid_resamples, "protocol": check_protocol(protocol)}
    if "clip_score" in metrics:
        Scorer = TorchmetricsClipScorer if protocol == "sjd" else ClipScorer

        kw["clip"] = Scorer.from_pretrained(clip, device=device)
    if "image_reward" in metrics:
        kw["image_reward"] = ImageRewardScorer(ir_checkpoint, ir_med_config, ir_python, device=device)
    if "fid" in metrics:
        files = coco_image_files(coco_images)
        kw["inception"] = InceptionFeatureExtractor.from_file(inception, device=device, fid_protocol=protocol)
        path = inception or default_inception_path(FID_PROTOCOLS[protocol]["weights_name"])
        weights = json.dumps(file_identity(path), sort_keys=True)
        kw["reference"] = reference_statistics(files, kw["inception"], cache_dir, weights)
    return kw


# flag -> (help, metrics that need it); the environment variable of its default, the input's name in
# errors and its source depend on the protocol for --clip / --inception (coolsd.metrics.protocols.INPUTS)
INPUT_FLAGS = {
    "--clip": ("local CLIP folder: openai/clip-vit-base-patch32 (lantern) or -patch16 (sjd)", ("clip_score",)),
    "--inception": ("FID Inception weights: weights-inception-2015-12-05-6726825d.pth (lantern) or "
                    "pt_inception-2015-12-05-6726825d.pth (sjd) (default: torch hub cache)", ("fid",)),
    "--coco-images": ("COCO val2017/ folder (FID's reference images)", ("fid",)),
    "--parti-tsv": ("PartiPrompts.tsv: the run was generated on PartiPrompts (sjd; CLIP only)", METRICS),
    "--ir-checkpoint": ("ImageReward.pt", ("image_reward",)),
    "--ir-med-config": ("med_config.json", ("image_reward",)),
    "--ir-python": ("interpreter with the image-reward package (default: this one)", ("image_reward",)),
}
FIXED_INPUTS = {  # flag -> (environment variable, name in errors); the protocol-independent inputs
    "--coco-images": ("COCO_VAL_IMAGES", "COCO val2017 images"), "--parti-tsv": (None, "PartiPrompts TSV"),
    "--ir-checkpoint": ("IMAGEREWARD_CKPT", "ImageReward checkpoint"),
    "--ir-med-config": ("IMAGEREWARD_MED_CONFIG", "ImageReward med_config"),
    "--ir-python": ("IMAGEREWARD_PYTHON", "ImageReward interpreter"),
}


# protocol -> flag -> its default without the flag and its environment variable: the hub id of an
# input that is on the Hugging Face hub (coolsd.util.hub; the others have no default)
_IMAGE_REWARD_HUB = {"--ir-checkpoint": "hf://THUDM/ImageReward/ImageReward.pt",
                     "--ir-med-config": "hf://THUDM/ImageReward/med_config.json"}
HUB_DEFAULTS = {"lantern": {"--clip": f"hf://{CLIP_HF_REPO}", **_IMAGE_REWARD_HUB},
                "sjd": {"--clip": f"hf://{SJD_CLIP_HF_REPO}", **_IMAGE_REWARD_HUB}}
# what a hub CLIP folder is fetched with: config, tokenizer files, one weight format
CLIP_FETCH = ("*.json", "*.txt", ("model.safetensors", "pytorch_model.bin"))


def input_env(protocol: str, flag: str):
    """The environment variable of a flag's default under a protocol (None: none)."""

    return INPUTS[protocol][flag][0] if flag in INPUTS[protocol] else FIXED_INPUTS[flag][0]


def fill_defaults(a) -> None:
    """Every input flag not given: from its environment variable under ``a.protocol``, else its hub id."""
    for flag in INPUT_FLAGS:
        dest, env = flag[2:].replace("-", "_"), input_env(a.protocol, flag)
        if getattr(a, dest, None) is None:
            setattr(a, dest, (os.environ.get(env) if env else None) or HUB_DEFAULTS[a.protocol].get(flag))


def download_command(protocol: str, wanted) -> str:
    """The command that fetches the hub inputs of the ``wanted`` metrics under ``protocol``."""
    return f"{DOWNLOAD} metrics={','.join(wanted)}" + (f" protocol={protocol}" if protocol != "lantern" else "")


def input_needs(a, wanted) -> list:
    """The ``Need`` of every input the ``wanted`` metrics read under ``a.protocol`` (``a``: the
    parsed arguments, defaults from the environment already filled in)."""

    protocol = getattr(a, "protocol", "lantern")
    weights = FID_PROTOCOLS[protocol]["weights_name"]
    clip = a.clip if hub.is_hub(a.clip) else a.clip and snapshot_dir(a.clip)
    value = {"--clip": clip, "--inception": a.inception or default_inception_path(weights),
             "--coco-images": a.coco_images, "--parti-tsv": getattr(a, "parti_tsv", None),
             "--ir-checkpoint": a.ir_checkpoint, "--ir-med-config": a.ir_med_config, "--ir-python": a.ir_python}
    kind = {flag: (folder, contains, source) for flag, (_, _, source, folder, contains) in INPUTS[protocol].items()}
    kind.update({"--coco-images": (True, (), COCO_IMAGES_SOURCE), "--parti-tsv": (False, (), PARTI_SOURCE),
                 "--ir-checkpoint": (False, (), IR_SOURCE), "--ir-med-config": (False, (), IR_SOURCE),
                 "--ir-python": (False, (), INSTALL)})
    needs = [Need("run folder", "give it as the first argument", a.run, "a folder written by python run.py",
                  None, True)]
    for flag, (_, metrics) in INPUT_FLAGS.items():
        if flag in ("--ir-python", "--parti-tsv") and value[flag] is None:  # None: this python / a COCO run
            continue
        if set(metrics) & set(wanted):
            name = INPUTS[protocol][flag][1] if flag in INPUTS[protocol] else FIXED_INPUTS[flag][1]
            needs.append(Need(name, flag, value[flag], kind[flag][2], input_env(protocol, flag), *kind[flag][:2],
                              CLIP_FETCH if flag == "--clip" else ()))
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder (samples.jsonl + images/)")
    ap.add_argument("--metrics", default="clip_score,fid", help=f"comma-separated, of {', '.join(METRICS)}")
    ap.add_argument("--protocol", default="lantern", help=f"how CLIP score and FID are computed: {' | '.join(PROTOCOLS)} "
                    "(coolsd.metrics.protocols)")
    for flag, (text, metrics) in INPUT_FLAGS.items():
        envs = sorted({e for p in PROTOCOLS if (e := input_env(p, flag))})
        ap.add_argument(flag, default=None, help=f"{text} [{', '.join('$' + e for e in envs) or 'no variable'}; "
                                                 f"for {', '.join(metrics)}]")
    ap.add_argument("--cache-dir", type=Path, default=Path("outputs/cache"))
    ap.add_argument("--device", default=None, help="where the metric networks run (default: cuda when "
                    "torch.cuda.is_available(), else cpu); TF32 is off either way (coolsd.metrics.numerics)")
    ap.add_argument("--fid-resamples", type=int, default=100)
    a = ap.parse_args(argv)
    a.device, why = choose_device(a.device)  # before any input is read: a missing CUDA is refused first
    print(f"metrics on {a.device} ({why}), float32 with TF32 off")
    check_protocol(a.protocol)
    fill_defaults(a)  # the protocol's environment variables, else the hub ids
    wanted = [m.strip() for m in a.metrics.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(METRICS))
    if unknown:
        raise ConfigError(f"unknown metric(s) {unknown}; valid: {', '.join(METRICS)}")
    if a.parti_tsv is not None and a.protocol != "sjd":
        raise ConfigError("--parti-tsv is a prompt set of --protocol sjd (LANTERN / COOL-SD evaluate on COCO only)")
    if a.parti_tsv is not None and "fid" in wanted:
        raise ConfigError("no FID on PartiPrompts (no reference images; the SJD papers report only CLIP score there): "
                         "use --metrics clip_score")
    # every missing input at once, the run folder's records and images included, before loading anything
    require_inputs("python -m coolsd.cli.evaluate", metric_missing_inputs(a, wanted) + run_folder_problems(a.run))
    use_local_inputs(a, wanted)
    kw = build_scorers(wanted, clip=a.clip, inception=a.inception, coco_images=a.coco_images, ir_checkpoint=a.ir_checkpoint,
                       ir_med_config=a.ir_med_config, ir_python=a.ir_python, device=a.device, cache_dir=a.cache_dir,
                       fid_resamples=a.fid_resamples, protocol=a.protocol)
    result = evaluate_run(a.run, parti_tsv=a.parti_tsv, **kw)
    result["protocol"] = {"name": a.protocol, "metrics": wanted, "clip": a.clip,
                          "inception": str(a.inception or "torch hub cache"), "coco_images": a.coco_images,
                          "prompts": "PartiPrompts " + str(a.parti_tsv) if a.parti_tsv else "COCO 2017 val",
                          "image_reward": a.ir_checkpoint, "device": a.device,
                          "numerics": metric_numerics(a.device),
                          **{m: DESCRIPTION[a.protocol][m] for m in ("clip_score", "fid") if m in wanted}}
    write_json_atomic(result, a.run / "metrics.json")
    for tag, r in result["per_method"].items():
        parts = [f"{m} {r[m]['mean']:.4f} [{r[m]['lo']:.4f}, {r[m]['hi']:.4f}]" for m in ("clip_score", "image_reward")
                 if m in r]
        if "fid" in r:
            parts.append(f"FID {r['fid']['fid']:.2f} [{r['fid']['lo']:.2f}, {r['fid']['hi']:.2f}]")
        print(f"{tag:<14} n={r['n']:<5} " + "  ".join(parts))
    print(f"protocol {a.protocol}; wrote {a.run / 'metrics.json'}")
    return result


if __name__ == "__main__":
    with one_line_errors():
        main()
