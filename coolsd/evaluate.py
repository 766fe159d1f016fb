"""Image metrics of a finished (or partial) run, from its records and PNGs (METHODS.md 6), so a
metric is added without regenerating:

    python -m coolsd.evaluate outputs/llamagen_xl/coolsd/<time> --metrics clip_score,fid,image_reward

Per method tag of the run: CLIP score (mean [95% CI] over images), ImageReward (same), FID
against the cached statistics of the COCO val2017 reference images (bootstrap interval over the
generated images). Written to ``<run>/metrics.json`` (atomically) with the per-sample scores.
Every weight file, model folder and image is checked before any work starts.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from coolsd.metrics.fid import bootstrap_fid_ci
from coolsd.metrics.image_prep import load_rgb
from coolsd.records import resume_records, write_json_atomic
from coolsd.stats import mean_ci

METRICS = ("clip_score", "fid", "image_reward")


def run_images(run_dir: Path) -> dict[str, list[dict]]:
    """Records with images, by method tag, in prompt order (images checked to exist and decode)."""
    records = resume_records(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir} holds no records (samples.jsonl); is it a run folder?")
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


def main(argv=None) -> dict:
    env = os.environ.get
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder (samples.jsonl + images/)")
    ap.add_argument("--metrics", default="clip_score,fid", help=f"comma-separated, of {', '.join(METRICS)}")
    ap.add_argument("--clip", default=env("CLIP_DIR"), help="local openai/clip-vit-base-patch32 folder [$CLIP_DIR]")
    ap.add_argument("--inception", default=env("INCEPTION_WEIGHTS"),
                    help="weights-inception-2015-12-05-6726825d.pth [$INCEPTION_WEIGHTS; default: torch hub cache]")
    ap.add_argument("--coco-images", default=env("COCO_VAL_IMAGES"), help="COCO val2017/ folder [$COCO_VAL_IMAGES]")
    ap.add_argument("--ir-checkpoint", default=env("IMAGEREWARD_CKPT"), help="ImageReward.pt [$IMAGEREWARD_CKPT]")
    ap.add_argument("--ir-med-config", default=env("IMAGEREWARD_MED_CONFIG"), help="med_config.json [$IMAGEREWARD_MED_CONFIG]")
    ap.add_argument("--ir-python", default=env("IMAGEREWARD_PYTHON"),
                    help="interpreter with the image-reward package [$IMAGEREWARD_PYTHON; default: this one]")
    ap.add_argument("--cache-dir", type=Path, default=Path("outputs/cache"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fid-resamples", type=int, default=100)
    a = ap.parse_args(argv)
    wanted = [m.strip() for m in a.metrics.split(",") if m.strip()]
    unknown = sorted(set(wanted) - set(METRICS))
    if unknown:
        raise SystemExit(f"unknown metric(s) {unknown}; valid: {', '.join(METRICS)}")
    run_images(a.run)  # the run folder and its images, before loading anything
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
    main()
