"""``target=mar_h`` / ``mar_l``: MAR class-conditional ImageNet 256 from the official local files,
with ``draft=mar_b`` / ``mar_large`` (a second MAR checkpoint) or ``draft=self``: the MAR target
and draft (``coolsd.models.mar``, ``checkpoint-last.pth``, EMA weights) and the KL-16 VAE
(``coolsd.models.kl16_vae``, ``kl16.ckpt``). Every file is checked before anything is loaded;
prompts are class labels (``dataset=imagenet``).
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING

from coolsd.engine.continuous.generate import HeadConfig
from coolsd.models.kl16_vae import KL16_SOURCE, decode_tokens
from coolsd.models.mar import MAR_CONFIGS, MAR_SOURCE, MARConfig, load_mar
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.base import ContinuousWorld, draft_kind
from coolsd.worlds.files import DTYPES, architecture, config_need, load_kl16_vae
from coolsd.worlds.schema import HeadSchema, TargetSchema


@dataclass
class MARTargetSchema(TargetSchema):
    arch: Any = MISSING  # a released architecture name or a mapping of MARConfig fields
    vae: Any = None  # a mapping of KLVAEConfig fields (tiny test files); null = MAR's KL-16 VAE
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "float32"
    head: HeadSchema = field(default_factory=HeadSchema)


class KL16World(ContinuousWorld):
    """A target that generates MAR's KL-16 latents, with one checkpoint file per model (target, draft)
    and the KL-16 VAE (MAR, xAR, Harmon): the file list, loading, labels and decoding; a subclass names
    its model family (``draft_kind``, ``presets``, ``config_cls``, ``load_model``, the checkpoints'
    ``source``), its sampling settings (``sampling``), what draft and target must share
    (``geometry``) and, for text prompts, its extra files (``extra_needs``) and conditioning
    (``attach``, ``labels``). Class-conditional by default: prompts are ImageNet class labels."""

    draft_kind: str
    draft_hint: str  # the valid drafts, for draft_kind's error
    source: str  # where the checkpoints come from
    presets: dict
    config_cls: type

    @classmethod
    def sampling(cls, t, arch):
        """The sampling settings draft and target share (``t``: the target config): the diffusion head's by default."""
        return HeadConfig(**t.head)

    @classmethod
    def geometry(cls, arch) -> dict:  # what draft and target must share (the token grid, the VAE's dim)
        raise NotImplementedError

    @classmethod
    def load_model(cls, path, arch, dtype, device):
        raise NotImplementedError

    @classmethod
    def parse_arch(cls, arch, where: str, t):
        """The model config of ``arch`` (``target.arch`` / ``draft.arch``; ``t``: the target config)."""
        return architecture(arch, where, cls.presets, cls.config_cls)

    @classmethod
    def extra_needs(cls, cfg) -> list:  # files beyond the checkpoints and the VAE (a tokenizer)
        return []

    @classmethod
    def needs(cls, cfg) -> list:
        needs = [config_need(cfg, "target.files.checkpoint", "checkpoint", cls.source, folder=False),
                 config_need(cfg, "target.files.vae", "vae", KL16_SOURCE, folder=False), *cls.extra_needs(cfg)]
        if (cfg.get("draft") or {}).get("kind") == cls.draft_kind:
            needs.append(config_need(cfg, "draft.files.checkpoint", "draft checkpoint", cls.source, folder=False))
        return needs

    @classmethod
    def load(cls, cfg) -> KL16World:
        t, d = cfg.target, cfg.get("draft")
        target_arch = cls.parse_arch(t.arch, "target.arch", t)
        settings = cls.sampling(t, target_arch)  # refused here, before any file is read
        kind = draft_kind(cfg, None, (cls.draft_kind, "self"), t.name, cls.draft_hint)
        draft_arch = None
        if kind == cls.draft_kind:
            draft_arch = cls.parse_arch(d.arch, "draft.arch", t)
            if cls.geometry(draft_arch) != cls.geometry(target_arch):
                raise ValueError(f"draft and target must share the token grid and dim (the same VAE): draft "
                                 f"{cls.geometry(draft_arch)} vs target {cls.geometry(target_arch)}")
        device, dtype = t.get("device", "cuda"), DTYPES[t.get("dtype", "float32")]
        target = cls.load_model(t.files.checkpoint, target_arch, dtype, device)
        draft = target if draft_arch is None else cls.load_model(d.files.checkpoint, draft_arch, dtype, device)
        files = {"checkpoint": file_identity(t.files.checkpoint), "vae": file_identity(t.files.vae),
                 **({"draft": file_identity(d.files.checkpoint)} if draft_arch is not None else {})}
        world = cls(t.name, target, draft, settings, load_kl16_vae(t, device), math.isqrt(target_arch.seq_len), files)
        world.attach(t)
        return world

    def __init__(self, name, target, draft, head, vae, side: int, files: dict):
        self.name, self.target, self.draft, self.head, self.vae, self.side = name, target, draft, head, vae, side
        self._files = files
        self.device = next(target.parameters()).device

    def attach(self, t) -> None:
        """After loading: what conditioning needs beyond the models (``t``: the target config)."""

    def files(self) -> dict:
        return self._files

    def labels(self, prompts) -> torch.Tensor:
        return torch.tensor([p.label for p in prompts], dtype=torch.long)

    def decode_uint8(self, tokens):
        return decode_tokens(self.vae, tokens, self.side, self.side)


class MARWorld(KL16World):

    targets = ("mar_h", "mar_l")  # conf/target/<name>.yaml
    schema = ("mar_schema", MARTargetSchema)  # its conf files name it first
    draft_kind, source, presets, config_cls = "mar", MAR_SOURCE, MAR_CONFIGS, MARConfig
    draft_hint = "a MAR checkpoint (draft=mar_b or draft=mar_large) or itself (draft=self)"

    @classmethod
    def geometry(cls, arch) -> dict:
        return {"seq_len": arch.seq_len, "token_dim": arch.token_dim}

    @classmethod
    def load_model(cls, path, arch, dtype, device):
        return load_mar(path, arch, dtype=dtype, device=device)
