"""The image metrics ``python -m coolsd.cli.evaluate`` computes from a finished run's PNGs and
captions (docs/methods.md#6-evaluation-protocol), registered with their facts
(``coolsd.metrics.registry``): CLIP score and FID as the run's protocol computes them
(``coolsd.metrics.protocols``), and the learned preference scores ImageReward and HPSv2
(protocol-independent; each in the interpreter that has its package, ``coolsd.metrics.external``). Each builder loads its
network once; its ``Scorer`` scores chunks of images (or the files) and summarises a method's
images: the mean with its 95% interval over images, FID with its bootstrap interval over the
generated images against the reference statistics.
"""
from __future__ import annotations

import json

import numpy as np

from coolsd.metrics.fid import bootstrap_fid_ci
from coolsd.metrics.hps import HUB_FILE as HPS_HUB, INSTALL as HPS_INSTALL, SOURCE as HPS_SOURCE, HPSv2Scorer
from coolsd.metrics.image_reward import INSTALL, SOURCE as IR_SOURCE, ImageRewardScorer
from coolsd.metrics.inception import FID_RECIPES, InceptionFeatureExtractor
from coolsd.metrics.protocols import PROTOCOLS
from coolsd.metrics.reference import COCO_IMAGES_SOURCE, coco_image_files, reference_statistics
from coolsd.metrics.registry import EvalContext, InputSpec, Scorer, register_metric
from coolsd.util.fingerprint import file_identity
from coolsd.util.stats import POSITIVE

COCO_IMAGES = InputSpec("--coco-images", "COCO val2017/ folder (FID's reference images)", "COCO val2017 images",
                        COCO_IMAGES_SOURCE, "COCO_VAL_IMAGES", folder=True)
_IR_HUB = "hf://THUDM/ImageReward/"
IR_INPUTS = (
    InputSpec("--ir-checkpoint", "ImageReward.pt", "ImageReward checkpoint", IR_SOURCE, "IMAGEREWARD_CKPT",
              hub=_IR_HUB + "ImageReward.pt"),
    InputSpec("--ir-med-config", "med_config.json", "ImageReward med_config", IR_SOURCE, "IMAGEREWARD_MED_CONFIG",
              hub=_IR_HUB + "med_config.json"),
    InputSpec("--ir-python", "interpreter with the image-reward package (default: this one)", "ImageReward interpreter",
              INSTALL, "IMAGEREWARD_PYTHON", optional=True),
)


HPS_INPUTS = (
    InputSpec("--hps-checkpoint", "HPS_v2.1_compressed.pt (HPSv2's weights)", "HPSv2 checkpoint", HPS_SOURCE,
              "HPSV2_CKPT", hub=HPS_HUB),
    InputSpec("--hps-python", "interpreter with the hpsv2 package (default: this one)", "HPSv2 interpreter",
              HPS_INSTALL, "HPSV2_PYTHON", optional=True),
)


class ClipMetric(Scorer):
    """A CLIP scorer of the protocol (``ClipScorer``: raw cosine; ``TorchmetricsClipScorer``: 100 x
    cosine, whose summary also keeps torchmetrics' own value: the mean clamped at 0)."""

    def __init__(self, clip):
        self.clip = clip
        self.protocol = getattr(clip, "protocol", None)

    def score(self, images, captions) -> np.ndarray:
        return self.clip.score(images, captions)

    def summarize(self, values):
        entry, per_sample = super().summarize(values)
        if hasattr(self.clip, "metric"):  # CLIPScore.compute(): the mean of 100 cos, clamped at 0
            entry["torchmetrics_value"] = max(float(values.mean()), 0.0)
        return entry, per_sample


class FidMetric(Scorer):
    """Features of the generated images against the reference statistics ``reference`` =
    (mu, sigma, n): FID with its bootstrap interval over the generated images (at least two)."""

    def __init__(self, extractor, reference, resamples: int = 100):
        self.extractor, self.reference, self.resamples = extractor, reference, resamples
        label = getattr(extractor, "protocol", None)  # the recipe's label, where the extractor has one
        owner = [p for p in PROTOCOLS.names() if FID_RECIPES[PROTOCOLS.get(p).fid_recipe]["label"] == label]
        self.protocol = owner[0] if owner else None

    def score(self, images, captions) -> np.ndarray:
        return self.extractor(images)

    def summarize(self, values):
        if len(values) < 2:
            return None, None
        mu_r, sig_r, n_ref = self.reference
        return {**bootstrap_fid_ci(values, mu_r, sig_r, n_resamples=self.resamples), "n_ref": n_ref}, None


class WorkerMetric(Scorer):
    """A score of every image file and its caption, computed in the interpreter that has the metric's
    package (``coolsd.metrics.external``: ImageReward, HPSv2)."""

    pixels = False

    def __init__(self, scorer):
        self.scorer = scorer

    def score(self, paths, captions) -> np.ndarray:
        return self.scorer.score(paths, captions)


@register_metric("clip_score", higher_is_better=True, label="CLIP", digits=4, pareto=True, inputs=("--clip",))
def build_clip_score(ctx: EvalContext) -> Scorer:
    """CLIP score: cosine of image and caption embeddings, as the protocol computes it (mean over images)."""
    return ClipMetric(ctx.protocol.clip.from_pretrained(ctx.inputs["clip"], device=ctx.device))


@register_metric("fid", higher_is_better=False, label="FID", digits=2, domain=(POSITIVE, 0.0), pareto=True,
                 inputs=("--inception", COCO_IMAGES), prompt_sets=("coco",))
def build_fid(ctx: EvalContext) -> Scorer:
    """FID against COCO val2017 as the protocol computes it (bootstrap interval over the generated images)."""
    recipe = ctx.protocol.fid_recipe
    files = coco_image_files(ctx.inputs["coco_images"])
    extractor = InceptionFeatureExtractor.from_file(ctx.inputs["inception"], device=ctx.device, recipe=recipe)
    weights = json.dumps(file_identity(ctx.inputs["inception"]), sort_keys=True)
    reference = reference_statistics(files, extractor, ctx.cache_dir, weights)
    return FidMetric(extractor, reference, ctx.fid_resamples)


@register_metric("image_reward", higher_is_better=True, label="ImageReward", digits=4, pareto=True, inputs=IR_INPUTS,
                 optional=True)
def build_image_reward(ctx: EvalContext) -> Scorer:
    """ImageReward v1.0: a learned human-preference score of (image, caption) (mean over images)."""
    return WorkerMetric(ImageRewardScorer(ctx.inputs["ir_checkpoint"], ctx.inputs["ir_med_config"],
                                          ctx.inputs.get("ir_python"), device=ctx.device))


@register_metric("hpsv2", higher_is_better=True, label="HPSv2", digits=4, pareto=True, inputs=HPS_INPUTS, optional=True)
def build_hpsv2(ctx: EvalContext) -> Scorer:
    """HPSv2: a learned human-preference score of (image, caption), as the hpsv2 package computes it (mean over images)."""
    return WorkerMetric(HPSv2Scorer(ctx.inputs["hps_checkpoint"], ctx.inputs.get("hps_python"), device=ctx.device))


