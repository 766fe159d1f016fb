"""Acceptance rules: the per-sibling step of METHODS.md 1.3 for every discrete method.

A rule maps (current residual target p_res, the sibling's conditional draft q_j, its token x_j,
its depth d) to the acceptance probability f_j(x_j) and the UNNORMALISED residual that replaces
p_res if x_j is rejected. The tree walk (``verify.py``) is shared by all rules.

Table of METHODS.md 1.3, with a_j the acceptance numerator:
  exact (eagle, sjd)     a_j = p_res                     residual [p_res - q_j]_+
  scaled (uniform_rsd,   a_j = omega_d * p_res           residual G* = [p_res - min(q_j, a_j)]_+
          coolsd)
  lantern(_pp)           a_j = p~ (neighbourhood sum)    residual LANTERN's own or G*
  group (gsd)            q f = q min(1, p(G)/q(G))       residual [p_res - q_j]_+ (GSD's) or G*
"""
from __future__ import annotations

from typing import Optional

import torch

from coolsd.decoding import lantern as _lantern
from coolsd.decoding.groups import group_masses


def acceptance_prob(a_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """f = min(1, a(x) / q(x)); 0 where q(x) <= 0 (such drafts are skipped anyway)."""
    safe_q = torch.where(q_x > 0, q_x, torch.ones_like(q_x))
    return torch.where(q_x > 0, torch.clamp(a_x / safe_q, max=1.0), torch.zeros_like(q_x))


def gstar_residual(p_res: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Unnormalised TV-optimal resampling G* = [p_res - q * f]_+ with q*f = min(q, a)
    (COOL-SD Theorem 2). For a = omega*p_res with omega >= 1 this is [p_res - q]_+ (Prop. 1)."""
    return torch.clamp(p_res - torch.minimum(q, a), min=0.0)


def take(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.gather(-1, x.unsqueeze(-1)).squeeze(-1)


class Rule:
    """Base: subclasses define the acceptance numerator a_j(.) over the whole vocabulary."""

    name = "rule"

    def numerator(self, p_res: torch.Tensor, depth: int) -> torch.Tensor:
        raise NotImplementedError

    def step(self, p_res, q, x, depth):
        a = self.numerator(p_res, depth)
        return acceptance_prob(take(a, x), take(q, x)), gstar_residual(p_res, q, a)

    def describe(self) -> dict:
        return {"rule": self.name}

    def on(self, device) -> "Rule":
        """This rule with every tensor it holds on ``device`` (a copy made once per device; the
        loop verifies with the target's): tables built where their inputs were (a codebook's
        neighbourhoods, a schedule) never meet the target's tensors on another device."""
        device = torch.device(device)
        state = {k: v for k, v in vars(self).items() if k != "_on_device"}
        if all(v.device == device for v in state.values() if isinstance(v, torch.Tensor)):
            return self
        copies = self.__dict__.setdefault("_on_device", {})
        if device not in copies:
            moved = object.__new__(type(self))
            moved.__dict__.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()})
            copies[device] = moved
        return copies[device]


class ExactRule(Rule):
    """Lossless speculative sampling (EAGLE-1 recursive rejection; SJD's window test)."""

    name = "exact"

    def numerator(self, p_res, depth):
        return p_res


class ScaledRule(Rule):
    """a_j = omega_d * p_res: UniformRSD (omega constant) and COOL-SD (annealed omega)."""

    name = "scaled"

    def __init__(self, omega: torch.Tensor):
        self.omega = omega.double()
        self.weights = [float(w) for w in self.omega]  # host floats: no tensor read per step (traceable)

    def weight(self, depth: int) -> float:
        # depths past the schedule (never reached by a tree of depth L) reuse the last weight
        return self.weights[min(depth, len(self.weights)) - 1]

    def numerator(self, p_res, depth):
        return self.weight(depth) * p_res

    def describe(self):
        return {"rule": self.name, "omega": [round(float(w), 6) for w in self.omega]}


class LanternRule(Rule):
    """LANTERN (absolute budget ``delta``) / LANTERN++ (relative budget ``lam``), METHODS.md 3."""

    name = "lantern"

    def __init__(self, neighbours: torch.Tensor, k: int, *, lam=None, delta=None, resample="lantern"):
        self.nb_k = neighbours[:, :k]
        self.nb_k1 = neighbours[:, : k + 1]  # LANTERN zeroes k+1 neighbours (reference code)
        # who has each token among its k+1 neighbours (the exact distortion's scatter as a gather, compiled)
        self.rev_k1 = _lantern.reverse_neighbours(self.nb_k1) if k + 1 <= _lantern.UNROLL_MAX else None
        self.lam, self.delta, self.resample = lam, delta, resample

    def numerator(self, p_res, depth):
        return _lantern.aggregate(p_res, self.nb_k, None, lam=self.lam, delta=self.delta)[0]

    def step(self, p_res, q, x, depth):
        if self.resample == "gstar":
            return super().step(p_res, q, x, depth)
        p_tilde_x, relaxed = _lantern.aggregate(p_res, self.nb_k, x, lam=self.lam, delta=self.delta)
        f = acceptance_prob(p_tilde_x, take(q, x))
        # LlamaGen static-tree path: if relaxation was used at x, zero q on x's first k+1
        # neighbours (not renormalised), then [p_res - q]_+.
        zero = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, self.nb_k1[x], True)
        q_mod = torch.where(zero & relaxed.unsqueeze(-1), torch.zeros_like(q), q)
        return f, torch.clamp(p_res - q_mod, min=0.0)


class GroupRule(Rule):
    """GSD (``coolsd.decoding.groups``): a draft x is accepted with probability
    min(1, p(G_x) / q(G_x)), its group's masses. The accepted mass at y is then
    q(y) f(y) = min(q(y), a(y)) with a = q p(G) / q(G), which depends on q: ``accepted`` gives it
    at every token. Resampling after a rejection: ``resample="sjd"`` GSD's own, SJD's
    [p_res - q]_+; ``"gstar"`` COOL-SD's G* = [p_res - min(q, a)]_+ (Theorem 2), so the two
    relaxation families can be compared at equal resampling. Both residuals do not depend on the
    rejected x (the exact distortion is then a closed form, docs/distortion.md)."""

    name = "group"

    def __init__(self, size: int, p_thr: Optional[float], resample: str = "sjd"):
        self.size, self.p_thr, self.resample = int(size), p_thr, resample

    def accepted(self, p_res: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q(y) f(y) at every token (..., V)."""
        pg, qg = group_masses(p_res, q, self.size, self.p_thr)
        return torch.where(qg > 0, q.to(p_res.dtype) * torch.clamp(pg / torch.where(qg > 0, qg, 1.0), max=1.0), 0.0)

    def residual(self, p_res: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        return torch.clamp(p_res - (accepted if self.resample == "gstar" else q.to(p_res.dtype)), min=0.0)

    def step(self, p_res, q, x, depth):
        acc = self.accepted(p_res, q)
        return acceptance_prob(take(acc, x), take(q, x)), self.residual(p_res, q, acc)  # f(x) = q f / q

    def describe(self):
        return {"rule": self.name, "size": self.size, "p_thr": self.p_thr, "resample": self.resample}
