"""CLIP score as LANTERN / COOL-SD compute it (``jadohu/LANTERN:entrypoints/eval_fid_clip.py``,
``compute_clip_score``), re-implemented with Hugging Face ``CLIPModel`` from a local folder
(``openai/clip-vit-base-patch32``, the HF port of OpenAI's ViT-B/32).

Per (generated image, caption) pair the score is the **raw cosine similarity** of CLIP's
projected image and text embeddings (not x100, not clipped at 0, not x2.5); the reported number
is the mean over pairs (``clip_score_summary``: mean with a 95% t interval).

Image path (uint8 (H, W, 3) pixels, i.e. ``Image.open(p).convert("RGB")``):

1. LANTERN's ``EvalDataset`` (``lantern_roundtrip=True``, the default): centre crop to the short
   side with round-half-even offsets, LANCZOS to 256x256 (``image_prep.lantern_transform``), then
   ``ToTensor`` + ``Normalize(0.5, 0.5)`` and back through ``tensor2pil``:
   ``((x + 1) * 127.5).clamp(0, 255).to(uint8)``, a truncating cast that maps pixel values
   1..63 to v - 1 (``tensor2pil_roundtrip``).
2. OpenAI ``clip`` ``_transform(224)``: PIL BICUBIC resize of the short side to 224 (long side
   ``int(224 * long / short)``), centre crop 224 (round-half-even), /255, normalise with the
   OpenAI mean/std (``clip_image_preprocess``; HF's image processor crops with floor offsets,
   which differs when the excess is 3 mod 4, so it is not used).

Text path: OpenAI ``clip.tokenize(caption, truncate=True)`` (SOT + BPE + EOT, at most 77 tokens,
EOT forced last when cut), then the prefix ``"A photo depicts "`` is spliced in as the literal
slice ``tokenize(prefix)[1:4]`` right after SOT, the row cut to 77 and its last token forced to
EOT if non-zero (``splice_prefix``). Rows are zero-padded to 77 and run without an attention
mask, as OpenAI's ``encode_text`` does (the causal mask makes padding irrelevant to the pooled
EOT state).

Differences from LANTERN's numbers that remain: LANTERN runs OpenAI's fp16 weights on CUDA (so
its embeddings, cosines and mean are fp16, quantised to ~2.4e-4); we run the fp32 HF weights.
HF's ``CLIPTokenizer`` has no ftfy / html.unescape step (irrelevant for plain-ASCII COCO
captions). Compare with LANTERN at about 3 decimals.

Why ours and not a library's: no maintained library computes this protocol. torchmetrics'
``CLIPScore`` (the other protocol, ``coolsd.metrics.clip_torchmetrics``) agrees with our cosine
x100 to ~1e-5 where the steps coincide (no prefix, no round trip, square images; shown in
tests/cli/test_eval_protocols.py), but it has no prefix splice, crops with HF's floor offsets, feeds
an attention mask and cuts long captions without re-inserting EOT, reports ``max(100 mean, 0)``,
and ships no LANTERN round trip; OpenAI's ``clip`` package (``clip-anytorch``) would need its
own JIT / pickle checkpoint and setuptools<70. The scorer here is therefore the LANTERN
protocol's only implementation, with the HF weights.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from coolsd.metrics.image_prep import lantern_transform
from coolsd.metrics.numerics import ieee_fp32
from coolsd.util.loading import MissingInputFile, reading
from coolsd.util.stats import mean_ci

__all__ = [
    "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "CLIP_PREFIX", "CLIP_CONTEXT_LENGTH", "CLIP_HF_REPO",
    "tensor2pil_roundtrip", "clip_image_preprocess", "splice_prefix", "clip_scores_from_embeddings",
    "clip_score_summary", "ClipScorer",
]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CLIP_PREFIX = "A photo depicts "
CLIP_CONTEXT_LENGTH = 77
CLIP_HF_REPO = "openai/clip-vit-base-patch32"

_MEAN32 = np.asarray(OPENAI_CLIP_MEAN, np.float32)
_STD32 = np.asarray(OPENAI_CLIP_STD, np.float32)


# ---- image path ---------------------------------------------------------------------------
def _check_uint8_hwc3(img, what: str) -> np.ndarray:
    if isinstance(img, torch.Tensor):
        img = img.detach().cpu().numpy()
    img = np.asarray(img)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"{what} expects a uint8 (H, W, 3) image, got shape {img.shape}")
    if img.dtype != np.uint8:
        raise ValueError(f"{what} expects uint8 pixels, got {img.dtype}")
    return np.ascontiguousarray(img)


def tensor2pil_roundtrip(img) -> np.ndarray:
    """LANTERN's uint8 -> tensor -> uint8 round trip (``ToTensor``, ``Normalize(0.5, 0.5)``,
    ``tensor2pil``), in float32 exactly as torch does it: ``x = v / 255``, ``y = (x - 0.5) / 0.5``,
    ``((y + 1) * 127.5).clamp(0, 255)`` cast to uint8 by truncation. Values 1..63 come back as
    v - 1 (float32 rounding lands just below the integer); 0 and 64..255 are unchanged."""
    v = np.asarray(img)
    if v.dtype != np.uint8:
        raise ValueError(f"tensor2pil_roundtrip expects uint8 pixels, got {v.dtype}")
    x = v.astype(np.float32) / np.float32(255.0)
    y = (x - np.float32(0.5)) / np.float32(0.5)
    z = (y + np.float32(1.0)) * np.float32(127.5)
    return np.clip(z, np.float32(0.0), np.float32(255.0)).astype(np.uint8)


def clip_image_preprocess(img, size: int = 224, lantern_roundtrip: bool = True) -> np.ndarray:
    """uint8 (H, W, 3) -> float32 (3, size, size): OpenAI CLIP's ``_transform(size)`` in PIL/numpy.

    With ``lantern_roundtrip`` (default, LANTERN's evaluation), the image first goes through
    LANTERN's ``EvalDataset`` + ``tensor2pil``: centre crop to the short side (round-half-even),
    LANCZOS 256x256, and the truncating uint8 round trip (``tensor2pil_roundtrip``).

    Then: PIL BICUBIC resize with the short side to ``size`` and the long side
    ``int(size * long / short)`` (skipped when already that size, as torchvision does), centre
    crop ``size`` x ``size`` at offsets ``int(round((L - size) / 2))`` (half to even), /255 and
    ``(x - mean) / std`` with the OpenAI mean/std, all in float32."""
    arr = _check_uint8_hwc3(img, "clip_image_preprocess")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if lantern_roundtrip:
        arr = tensor2pil_roundtrip(lantern_transform(arr))
    pil = Image.fromarray(arr, "RGB")
    w, h = pil.size
    short, long = (w, h) if w <= h else (h, w)
    new_long = int(size * long / short)
    new_w, new_h = (size, new_long) if w <= h else (new_long, size)
    if (new_w, new_h) != (w, h):
        pil = pil.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = int(round((new_w - size) / 2.0)), int(round((new_h - size) / 2.0))
    if (left, top, size, size) != (0, 0, new_w, new_h):
        pil = pil.crop((left, top, left + size, top + size))
    x = np.asarray(pil, dtype=np.uint8).astype(np.float32) / np.float32(255.0)
    x = (x - _MEAN32) / _STD32
    return np.ascontiguousarray(x.transpose(2, 0, 1))


# ---- text path ----------------------------------------------------------------------------
def splice_prefix(caption_ids: Sequence[int], prefix_ids: Sequence[int], sot: int, eot: int,
                  max_len: int = CLIP_CONTEXT_LENGTH) -> list[int]:
    """LANTERN's prefix splice on one tokenised caption (ids starting with SOT, unpadded):
        new = ([SOT] + prefix_ids + caption_ids[1:])[:max_len]
        if len(new) == max_len and new[-1] > 0: new[-1] = EOT

    LANTERN does this on zero-padded 77-token rows (``cat([tok[:, :1], prefix, tok[:, 1:]])[:, :77]``,
    last column set to 49407 where > 0), so a sequence cut at 77 ends in EOT, except in the
    (literal, practically unreachable) case where the token left at position 76 has id 0
    (``!`` in CLIP's vocabulary), which LANTERN leaves in place. ``prefix_ids`` is
    ``tokenize(prefix)[1:4]`` in LANTERN (a literal 3-token slice). Whether ``caption_ids`` was
    already cut to 77 does not matter: the splice only keeps its first ``max_len - 1 - len(prefix)``
    tokens after SOT."""
    ids = [int(t) for t in caption_ids]
    if not ids or ids[0] != sot:
        raise ValueError(f"caption_ids must start with the SOT token {sot}, got {ids[:3]}...")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2, got {max_len}")
    new = ([ids[0]] + [int(t) for t in prefix_ids] + ids[1:])[:max_len]
    if len(new) == max_len and new[-1] > 0:
        new[-1] = eot
    return new


# ---- score ----------------------------------------------------------------------------------
def _as_2d_float64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"{name} must be (n, d), got shape {x.shape}")
    return x


def clip_scores_from_embeddings(image_emb, text_emb, eps: float = 1e-8) -> np.ndarray:
    """(n,) raw cosine similarity of paired (n, d) image and text embeddings, in float64, with
    ``torch.nn.functional.cosine_similarity``'s convention (each norm clamped below at ``eps``,
    so a zero vector scores 0)."""
    a, b = _as_2d_float64(image_emb, "image_emb"), _as_2d_float64(text_emb, "text_emb")
    if a.shape != b.shape:
        raise ValueError(f"image_emb {a.shape} and text_emb {b.shape} must have the same shape")
    na = np.maximum(np.linalg.norm(a, axis=1), eps)
    nb = np.maximum(np.linalg.norm(b, axis=1), eps)
    return np.einsum("nd,nd->n", a / na[:, None], b / nb[:, None])


def clip_score_summary(scores, level: float = 0.95) -> dict:
    """The reported CLIP score: mean of the per-pair cosines with a Student-t interval
    (``coolsd.util.stats.mean_ci``)."""
    return mean_ci(scores, level)


# ---- model ----------------------------------------------------------------------------------
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json")


CLIP_FILES = ("config.json", _WEIGHT_FILES, "vocab.json", "merges.txt")  # a tuple entry: any one of them
CLIP_SOURCE = f"https://huggingface.co/{CLIP_HF_REPO} (hf download {CLIP_HF_REPO} --local-dir <folder>)"


def snapshot_dir(local_dir) -> Path:
    """The folder itself, or for an HF cache entry (``models--openai--clip-vit-base-patch32``)
    the snapshot that ``refs/main`` points to (nothing checked)."""
    d = Path(os.path.expanduser(str(local_dir)))
    ref = d / "refs" / "main"
    if ref.is_file() and (d / "snapshots").is_dir():
        d = d / "snapshots" / ref.read_text().strip()
    return d


def _resolve_model_dir(local_dir) -> Path:
    """``snapshot_dir``, checked to hold ``CLIP_FILES``: else FileNotFoundError naming what is missing."""
    d = snapshot_dir(local_dir)
    where = (f"Expected a local snapshot of the Hugging Face repo {CLIP_HF_REPO} (the HF port of "
             f"OpenAI's ViT-B/32 used by LANTERN's CLIP score) with config.json, model.safetensors "
             f"or pytorch_model.bin, vocab.json and merges.txt; fetch it on a machine with internet, "
             f"e.g. `hf download {CLIP_HF_REPO} --local-dir <folder>`, and copy the folder here.")

    if not d.is_dir():
        raise MissingInputFile(f"CLIP model folder {str(d)!r} does not exist. {where}")
    missing = [" or ".join(c[:2]) if isinstance(c, tuple) else c for c in CLIP_FILES
               if not any((d / f).is_file() for f in (c if isinstance(c, tuple) else (c,)))]
    if missing:
        raise MissingInputFile(f"CLIP model folder {str(d)!r} lacks {', '.join(missing)}. {where}")
    return d


def _projected(out) -> torch.Tensor:
    """transformers v4 ``get_*_features`` return the projected embedding as a tensor; v5 returns
    a ``BaseModelOutputWithPooling`` whose ``pooler_output`` is the projected embedding."""
    if isinstance(out, torch.Tensor):
        return out
    pooled = getattr(out, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return pooled
    raise TypeError(f"unexpected CLIP feature output {type(out).__name__}: no tensor / pooler_output")


class ClipScorer:
    """LANTERN's CLIP score with a Hugging Face ``CLIPModel`` + ``CLIPTokenizer``.

    ``embed_images`` / ``embed_texts`` give the projected (not normalised) float32 embeddings;
    ``score`` gives the per-pair raw cosines (float64). The model runs in eval mode under
    ``torch.inference_mode`` with TF32 off (``numerics.ieee_fp32``); images are preprocessed
    one at a time (``clip_image_preprocess``) and text rows are always padded to 77, so results
    do not depend on ``batch_size`` beyond float kernel rounding (~1e-7).
    """

    protocol = "lantern"  # coolsd.metrics.protocols: the number this scorer's scores make

    def __init__(self, model, tokenizer, *, device: str | torch.device = "cpu", batch_size: int = 64,
                 lantern_roundtrip: bool = True, prefix: str | None = CLIP_PREFIX,
                 context_length: int = CLIP_CONTEXT_LENGTH, source: str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.model = model.float().to(self.device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.lantern_roundtrip = lantern_roundtrip
        self.context_length = context_length
        self.source = source
        cfg = model.config
        self.image_size = int(cfg.vision_config.image_size)
        self.embed_dim = int(cfg.projection_dim)
        self.sot = self._special_id("bos_token", "<|startoftext|>")
        self.eot = self._special_id("eos_token", "<|endoftext|>")
        self.prefix = prefix
        # LANTERN: clip.tokenize("A photo depicts ")[:, 1:4], a literal slice (3 tokens for CLIP's BPE).
        self.prefix_ids = [] if prefix is None else list(self._encode([prefix])[0][1:4])

    def _special_id(self, attr: str, default: str) -> int:
        tok = getattr(self.tokenizer, attr, None) or default
        i = self.tokenizer.convert_tokens_to_ids(tok)
        if i is None or (isinstance(i, int) and i < 0):
            raise ValueError(f"tokenizer has no id for {attr} {tok!r}")
        return int(i)

    @classmethod
    def from_pretrained(cls, local_dir: str | os.PathLike, **kwargs) -> "ClipScorer":
        """Load ``CLIPModel`` and ``CLIPTokenizer`` from a local folder (never the network:
        ``local_files_only=True``); ``kwargs`` go to ``ClipScorer(...)``. A missing folder or file
        raises FileNotFoundError saying what is expected and where it comes from."""

        d = _resolve_model_dir(local_dir)
        from transformers import CLIPModel, CLIPTokenizer  # lazy: importing transformers takes seconds

        with reading(d, f"a local {CLIP_HF_REPO} folder", f"https://huggingface.co/{CLIP_HF_REPO}"):
            model = CLIPModel.from_pretrained(str(d), local_files_only=True)
            tokenizer = CLIPTokenizer.from_pretrained(str(d), local_files_only=True)
        return cls(model, tokenizer, source=str(d), **kwargs)

    # -- text --
    def _encode(self, captions: Sequence[str]) -> list[list[int]]:
        enc = self.tokenizer(list(captions), truncation=True, max_length=self.context_length)
        return [list(map(int, ids)) for ids in enc["input_ids"]]

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """(n, 77) int64 token rows as LANTERN feeds ``encode_text``: tokenised with truncation
        at 77, prefix spliced after SOT (``splice_prefix``), zero-padded to 77."""
        if isinstance(captions, str):
            raise TypeError("captions must be a sequence of strings, not a single string")
        rows = torch.zeros(len(captions), self.context_length, dtype=torch.long)
        for i, ids in enumerate(self._encode(captions) if len(captions) else []):
            if ids[0] != self.sot:
                raise ValueError(f"tokenizer did not start caption {i} with SOT {self.sot}: {ids[:3]}")
            if self.prefix is not None:
                ids = splice_prefix(ids, self.prefix_ids, self.sot, self.eot, self.context_length)
            rows[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        return rows

    def embed_texts(self, captions: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """(n, projection_dim) float32 projected text embeddings of ``captions``."""
        tokens = self.tokenize(captions)
        bs = self.batch_size if batch_size is None else max(int(batch_size), 1)
        out = [np.zeros((0, self.embed_dim), np.float32)]
        with torch.inference_mode(), ieee_fp32():
            for s in range(0, len(tokens), bs):
                e = _projected(self.model.get_text_features(input_ids=tokens[s:s + bs].to(self.device)))
                out.append(e.float().cpu().numpy())
        return np.concatenate(out)

    # -- images --
    def preprocess(self, images) -> torch.Tensor:
        """(n, 3, S, S) float32 pixel values (S = the model's image size) of uint8 images."""
        imgs = self._image_list(images)
        if not imgs:
            return torch.zeros(0, 3, self.image_size, self.image_size)
        return torch.from_numpy(np.stack([clip_image_preprocess(im, self.image_size, self.lantern_roundtrip)
                                          for im in imgs]))

    @staticmethod
    def _image_list(images) -> list:
        if isinstance(images, torch.Tensor):
            images = images.detach().cpu().numpy()
        if isinstance(images, np.ndarray):
            if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
                raise ValueError(f"images must be uint8 (n, H, W, 3), got {images.dtype} {images.shape}")
            return list(images)
        return list(images)  # a sequence of uint8 (H, W, 3) arrays (sizes may differ)

    def embed_images(self, images, batch_size: int | None = None) -> np.ndarray:
        """(n, projection_dim) float32 projected image embeddings of uint8 (n, H, W, 3) images
        (or a sequence of uint8 (H, W, 3) arrays)."""
        imgs = self._image_list(images)
        bs = self.batch_size if batch_size is None else max(int(batch_size), 1)
        out = [np.zeros((0, self.embed_dim), np.float32)]
        with torch.inference_mode(), ieee_fp32():
            for s in range(0, len(imgs), bs):
                px = self.preprocess(imgs[s:s + bs]).to(self.device)
                out.append(_projected(self.model.get_image_features(pixel_values=px)).float().cpu().numpy())
        return np.concatenate(out)

    # -- score --
    def score(self, images, captions: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """(n,) float64 raw cosine similarity of each image with its caption (pairs by index)."""
        imgs = self._image_list(images)
        if isinstance(captions, str):
            raise TypeError("captions must be a sequence of strings, not a single string")
        if len(imgs) != len(captions):
            raise ValueError(f"{len(imgs)} images but {len(captions)} captions: pairs must match one to one")
        return clip_scores_from_embeddings(self.embed_images(imgs, batch_size),
                                           self.embed_texts(captions, batch_size))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(source={self.source!r}, image_size={self.image_size}, "
                f"embed_dim={self.embed_dim}, prefix={self.prefix!r}, lantern_roundtrip={self.lantern_roundtrip}, "
                f"batch_size={self.batch_size}, device={self.device})")
