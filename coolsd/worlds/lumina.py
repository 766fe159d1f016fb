"""``target=lumina_mgpt``: Lumina-mGPT 7B (768 px) from the official local files.

``coolsd.models.lumina.load_lumina_target`` (Chameleon backbone + VQGAN decoder, image-code
vocabulary, adapter-inserted structural tokens) with Chameleon's text tokenizer and the prompt
template. Every file is checked before anything is loaded. Drafting: ``draft=self`` (the target
drafts for itself) or model-free methods (``ar``, ``sjd``); an EAGLE head for Lumina (1D RoPE,
4096 wide) is not available here: LANTERN released none, and training one needs the target on a
GPU.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from coolsd.decoding.lantern import neighbours_from_codebook
from coolsd.drafting import SamplingConfig
from coolsd.loading import reading
from coolsd.models.lumina import LuminaTarget, load_lumina_target, prompt_ids
from coolsd.worlds.base import DiscreteWorld, draft_kind
from coolsd.worlds.files import DTYPES, config_need, file_identity, missing_inputs
from coolsd.worlds.llamagen import REAL_TARGET_HINT

SOURCES = {
    "model": "https://huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768 (config.json, model-*.safetensors, index)",
    "vqgan": "Meta's Chameleon tokenizer files, tokenizer/vqgan.ckpt (also in huggingface.co/GAIR/Anole-7b-v0.1)",
    "text_tokenizer": "Meta's Chameleon tokenizer files, tokenizer/text_tokenizer.json (also in GAIR/Anole-7b-v0.1)",
}


class TextPrompts:
    """``encode(captions) -> [prompt ids]``: BOS + Chameleon BPE of Lumina's template (the
    ``<reserved08706>`` separator included), as ``LuminaTarget.begin`` takes them."""

    def __init__(self, tokenizer, width: int, height: int):
        self.tok, self.width, self.height = tokenizer, width, height
        self.bos = tokenizer.token_to_id("<s>")
        if self.bos is None:
            raise ValueError("the text tokenizer has no <s> (BOS) token")

    def encode(self, captions) -> list[list[int]]:
        enc = lambda s: self.tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        return [prompt_ids(enc, c, self.width, self.height, self.bos) for c in captions]


class LuminaWorld(DiscreteWorld):
    next_step = REAL_TARGET_HINT

    @classmethod
    def missing_files(cls, cfg) -> list[str]:
        out = missing_inputs(cfg, [
            config_need(cfg, "target.files.model", "model", SOURCES["model"], folder=True, contains=("config.json",)),
            config_need(cfg, "target.files.vqgan", "vqgan", SOURCES["vqgan"], folder=False),
            config_need(cfg, "target.files.text_tokenizer", "text_tokenizer", SOURCES["text_tokenizer"], folder=False)])
        if (cfg.get("draft") or {}).get("kind") == "eagle":
            out.append("drafter: no EAGLE head for Lumina-mGPT is available (use draft=self, or method=ar / sjd)")
        return out

    @classmethod
    def load(cls, cfg) -> "LuminaWorld":
        from tokenizers import Tokenizer

        from coolsd.models.chameleon_vq import CHAMELEON_VQGAN, VQConfig

        t = cfg.target
        f, size = t.files, int(t.image_size)
        vq_cfg = t.get("vq_config")
        vq_cfg = VQConfig(**{k: tuple(v) if k in ("ch_mult", "attn_resolutions") else v for k, v in vq_cfg.items()}) \
            if vq_cfg else CHAMELEON_VQGAN
        if size % (2 * vq_cfg.downsample):
            raise ValueError(f"image_size {size} must be a multiple of {2 * vq_cfg.downsample} (whole 2x2-token grid cells)")
        kind = draft_kind(cfg, "none", ("self", "none"), t.name, "itself (draft=self)")
        latent = size // vq_cfg.downsample  # 48 at 768 px
        with reading(f.text_tokenizer, "Chameleon's text tokenizer (text_tokenizer.json)", SOURCES["text_tokenizer"]):
            encoder = TextPrompts(Tokenizer.from_file(os.fspath(f.text_tokenizer)), size, size)  # first: seconds, not minutes
        target = load_lumina_target(f.model, f.vqgan, h_latent=latent, w_latent=latent, cfg_scale=float(t.cfg_scale),
                                    vq_config=vq_cfg, dtype=DTYPES[t.get("dtype", "bfloat16")],
                                    device=t.get("device", "cuda"))
        drafter = None
        if kind == "self":  # a second target over the same weights: its own caches
            drafter = LuminaTarget(target.model, target.vocab, h_latent=latent, w_latent=latent,
                                   cfg_scale=target.cfg_scale, tokens=target.tokens)
        sampling = SamplingConfig.resolve(t.get("sampling"), cfg.get("sampling"))
        return cls(t.name, target, encoder, sampling, {k: file_identity(v) for k, v in f.items()}, drafter)

    def __init__(self, name: str, target: LuminaTarget, encoder, sampling: SamplingConfig, files: dict,
                 drafter: Optional[LuminaTarget] = None):
        self.name, self.target, self.encoder, self.sampling = name, target, encoder, sampling
        self._files, self._drafter = files, drafter
        self.cfg_scale = target.cfg_scale
        self.device = target.model.device
        codebook = getattr(target.decoder, "codebook", None)
        self.neighbours = None if codebook is None else neighbours_from_codebook(codebook.detach().float())

    def files(self) -> dict:
        return self._files

    def encode(self, captions):
        return self.encoder.encode(captions)

    @torch.no_grad()
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """The VQGAN decoder's [0, 1] floats -> uint8 (B, H, W, 3)."""
        x = self.target.decode(tokens).float()
        return (x * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def drafter(self):
        if self._drafter is None:
            raise ValueError(f"this method drafts with a model; for {self.name} use draft=self")
        return self._drafter
