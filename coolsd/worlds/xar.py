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

from omegaconf import MISSING

from coolsd.engine.continuous.flow import FlowConfig
from coolsd.models.xar import XAR_CONFIGS, XAR_SOURCE, XARConfig, load_xar
from coolsd.worlds.mar import KL16World
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
    vae: Any = None  # a mapping of KLVAEConfig fields (tiny test files); null = MAR's KL-16 VAE
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "float32"
    flow: FlowSchema = field(default_factory=FlowSchema)


class XARWorld(KL16World):

    targets = ("xar_h", "xar_l")  # conf/target/<name>.yaml
    schema = ("xar_schema", XARTargetSchema)  # its conf files name it first
    draft_kind, source, presets, config_cls = "xar", XAR_SOURCE, XAR_CONFIGS, XARConfig
    draft_hint = "an xAR checkpoint (draft=xar_b) or itself (draft=self)"

    @classmethod
    def sampling(cls, t, arch) -> FlowConfig:
        flow = FlowConfig(**t.flow)
        flow.unit_for(arch.cell_len, arch.n_cells)  # a unit that does not divide the cell: refused before loading
        return flow

    @classmethod
    def geometry(cls, arch) -> dict:
        return {"grid": arch.grid, "cell": arch.cell, "token_dim": arch.token_dim}

    @classmethod
    def load_model(cls, path, arch, dtype, device):
        return load_xar(path, arch, dtype=dtype, device=device)
