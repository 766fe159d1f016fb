"""CLIP score as the SJD family reports it (``--protocol sjd``): torchmetrics ``CLIPScore`` with
``openai/clip-vit-base-patch16`` from a local folder, the library computing the number.

``tyshiwo1/Accelerating-T2I-AR-with-SJD:evaluation_metrics.py`` (``evaluate_quantitative_scores_text2img``),
which MC-SJD / GSD follow: each generated PNG is read as uint8, resized to 299x299 by
``torch.nn.functional.interpolate(mode="bilinear", align_corners=False)`` on the uint8 tensor
(on the CPU, batch 1), and passed with its caption to ``CLIPScore.update``. torchmetrics then
runs the HF ``CLIPProcessor`` (PIL bicubic resize of the short side to 224, centre crop 224,
OpenAI mean / std; text padded to the batch's longest caption with an attention mask and cut at
the text model's 77 positions, without re-inserting EOT), and scores ``100 * cos`` of the
projected embeddings; ``compute()`` is ``max(mean, 0)``. No "A photo depicts " prefix, no
LANTERN round trip: those belong to the other protocol (``coolsd.metrics.clip_score``).

Per-sample scores (for the confidence interval) are the summands of ``CLIPScore``'s ``score``
state: the metric is reset and updated with one image at a time (as the SJD script runs it,
batch size 1), so each is exactly torchmetrics' ``100 * cos`` of that pair, unclamped;
``torchmetrics_value`` = ``max(mean, 0)`` is the number ``CLIPScore.compute()`` gives over all
of them (tests/cli/test_eval_protocols.py checks both against one batched ``CLIPScore``).

One shim the project owns: torchmetrics 1.9.0 calls ``.norm`` on ``get_image_features`` /
``get_text_features``, which transformers v5 returns as a ``BaseModelOutputWithPooling`` (its
``pooler_output`` is the projected embedding); ``_ProjectedCLIP`` returns that tensor. Without
torchvision transformers falls back to ``CLIPImageProcessorPil``, the PIL processor transformers
v4 used (the one the SJD runs had).
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from coolsd.metrics.clip_score import _projected, snapshot_dir
from coolsd.metrics.numerics import ieee_fp32
from coolsd.util.loading import MissingInputFile, reading

__all__ = ["SJD_CLIP_HF_REPO", "SJD_CLIP_FILES", "SJD_CLIP_SOURCE", "SJD_RESIZE", "sjd_clip_image", "TorchmetricsClipScorer"]

SJD_CLIP_HF_REPO = "openai/clip-vit-base-patch16"
SJD_CLIP_FILES = ("config.json", ("model.safetensors", "pytorch_model.bin"), "vocab.json", "merges.txt",
                  "preprocessor_config.json")  # a tuple entry: any one of them
SJD_CLIP_SOURCE = f"https://huggingface.co/{SJD_CLIP_HF_REPO} (hf download {SJD_CLIP_HF_REPO} --local-dir <folder>)"
SJD_RESIZE = 299


class _ProjectedCLIP(torch.nn.Module):
    """A ``CLIPModel`` whose ``get_*_features`` return the projected embedding tensor under any
    transformers version (what torchmetrics 1.9 expects), nothing else changed."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip
        self.config = clip.config  # torchmetrics reads text_config.max_position_embeddings

    def get_image_features(self, pixel_values):
        return _projected(self.clip.get_image_features(pixel_values=pixel_values))

    def get_text_features(self, input_ids, attention_mask=None):
        return _projected(self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask))


def sjd_clip_image(img) -> torch.Tensor:
    """uint8 (H, W, 3) -> uint8 (3, 299, 299): the SJD script's bilinear resize of the uint8 tensor
    (torch's uint8 kernel rounds to the nearest integer), before torchmetrics' processor."""
    x = torch.from_numpy(np.array(img))  # a copy: decoded PNGs may be read-only
    if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[2] != 3:
        raise ValueError(f"CLIP images must be uint8 (H, W, 3), got {x.dtype} {tuple(x.shape)}")
    x = x.permute(2, 0, 1)[None].contiguous()
    return F.interpolate(x, size=(SJD_RESIZE, SJD_RESIZE), mode="bilinear", align_corners=False)[0]


