"""The one generation loop of continuous-token models: target-only sampling and CSpD speculative
decoding, batched, in autoregressive STEPS of ``unit`` tokens along a per-sample order. A model
family (``DiffusionFamily``, ``FlowFamily``) says how a step's tokens are sampled; the loop, the
rounds, the verification and the counters are shared:
* diffusion-head models (MAR-style ``conditions`` + ``head``, e.g. ``coolsd.models.mar.MAR``,
  ``coolsd.models.harmon.Harmon``) along MAR's random order or raster (``HeadConfig``): one token per
  step, or upstream's MaskGIT-cosine steps of several tokens (``HeadConfig.num_iter``, ``maskgit_steps``);
* flow models (xAR-style ``context_all`` + ``velocity_at``, ``coolsd.models.xar.XAR``), ``unit``
  tokens per step along the cell order, each step one Euler-Maruyama chain (``FlowConfig``,
  ``coolsd.engine.continuous.flow``).

CSpD (continuous_sd.md 2.9; docs/methods.md#5-continuous-speculative-decoding): the first
``ceil(prefill * n_steps)`` steps by the target alone; then rounds of gamma draft steps and ONE
target call, verified per token by ``coolsd.engine.continuous.cspd`` with the rule ``mode``:
* ``paper``: log r = log Sigma + l_p0(x0) - l_q0(x0), the noiseless final step (x0 = mu_q0);
* ``exact``: final-step noise, no Sigma; exact given the shared noise.
and the schedule ``verify``:
* ``parallel`` (mode A, the paper's MAR setting, section 2.7 d): the target sees the verified
  tokens only, every drafted token is decided independently and kept (accepted or resampled);
* ``prefix`` (mode B, textbook, lossless with ``exact``): the drafted tokens of step s are verified
  under the target's condition given exactly the tokens of steps < s (draft tokens included: one
  target call over gamma + 1 known sets), stop at the first step with a rejected token (that step's
  accepted drafts and resamples are kept, later drafts dropped), the target's bonus step when all
  are accepted (computed in the same target call). Within a step, tokens are independent given the
  shared noise (each is N(mu_p, s^2) given it), so the per-token coupling is exact for the step.
Steps may hold different numbers of tokens (``bounds``, the same for every sample): gamma counts steps,
the counters count tokens.

Alignment (2.3): the initial noise and every chain step's noise of position j come from a generator
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
target (diffusion: ``constant``, or MAR's ``linear`` 1 + (w - 1)(s + 1) / L; flow: the weight of the
step's cell, ``flow.cfg_schedule``).
Counters per sample (tokens, not steps): drafted, verified, accepted, resample rounds, fallbacks;
target and draft forwards (calls of the model per step: a flow call is one context pass and
num_steps velocity passes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from coolsd.engine.continuous.cspd import verify_exact, verify_paper
from coolsd.engine.continuous.annealing import CLIP_TIMESTEP, annealed_steps, check_annealing
from coolsd.engine.continuous.diffusion import HeadSample, Schedule, aligned_sample, check_sampler
from coolsd.engine.continuous.flow import (DEFAULT_FINAL_STD, FlowConfig, cfg_schedule, guide, schedule_log_var_sum,
                                           time_grid, transition)
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
    sampler: str = "ddpm"  # the head's chain: ddpm (MAR's) or ddim (coolsd.engine.continuous.diffusion)
    eta: float = 0.0  # DDIM's noise scale in [0, 1] (0: deterministic steps k >= 1); ddpm: 0
    num_iter: int | None = None  # AR steps: None = one token a step; n = MaskGIT-cosine steps (``maskgit_steps``)
    # DiSA (coolsd.engine.continuous.annealing): head steps annealed from ``steps`` (the first AR
    # iteration) to ``lower_steps`` (the last) by ``anneal`` (linear, cosine, constant, two-stage);
    # None: every token runs ``steps``
    anneal: str | None = None
    lower_steps: int | None = None

    def __post_init__(self):
        for name, value, valid in (("order", self.order, ORDERS), ("cfg_schedule", self.cfg_schedule, CFG_SCHEDULES)):
            if value not in valid:
                raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
        check_sampler(self.sampler, self.eta)
        if self.steps < 2:
            raise ValueError(f"steps (diffusion steps of the head) must be >= 2, got {self.steps}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.num_iter is not None and (isinstance(self.num_iter, bool) or int(self.num_iter) != self.num_iter
                                          or self.num_iter < 1):
            raise ValueError(f"num_iter (AR steps) must be an integer >= 1 or null (one token a step), got {self.num_iter!r}")
        if self.anneal is not None:
            check_annealing(self.anneal, self.steps, self.lower_steps)
            if self.sampler != "ddpm":  # DiSA's sampler is MAR's DDPM chain (its DDIM clips elsewhere)
                raise ValueError(f"DiSA's annealing runs the ddpm head sampler, not {self.sampler!r}")
        elif self.lower_steps is not None:
            raise ValueError(f"lower_steps={self.lower_steps!r} is DiSA's last-iteration head steps: it needs an "
                             "annealing strategy (anneal)")


def maskgit_steps(L: int, num_iter: int | None) -> tuple[list[int], list[int]]:
    """``maskgit_iterations`` less the iterations: (bounds, known)."""
    return maskgit_iterations(L, num_iter)[:2]


def maskgit_iterations(L: int, num_iter: int | None) -> tuple[list[int], list[int], list[int]]:
    """(bounds, known): step s generates the tokens bounds[s] .. bounds[s + 1] - 1 of the order, and its
    ``linear`` CFG scale is 1 + (w - 1) known[s] / L. ``num_iter`` None: one token a step, known[s] = s + 1
    (MAR's ``num_iter = L`` as this loop has always run it). Otherwise upstream's MaskGIT cosine schedule
    (MAR ``sample_tokens``, Harmon ``Harmon.sample``, harmon_upstream.md 2.1): after step s,
    mask_len = max(1, min(masked - 1, floor(L cos(pi/2 (s + 1) / num_iter)))) tokens stay masked, the
    last step takes all that remain, and known[s] = L - mask_len (the clamped value, before the last
    step's override, as upstream). Steps that would reveal no token are dropped (no work, no draw);
    ``iters[s]``: the upstream iteration index of step s (what DiSA's annealing reads)."""
    if num_iter is None:
        return list(range(L + 1)), list(range(1, L + 1)), list(range(L))
    bounds, known, iters, masked = [0], [], [], L
    for step in range(num_iter):
        mask_len = max(1, min(masked - 1, math.floor(L * np.cos(math.pi / 2.0 * (step + 1) / num_iter))))
        nxt = 0 if step >= num_iter - 1 else mask_len
        if nxt < masked:  # nxt <= masked always; equal: the step reveals nothing
            bounds.append(L - nxt)
            known.append(L - mask_len)
            iters.append(step)
        masked = nxt
        if masked == 0:
            break
    return bounds, known, iters


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
    #                 draft_forwards}; prefix mode verifies drafts up to the first rejected step only

    def acceptance_rate(self, b: int) -> float | None:
        c = self.counters[b]
        return c["accepted"] / c["verified"] if c.get("verified") else None


def _f64(h: HeadSample) -> HeadSample:
    f = lambda t: t.to(torch.float64)  # noqa: E731
    return HeadSample(h.x0, f(h.mu0), f(h.log_std0), f(h.s))


class DiffusionFamily:
    """MAR-style models: ``model.conditions(tokens, known, labels)`` gives one condition per position
    (both CFG branches in one batch), ``model.head`` runs the aligned DDPM or DDIM chain of each
    token (``hc.sampler``, ``coolsd.engine.continuous.diffusion``); one token per step."""

    def __init__(self, model, hc: HeadConfig):
        self.hc, self.L, self.C = hc, model.config.seq_len, model.config.token_dim
        self.bounds, known, iters = maskgit_iterations(self.L, hc.num_iter)
        self.n_steps = len(self.bounds) - 1
        if hc.anneal is None:
            self.sched = Schedule.respaced(hc.steps, sampler=hc.sampler, eta=hc.eta)
            self.step_scheds = None
        else:  # DiSA: each step's schedule from its upstream iteration (num_iter, or one token a step: L)
            nominal = annealed_steps(hc.anneal, hc.steps, hc.lower_steps, hc.num_iter or self.L)
            scheds = {k: Schedule.respaced(k, clip_timestep=CLIP_TIMESTEP) for k in set(nominal)}
            self.step_scheds = [scheds[nominal[i]] for i in iters]
            self.sched = self.step_scheds[0]
        self.chain_steps = self.sched.K  # steps of the chain (the first step's, where they vary)
        self.known_after = torch.tensor(known, dtype=torch.float64, device=next(model.parameters()).device)

    def positions(self, seed: int) -> torch.Tensor:
        return generation_order(seed, self.L, self.hc.order)

    def scale(self, step: torch.Tensor) -> torch.Tensor:
        """(n, 1) guidance scale of each row's generation step (``maskgit_steps``)."""
        if self.hc.cfg_schedule != "linear":
            return torch.full((len(step), 1), self.hc.cfg, dtype=torch.float64, device=step.device)
        return 1 + (self.hc.cfg - 1) * self.known_after[step].unsqueeze(1) / self.L

    def check_draft(self, draft) -> None:
        got, want = (draft.config.seq_len, draft.config.token_dim), (self.L, self.C)
        if got != want:
            raise ValueError(f"draft and target disagree on (seq_len, token_dim): {got} vs {want}")

    def prepare(self, run: _Run, model, rows, tokens, known):
        """z (and z_u with CFG) of every position of each entry, one forward (both CFG branches in one batch)."""
        labels = run.labels[rows]
        if self.hc.cfg == 1.0:
            return model.conditions(tokens, known, labels), None
        z = model.conditions(torch.cat([tokens, tokens]), torch.cat([known, known]),
                             torch.cat([labels, torch.full_like(labels, NULL_LABEL)]))
        return z.chunk(2)

    def sample(self, run: _Run, model, ctx, entry, rows, steps) -> HeadSample:
        """The aligned head chains of the tokens of query q's step: sample ``rows[q]``, step ``steps[q]``,
        conditions of ctx entry ``entry[q]``; token rows query-major, in order within a step. Densities
        in float64, on the device."""
        z, zu = ctx
        owner, pos, _ = run.tokens_of(rows, steps)
        b, e = rows[owner], entry[owner]
        zr, zur = z[e, pos], None if zu is None else zu[e, pos]
        cfg = self.scale(steps[owner]).to(device=run.device, dtype=run.dtype)

        def chains(i, sched: Schedule) -> HeadSample:  # the token rows i, all on ``sched``
            noise, eps = run.noise(b[i], pos[i], sched.K)
            return _f64(aligned_sample(model.head, zr[i], noise, eps, sched, z_u=None if zur is None else zur[i],
                                       cfg=cfg[i], tau=self.hc.temperature, final_noise=run.final_noise,
                                       clip_x0=self.hc.clip_x0, final_std=run.final_std))

        if self.step_scheds is None:
            return chains(slice(None), self.sched)
        # DiSA: every token of a step runs its step's chain; the tokens of one chain together
        return by_key([self.step_scheds[s] for s in steps[owner].tolist()], 1, run.device, chains)


class FlowFamily:
    """xAR-style flow models: ``model.context_all`` gives the keys of every position of clean tokens,
    unit-causal, and ``model.velocity_at`` the velocity of query tokens that see the keys of the known
    steps and their own step; a step is ``unit`` consecutive positions of ``model.cell_positions()``
    (cell order), sampled by the Euler-Maruyama chain of ``coolsd.engine.continuous.flow`` from
    aligned noise: position j's x^(K) starts the chain, eps_k drives step i = K-1-k (k = K-1 .. 1) and
    eps_0 is the final noise (exact mode). The final std s is shared (``final_std``, default
    ``DEFAULT_FINAL_STD``) and S is the schedule's constant, so log Sigma = 0 (flow module docstring)."""

    def __init__(self, model, fc: FlowConfig, final_std: float | None):
        c = model.config
        self.fc, self.L, self.C, self.cell_len = fc, c.seq_len, c.token_dim, c.cell_len
        self.unit = fc.unit_for(c.cell_len, c.n_cells)
        self.n_steps, self.n_cells = self.L // self.unit, c.n_cells
        self.bounds = list(range(0, self.L + 1, self.unit))
        self.chain_steps = fc.num_steps
        device = next(model.parameters()).device
        self.order = model.cell_positions().to(device)  # (L,) raster index of cell-order position i
        self.cell_weight = torch.tensor([cfg_schedule(fc.cfg, k, c.n_cells) for k in range(c.n_cells)],
                                        dtype=torch.float64, device=device)  # CFG weight of each cell
        self.final_std = DEFAULT_FINAL_STD if final_std is None else float(final_std)
        self.geometry = (c.seq_len, c.token_dim, c.grid, c.cell)
        # DiSA: cell c's SDE steps (xAR_DiSA anneals by cell, its AR iteration; every unit of a cell alike)
        self.cell_steps = (None if fc.anneal is None else
                           annealed_steps(fc.anneal, fc.num_steps, fc.lower_steps, self.n_cells))
        # every chain length's time grid and schedule constant S (log Sigma = 0: draft and target share it)
        self.grids = {K: (time_grid(K), schedule_log_var_sum(K, self.C))
                      for K in (self.cell_steps or [fc.num_steps])}

    def positions(self, seed: int) -> torch.Tensor:
        return self.order

    def check_draft(self, draft) -> None:
        c = draft.config
        got = (c.seq_len, c.token_dim, getattr(c, "grid", None), getattr(c, "cell", None))
        if got != self.geometry:
            raise ValueError(f"draft and target disagree on (seq_len, token_dim, grid, cell): {got} vs {self.geometry}")

    def prepare(self, run: _Run, model, rows, tokens, known):
        """Entries e = (sample rows[e], known steps < sees[e]); one context per distinct sample (the
        entries of one sample share its tokens on their known steps, which is all a unit-causal key
        depends on). With CFG the null-label half follows the labelled half."""
        uniq, inv = torch.unique(rows, return_inverse=True)
        first = torch.full((len(uniq),), len(rows), dtype=torch.long, device=rows.device).scatter_reduce(
            0, inv, torch.arange(len(rows), device=rows.device), "amin")  # the first entry of each sample
        cells = tokens[first][:, self.order]  # (U, L, C) cell order
        labels = run.labels[uniq]
        if self.fc.cfg > 1:
            cells, labels = torch.cat([cells, cells]), torch.cat([labels, torch.full_like(labels, NULL_LABEL)])
        sees = known.sum(1) // self.unit
        return dict(kv=model.context_all(cells, labels, self.unit), labels=labels, inv=inv, sees=sees, U=len(uniq))

    def sample(self, run: _Run, model, ctx, entry, rows, steps) -> HeadSample:
        """The aligned chains of query steps: query q is step ``steps[q]`` of sample ``rows[q]`` seeing
        the known steps of ctx entry ``entry[q]``; the queries of one sample run together (each sees
        its own step's tokens and the keys of its entry's known steps). Returns (Q * unit) token rows,
        query-major. The chain runs in float64 (upstream's state dtype), the model in its own. Under
        DiSA the queries of each chain length run together."""
        def chains(q, K: int) -> HeadSample:
            return self._sample(run, model, ctx, entry[q], rows[q], steps[q], K)

        if self.cell_steps is None:
            return chains(slice(None), self.chain_steps)
        return by_key([self.cell_steps[s * self.unit // self.cell_len] for s in steps.tolist()], self.unit, run.device,
                      chains)

    def _sample(self, run: _Run, model, ctx, entry, rows, steps, K: int) -> HeadSample:
        """``sample`` for queries whose chains all run K steps (``grids[K]``: time grid, schedule constant)."""
        grid, S = self.grids[K]
        u, L, C, dev = self.unit, self.L, self.C, run.device
        Q = len(entry)
        g = ctx["inv"][entry]  # context row of each query
        counts = torch.bincount(g, minlength=ctx["U"])
        by_row = torch.argsort(g, stable=True)  # the query's place among its context's queries, in query order
        slot = torch.empty_like(g)
        slot[by_row] = torch.arange(Q, device=dev) - (torch.cumsum(counts, 0) - counts)[g[by_row]]
        used = (counts > 0).nonzero().squeeze(1)
        R, M = len(used), int(counts.max())
        row_of = torch.full((ctx["U"],), -1, dtype=torch.long, device=dev)
        row_of[used] = torch.arange(R, device=dev)
        qr, T = row_of[g], M * u  # query -> batch row; T query tokens per row
        tok = slot[:, None] * u + torch.arange(u, device=dev)  # (Q, u) column of each token in its row
        cell_pos = steps[:, None] * u + torch.arange(u, device=dev)  # (Q, u) cell-order positions
        img_pos = run.order[rows[:, None], cell_pos]  # (Q, u) raster positions
        noise, eps = run.noise(rows.repeat_interleave(u), img_pos.reshape(-1), K)
        noise = noise.double().view(Q, u, C)
        eps = eps.double().view(-1, Q, u, C)
        pos = torch.zeros(R, T, dtype=torch.long, device=dev)
        pos[qr[:, None], tok] = cell_pos
        limit = torch.zeros(R, T, dtype=torch.long, device=dev)  # cache keys < limit are visible
        limit[qr[:, None], tok] = (ctx["sees"][entry] * u)[:, None].expand(Q, u)
        blk = torch.full((R, T), -1, dtype=torch.long, device=dev)  # query block id (-1: padding)
        blk[qr[:, None], tok] = slot[:, None].expand(Q, u)
        keys = torch.arange(L, device=dev)[None, None, :] < limit[:, :, None]
        self_vis = (blk[:, :, None] == blk[:, None, :]) & (blk[:, None, :] >= 0)
        self_vis |= torch.eye(T, dtype=torch.bool, device=dev)[None]  # padding sees itself (no empty row)
        visible = torch.cat([keys, self_vis], 2)
        w = self.cell_weight[cell_pos // self.cell_len][..., None]  # (Q, u, 1)
        halves = self.fc.cfg > 1
        ctx_rows = used if not halves else torch.cat([used, used + ctx["U"]])
        kv = [(k[ctx_rows], v[ctx_rows]) for k, v in ctx["kv"]]
        labels = ctx["labels"][ctx_rows]
        dup = (lambda z: torch.cat([z, z])) if halves else (lambda z: z)
        x = noise
        for i in range(K):
            t, dt = float(grid[i]), float(grid[i + 1] - grid[i])
            xb = torch.zeros(R, T, C, dtype=run.dtype, device=dev)
            xb[qr[:, None], tok] = x.to(run.dtype)
            v = model.velocity_at(kv, dup(xb), dup(pos), t, labels, dup(visible)).double()
            vq = v[qr[:, None], tok]  # (Q, u, C) labelled half
            if halves:
                vq = guide(vq, v[R:][qr[:, None], tok], w)
            mean, std = transition(x, vq, t, dt, last=i == K - 1)
            x = mean + std * eps[K - 1 - i] if std else mean
        mu0 = x.reshape(Q * u, C)
        s0 = torch.full_like(mu0, math.log(self.final_std))
        x0 = mu0 + self.final_std * eps[0].reshape(Q * u, C) if run.final_noise else mu0
        return HeadSample(x0.to(run.dtype), mu0, s0, torch.full((Q * u,), S, dtype=torch.float64, device=dev))


def by_key(keys: list, width: int, device, run) -> HeadSample:
    """DiSA's chains of several lengths in one call: ``run(q, key)`` for the queries q (an index
    tensor) sharing each key, first seen first; each query's ``width`` token rows put back in query
    order."""
    groups: dict = {}  # key -> its queries (a dict: one hash lookup a query, identity first)
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    parts, where = [], []
    for key, idx in groups.items():
        q = torch.tensor(idx, device=device)
        parts.append(run(q, key))
        where.append((q[:, None] * width + torch.arange(width, device=device)).reshape(-1))
    order = torch.argsort(torch.cat(where))
    return HeadSample(*(torch.cat([getattr(p, f) for p in parts])[order] for f in ("x0", "mu0", "log_std0", "s")))


def family_for(model, settings, final_std=None):
    """The family of ``settings``: ``HeadConfig`` -> ``DiffusionFamily``, ``FlowConfig`` -> ``FlowFamily``."""
    if isinstance(settings, FlowConfig):
        if not hasattr(model, "velocity_at"):
            raise ValueError(f"FlowConfig needs a flow model (context_all / velocity_at), got {type(model).__name__}")
        return FlowFamily(model, settings, final_std)
    if isinstance(settings, HeadConfig):
        if not hasattr(model, "head"):
            raise ValueError(f"HeadConfig needs a diffusion-head model (conditions / head), got {type(model).__name__}")
        return DiffusionFamily(model, settings)
    raise TypeError(f"sampling settings must be a HeadConfig or a FlowConfig, got {type(settings).__name__}")


class _Run:
    """The state of one batch: tokens, known mask, each sample's generation order (``order`` (B, L):
    the positions in the order they are generated), the family's steps (step s generates order
    entries ``bounds[s]`` .. ``bounds[s + 1] - 1``; the same for every sample) and the step of each
    position (``rank``), per-sample generators and counters, all on the device of the target's
    parameters (``device``)."""

    def __init__(self, model, labels, seeds, settings, final_noise: bool, final_std: float | None = None,
                 inner_temperature: float = 1.0):
        self.fam = family_for(model, settings, final_std)
        self.L, self.C, self.n_steps = self.fam.L, self.fam.C, self.fam.n_steps
        self.final_noise, self.final_std = final_noise, final_std
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.labels, self.seeds = labels.to(self.device), list(seeds)
        B = len(self.seeds)
        self.tokens = torch.zeros(B, self.L, self.C, dtype=self.dtype, device=self.device)
        self.known = torch.zeros(B, self.L, dtype=torch.bool, device=self.device)
        self.order = torch.stack([self.fam.positions(s) for s in self.seeds]).to(self.device)
        self.bl = list(self.fam.bounds)  # host copy: slicing without device reads
        self.bounds = torch.tensor(self.bl, dtype=torch.long, device=self.device)
        self.sizes = self.bounds.diff()  # tokens of each step
        self.rank = torch.empty(B, self.L, dtype=torch.long, device=self.device)  # rank[b, j]: the step of j
        steps = torch.repeat_interleave(torch.arange(self.n_steps, device=self.device), self.sizes, output_size=self.L)
        self.rank.scatter_(1, self.order, steps.expand(B, -1).contiguous())
        self.gens = [torch.Generator(device=self.device).manual_seed(_seed(s, 1 << 20)) for s in self.seeds]
        self.inner_temperature = inner_temperature  # the paper rule's lam (cspd_generate)
        self.counters = [dict(drafted=0, verified=0, accepted=0, resample_rounds=0, fallbacks=0, target_forwards=0, draft_forwards=0)
                         for _ in self.seeds]

    def tokens_of(self, rows, steps):
        """The tokens of step ``steps[q]`` of sample ``rows[q]``, query-major, in order within a step:
        (owner q (N,), position (N,), place within its step (N,))."""
        cnt = self.sizes[steps]
        owner = torch.repeat_interleave(torch.arange(len(steps), device=self.device), cnt)
        within = torch.arange(len(owner), device=self.device) - (torch.cumsum(cnt, 0) - cnt)[owner]
        return owner, self.order[rows[owner], self.bounds[steps][owner] + within], within

    def noise(self, rows, pos, K: int):
        """(x^(K) (n, C), eps (K, n, C)) of the positions ``pos`` of samples ``rows`` (``position_noise``),
        for chains of K steps."""
        noise, eps = zip(*(position_noise(self.seeds[int(b)], int(j), K, self.C, self.dtype, self.device)
                           for b, j in zip(rows.tolist(), pos.tolist())))
        return torch.stack(noise), torch.stack(eps, 1)

    def prepare(self, model, rows, tokens, known):
        return self.fam.prepare(self, model, rows, tokens, known)

    def sample(self, model, ctx, entry, rows, steps) -> HeadSample:
        return self.fam.sample(self, model, ctx, entry, rows, steps)

    def write(self, rows, steps, x0):
        """Tokens x0 ((N, C), ``tokens_of`` order) of step ``steps[i]`` of sample ``rows[i]``, now known."""
        owner, p, _ = self.tokens_of(rows, steps)
        self.tokens[rows[owner], p] = x0.to(device=self.device, dtype=self.dtype)
        self.known[rows[owner], p] = True

    def target_step(self, target, step: int):
        """One step per sample by the target alone (lockstep: every sample at ``step``)."""
        rows = torch.arange(len(self.seeds), device=self.device)
        ctx = self.prepare(target, rows, self.tokens, self.known)
        self.write(rows, torch.full_like(rows, step), self.sample(target, ctx, rows, rows, torch.full_like(rows, step)).x0)
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
def ar_generate(target, labels, seeds, hc, *, final_noise: bool = False,
                final_std: float | None = None) -> ContinuousResult:
    """Target-only sampling, one step at a time (MAR with num_iter = seq_len; xAR with unit tokens a step)."""
    run = _Run(target, labels, seeds, hc, final_noise, final_std)
    for s in range(run.n_steps):
        run.target_step(target, s)
    return run.result()


@torch.no_grad()
def cspd_generate(target, draft, labels, seeds, hc, *, gamma: int = 4, mode: str = "paper",
                  verify: str = "parallel", prefill: float = 0.05, max_rounds: int = 100,
                  final_std: float | None = None, inner_temperature: float = 1.0) -> ContinuousResult:
    """``hc``: a ``HeadConfig`` or a ``FlowConfig`` (the family). ``final_std``: the final step's std s for
    both models (None: the head's tau sigma_0; a flow's ``DEFAULT_FINAL_STD``); the exact mode's
    smoothing (continuous_sd.md 2.9), to be used by the target-only reference too. ``gamma``: draft
    STEPS per round. ``inner_temperature``: the paper rule's lam (``coolsd.engine.continuous.cspd.verify_paper``)."""
    check_settings(gamma, mode, verify, prefill, max_rounds, final_std, inner_temperature)
    run = _Run(target, labels, seeds, hc, mode == "exact", final_std, inner_temperature)  # exact: final noise (2.9)
    run.fam.check_draft(draft)
    m = min(math.ceil(prefill * run.n_steps), run.n_steps)
    for s in range(m):  # token pre-filling (2.5): every sample is at the same step here
        run.target_step(target, s)
    (_parallel if verify == "parallel" else _prefix)(run, target, draft, m, int(gamma), mode, max_rounds)
    return run.result()


def _draft(run: _Run, draft, rows, start, g):
    """g[k] draft steps of sample rows[k] from its step start[k]: returns (draft tokens (R, L, C),
    HeadSample of (R, T) rows, T the most tokens of any row's g steps: the tokens of row k's steps in
    order at [k, 0 ..], zeros past them)."""
    tokens, known = run.tokens[rows].clone(), run.known[rows].clone()
    R, G = len(rows), int(g.max())
    T = int((run.bounds[start + g] - run.bounds[start]).max())
    f64 = dict(dtype=torch.float64, device=run.device)
    q = HeadSample(torch.zeros(R, T, run.C, dtype=run.dtype, device=run.device), torch.zeros(R, T, run.C, **f64),
                   torch.zeros(R, T, run.C, **f64), torch.zeros(R, T, **f64))
    for j in range(G):
        live = (g > j).nonzero().squeeze(1)
        ctx = run.prepare(draft, rows[live], tokens[live], known[live])
        steps = start[live] + j
        h = run.sample(draft, ctx, torch.arange(len(live), device=run.device), rows[live], steps)
        owner, p, within = run.tokens_of(rows[live], steps)
        k = live[owner]
        tokens[k, p] = h.x0
        known[k, p] = True
        col = (run.bounds[steps] - run.bounds[start[live]])[owner] + within  # place among row k's drafted tokens
        for f in ("x0", "mu0", "log_std0", "s"):
            getattr(q, f)[k, col] = getattr(h, f)
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
    B, bl = len(run.seeds), run.bl
    rows = torch.arange(B, device=run.device)
    while s < run.n_steps:
        g = min(gamma, run.n_steps - s)
        _, q = _draft(run, draft, rows, torch.full_like(rows, s), torch.full_like(rows, g))
        ctx = run.prepare(target, rows, run.tokens, run.known)  # the verified tokens only (2.7 d)
        trows = rows.repeat_interleave(g)
        tsteps = (s + torch.arange(g, device=run.device)).repeat(B)
        p = run.sample(target, ctx, trows, trows, tsteps)
        n = bl[s + g] - bl[s]  # tokens of the g steps (the same for every sample)
        for b in range(B):
            v = run.verify(b, mode, _rows(p, slice(b * n, (b + 1) * n)), _rows(q, b), max_rounds)
            pos = run.order[b, bl[s]:bl[s + g]]
            run.tokens[b, pos] = v.tokens.to(device=run.device, dtype=run.dtype)  # every token kept: no rollback
            run.known[b, pos] = True
            _count(run.counters[b], v, n, n)
        s += g


def _prefix(run: _Run, target, draft, m: int, gamma: int, mode: str, max_rounds: int):
    dev, bl = run.device, run.bl
    n = torch.full((len(run.seeds),), m, dtype=torch.long, device=dev)  # steps done per sample
    while bool((n < run.n_steps).any()):
        rows = (n < run.n_steps).nonzero().squeeze(1)
        g = (run.n_steps - n[rows]).clamp(max=gamma)
        dtok, q = _draft(run, draft, rows, n[rows], g)
        # one target call: entry (k, j), j = 0..g[k], knows the steps < n + j of sample rows[k] (drafts
        # included); queries: step n + j of every entry with j < g[k], and j = g[k] (the bonus) if it exists
        rk = torch.repeat_interleave(torch.arange(len(rows), device=dev), g + 1)
        rj = torch.cat([torch.arange(int(x) + 1, device=dev) for x in g])
        tr = rows[rk]
        ctx = run.prepare(target, tr, dtok[rk], run.rank[tr] < (n[tr] + rj).unsqueeze(1))
        sel = ((rj < g[rk]) | (n[tr] + rj < run.n_steps)).nonzero().squeeze(1)
        qsteps = n[tr[sel]] + rj[sel]
        p = run.sample(target, ctx, sel, tr[sel], qsteps)
        cnt = run.sizes[qsteps]
        qoff = torch.zeros(len(rk), dtype=torch.long, device=dev)
        qoff[sel] = torch.cumsum(cnt, 0) - cnt  # entry -> the first token of its query in p
        first = torch.cumsum(g + 1, 0) - (g + 1)  # the entry of (k, 0)
        for k, b in enumerate(rows.tolist()):
            gk, nb = int(g[k]), int(n[b])
            i0, nt = int(qoff[first[k]]), bl[nb + gk] - bl[nb]
            v = run.verify(b, mode, _rows(p, slice(i0, i0 + nt)), _rows(q, (k, slice(0, nt))), max_rounds)
            step = run.rank[b, run.order[b, bl[nb]:bl[nb] + nt]] - nb  # each verified token's step, 0 .. gk - 1
            rejected = torch.zeros(gk, dtype=torch.long, device=dev).index_add_(0, step, (~v.accepted).long())
            acc = (rejected == 0).tolist()
            take = acc.index(False) + 1 if False in acc else gk  # the accepted steps, then the one with a resample
            nk = bl[nb + take] - bl[nb]
            pos = run.order[b, bl[nb]:bl[nb] + nk]
            run.tokens[b, pos] = v.tokens[:nk].to(device=dev, dtype=run.dtype)
            run.known[b, pos] = True
            _count(run.counters[b], v, nk, nt)
            n[b] += take
            if all(acc) and int(n[b]) < run.n_steps:  # the target's own step after gk accepted: entry (k, gk)
                ib, nbonus = int(qoff[first[k] + gk]), bl[nb + gk + 1] - bl[nb + gk]
                run.write(torch.tensor([b], device=dev), n[b:b + 1].clone(), p.x0[ib:ib + nbonus])
                n[b] += 1
