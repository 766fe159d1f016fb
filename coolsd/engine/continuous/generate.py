"""The one generation loop of continuous-token models (MAR-style: ``conditions`` + diffusion
``head``, e.g. ``coolsd.models.mar.MAR``): target-only sampling and CSpD speculative decoding,
one token per step along a per-sample order (MAR's random order, or raster), batched.

CSpD (continuous_sd.md 2.9; docs/methods.md#5-continuous-speculative-decoding): the first ``ceil(prefill * L)`` steps by the target
alone; then rounds of gamma draft steps and ONE target forward, verified per token by
``coolsd.engine.continuous.cspd`` with the rule ``mode``:
* ``paper``: log r = log Sigma + l_p0(x0) - l_q0(x0), MAR's noiseless final step (x0 = mu_q0);
* ``exact``: final-step noise, no Sigma; exact given the shared noise.
and the schedule ``verify``:
* ``parallel`` (mode A, the paper's MAR setting, section 2.7 d): the target sees the verified
  tokens only, every drafted token is decided independently and kept (accepted or resampled);
* ``prefix`` (mode B, textbook, lossless with ``exact``): the drafted token of step s is verified
  under the target's condition given exactly the tokens of steps < s (draft tokens included: one
  target forward over gamma + 1 rows of known sets), stop at the first rejection (its resample is
  kept, later drafts dropped), the target's bonus token when all are accepted.

Alignment (2.3): the initial noise and every step's noise of position j come from a generator
seeded by (sample seed, j), shared by draft, target and target-only sampling and independent of
batch and order of work; the generation order, the verification uniforms and the resamples come
from per-sample generators too, so a sample is the same alone or in a batch. Identical draft and
target therefore accept everything (prefix, or parallel at gamma = 1) and reproduce target-only
sampling. Device: every generator is made on the device of the target's parameters and every draw
lands there (verification included: the head's Gaussians stay on the device), so a CUDA model
draws with CUDA generators and no random numbers are drawn on the CPU and copied over. A sample
is a function of (seed, label) on a given device type; CPU and CUDA samples of the same seed
differ (torch's CPU and CUDA generators produce different streams), CPU samples are those of the
CPU-only code before. CFG: both branches share the noise; the scale of step s is the same for draft and
target (``constant``, or MAR's ``linear`` 1 + (w - 1)(s + 1) / L).
Counters per sample: drafted, verified, accepted, resample rounds, fallbacks, target and draft forwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from coolsd.engine.continuous.cspd import verify_exact, verify_paper
from coolsd.engine.continuous.diffusion import HeadSample, Schedule, aligned_sample
from coolsd.engine.model_protocol import NULL_LABEL

MODES = ("exact", "paper")
VERIFY = ("parallel", "prefix")
ORDERS = ("random", "raster")
CFG_SCHEDULES = ("constant", "linear")


@dataclass(frozen=True)
class HeadConfig:
    """The sampling settings draft, target and target-only runs share (MAR's ``sample_tokens``)."""

    steps: int = 100  # respaced diffusion steps of the head
    cfg: float = 1.0
    cfg_schedule: str = "constant"
    temperature: float = 1.0
    order: str = "random"
    clip_x0: float | None = None  # clamp x0_hat to [-c, c] (None: MAR's unclipped chain)

    def __post_init__(self):
        for name, value, valid in (("order", self.order, ORDERS), ("cfg_schedule", self.cfg_schedule, CFG_SCHEDULES)):
            if value not in valid:
                raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
        if self.steps < 2:
            raise ValueError(f"steps (diffusion steps of the head) must be >= 2, got {self.steps}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    def scale(self, step: torch.Tensor, L: int) -> torch.Tensor:
        """(n, 1) guidance scale of each row's generation step."""
        s = step.to(torch.float64).unsqueeze(1)
        return 1 + (self.cfg - 1) * (s + 1) / L if self.cfg_schedule == "linear" else torch.full_like(s, self.cfg)


def _seed(*key) -> int:
    return int(np.random.default_rng(list(key)).integers(2**62))


def position_noise(seed: int, j: int, K: int, C: int, dtype=torch.float64, device=None):
    """(x^(K) (C,), eps (K, C)) of position j of the sample with ``seed``, drawn on ``device``
    (default the CPU) by a generator of that device: the same numbers for a device type whatever
    the batch, different numbers on the CPU and on CUDA (different generators)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    g = torch.Generator(device=device).manual_seed(_seed(seed, j))
    return (torch.randn(C, generator=g, dtype=dtype, device=device),
            torch.randn(K, C, generator=g, dtype=dtype, device=device))


def generation_order(seed: int, L: int, order: str) -> torch.Tensor:
    return torch.arange(L) if order == "raster" else torch.from_numpy(np.random.default_rng([seed, 2]).permutation(L))


@dataclass
class ContinuousResult:
    tokens: torch.Tensor  # (B, L, C) in the model dtype, positions in image (raster) order
    counters: list  # per sample: {drafted, verified, accepted, resample_rounds, fallbacks, target_forwards,
    #                 draft_forwards}; prefix mode verifies drafts up to the first rejection only

    def acceptance_rate(self, b: int) -> float | None:
        c = self.counters[b]
        return c["accepted"] / c["verified"] if c.get("verified") else None


class _Run:
    """The state of one batch: tokens, known mask, orders, per-sample generators and counters,
    all on the device of the target's parameters (``device``)."""

    def __init__(self, model, labels, seeds, hc: HeadConfig, final_noise: bool, final_std: float | None = None,
                 inner_temperature: float = 1.0):
        cfg = model.config
        self.L, self.C, self.hc, self.final_noise, self.final_std = cfg.seq_len, cfg.token_dim, hc, final_noise, final_std
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.labels, self.seeds = labels.to(self.device), list(seeds)
        B = len(self.seeds)
        self.sched = Schedule.respaced(hc.steps)
        self.tokens = torch.zeros(B, self.L, self.C, dtype=self.dtype, device=self.device)
        self.known = torch.zeros(B, self.L, dtype=torch.bool, device=self.device)
        self.order = torch.stack([generation_order(s, self.L, hc.order) for s in self.seeds]).to(self.device)
        self.rank = torch.argsort(self.order, 1)  # rank[b, j]: the step at which position j is generated
        self.gens = [torch.Generator(device=self.device).manual_seed(_seed(s, 1 << 20)) for s in self.seeds]
        self.inner_temperature = inner_temperature  # the paper rule's lam (cspd_generate)
        self.counters = [dict(drafted=0, verified=0, accepted=0, resample_rounds=0, fallbacks=0, target_forwards=0, draft_forwards=0)
                         for _ in self.seeds]

    def conditions(self, model, rows, tokens, known):
        """z (and z_u with CFG) of every position, one forward (both CFG branches in one batch)."""
        labels = self.labels[rows]
        if self.hc.cfg == 1.0:
            return model.conditions(tokens, known, labels), None
        z = model.conditions(torch.cat([tokens, tokens]), torch.cat([known, known]),
                             torch.cat([labels, torch.full_like(labels, NULL_LABEL)]))
        return z.chunk(2)

    def sample(self, model, z, zu, rows, steps) -> HeadSample:
        """The aligned head chain of each row (sample ``rows[i]``, generation step ``steps[i]``);
        z, zu: (B', L, D) conditions of those rows. Densities are returned in float64, on the
        device (verification runs there, with the per-sample generators of that device)."""
        n = len(rows)
        pos = self.order[rows, steps]
        ar = torch.arange(n, device=self.device)
        noise, eps = zip(*(position_noise(self.seeds[int(b)], int(j), self.sched.K, self.C, self.dtype, self.device)
                           for b, j in zip(rows.tolist(), pos.tolist())))
        noise, eps = torch.stack(noise), torch.stack(eps, 1)
        zr, zur = z[ar, pos], None if zu is None else zu[ar, pos]
        cfg = self.hc.scale(steps, self.L).to(device=self.device, dtype=self.dtype)
        h = aligned_sample(model.head, zr, noise, eps, self.sched, z_u=zur, cfg=cfg, tau=self.hc.temperature,
                           final_noise=self.final_noise, clip_x0=self.hc.clip_x0, final_std=self.final_std)
        f = lambda t: t.to(torch.float64)  # noqa: E731
        return HeadSample(h.x0, f(h.mu0), f(h.log_std0), f(h.s))

    def target_step(self, target, step: int):
        """One token per sample by the target alone (lockstep: every sample at ``step``)."""
        rows = torch.arange(len(self.seeds), device=self.device)
        z, zu = self.conditions(target, rows, self.tokens, self.known)
        h = self.sample(target, z, zu, rows, torch.full_like(rows, step))
        pos = self.order[rows, step]
        self.tokens[rows, pos] = h.x0
        self.known[rows, pos] = True
        for c in self.counters:
            c["target_forwards"] += 1

    def verify(self, b: int, mode: str, p: HeadSample, q: HeadSample, max_rounds: int):
        """The rule ``mode`` on sample b's rows of p (target) and q (draft), with b's generator."""
        x0 = q.x0.to(torch.float64)
        if mode == "exact":
            return verify_exact(x0, p.mu0, p.log_std0, q.mu0, q.log_std0, self.gens[b], max_rounds)
        return verify_paper(x0, p.mu0, p.log_std0, q.mu0, q.log_std0, p.s, q.s, self.gens[b], max_rounds,
                            self.inner_temperature)

    def result(self) -> ContinuousResult:
        return ContinuousResult(self.tokens, self.counters)


def check_settings(gamma=1, mode="paper", verify="parallel", prefill=0.0, max_rounds=1, final_std=None,
                   inner_temperature=1.0) -> None:
    """CSpD's settings, each error naming the value and what is valid (before any work)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if verify not in VERIFY:
        raise ValueError(f"unknown verify {verify!r}; valid: {', '.join(VERIFY)}")
    if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1, got {gamma!r}")
    if not 0 <= prefill <= 1:
        raise ValueError(f"prefill must be a fraction in [0, 1], got {prefill}")
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    if final_std is not None and not final_std > 0:
        raise ValueError(f"final_std must be > 0 (or null), got {final_std}")
    if not inner_temperature > 0:
        raise ValueError(f"inner_temperature must be > 0, got {inner_temperature}")


@torch.no_grad()
def ar_generate(target, labels, seeds, hc: HeadConfig, *, final_noise: bool = False,
                final_std: float | None = None) -> ContinuousResult:
    """Target-only sampling, one token per step (MAR with num_iter = seq_len)."""
    run = _Run(target, labels, seeds, hc, final_noise, final_std)
    for s in range(run.L):
        run.target_step(target, s)
    return run.result()


@torch.no_grad()
def cspd_generate(target, draft, labels, seeds, hc: HeadConfig, *, gamma: int = 4, mode: str = "paper",
                  verify: str = "parallel", prefill: float = 0.05, max_rounds: int = 100,
                  final_std: float | None = None, inner_temperature: float = 1.0) -> ContinuousResult:
    """``final_std``: the final step's std s for both models (None: the head's tau sigma_0); the
    exact mode's smoothing (continuous_sd.md 2.9), to be used by the target-only reference too.
    ``inner_temperature``: the paper rule's lam (``coolsd.engine.continuous.cspd.verify_paper``)."""
    check_settings(gamma, mode, verify, prefill, max_rounds, final_std, inner_temperature)
    if (draft.config.seq_len, draft.config.token_dim) != (target.config.seq_len, target.config.token_dim):
        raise ValueError(f"draft and target disagree on (seq_len, token_dim): {(draft.config.seq_len, draft.config.token_dim)}"
                         f" vs {(target.config.seq_len, target.config.token_dim)}")
    run = _Run(target, labels, seeds, hc, mode == "exact", final_std, inner_temperature)  # exact: final noise (2.9)
    m = min(math.ceil(prefill * run.L), run.L)
    for s in range(m):  # token pre-filling (2.5): every sample is at the same step here
        run.target_step(target, s)
    (_parallel if verify == "parallel" else _prefix)(run, target, draft, m, int(gamma), mode, max_rounds)
    return run.result()


def _draft(run: _Run, draft, rows, start, g):
    """g[k] draft steps of sample rows[k] from its step start[k]: returns (draft tokens (R, L, C),
    HeadSample of (R, max g) rows: step j of row k at [k, j], zeros past g[k])."""
    tokens, known = run.tokens[rows].clone(), run.known[rows].clone()
    R, G = len(rows), int(g.max())
    f64 = dict(dtype=torch.float64, device=run.device)
    q = HeadSample(torch.zeros(R, G, run.C, dtype=run.dtype, device=run.device), torch.zeros(R, G, run.C, **f64),
                   torch.zeros(R, G, run.C, **f64), torch.zeros(R, G, **f64))
    for j in range(G):
        live = (g > j).nonzero().squeeze(1)
        z, zu = run.conditions(draft, rows[live], tokens[live], known[live])
        h = run.sample(draft, z, zu, rows[live], start[live] + j)
        pos = run.order[rows[live], start[live] + j]
        tokens[live, pos], known[live, pos] = h.x0, True
        for f in ("x0", "mu0", "log_std0", "s"):
            getattr(q, f)[live, j] = getattr(h, f)
        for b in rows[live].tolist():
            run.counters[b]["draft_forwards"] += 1
    return tokens, q


def _rows(h: HeadSample, idx) -> HeadSample:
    return HeadSample(*(getattr(h, f)[idx] for f in ("x0", "mu0", "log_std0", "s")))


def _count(c: dict, v, take: int, drafted: int):
    c["target_forwards"] += 1
    c["drafted"] += drafted
    c["verified"] += take
    acc, rounds, fb = torch.stack([v.accepted[:take].sum(), v.rounds[:take].sum(), v.fallback[:take].sum()]).tolist()
    c["accepted"] += acc  # one host read for the three counters
    c["resample_rounds"] += rounds
    c["fallbacks"] += fb


def _parallel(run: _Run, target, draft, s: int, gamma: int, mode: str, max_rounds: int):
    B = len(run.seeds)
    rows = torch.arange(B, device=run.device)
    while s < run.L:
        g = min(gamma, run.L - s)
        _, q = _draft(run, draft, rows, torch.full_like(rows, s), torch.full_like(rows, g))
        z, zu = run.conditions(target, rows, run.tokens, run.known)  # the verified tokens only (2.7 d)
        trows = rows.repeat_interleave(g)
        tsteps = (s + torch.arange(g, device=run.device)).repeat(B)
        p = run.sample(target, z[trows], None if zu is None else zu[trows], trows, tsteps)
        for b in range(B):
            v = run.verify(b, mode, _rows(p, slice(b * g, (b + 1) * g)), _rows(q, b),
                           max_rounds)
            pos = run.order[b, s:s + g]
            run.tokens[b, pos] = v.tokens.to(device=run.device, dtype=run.dtype)  # every token kept: no rollback
            run.known[b, pos] = True
            _count(run.counters[b], v, g, g)
        s += g


def _prefix(run: _Run, target, draft, m: int, gamma: int, mode: str, max_rounds: int):
    n = torch.full((len(run.seeds),), m, dtype=torch.long, device=run.device)  # tokens done per sample
    while bool((n < run.L).any()):
        rows = (n < run.L).nonzero().squeeze(1)
        g = (run.L - n[rows]).clamp(max=gamma)
        dtok, q = _draft(run, draft, rows, n[rows], g)
        # one target forward: row (k, j), j = 0..g[k], knows the steps < n + j of sample rows[k] (drafts included)
        rk = torch.repeat_interleave(torch.arange(len(rows), device=run.device), g + 1)
        rj = torch.cat([torch.arange(int(x) + 1, device=run.device) for x in g])
        tr = rows[rk]
        z, zu = run.conditions(target, tr, dtok[rk], run.rank[tr] < (n[tr] + rj).unsqueeze(1))
        first = torch.cumsum(g + 1, 0) - (g + 1)  # the row of (k, 0)
        sel = torch.cat([first[k] + torch.arange(int(g[k]), device=run.device) for k in range(len(rows))])
        p = run.sample(target, z[sel], None if zu is None else zu[sel], tr[sel], n[tr[sel]] + rj[sel])
        bonus, i0 = [], 0
        for k, b in enumerate(rows.tolist()):
            gk = int(g[k])
            v = run.verify(b, mode, _rows(p, slice(i0, i0 + gk)), _rows(q, (k, slice(0, gk))), max_rounds)
            i0 += gk
            acc = v.accepted.tolist()
            take = acc.index(False) + 1 if False in acc else gk  # the accepted drafts, then the resample
            pos = run.order[b, int(n[b]):int(n[b]) + take]
            run.tokens[b, pos] = v.tokens[:take].to(device=run.device, dtype=run.dtype)
            run.known[b, pos] = True
            _count(run.counters[b], v, take, gk)
            n[b] += take
            if all(acc) and int(n[b]) < run.L:
                bonus.append((k, b))
        if bonus:  # the target's own token after g accepted drafts: its condition is row (k, g[k])
            sel = torch.tensor([int(first[k] + g[k]) for k, _ in bonus], device=run.device)
            bs = torch.tensor([b for _, b in bonus], device=run.device)
            h = run.sample(target, z[sel], None if zu is None else zu[sel], bs, n[bs])
            pos = run.order[bs, n[bs]]
            run.tokens[bs, pos], run.known[bs, pos] = h.x0, True
            n[bs] += 1
