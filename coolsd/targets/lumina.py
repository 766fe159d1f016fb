"""Lumina-mGPT 7B (768 px) from the official local files (``target=lumina_mgpt``).

Assembles ``coolsd.models.lumina.load_lumina_target`` (Chameleon backbone + VQGAN decoder,
image-code vocabulary, adapter-inserted structural tokens) with Chameleon's text tokenizer and
the prompt template, as a world for the generation job (``coolsd.job``). Every file is checked
before anything is loaded. Drafting: ``draft=self`` (the target drafts for itself) or model-free
methods (``ar``, ``sjd``); an EAGLE head for Lumina (1D RoPE, 4096 wide) is not available here:
LANTERN released none, and training one needs the target on a GPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from coolsd.decoding.lantern import neighbours_from_codebook
from coolsd.models.lumina import LuminaTarget, load_lumina_target, prompt_ids
from coolsd.targets.files import DTYPES, file_identity, missing_paths

SOURCES = {
    "model": "https://huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768 (config.json, model-*.safetensors, index)",
    "vqgan": "Meta's Chameleon tokenizer files, tokenizer/vqgan.ckpt (also in huggingface.co/GAIR/Anole-7b-v0.1)",
    "text_tokenizer": "Meta's Chameleon tokenizer files, tokenizer/text_tokenizer.json (also in GAIR/Anole-7b-v0.1)",
}


def missing_files(target_cfg, draft_cfg=None) -> list[str]:
    out = missing_paths(dict(target_cfg.get("files") or {}), SOURCES)
    if draft_cfg is not None and draft_cfg.get("kind") == "eagle":
        out.append("drafter: no EAGLE head for Lumina-mGPT is available (use draft=self, or method=ar / sjd)")
    return out


class TextPrompts:
    """``encode(captions) -> [prompt ids]``: BOS + Chameleon BPE of Lumina's template (the
    ``<reserved08706>`` separator included), as ``LuminaTarget.begin`` takes them."""

    def __init__(self, tokenizer, width: int, height: int):
        self.tok, self.width, self.height = tokenizer, width, height
        self.bos = tokenizer.token_to_id("<s>")
        if self.bos is None:
            raise ValueError("the text tokenizer has no <s> (BOS) token; expected Chameleon's text_tokenizer.json")

    def encode(self, captions) -> list[list[int]]:
        enc = lambda s: self.tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        return [prompt_ids(enc, c, self.width, self.height, self.bos) for c in captions]


class Pixels:
    """``decode_uint8`` over the target's VQGAN decoder: [0, 1] floats -> uint8 (B, H, W, 3)."""

    def __init__(self, target: LuminaTarget):
        self.target = target

    @torch.no_grad()
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        x = self.target.decode(tokens).float()
        return (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


@dataclass
class LuminaWorld:
    lumina: LuminaTarget
    encoder: Any
    draft_kind: str = "self"
    manifest: dict = field(default_factory=dict)
    drafter_target: Optional[LuminaTarget] = None

    def __post_init__(self):
        self.gpt = self.lumina.model
        self.vq = Pixels(self.lumina)
        codebook = getattr(self.lumina.decoder, "codebook", None)
        self.neighbours = None if codebook is None else neighbours_from_codebook(codebook.detach().float())

    def target(self) -> LuminaTarget:
        return self.lumina

    def drafter(self):
        if self.drafter_target is None:
            raise ValueError("this method drafts with a model; for Lumina-mGPT use draft=self")
        return self.drafter_target


def load_lumina_world(name: str, target_cfg, draft_cfg, device: str = "cuda") -> LuminaWorld:
    missing = missing_files(target_cfg, draft_cfg)
    if missing:
        raise FileNotFoundError(f"target {name!r} cannot run: missing files\n  " + "\n  ".join(missing))
    from tokenizers import Tokenizer

    from coolsd.models.chameleon_vq import CHAMELEON_VQGAN, VQConfig

    f, size = target_cfg.files, int(target_cfg.image_size)
    vq_cfg = target_cfg.get("vq_config")
    vq_cfg = VQConfig(**{k: tuple(v) if k in ("ch_mult", "attn_resolutions") else v for k, v in vq_cfg.items()}) \
        if vq_cfg else CHAMELEON_VQGAN
    if size % (2 * vq_cfg.downsample):
        raise ValueError(f"image_size {size} must be a multiple of {2 * vq_cfg.downsample} (whole 2x2-token grid cells)")
    latent = size // vq_cfg.downsample  # 48 at 768 px
    kw = dict(h_latent=latent, w_latent=latent, cfg_scale=float(target_cfg.cfg_scale), vq_config=vq_cfg,
              dtype=DTYPES[target_cfg.get("dtype", "bfloat16")], device=device)
    target = load_lumina_target(f.model, f.vqgan, **kw)
    encoder = TextPrompts(Tokenizer.from_file(os.fspath(f.text_tokenizer)), size, size)
    kind = draft_cfg.get("kind", "self") if draft_cfg is not None else "none"
    drafter = None
    if kind == "self":  # a second target over the same weights: its own caches
        drafter = LuminaTarget(target.model, target.vocab, h_latent=latent, w_latent=latent,
                               cfg_scale=target.cfg_scale, tokens=target.tokens)
    manifest = {k: file_identity(v) for k, v in f.items()}
    return LuminaWorld(target, encoder, draft_kind=kind, manifest=manifest, drafter_target=drafter)
