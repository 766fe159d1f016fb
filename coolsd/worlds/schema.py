"""The config schema every target shares (Hydra structured configs, typed at compose time): a
world's own target schema subclasses one of these beside the world's code (``World.schema``), and
``coolsd.job.config_schema.register_schemas`` stores every registered world's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class SamplingSchema:
    """Logit warpers; null = the target's protocol value (``target.sampling``)."""

    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None


@dataclass
class TargetSchema:
    """What every target has."""

    name: str = MISSING


@dataclass
class TokenTargetSchema(TargetSchema):
    """A discrete (token) target: guidance and protocol sampling values."""

    cfg_scale: float = MISSING
    sampling: SamplingSchema = field(default_factory=SamplingSchema)


@dataclass
class HeadSchema:
    """A continuous target's diffusion head settings (``coolsd.engine.continuous.generate.HeadConfig``)."""

    steps: int = MISSING
    cfg: float = MISSING
    cfg_schedule: str = MISSING
    temperature: float = MISSING
    order: str = MISSING
    clip_x0: Optional[float] = None
    sampler: str = "ddpm"  # ddpm | ddim (HeadConfig; docs/methods.md#51-ddim-head-sampler)
    eta: float = 0.0  # DDIM's noise scale in [0, 1]; 0 with ddpm
    num_iter: Optional[int] = None  # AR steps: null = one token a step; n = upstream's MaskGIT-cosine n steps
