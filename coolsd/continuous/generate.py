"""Continuous-token generation for a causal ``ContinuousAR`` pair: plain AR sampling and CSpD
speculative decoding in raster order (continuous_sd.md 2.9, mode B): draft gamma tokens with
the draft model, one target forward over prefix + drafts, per-token verification in order
(``coolsd.continuous.cspd``), stop at the first rejection (its resample is emitted, later drafts
are discarded), a bonus target token when every draft is accepted; the first ``prefill`` tokens
come from the target alone.

Alignment: the initial noise and every step's noise of position i come from the generator seeded
with (sample seed, i), shared by draft, target and plain AR, and never from the order of work, so
identical models accept everything and reproduce the target-only tokens bit for bit.
Counters per sample: drafted, accepted, resample rounds, fallbacks, target and draft forwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from coolsd.continuous.cspd import verify_exact, verify_paper
from coolsd.continuous.diffusion import Schedule, aligned_sample

MODES = ("exact", "paper")


def position_noise(seed: int, i: int, K: int, C: int, dtype=torch.float64):
    """(x^(K) (C,), eps (K, C)) of position i of the sample with ``seed``."""
    g = torch.Generator().manual_seed(int(np.random.default_rng([seed, i]).integers(2**62)))
    return torch.randn(C, generator=g, dtype=dtype), torch.randn(K, C, generator=g, dtype=dtype)


@dataclass(frozen=True)
class _Chain:
    """The head settings one sample shares between models (aligned noise by seed and position)."""

    seed: int
    sched: Schedule
    cfg: float
    tau: float
    final_noise: bool
    dtype: torch.dtype

    def at(self, model, z, zu, j: int):
        """The head's aligned chain at position j under the conditions z[j] (and zu[j] for CFG)."""
        noise, eps = position_noise(self.seed, j, self.sched.K, model.config.token_dim, self.dtype)
        return aligned_sample(model.head, z[j:j + 1], noise[None], eps[:, None], self.sched,
                              z_u=None if zu is None else zu[j:j + 1], cfg=self.cfg, tau=self.tau,
                              final_noise=self.final_noise)


@dataclass
class ContinuousResult:
    tokens: torch.Tensor  # (N, C)
    counters: dict = field(default_factory=dict)


def _conds(model, tokens, label, cfg):
    z = model.conditions(tokens[None], torch.tensor([label]))[0]
    zu = model.conditions(tokens[None], torch.tensor([model.null_class]))[0] if cfg != 1.0 else None
    return z, zu


@torch.no_grad()
def ar_generate(model, label: int, seed: int, sched: Schedule, *, cfg: float = 1.0, tau: float = 1.0,
                final_noise: bool = True, dtype=torch.float64) -> ContinuousResult:
    N, C = model.config.seq_len, model.config.token_dim
    chain = _Chain(seed, sched, cfg, tau, final_noise, dtype)
    toks = torch.zeros(0, C, dtype=dtype)
    for i in range(N):
        z, zu = _conds(model, toks, label, cfg)
        s = chain.at(model, z, zu, i)
        toks = torch.cat([toks, s.x0])
    return ContinuousResult(toks, {"target_forwards": N})


@torch.no_grad()
def cspd_generate(target, draft, label: int, seed: int, sched: Schedule, *, gamma: int = 4, mode: str = "exact",
                  prefill: float = 0.05, cfg: float = 1.0, tau: float = 1.0, max_rounds: int = 100,
                  dtype=torch.float64) -> ContinuousResult:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    N, C = target.config.seq_len, target.config.token_dim
    # the exact rule needs a stochastic final step (continuous_sd.md 2.9); MAR's has none
    chain = _Chain(seed, sched, cfg, tau, mode == "exact", dtype)
    gen = torch.Generator().manual_seed(int(np.random.default_rng([seed, 1 << 20]).integers(2**62)))
    c = {"drafted": 0, "accepted": 0, "resample_rounds": 0, "fallbacks": 0, "target_forwards": 0, "draft_forwards": 0}
    toks = torch.zeros(0, C, dtype=dtype)
    m = math.ceil(prefill * N)
    while len(toks) < N:
        i = len(toks)
        if i < m:  # token pre-filling: the target alone
            z, zu = _conds(target, toks, label, cfg)
            c["target_forwards"] += 1
            s = chain.at(target, z, zu, i)
            toks = torch.cat([toks, s.x0])
            continue
        g = min(gamma, N - i)
        drafts, qs = toks, []
        for j in range(i, i + g):
            z, zu = _conds(draft, drafts, label, cfg)
            c["draft_forwards"] += 1
            q = chain.at(draft, z, zu, j)
            qs.append(q)
            drafts = torch.cat([drafts, q.x0])
        z, zu = _conds(target, drafts, label, cfg)  # one target forward: every drafted position's condition
        c["target_forwards"] += 1
        c["drafted"] += g
        for k, j in enumerate(range(i, i + g)):
            p = chain.at(target, z, zu, j)
            q = qs[k]
            if mode == "exact":
                v = verify_exact(q.x0, p.mu0, p.log_std0, q.mu0, q.log_std0, gen, max_rounds)
            else:
                v = verify_paper(q.x0, p.mu0, p.log_std0, q.mu0, q.log_std0, p.s, q.s, gen, max_rounds)
            c["resample_rounds"] += int(v.rounds.sum())
            c["fallbacks"] += int(v.fallback.sum())
            toks = torch.cat([toks, v.tokens])
            if not bool(v.accepted[0]):
                break
            c["accepted"] += 1
        else:
            if len(toks) < N:  # every draft accepted: the target's bonus token at the next position
                j = len(toks)
                p = chain.at(target, z, zu, j)
                toks = torch.cat([toks, p.x0])
    c["acceptance_rate"] = c["accepted"] / max(c["drafted"], 1)
    return ContinuousResult(toks, c)
