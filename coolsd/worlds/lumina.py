"""``target=lumina_mgpt``: Lumina-mGPT 7B (768 px) from the official local files.

``coolsd.models.lumina.load_lumina_target`` (Chameleon backbone + VQGAN decoder, image-code
vocabulary, adapter-inserted structural tokens) with Chameleon's text tokenizer and the prompt
template. Every file is checked before anything is loaded. Drafting (``draft``):
``draft=lumina_mgpt`` (the default): LANTERN's EAGLE-1 head for Lumina-mGPT
(``coolsd.models.eagle.lumina``; a folder at ``draft.path`` / ``$LUMINA_DRAFTER``, released
with LANTERN or trained here with ``python -m coolsd.cli.train_drafter target=lumina_mgpt``), with
the target handing over every prefill slot's feature (the drafter's text prefix); ``draft=self``
(the target drafts for itself: an engine check, not a speed-up); model-free methods (``ar``,
``sjd``) need none. Structural tokens (row-end newlines, ``<racm3:break>`` and the grid sizes)
are inserted by the target and the drafter adapters, never drafted against.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import torch
from omegaconf import MISSING

from coolsd.engine.drafting import SamplingConfig
from coolsd.models.chameleon_vq import CHAMELEON_VQGAN, VQConfig
from coolsd.models.eagle.lumina import LUMINA_DRAFTER_SOURCE, LuminaEagleDrafter, load_lumina_eagle_head
from coolsd.models.eagle.training import read_captions
from coolsd.models.lumina import LuminaTarget, load_lumina_target, prompt_ids
from coolsd.util.loading import reading
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.base import DiscreteWorld, EncodedPromptWorld, draft_kind
from coolsd.worlds.files import DRAFTER_FOLDER, DTYPES, config_need
from coolsd.worlds.presentation import REAL_TARGET_HINT, Presentation
from coolsd.worlds.schema import TokenTargetSchema

SOURCES = {
    "model": "https://huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768 (config.json, model-*.safetensors, index)",
    "vqgan": "Meta's Chameleon tokenizer files, tokenizer/vqgan.ckpt (also in huggingface.co/GAIR/Anole-7b-v0.1)",
    "text_tokenizer": "Meta's Chameleon tokenizer files, tokenizer/text_tokenizer.json (also in GAIR/Anole-7b-v0.1)",
}


def _vq_config(t):
    """The VQGAN's ``VQConfig``: ``target.vq_config`` (tiny test files) or Chameleon's."""

    vq = t.get("vq_config")
    return VQConfig(**{k: tuple(v) if k in ("ch_mult", "attn_resolutions") else v for k, v in vq.items()}) \
        if vq else CHAMELEON_VQGAN


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


@dataclass
class LuminaTargetSchema(TokenTargetSchema):
    image_size: int = MISSING
    vq_config: Any = None  # a mapping of VQConfig fields (tiny test files); null = Chameleon's VQGAN
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "bfloat16"


class LuminaWorld(EncodedPromptWorld):

    targets = ("lumina_mgpt",)  # conf/target/<name>.yaml
    schema = ("lumina_schema", LuminaTargetSchema)  # its conf files name it first
    presentation = Presentation(DiscreteWorld.presentation.columns, next_step=REAL_TARGET_HINT)
    trains_drafters = True
    compiles = True  # compile=true: target and drafter forwards under torch.compile (coolsd.models.row_ends)
    draft_hint = "draft=lumina_mgpt draft.path=... or draft=self"

    @classmethod
    def training_captions(cls, n: int, seed: int, path=None) -> list[str]:
        """``train.captions``: a COCO captions file or one caption per line (never evaluation captions)."""

        return read_captions(path)

    @classmethod
    def image_tokens(cls, cfg) -> int:
        """(image_size / the VQGAN's downsampling)^2: 48 x 48 = 2304 at 768 px (row ends excluded:
        the adapter inserts them, they are never drafted)."""
        return (int(cfg.target.image_size) // _vq_config(cfg.target).downsample) ** 2

    @classmethod
    def needs(cls, cfg) -> list:
        needs = [
            config_need(cfg, "target.files.model", "model", SOURCES["model"], folder=True, contains=("config.json",),
                        fetch=("*.json", "*.safetensors")),
            config_need(cfg, "target.files.vqgan", "vqgan", SOURCES["vqgan"], folder=False),
            config_need(cfg, "target.files.text_tokenizer", "text_tokenizer", SOURCES["text_tokenizer"], folder=False)]
        if (cfg.get("draft") or {}).get("kind") == "eagle":
            needs.append(config_need(cfg, "draft.path", "drafter", LUMINA_DRAFTER_SOURCE, folder=True,
                                     contains=DRAFTER_FOLDER))
        return needs

    @classmethod
    def load(cls, cfg) -> "LuminaWorld":
        from tokenizers import Tokenizer

        t = cfg.target
        f, size = t.files, int(t.image_size)
        vq_cfg = _vq_config(t)
        if size % (2 * vq_cfg.downsample):
            raise ValueError(f"image_size {size} must be a multiple of {2 * vq_cfg.downsample} (whole 2x2-token grid cells)")
        kind = draft_kind(cfg, "none", ("eagle", "self", "none"), t.name,
                          f"an EAGLE folder (draft={t.name} draft.path=...) or itself (draft=self)")
        latent = size // vq_cfg.downsample  # 48 at 768 px
        with reading(f.text_tokenizer, "Chameleon's text tokenizer (text_tokenizer.json)", SOURCES["text_tokenizer"]):
            encoder = TextPrompts(Tokenizer.from_file(os.fspath(f.text_tokenizer)), size, size)  # first: seconds, not minutes
        target = load_lumina_target(f.model, f.vqgan, h_latent=latent, w_latent=latent, cfg_scale=float(t.cfg_scale),
                                    vq_config=vq_cfg, dtype=DTYPES[t.get("dtype", "bfloat16")],
                                    device=t.get("device", "cuda"),
                                    # the EAGLE drafter's text prefix: every prefill slot's feature
                                    prefill_features="all" if kind == "eagle" else "last",
                                    compile=bool(cfg.get("compile", False)))
        compiled = target.compiled
        drafter = None
        files = {k: file_identity(v) for k, v in f.items()}
        if kind == "self":  # a second target over the same weights: its own caches
            drafter = LuminaTarget(target.model, target.vocab, h_latent=latent, w_latent=latent,
                                   cfg_scale=target.cfg_scale, tokens=target.tokens, compile=compiled)
        elif kind == "eagle":
            d = cfg.draft
            head = load_lumina_eagle_head(d.path, target, variant=t.get("variant", "upstream"))
            drafter = LuminaEagleDrafter.for_target(head, target, compile=compiled)
            files["drafter"] = file_identity(d.path)
        sampling = SamplingConfig.resolve(t.get("sampling"), cfg.get("sampling"))
        world = cls(t.name, target, encoder, sampling, files, drafter)
        world.compiled = compiled
        return world

    @torch.no_grad()
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """The VQGAN decoder's pixels -> uint8 (B, H, W, 3) exactly as upstream: clamp to [0, 1]
        first (``chameleon_vae_ori/image_tokenizer.py`` ``_pil_from_chw_tensor``: clamp to
        [-1, 1], then ``(x + 1) / 2``; ``decode_codes`` does both), then TRUNCATE
        ``(x * 255).astype(np.uint8)`` -- not round: rounding makes ~45% of the values 1 higher."""
        x = self.target.decode(tokens).float().clamp(0.0, 1.0)
        return (x * 255).floor().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def codebook(self):
        codebook = getattr(self.target.decoder, "codebook", None)  # the VQGAN's raw codebook (chameleon_vq)
        return None if codebook is None else codebook.detach().float()