class TorchmetricsClipScorer:
    """torchmetrics ``CLIPScore`` on a local CLIP folder; ``score(images, captions)`` -> (n,) float64
    per-pair ``100 * cos`` (the interface of ``ClipScorer``). ``resize``: 299 as the SJD script
    (None: the image as it is, for agreement checks)."""

    scale = "100*cos (torchmetrics CLIPScore)"
    protocol = "sjd"  # coolsd.metrics.protocols

    def __init__(self, model, processor, *, device: str | torch.device = "cpu", resize: int | None = SJD_RESIZE,
                 source: str | None = None):
        from torchmetrics.multimodal.clip_score import CLIPScore

        self.device = torch.device(device)
        self.resize = resize
        self.source = source
        wrapped = _ProjectedCLIP(model.float().eval())
        self.metric = CLIPScore(model_name_or_path=lambda: (wrapped, processor)).to(self.device)

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike, **kwargs) -> "TorchmetricsClipScorer":
        """``CLIPModel`` + ``CLIPProcessor`` from a local folder (``local_files_only``: never the
        network); a missing folder or file is one error naming it and the repo to fetch."""

        d = snapshot_dir(local_dir)
        where = (f"expected a local snapshot of {SJD_CLIP_HF_REPO} (the SJD family's CLIP score): "
                 f"{SJD_CLIP_SOURCE}")
        if not d.is_dir():
            raise MissingInputFile(f"CLIP model folder {str(d)!r} does not exist; {where}")
        missing = [" or ".join(c) if isinstance(c, tuple) else c for c in SJD_CLIP_FILES
                   if not any((d / f).is_file() for f in (c if isinstance(c, tuple) else (c,)))]
        if missing:
            raise MissingInputFile(f"CLIP model folder {str(d)!r} lacks {', '.join(missing)}; {where}")
        import transformers
        from transformers import CLIPModel, CLIPProcessor

        with reading(d, f"a local {SJD_CLIP_HF_REPO} folder", SJD_CLIP_SOURCE):
            model = CLIPModel.from_pretrained(str(d), local_files_only=True)
            verbosity = transformers.logging.get_verbosity()
            transformers.logging.set_verbosity_error()  # the "falling back to CLIPImageProcessorPil" notice
            try:
                processor = CLIPProcessor.from_pretrained(str(d), local_files_only=True)
            finally:
                transformers.logging.set_verbosity(verbosity)
        return cls(model, processor, source=str(d), **kwargs)

    def _image(self, img) -> torch.Tensor:
        if self.resize is None:
            return torch.from_numpy(np.array(img)).permute(2, 0, 1)
        return sjd_clip_image(img)

    def score(self, images, captions: Sequence[str]) -> np.ndarray:
        """(n,) float64 ``100 * cos`` of each uint8 (H, W, 3) image with its caption (pairs by index),
        each the ``score`` state of ``CLIPScore`` after one ``update`` with that pair alone."""
        if isinstance(captions, str):
            raise TypeError("captions must be a sequence of strings, not a single string")
        images = list(images)
        if len(images) != len(captions):
            raise ValueError(f"{len(images)} images but {len(captions)} captions: pairs must match one to one")
        out = np.empty(len(images))
        with torch.inference_mode(), ieee_fp32():  # TF32 off (coolsd.metrics.numerics)
            for i, (img, cap) in enumerate(zip(images, captions)):
                self.metric.reset()
                self.metric.update(self._image(img)[None].to(self.device), [cap])
                out[i] = float(self.metric.score)
        self.metric.reset()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source={self.source!r}, resize={self.resize}, device={self.device})"
