"""``target=xar_h`` / ``xar_l``: xAR class-conditional ImageNet 256 from the official local files,
with ``draft=xar_b`` (xAR-B, the continuous-SD paper's draft of xAR-H) or ``draft=self``: the xAR
target and draft (``coolsd.models.xar``, ``xAR-{B,L,H}.pth``) and the KL-16 VAE
(``coolsd.models.kl16_vae``, ``kl16.ckpt``, MAR's). Every file is checked before anything is loaded;
prompts are class labels (``dataset=imagenet``). The flow settings (``FlowConfig``) are shared by draft
and target: both run ``num_steps`` SDE steps per unit (the draft at the target's 50, not xAR-B's
released 40, so the schedule variances agree and Sigma = 1, continuous_sd.md 2.3).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING

from coolsd.engine.continuous.flow import FlowConfig
from coolsd.models.kl16_vae import KL16_SOURCE, decode_tokens
from coolsd.models.xar import XAR_CONFIGS, XAR_SOURCE, XARConfig, load_xar
from coolsd.worlds.base import ContinuousWorld, draft_kind
from coolsd.worlds.files import DTYPES, architecture, config_need, file_identity, load_kl16_vae, run_missing_inputs
from coolsd.worlds.schema import TargetSchema


@dataclass
class FlowSchema:
    """The flow sampler's settings (``coolsd.engine.continuous.flow.FlowConfig``)."""

    num_steps: int = MISSING
    cfg: float = MISSING
    unit: Optional[int] = None


@dataclass
class XARTargetSchema(TargetSchema):
    arch: Any = MISSING  # a released architecture name or a mapping of XARConfig fields
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "float32"
    flow: FlowSchema = field(default_factory=FlowSchema)


class XARWorld(ContinuousWorld):

    targets = ("xar_h", "xar_l")  # conf/target/<name>.yaml
    schema = ("xar_schema", XARTargetSchema)  # its conf files name it first

    @classmethod
    def missing_files(cls, cfg) -> list[str]:
        needs = [config_need(cfg, "target.files.checkpoint", "checkpoint", XAR_SOURCE, folder=False),
                 config_need(cfg, "target.files.vae", "vae", KL16_SOURCE, folder=False)]
        if (cfg.get("draft") or {}).get("kind") == "xar":
            needs.append(config_need(cfg, "draft.files.checkpoint", "draft checkpoint", XAR_SOURCE, folder=False))
        return run_missing_inputs(cfg, needs)

    @classmethod
    def load(cls, cfg) -> XARWorld:
        t, d = cfg.target, cfg.get("draft")
        flow = FlowConfig(**t.flow)
        target_arch = architecture(t.arch, "target.arch", XAR_CONFIGS, XARConfig)
        flow.unit_for(target_arch.cell_len)  # a unit that does not divide the cell: refused before loading
        kind = draft_kind(cfg, None, ("xar", "self"), t.name, "an xAR checkpoint (draft=xar_b) or itself (draft=self)")
        draft_arch = None
        if kind == "xar":
            draft_arch = architecture(d.arch, "draft.arch", XAR_CONFIGS, XARConfig)
            geometry = lambda a: (a.grid, a.cell, a.token_dim)  # noqa: E731
            if geometry(draft_arch) != geometry(target_arch):
                raise ValueError(f"draft and target must share the token grid, the cell and the token dim (the same "
                                 f"VAE): draft {geometry(draft_arch)} vs target {geometry(target_arch)}")
        device, dtype = t.get("device", "cuda"), DTYPES[t.get("dtype", "float32")]
        target = load_xar(t.files.checkpoint, target_arch, dtype=dtype, device=device)
        draft = target if draft_arch is None else load_xar(d.files.checkpoint, draft_arch, dtype=dtype, device=device)
        vae = load_kl16_vae(t, device)
        files = {"checkpoint": file_identity(t.files.checkpoint), "vae": file_identity(t.files.vae),
                 **({"draft": file_identity(d.files.checkpoint)} if draft_arch is not None else {})}
        return cls(t.name, target, draft, flow, vae, target_arch.grid, files)

    def __init__(self, name, target, draft, flow: FlowConfig, vae, side: int, files: dict):
        self.name, self.target, self.draft, self.head, self.vae, self.side = name, target, draft, flow, vae, side
        self._files = files
        self.device = next(target.parameters()).device

    def files(self) -> dict:
        return self._files

    def labels(self, prompts) -> torch.Tensor:
        return torch.tensor([p.label for p in prompts], dtype=torch.long)

    def decode_uint8(self, tokens):
        return decode_tokens(self.vae, tokens, self.side, self.side)
