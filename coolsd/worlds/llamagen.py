"""``target=llamagen_xl`` / ``llamagen_xl_512``: LlamaGen-XL text-to-image from the official local
files. The GPT (``coolsd.models.llamagen``: ``t2i_XL_stage1_256.pt`` or ``t2i_XL_stage2_512.pt``,
or a folder of LANTERN's HF conversion ``jadohu/LlamaGen-T2I`` / ``-2``), FLAN-T5-XL
(``coolsd.models.t5_text``), the VQ-16 tokenizer (``coolsd.models.llamagen_vq``) and the drafter
(``draft``: LANTERN's EAGLE-1 head, ``draft=self``, or none for model-free methods).
``target.variant`` (``upstream`` | ``lantern``) is the padded-text-slot attention of the GPT
(``coolsd.models.llamagen.text_slot_mask``); a non-default one is part of the run identity
(``settings``), so a run folder never mixes the two. Every file is checked before anything is
loaded; image metrics: ``python -m coolsd.cli.evaluate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import numpy as np
import torch
from omegaconf import MISSING

from coolsd.engine.drafting import SamplingConfig
from coolsd.models.eagle.model import DRAFTER_SOURCE, EagleDrafter, EagleHead, load_eagle_head
from coolsd.models.eagle.training import read_captions
from coolsd.models.llamagen import (
    GPT_SOURCE,
    HF_SOURCE,
    HF_WEIGHTS,
    VARIANTS,
    LlamaGenGPT,
    LlamaGenTarget,
    gpt_config,
    load_gpt,
)
from coolsd.models.llamagen_vq import VQ_16, VQ_SOURCE, VQConfig, load_llamagen_vq
from coolsd.models.t5_text import T5_FILES, T5_SOURCE, T5CaptionEncoder
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.base import DiscreteWorld, draft_kind
from coolsd.worlds.files import DRAFTER_FOLDER, DTYPES, config_need
from coolsd.worlds.presentation import REAL_TARGET_HINT, Presentation
from coolsd.worlds.schema import TokenTargetSchema


@dataclass
class LlamaGenTargetSchema(TokenTargetSchema):
    gpt_config: Any = MISSING  # a named config (GPT_XL) or a mapping of LlamaGenConfig fields
    vq_config: Any = None  # a mapping of VQConfig fields (tiny test files); null = the released VQ
    variant: str = "upstream"  # padded-text-slot attention: upstream (LlamaGen) | lantern (LANTERN, the paper's)
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "bfloat16"
    t5_dtype: str = "bfloat16"


class LlamaGenWorld(DiscreteWorld):

    targets = ("llamagen_xl", "llamagen_xl_512")  # conf/target/<name>.yaml
    schema = ("llamagen_schema", LlamaGenTargetSchema)  # its conf files name it first
    presentation = Presentation(DiscreteWorld.presentation.columns, next_step=REAL_TARGET_HINT)
    trains_drafters = True
    compiles = True
    row_parallel = True
    variants = VARIANTS  # target.variant (checked by coolsd.job.config_schema.check_config)

    @classmethod
    def training_captions(cls, n: int, seed: int, path=None) -> list[str]:
        """``train.captions``: a COCO captions file or one caption per line (never evaluation captions)."""

        return read_captions(path)

    @classmethod
    def needs(cls, cfg) -> list:
        # target.files.gpt: the official .pt file, or a folder in LANTERN's HF layout (config.json + weights)
        gpt = config_need(cfg, "target.files.gpt", "gpt", f"{GPT_SOURCE}, or the folder from {HF_SOURCE}",
                          fetch=("config.json", HF_WEIGHTS))
        local = gpt.local()
        if local is not None:
            is_dir = local.is_dir()
            gpt = gpt._replace(folder=is_dir, contains=("config.json", HF_WEIGHTS) if is_dir else ())
        needs = [gpt,
                 config_need(cfg, "target.files.vq", "vq", VQ_SOURCE, folder=False),
                 config_need(cfg, "target.files.t5", "t5", T5_SOURCE, folder=True, contains=("config.json",),
                             fetch=T5_FILES)]
        if (cfg.get("draft") or {}).get("kind") == "eagle":
            needs.append(config_need(cfg, "draft.path", "drafter", DRAFTER_SOURCE, folder=True, contains=DRAFTER_FOLDER))
        return needs

    @classmethod
    def image_tokens(cls, cfg) -> int:
        return gpt_config(cfg.target.gpt_config).block_size

    @classmethod
    def load(cls, cfg) -> "LlamaGenWorld":
        t, d = cfg.target, cfg.get("draft")
        kind = draft_kind(cfg, "none", ("eagle", "self", "none"), t.name,
                          f"an EAGLE folder (draft={t.name} draft.path=...) or itself (draft=self)")
        device = t.get("device", "cuda")
        gpt = load_gpt(t.files.gpt, gpt_config(t.gpt_config, t.get("variant", "upstream")),
                       DTYPES[t.get("dtype", "bfloat16")], device)
        vq_cfg = t.get("vq_config")
        vq = load_llamagen_vq(t.files.vq, VQConfig(**{k: tuple(v) if k == "ch_mult" else v for k, v in vq_cfg.items()})
                              if vq_cfg else VQ_16, device=device)
        encoder = T5CaptionEncoder.from_folder(t.files.t5, dtype=DTYPES[t.get("t5_dtype", "bfloat16")], device=device,
                                               max_length=gpt.config.cls_token_num)
        head = load_eagle_head(d.path, gpt) if kind == "eagle" else None
        files = {k: file_identity(v) for k, v in t.files.items()}
        if kind == "eagle":
            files["drafter"] = file_identity(d.path)
        sampling = SamplingConfig.resolve(t.get("sampling"), cfg.get("sampling"))
        return cls(t.name, gpt, encoder, vq, float(t.cfg_scale), sampling, kind, head, files,
                   compile=bool(cfg.get("compile", False)))

    def __init__(self, name: str, gpt: LlamaGenGPT, encoder, vq, cfg_scale: float, sampling: SamplingConfig,
                 draft_kind: str = "eagle", head: Optional[EagleHead] = None, files: Optional[dict] = None,
                 compile: bool = False):
        self.name, self.gpt, self.encoder, self.vq = name, gpt, encoder, vq
        self.cfg_scale, self.sampling, self.draft_kind, self._files = cfg_scale, sampling, draft_kind, files or {}
        self.device = gpt.device
        # LANTERN's drafters prefill every text slot's feature: the target hands them all over
        prefix = head is not None and getattr(head, "text_prefix", True)
        self.compiled = compile
        self.target = LlamaGenTarget(gpt, cfg_scale=cfg_scale, prefill_features="all" if prefix else "last",
                                     compile=compile)
        if draft_kind == "self":  # the target drafts for itself (its own caches)
            self._drafter = LlamaGenTarget(gpt, cfg_scale=cfg_scale, compile=compile)
        elif head is not None:
            self._drafter = EagleDrafter.for_target(head, self.target, text_prefix=prefix, compile=compile)
        else:
            self._drafter = None

    def files(self) -> dict:
        return self._files

    def settings(self) -> dict:
        """The shared settings, plus the GPT's variant when it is not upstream's (so run folders
        made before the option existed keep their identity, and upstream and lantern never mix)."""
        variant = self.gpt.config.variant
        return {**super().settings(), **({"variant": variant} if variant != "upstream" else {})}

    def encode(self, captions):
        return self.encoder.encode(captions)

    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        return self.vq.decode_uint8(tokens)

    def codebook(self) -> torch.Tensor:
        return self.vq.quantize.codebook().detach().float()  # L2-normalised, as looked up (llamagen_vq)

    def drafter(self):
        if self._drafter is None:
            raise ValueError(f"this method drafts with a model, but target {self.name} has no drafter configured "
                             f"(draft={self.name} draft.path=... or draft=self)")
        return self._drafter
