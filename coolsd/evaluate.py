"""Image metrics of a finished (or partial) run, from its records and PNGs (METHODS.md 6), so a
metric is added without regenerating:

    python -m coolsd.evaluate outputs/llamagen_xl/coolsd/<time> --metrics clip_score,fid,image_reward

Per method tag of the run: CLIP score (mean [95% CI] over images), ImageReward (same), FID
against the cached statistics of the COCO val2017 reference images (bootstrap interval over the
generated images). Written to ``<run>/metrics.json`` (atomically) with the per-sample scores.
Every input the requested metrics need (the run folder, CLIP folder, Inception weights, COCO
val2017 images, ImageReward files) is checked before any network loads, and every missing one is
listed at once with the flag that sets it and its environment variable (``missing_inputs``).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from coolsd.loading import MissingInputFile
from coolsd.metrics.fid import bootstrap_fid_ci
from coolsd.metrics.image_prep import load_rgb
from coolsd.records import resume_records, write_json_atomic
from coolsd.stats import mean_ci

METRICS = ("clip_score", "fid", "image_reward")


def run_images(run_dir: Path) -> dict[str, list[dict]]:
    """Records with images, by method tag, in prompt order (images checked to exist and decode)."""
    records = resume_records(run_dir)
    if not records:
        raise MissingInputFile(f"{run_dir} holds no records (samples.jsonl); is it a run folder of python run.py?")
    by_tag: dict[str, list[dict]] = {}
    for r in records:
        if "image" in r:
            by_tag.setdefault(r["method"], []).append(r)
    return {t: sorted(rs, key=lambda r: r["prompt_index"]) for t, rs in by_tag.items()}


def evaluate_run(run_dir, *, clip=None, image_reward=None, inception=None, reference=None,
                 fid_resamples: int = 100) -> dict:
    """Metrics of every method tag of a run. ``clip``: a ``ClipScorer``; ``image_reward``: an
    ``ImageRewardScorer``; ``inception`` + ``reference`` = (mu, sigma, n): FID. Each is optional
    (a metric whose scorer is None is not computed)."""
    run_dir = Path(run_dir)
    by_tag = run_images(run_dir)
    out = {"run": str(run_dir), "per_method": {}, "per_sample": {}}
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
            res["clip_score"], samples["clip_score"] = mean_ci(sc), sc.tolist()
        if image_reward is not None:
            sc = image_reward.score(paths, captions)
            res["image_reward"], samples["image_reward"] = mean_ci(sc), sc.tolist()
        if inception is not None:
            mu_r, sig_r, n_ref = reference
            feats = np.concatenate(feats)
            if len(feats) >= 2:
                res["fid"] = {**bootstrap_fid_ci(feats, mu_r, sig_r, n_resamples=fid_resamples), "n_ref": n_ref}
        out["per_method"][tag] = res
        out["per_sample"][tag] = samples
    return out


def build_scorers(metrics, *, clip=None, inception=None, coco_images=None, ir_checkpoint=None, ir_med_config=None,
                  ir_python=None, device="cpu", cache_dir=Path("outputs/cache"), fid_resamples: int = 100) -> dict:
    """The keyword arguments of ``evaluate_run`` for the named metrics, every network loaded (and
    the FID reference statistics computed or read from the cache) once."""
    kw = {"fid_resamples": fid_resamples}
    if "clip_score" in metrics:
        from coolsd.metrics.clip_score import ClipScorer

        kw["clip"] = ClipScorer.from_pretrained(clip, device=device)
    if "image_reward" in metrics:
        from coolsd.metrics.image_reward import ImageRewardScorer

        kw["image_reward"] = ImageRewardScorer(ir_checkpoint, ir_med_config, ir_python, device=device)
    if "fid" in metrics:
        from coolsd.metrics.inception import InceptionFeatureExtractor, default_inception_path
        from coolsd.metrics.reference import coco_image_files, reference_statistics
        from coolsd.worlds.files import file_identity

        files = coco_image_files(coco_images)
        kw["inception"] = InceptionFeatureExtractor.from_file(inception, device=device)
        weights = json.dumps(file_identity(inception or default_inception_path()), sort_keys=True)
        kw["reference"] = reference_statistics(files, kw["inception"], cache_dir, weights)
    return kw


# flag -> (environment variable of its default, help, the input's name in errors, metrics that need it)
INPUT_FLAGS = {
    "--clip": ("CLIP_DIR", "local openai/clip-vit-base-patch32 folder", "CLIP model folder", ("clip_score",)),
    "--inception": ("INCEPTION_WEIGHTS", "weights-inception-2015-12-05-6726825d.pth (default: torch hub cache)",
                    "Inception weights", ("fid",)),
    "--coco-images": ("COCO_VAL_IMAGES", "COCO val2017/ folder (FID's reference images)", "COCO val2017 images", ("fid",)),
    "--ir-checkpoint": ("IMAGEREWARD_CKPT", "ImageReward.pt", "ImageReward checkpoint", ("image_reward",)),
    "--ir-med-config": ("IMAGEREWARD_MED_CONFIG", "med_config.json", "ImageReward med_config", ("image_reward",)),
    "--ir-python": ("IMAGEREWARD_PYTHON", "interpreter with the image-reward package (default: this one)",
                    "ImageReward interpreter", ("image_reward",)),
}


def input_needs(a, wanted) -> list:
    """The ``Need`` of every input the ``wanted`` metrics read (``a``: the parsed arguments)."""
    from coolsd.metrics.clip_score import CLIP_FILES, CLIP_SOURCE, snapshot_dir
    from coolsd.metrics.image_reward import INSTALL, SOURCE as IR_SOURCE
    from coolsd.metrics.inception import WEIGHTS_URL, default_inception_path
    from coolsd.metrics.reference import COCO_IMAGES_SOURCE
    from coolsd.worlds.files import Need

    value = {"--clip": a.clip and snapshot_dir(a.clip), "--inception": a.inception or default_inception_path(),
             "--coco-images": a.coco_images, "--ir-checkpoint": a.ir_checkpoint, "--ir-med-config": a.ir_med_config,
             "--ir-python": a.ir_python}
    kind = {"--clip": (True, CLIP_FILES, CLIP_SOURCE), "--inception": (False, (), WEIGHTS_URL),
            "--coco-images": (True, (), COCO_IMAGES_SOURCE), "--ir-checkpoint": (False, (), IR_SOURCE),
            "--ir-med-config": (False, (), IR_SOURCE), "--ir-python": (False, (), INSTALL)}
    needs = [Need("run folder", "give it as the first argument", a.run, "a folder written by python run.py",
                  None, True)]
    for flag, (env, _, name, metrics) in INPUT_FLAGS.items():
        if set(metrics) & set(wanted) and not (flag == "--ir-python" and value[flag] is None):  # None: this python
            needs.append(Need(name, flag, value[flag], kind[flag][2], env, *kind[flag][:2]))
    return needs


def missing_inputs(a, wanted) -> list[str]:
    """One line per unusable input of the requested metrics, each naming its flag and variable."""
    return [p for n in input_needs(a, wanted) if (p := n.problem()) is not None]


def main(argv=None) -> dict:
    from coolsd.worlds.files import require_inputs

    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder (samples.jsonl + images/)")
    ap.add_argument("--metrics", default="clip_score,fid", help=f"comma-separated, of {', '.join(METRICS)}")
    for flag, (var, text, _, metrics) in INPUT_FLAGS.items():
        ap.add_argument(flag, default=env(var), help=f"{text} [${var}; for {', '.join(metrics)}]")
    ap.add_argument("--cache-dir", type=Path, default=Path("outputs/cache"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fid-resamples", type=int, default=100)
    a = ap.parse_args(argv)
    wanted = [m.strip() for m in a.metrics.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(METRICS))
    if unknown:
        raise SystemExit(f"unknown metric(s) {unknown}; valid: {', '.join(METRICS)}")
    require_inputs("python -m coolsd.evaluate", missing_inputs(a, wanted))  # every missing input at once
    run_images(a.run)  # the run folder's records and images, before loading anything
    kw = build_scorers(wanted, clip=a.clip, inception=a.inception, coco_images=a.coco_images, ir_checkpoint=a.ir_checkpoint,
                       ir_med_config=a.ir_med_config, ir_python=a.ir_python, device=a.device, cache_dir=a.cache_dir,
                       fid_resamples=a.fid_resamples)
    result = evaluate_run(a.run, **kw)
    result["protocol"] = {"metrics": wanted, "clip": a.clip, "inception": str(a.inception or "torch hub cache"),
                          "coco_images": a.coco_images, "image_reward": a.ir_checkpoint}
    write_json_atomic(result, a.run / "metrics.json")
    for tag, r in result["per_method"].items():
        parts = [f"{m} {r[m]['mean']:.4f} [{r[m]['lo']:.4f}, {r[m]['hi']:.4f}]" for m in ("clip_score", "image_reward") if m in r]
        if "fid" in r:
            parts.append(f"FID {r['fid']['fid']:.2f} [{r['fid']['lo']:.2f}, {r['fid']['hi']:.2f}]")
        print(f"{tag:<14} n={r['n']:<5} " + "  ".join(parts))
    print(f"wrote {a.run / 'metrics.json'}")
    return result


if __name__ == "__main__":
    from coolsd.runner import one_line_errors

    with one_line_errors():
        main()
