"""Relaxation schedules omega_d, d = 1..L (docs/methods.md#2-relaxation-schedules; COOL-SD section "annealing").

L is the draft length (chain) or the tree depth. Siblings at one depth share omega_d.
"""
from __future__ import annotations

import math

import torch

SCHEDULES = ("uniform", "exp", "exp_geomean", "linear", "toward_one")
EXP_NORMALIZATIONS = ("mean", "geomean")


def omega_schedule(
    schedule: str,
    delta: float,
    length: int,
    nu: float = 0.7,
    slope: float | None = None,
    normalize: str = "mean",
) -> torch.Tensor:
    """omega_1..omega_L as a float64 tensor of shape (L,); delta > 0 and nu >= 0 finite (the
    methods' parameters, checked by the registry: ``coolsd.engine.methods.relaxed``).

    - ``uniform``: omega_d = delta (UniformRSD).
    - ``exp`` (COOL-SD): omega_d = delta * exp(-nu*d - mu). The paper note does not state mu
      (research/coolsd_lantern.md 1.3): ``normalize="mean"`` sets mu = log(mean_j exp(-nu*j)) so
      that mean(omega) = delta; ``normalize="geomean"`` sets mu = -nu*(L+1)/2, which is
      ``exp_geomean``.
    - ``linear``: omega_d = delta * (1 + s*((L+1)/2 - d)), 0 <= s <= 2/(L-1); default s = 2/(L+1)
      (omega_L = delta * 2/(L+1) > 0) [inferred; the paper's parametrisation is unknown].
    - ``toward_one``: omega_d = 1 + (delta - 1) * exp(-nu*(d - 1)): omega_1 = delta, then the
      relaxation decays toward vanilla verification (omega = 1) without crossing it (from
      above for delta > 1, from below for delta < 1); delta = 1 gives omega = 1 exactly (EAGLE).
    """
    if int(length) < 1:
        raise ValueError(f"draft length must be >= 1, got {length!r}")
    L, delta, nu = int(length), float(delta), float(nu)
    d = torch.arange(1, L + 1, dtype=torch.float64, device="cpu")  # a rule's table, moved by ``Rule.on``
    if schedule == "uniform":
        return torch.full((L,), delta, dtype=torch.float64, device="cpu")
    if schedule in ("exp", "exp_geomean"):
        norm = "geomean" if schedule == "exp_geomean" else normalize
        if norm not in EXP_NORMALIZATIONS:
            raise ValueError(
                f"unknown exp normalisation {norm!r}; valid: {', '.join(EXP_NORMALIZATIONS)}"
            )
        if norm == "mean":
            mu = math.log(torch.exp(-nu * d).mean().item())
        else:
            mu = -nu * (L + 1) / 2
        return delta * torch.exp(-nu * d - mu)
    if schedule == "linear":
        s_max = 2.0 / (L - 1) if L > 1 else float("inf")
        s = 2.0 / (L + 1) if slope is None else float(slope)
        if not (0 <= s <= s_max):
            raise ValueError(f"linear schedule slope must be in [0, 2/(L-1)] = [0, {s_max:.4g}], got {s}")
        return delta * (1 + s * ((L + 1) / 2 - d))
    if schedule == "toward_one":
        # exp(.) in (0, 1]: omega_d lies between delta and 1, on delta's side of 1
        return 1 + (delta - 1) * torch.exp(-nu * (d - 1))
    raise ValueError(f"unknown schedule {schedule!r}; valid names: {', '.join(SCHEDULES)}")
