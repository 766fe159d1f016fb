"""``target=mar_h`` / ``mar_l``: MAR class-conditional ImageNet 256 from the official local files,
with ``draft=mar_b`` / ``mar_large`` (a second MAR checkpoint) or ``draft=self``: the MAR target
and draft (``coolsd.models.mar``, ``checkpoint-last.pth``, EMA weights) and the KL-16 VAE
(``coolsd.models.kl16_vae``, ``kl16.ckpt``). Every file is checked before anything is loaded;
prompts are class labels (``dataset=imagenet``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING

from coolsd.engine.continuous.generate import HeadConfig
from coolsd.models.kl16_vae import KL16_SOURCE, decode_tokens
from coolsd.models.mar import MAR_CONFIGS, MAR_SOURCE, MARConfig, load_mar
from coolsd.worlds.base import ContinuousWorld, draft_kind
from coolsd.worlds.files import DTYPES, architecture, config_need, file_identity, load_kl16_vae, run_missing_inputs
from coolsd.worlds.schema import HeadSchema, TargetSchema


@dataclass
class MARTargetSchema(TargetSchema):
    arch: Any = MISSING  # a released architecture name or a mapping of MARConfig fields
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "float32"
    head: HeadSchema = field(default_factory=HeadSchema)


class MARWorld(ContinuousWorld):

    targets = ("mar_h", "mar_l")  # conf/target/<name>.yaml
    schema = ("mar_schema", MARTargetSchema)  # its conf files name it first
    @classmethod
    def missing_files(cls, cfg) -> list[str]:
        needs = [config_need(cfg, "target.files.checkpoint", "checkpoint", MAR_SOURCE, folder=False),
                 config_need(cfg, "target.files.vae", "vae", KL16_SOURCE, folder=False)]
        if (cfg.get("draft") or {}).get("kind") == "mar":
            needs.append(config_need(cfg, "draft.files.checkpoint", "draft checkpoint", MAR_SOURCE, folder=False))
        return run_missing_inputs(cfg, needs)

    @classmethod
    def load(cls, cfg) -> "MARWorld":
        t, d = cfg.target, cfg.get("draft")
        head = HeadConfig(**t.head)
        target_arch = architecture(t.arch, "target.arch", MAR_CONFIGS, MARConfig)
        kind = draft_kind(cfg, None, ("mar", "self"), t.name,
                          "a MAR checkpoint (draft=mar_b or draft=mar_large) or itself (draft=self)")
        draft_arch = None
        if kind == "mar":
            draft_arch = architecture(d.arch, "draft.arch", MAR_CONFIGS, MARConfig)
            if (draft_arch.seq_len, draft_arch.token_dim) != (target_arch.seq_len, target_arch.token_dim):
                raise ValueError("draft and target must share the token grid and dim (the same VAE)")
        device, dtype = t.get("device", "cuda"), DTYPES[t.get("dtype", "float32")]
        target = load_mar(t.files.checkpoint, target_arch, dtype=dtype, device=device)
        draft = target if draft_arch is None else load_mar(d.files.checkpoint, draft_arch, dtype=dtype, device=device)
        vae = load_kl16_vae(t, device)
        files = {"checkpoint": file_identity(t.files.checkpoint), "vae": file_identity(t.files.vae),
                 **({"draft": file_identity(d.files.checkpoint)} if draft_arch is not None else {})}
        return cls(t.name, target, draft, head, vae, target_arch.side, files)

    def __init__(self, name, target, draft, head: HeadConfig, vae, side: int, files: dict):
        self.name, self.target, self.draft, self.head, self.vae, self.side = name, target, draft, head, vae, side
        self._files = files
        self.device = next(target.parameters()).device

    def files(self) -> dict:
        return self._files

    def labels(self, prompts) -> torch.Tensor:
        return torch.tensor([p.label for p in prompts], dtype=torch.long)

    def decode_uint8(self, tokens):
        return decode_tokens(self.vae, tokens, self.side, self.side)
