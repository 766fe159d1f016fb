"""Drafters: who proposes the tree each round (docs/methods.md#11-chain-drafting, #12-static-tree-drafting and #4-sjd).

``ModelDrafter`` wraps any ``ARModel`` (an EAGLE-1 head, a small AR model, the tabular lab
model, the target itself) and expands a static tree level by level, sampling each node's
children without replacement. ``JacobiDrafter`` is SJD's training-free drafter: last
iteration's target samples plus uniform random tokens. Both return, for every node, its token
and the conditional draft distribution it was drawn from; verification is shared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from coolsd.engine.compiled import compile_step, compiling
from coolsd.engine.decoding.sampling import normalize, sample_inverse_cdf, sample_without_replacement, warp_probs
from coolsd.engine.decoding.trees import Tree, pac_tree
from coolsd.engine.host_reads import host_checks
from coolsd.engine.model_protocol import ARModel, StepOut
from coolsd.util.registry import Registry


@dataclass(frozen=True)
class SamplingConfig:
    """Logit warpers applied identically to target and drafter (docs/methods.md#0-notation)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def resolve(cls, target_defaults=None, overrides=None) -> "SamplingConfig":
        """The target's protocol values (``target.sampling``), then every non-null entry of
        ``overrides`` (the top-level ``sampling``: ``python run.py sampling.top_k=0``)."""
        values = {}
        for source in (target_defaults or {}, overrides or {}):
            for k, v in dict(source).items():
                if k not in cls.__dataclass_fields__:
                    raise ValueError(f"unknown sampling option {k!r}; valid: {sorted(cls.__dataclass_fields__)}")
                if v is not None:
                    values[k] = v
        out = cls(**values)
        if out.temperature < 0 or out.top_k < 0 or not 0 < out.top_p <= 1:
            raise ValueError(f"invalid sampling {out}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1")
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_probs(logits, self.temperature, self.top_k, self.top_p)


@dataclass
class RoundInfo:
    """What a drafter may observe after verification."""

    tokens: torch.Tensor  # (B, n+1) tree tokens, node 0 = root
    path: torch.Tensor  # (B, D) accepted nodes
    n_accepted: torch.Tensor  # (B,)
    emitted: torch.Tensor  # (B,) -1 where none
    target_probs: torch.Tensor  # (B, n+1, V)
    target_hidden: Optional[torch.Tensor]  # (B, n+1, H)


def _gather_nodes(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: (B, n, ...) , idx: (B, K) -> (B, K, ...)."""
    shape = idx.shape + x.shape[2:]
    flat = idx.reshape(idx.shape[0], -1, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:])
    return torch.gather(x, 1, flat).reshape(shape)


class ModelDrafter:
    """Tree drafting with any AR model; EAGLE-1 feature hand-over when the model uses features.

    Feature convention (EAGLE-1): the drafter input at an entry is (token x_{t+1}, feature f_t),
    where f_t is the target's hidden state at the entry BEFORE it; inside the drafted tree the
    parent's drafter output stands in for f_t.
    """

    def __init__(self, model: ARModel, sampling: SamplingConfig):
        self.model = model
        self.sampling = sampling
        self.forwards = 0
        # a compiled model (coolsd.engine.compiled): the whole expansion of a round is one compiled call, and it
        # drafts the full tree every round (static shapes; nodes past the image's end are never verified)
        self.compiled = bool(getattr(model, "compiled", False))
        self._expand_fn = compile_step(self._expand, getattr(model, "device", "cpu")) if self.compiled else self._expand

    def begin(self, cond: Any, batch_size: int, first_token: torch.Tensor, target_out: Optional[StepOut],
              n_tokens: Optional[int] = None):
        """A new batch: the condition, its first token and the target's prefill; ``n_tokens``: the
        tokens each sample will emit in all (None: not known)."""
        self.model.begin(cond, batch_size, context=target_out)
        self.ctx_tokens = first_token.unsqueeze(1)
        feat = None if target_out is None or target_out.hidden is None else target_out.hidden[:, -1:]
        self.ctx_feats = feat
        dev = first_token.device
        self.ctx_count = torch.ones(batch_size, dtype=torch.long, device=dev)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=dev)  # committed entries

    def depth_cap(self, n_out: torch.Tensor) -> Optional[torch.Tensor]:
        return None

    def propose(self, tree: Tree, rng, max_depth: torch.Tensor, depth_bound: Optional[int] = None,
                emitted: Optional[list] = None):
        """The round's tree: (tokens (B, n+1), q (B, n+1, V)); nodes deeper than ``max_depth``
        (B,) are not verified, so eager drafting stops at ``depth_bound``, the loop's host-known
        upper bound of ``max_depth.max()`` (None: read it, one host read). ``emitted``: each
        sample's tokens so far, host-known from the loop's round read (None: not known); a drafter
        may use it to plan its work without a read."""
        # a fixed number of uniforms per sample and round, whatever the batch needs: one per
        # (expanded node, child rank)
        u = rng.uniform(max(len(tree.expanded_nodes), 1), max(tree.max_children, 1))
        bound = int(max_depth.max()) if depth_bound is None else depth_bound
        depth = tree.max_depth if self.compiled else min(tree.max_depth, bound)
        masks = tree.drafting_masks(depth)  # made once per (tree, device, depth), outside any compiled call
        if self.compiled:  # inputs of the compiled expansion: static addresses, as CUDA graphs need
            from torch._dynamo import mark_static_address

            for m in masks:
                mark_static_address(m)
        tokens, q, self.length = self._expand_fn(tree, u, depth, masks, self.ctx_tokens, self.ctx_feats,
                                                 self.ctx_count, self.length)
        self.forwards += 1 + len(tree.forwarded_levels(depth))
        return tokens, q

    def _causal(self, C: int, device: torch.device) -> torch.Tensor:
        """The context forward's (C, C) causal mask on ``device``: one object per (C, device) in
        eager code (a drafter may analyse a mask once per object: LuminaEagleDrafter)."""
        if compiling():
            return torch.ones(C, C, dtype=torch.bool, device=device).tril()
        masks = self.__dict__.setdefault("_causal_masks", {})
        key = (C, device)
        if key not in masks:
            masks[key] = torch.ones(C, C, dtype=torch.bool, device=device).tril()
        return masks[key]

    def _expand(self, tree: Tree, u: torch.Tensor, depth_to_draft: int, masks: tuple, ctx_tokens, ctx_feats,
                ctx_count, length):
        """The drafter's forwards of one round: the context (accepted tokens and the emitted
        one, committed), then level by level the children of every node, drawn without
        replacement with the round's uniforms ``u``; ``masks``: ``tree.drafting_masks(depth_to_draft)``,
        the attention of each forwarded level. Returns (tokens, q, new committed length)."""
        B, C = ctx_tokens.shape
        dev = ctx_tokens.device
        ar = torch.arange(B, device=dev)
        forwarded_levels = set(tree.forwarded_levels(depth_to_draft))
        V = self.model.vocab_size

        pos = length.unsqueeze(1) + torch.arange(C, device=dev)
        out = self.model.forward(ctx_tokens, pos, self._causal(C, dev), ctx_feats)
        self.model.commit(None, ctx_count)  # the context's entries in order: in place
        last = ctx_count - 1
        length = length + ctx_count
        root_logits = out.logits[ar, last]
        root_hidden = None if out.hidden is None else out.hidden[ar, last]

        n1 = tree.n_nodes + 1
        tokens = torch.zeros(B, n1, dtype=torch.long, device=dev)
        tokens[:, 0] = ctx_tokens[ar, last]
        q = torch.zeros(B, n1, V, dtype=torch.promote_types(root_logits.dtype, torch.float32), device=dev)
        # level by level, every node of a level at once (Tree.drafting_plan): its distributions
        # (B, n_d, V) and the drafter's outputs there (B, n_d, H), the root's level first
        probs = self.sampling.probs(root_logits).unsqueeze(1)
        hidden = None if root_hidden is None else root_hidden.unsqueeze(1)
        positions = (length - 1).unsqueeze(1) + tree.depth.unsqueeze(0)  # (B, n+1): every node's, once
        forwarded: tuple[int, ...] = ()  # levels of the pending tree entries, in cache order
        for d in range(depth_to_draft):
            draw = tree.drafting_plan[d]
            if not draw.locs:
                break  # no node of level d has children: nothing deeper exists
            # each expanded node's children: successive draws from its distribution (draws past a
            # node's own count are never used; a draw depends only on the draws before it)
            toks, cond = sample_without_replacement(draw.pick(probs), u[:, draw.u_col : draw.u_col + len(draw.locs)],
                                                    draw.k)
            tokens[:, draw.children] = draw.children_of(toks)
            q[:, draw.children] = draw.children_of(cond).to(q.dtype)
            # run the drafter on level d+1 only if some of its nodes will be expanded
            if d + 1 not in forwarded_levels:
                continue
            forwarded += (d + 1,)
            attend = masks[len(forwarded) - 1]
            feats = None if hidden is None else draw.parents_of(draw.pick(hidden))
            at = draw.children
            step = self.model.forward(tokens[:, at], positions[:, at], attend, feats)
            probs = self.sampling.probs(step.logits)
            hidden = step.hidden
        return tokens, q, length

    def observe(self, info: RoundInfo) -> None:
        B, dev = info.tokens.shape[0], info.tokens.device
        self.model.commit(torch.zeros(B, 0, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev))
        D = info.path.shape[1]
        # new context: accepted drafts then the emitted token; features: target hidden at the
        # entry before each (root, then accepted nodes)
        acc_tokens = _gather_nodes(info.tokens, info.path.clamp(min=0))  # (B, D)
        toks = torch.cat([acc_tokens, torch.zeros(B, 1, dtype=torch.long, device=dev)], dim=1)
        toks[torch.arange(B, device=dev), info.n_accepted] = info.emitted.clamp(min=0)
        self.ctx_tokens = toks[:, : D + 1]
        self.ctx_count = info.n_accepted + 1
        if info.target_hidden is not None:
            prev = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), info.path.clamp(min=0)], dim=1)
            self.ctx_feats = _gather_nodes(info.target_hidden, prev)
        else:
            self.ctx_feats = None


class JacobiDrafter:
    """SJD's drafter (docs/methods.md#4-sjd): the window's drafts are the previous iteration's target
    samples at the positions after the accepted prefix (q = the p they were drawn from), topped
    up with uniformly random tokens from ``[token_lo, token_hi)`` (q one-hot).

    ``coupling`` (MC-SJD / SCD, arXiv 2510.24211): how the next iteration's sample at a position
    is drawn from this iteration's p there. ``None`` (SJD): independently. ``"maximal"``: coupled
    to the draft that held that position in this window (d, drawn from q): keep d with
    probability min(1, p(d) / q(d)), else draw from Norm([p - q]_+) (a maximal coupling of q and
    p: the sample is still distributed as p, and equals d as often as possible). ``"gumbel"``:
    every position keeps one Gumbel noise vector g from when it enters the window until it is
    emitted, and each of its samples is argmax(log p + g) (its top-up draft argmax of g over the
    token range: uniform, q one-hot). g is a function of (the sample's key, the image position):
    ``indexed_uniforms``, so it can be computed ahead (``_window_noise``) and is the same when
    recomputed.

    Lossless either way (the lab's chi-square tests decide): a position that is still a draft has
    never been verified (a verified draft is accepted or replaced by the emitted token), so the
    history of tests is a function of other positions' noise and the verification uniforms, and
    the noise kept at a draft position (d or g) is, given that history, distributed as when it was
    drawn: each carried sample is distributed as the p it reports as q. (junhyukso/SCD's MC
    sampler reports a KEPT draft with its old q instead; a kept draft is distributed as
    min(q, p) / beta, so that proposal is wrong, and in the lab that bookkeeping fails the
    chi-square test: tests/engine/test_parallel_decoders.py.)

    ``init`` (SJD's ``multi_token_init_scheme``, scheduler/jacobi_iteration_lumina_mgpt.py
    ``get_multi_token_for_preparation``): what the top-ups are on an image grid ``grid_width``
    tokens wide. ``random``: uniform on the token range. ``repeat_horizon``: the token to the left
    (upstream reads it from the window when it is not emitted yet, so a run of top-ups repeats the
    last token before them); ``sample_horizon``: the most likely token of the distribution the
    token to the left was drawn from (upstream samples it after top-k 1: its argmax); both random
    at a row's first column. ``vertical_repeat``: the token one row above (random in the first
    row); upstream has it but disables it, its paper's Fig. 9 finds it the fastest. Every top-up
    has a one-hot q (it is a given token, not a draw), so the choice changes speed, never the
    output distribution."""

    COUPLINGS = (None, "maximal", "gumbel")
    INITS = ("random", "repeat_horizon", "sample_horizon", "vertical_repeat")

    def __init__(self, vocab_size: int, window: int, token_range=None, active_range=None, coupling=None,
                 init: str = "random", grid_width: Optional[int] = None):
        if coupling not in self.COUPLINGS:
            raise ValueError(f"unknown coupling {coupling!r}; valid: maximal, gumbel (or none)")
        if init not in self.INITS:
            raise ValueError(f"unknown Jacobi init {init!r}; valid: {', '.join(self.INITS)}")
        if init != "random" and not grid_width:
            raise ValueError(f"init={init} needs the image grid's width; this target has no image grid (use init=random)")
        self.V = vocab_size
        self.n = window - 1
        self.lo, self.hi = token_range if token_range is not None else (0, vocab_size)
        self.active = active_range  # (l, r): Jacobi window only for l <= n_out < r
        self.coupling = coupling
        self.init, self.width = init, grid_width
        self.forwards = 0

    def begin(self, cond, batch_size, first_token, target_out, n_tokens: Optional[int] = None):
        self.root = first_token
        self.n_tokens = n_tokens
        dev = first_token.device
        self.carry_tokens = torch.zeros(batch_size, self.n, dtype=torch.long, device=dev)
        self.carry_q = None
        self.noise_keys = None  # gumbel: (B,) each sample's key for its positions' noise (first propose)
        self._noise = None  # gumbel: (B, H, V) noise of positions _noise_start.. (_window_noise)
        self._noise_start = torch.full((batch_size,), -(1 << 40), dtype=torch.long, device=dev)  # none computed yet
        self._host_start = [-(1 << 40)] * batch_size
        self.carry_count = torch.zeros(batch_size, dtype=torch.long, device=dev)
        # spatial inits: image positions. The root is image token 0 when the target was prefilled
        # (the loop draws it from the prefill), a BOS (no position) when it was not.
        self.n_out = torch.full((batch_size,), 0 if target_out is None else 1, dtype=torch.long, device=dev)
        self._n_out_bound = 0 if target_out is None else 1  # host upper bound of n_out.max()
        self._n_out0, self._emitted0 = self._n_out_bound, None  # n_out's start, and the loop's counts then
        # emitted tokens by position (vertical_repeat), the root first when it is image token 0
        self.history = torch.zeros(batch_size, 0, dtype=torch.long, device=dev) if target_out is None \
            else first_token.view(-1, 1).clone()
        self.root_q = None  # sample_horizon: the distribution the root was emitted from (None: one-hot)

    def depth_cap(self, n_out: torch.Tensor) -> Optional[torch.Tensor]:
        if self.active is None:
            return None
        lo, hi = self.active
        return torch.where((n_out >= lo) & (n_out < hi), self.n, 0)

    def propose(self, tree: Tree, rng, max_depth: torch.Tensor, depth_bound: Optional[int] = None,
                emitted: Optional[list] = None):
        B, n, dev = self.carry_tokens.shape[0], self.n, self.carry_tokens.device
        # row 0: random top-ups, row 1: next iteration's target samples, row 2 (maximal): keep
        # tests; gumbel takes the first two from its noise (and has no keep test)
        u = rng.uniform(3 if self.coupling == "maximal" else 2, n) if self.coupling != "gumbel" else None
        self._u_next = u[:, 1] if u is not None else None
        self._u_keep = u[:, 2] if self.coupling == "maximal" else None
        slot = torch.arange(n, device=dev).unsqueeze(0)
        carried = slot < self.carry_count.unsqueeze(1)
        if self.coupling == "gumbel":  # (B, n+1, V): the noise of depths 1..n+1
            self._g = self._window_noise(rng, emitted)
            rand = self.lo + self._g[:, :n, self.lo : self.hi].argmax(-1)  # uniform on the range
        else:
            rand = (self.lo + (u[:, 0] * (self.hi - self.lo)).long()).clamp(max=self.hi - 1)
        if self.init != "random":
            rand = self._spatial_topups(carried, rand)
        drafts = torch.where(carried, self.carry_tokens, rand)
        q = torch.nn.functional.one_hot(drafts, self.V).double()
        if self.carry_q is not None:
            q = torch.where(carried.unsqueeze(-1), self.carry_q.to(q.dtype), q)
        tokens = torch.cat([self.root.unsqueeze(1), drafts], dim=1)
        q = torch.cat([torch.zeros(B, 1, self.V, dtype=q.dtype, device=dev), q], dim=1)
        self._drafts, self._q = drafts, q
        return tokens, q

    NOISE_WINDOWS = 4  # gumbel: noise is computed for this many windows' positions at a time

    def _window_noise(self, rng, emitted: Optional[list]) -> torch.Tensor:
        """(B, n+1, V) Gumbel noise of the window's positions: slot s (depth s+1) holds image
        position n_out + s, its noise -log(-log u), u = indexed_uniforms(key, position). Computed
        ahead for ``NOISE_WINDOWS`` windows' positions per sample (a table of H rows, B x H x V
        float64; positions past the image's ``n_tokens`` are never drafted into an accepted
        token and are left 0), recomputed for a sample when its window leaves its table: each
        position's noise is computed about once, in few large calls. Which samples need it, and
        how many rows, is known on the host from ``emitted`` (the loop's round read), so there is
        no read; with ``emitted=None`` the window is computed directly (the same values)."""
        B, n, V, dev = self.carry_tokens.shape[0], self.n, self.V, self.carry_tokens.device
        if self.noise_keys is None:
            self.noise_keys = rng.keys()
        slots = torch.arange(n + 1, device=dev)
        if emitted is None:
            rows = torch.arange(B, device=dev).repeat_interleave(n + 1)
            u = rng.indexed(self.noise_keys[rows], (self.n_out.unsqueeze(1) + slots).flatten(), V)
            return _gumbel(u).view(B, n + 1, V)
        H = self.NOISE_WINDOWS * (n + 1)
        if self._emitted0 is None:
            self._emitted0 = list(emitted)
        pos = [self._n_out0 + e - e0 for e, e0 in zip(emitted, self._emitted0)]  # = self.n_out, on the host
        need = [b for b in range(B) if pos[b] + n + 1 > self._host_start[b] + H]
        if self._noise is None:
            self._noise = torch.zeros(B, H, V, dtype=torch.float64, device=dev)
        if need:  # the same samples on the device (no read): their rows first, in a static shape
            stale = self.n_out + n + 1 > self._noise_start + H
            who = torch.argsort((~stale).to(torch.int8), stable=True)[: len(need)]
            end = self.n_tokens if self.n_tokens is not None else 1 << 40
            count = torch.clamp(end - self.n_out[who], 0, H)  # rows of each (host: the same numbers)
            N = sum(min(max(end - pos[b], 0), H) for b in need)
            sample = torch.repeat_interleave(who, count, output_size=N)
            first = torch.repeat_interleave(torch.cumsum(count, 0) - count, count, output_size=N)
            row = torch.arange(N, device=dev) - first  # row of the sample's table, position n_out + row
            self._noise[who] = 0.0
            self._noise[sample, row] = _gumbel(rng.indexed(self.noise_keys[sample], self.n_out[sample] + row, V))
            self._noise_start[who] = self.n_out[who]
            for b in need:
                self._host_start[b] = pos[b]
        if host_checks():
            assert self.n_out.tolist() == pos, "the drafter's positions disagree with the loop's counts"
        return _gather_nodes(self._noise, (self.n_out - self._noise_start).unsqueeze(1) + slots)

    def _spatial_topups(self, carried: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
        """(B, n) top-up tokens of the spatial inits (the class docstring); slot k (depth k+1) holds
        image position n_out + k; ``rand`` where the init has no source (first column / row)."""
        n, W = self.n, self.width
        k = torch.arange(n, device=rand.device).unsqueeze(0)
        pos = self.n_out.unsqueeze(1) + k
        if self.init == "vertical_repeat":
            out = torch.where(carried, self.carry_tokens, rand)
            src = pos - W
            hist = self.history.gather(1, src.clamp(0, max(self.history.shape[1] - 1, 0))) if self.history.shape[1] \
                else torch.zeros_like(rand)
            emitted = (src >= 0) & (src < self.n_out.unsqueeze(1))
            out = torch.where(~carried & emitted, hist, out)
            for _ in range((n - 1) // W):  # a source inside the window: filled W slots earlier
                inside = ~carried & (src >= self.n_out.unsqueeze(1))
                out = torch.where(inside, out.gather(1, (k - W).clamp(min=0).expand_as(out)), out)
            return out
        # horizon: a top-up copies the nearest anchor before it (a carried draft, a first-column
        # random top-up, or the root at slot -1)
        anchor = carried | (pos % W == 0)
        if self.init == "sample_horizon":  # the anchor's most likely token (a random top-up: itself)
            carried_best = self.carry_q.argmax(-1) if self.carry_q is not None else self.carry_tokens
            root_best = self.root_q.argmax(-1) if self.root_q is not None else self.root
            values = torch.where(carried, carried_best, rand)
        else:
            values, root_best = torch.where(carried, self.carry_tokens, rand), self.root
        values = torch.cat([root_best.unsqueeze(1), values], 1)  # (B, n+1): slot -1 = the root
        src = torch.where(anchor, k + 1, 0).cummax(1).values
        return torch.where(carried, self.carry_tokens, values.gather(1, src))

    def _samples(self, p: torch.Tensor) -> torch.Tensor:
        """(B, n): one sample from each node's p (B, n, V); node j (1..n) predicts depth j+1."""
        if self.coupling == "gumbel":  # argmax(log p + g) of the noise kept at depth j+1
            return (torch.log(p) + self._g[:, 1:]).argmax(-1)
        y = sample_inverse_cdf(p, self._u_next)
        if self.coupling != "maximal":
            return y
        # the draft d at depth j+1 (none after the window's last) and its q: keep d w.p. min(1, p(d)/q(d))
        d = self._drafts[:, 1:]
        q = self._q[:, 2:].to(p.dtype)
        pd = p[:, :-1].gather(-1, d.unsqueeze(-1)).squeeze(-1)
        qd = q.gather(-1, d.unsqueeze(-1)).squeeze(-1)
        coupled = _maximal_coupling(d, q, p[:, :-1], qd, pd, self._u_keep[:, :-1], self._u_next[:, :-1])
        return torch.cat([coupled, y[:, -1:]], 1)

    def observe(self, info: RoundInfo) -> None:
        n = self.n
        # p at node j (j = 1..n) predicts depth j+1; one sample from each, SJD's y_j
        p = info.target_probs[:, 1 : n + 1]
        y = self._samples(p)
        # the next window (rooted at the emitted token, depth n_acc+1) takes y_{n_acc+1..n}
        idx = (info.n_accepted.unsqueeze(1) + torch.arange(n, device=p.device)).clamp(max=n - 1)
        self.carry_count = n - info.n_accepted
        self.carry_tokens = torch.gather(y, 1, idx)
        self.carry_q = _gather_nodes(p, idx)
        self._advance(info)

    def _advance(self, info: RoundInfo) -> None:
        """The window moves on past the tokens the round emitted (its accepted drafts, then the
        emitted token), rooted at the emitted one."""
        new = info.n_accepted + (info.emitted >= 0).long()
        if self.init != "random":
            self._record(info, new)
        self.n_out = self.n_out + new
        self.root = info.emitted.clamp(min=0)

    def _record(self, info: RoundInfo, new: torch.Tensor) -> None:
        """The tokens (vertical_repeat) the round emitted at positions n_out.. (``new`` of them: its
        accepted drafts, then the emitted token); the root's distribution for sample_horizon."""
        B, dev = info.n_accepted.shape[0], info.n_accepted.device
        if self.init == "vertical_repeat":
            D = info.path.shape[1]
            vals = torch.cat([info.tokens.gather(1, info.path.clamp(min=0)),
                              torch.zeros(B, 1, dtype=torch.long, device=dev)], 1)
            vals.scatter_(1, info.n_accepted.unsqueeze(1), info.emitted.clamp(min=0).unsqueeze(1))
            # n_out grows by at most D + 1 a round: a host bound (no read); the last column is a dump
            # never written with a token this round
            self._n_out_bound += D + 1
            width = self._n_out_bound + D + 2
            if self.history.shape[1] < width:
                width = max(width, 2 * self.history.shape[1])
                self.history = torch.cat([self.history, torch.zeros(B, width - self.history.shape[1], dtype=torch.long,
                                                                    device=dev)], 1)
            cols = torch.arange(D + 1, device=dev).unsqueeze(0)
            write = cols < new.unsqueeze(1)
            where = torch.where(write, self.n_out.unsqueeze(1) + cols, self.history.shape[1] - 1)
            keep = self.history.gather(1, where)
            self.history.scatter_(1, where, torch.where(write, vals, keep))
        if self.init == "sample_horizon":  # the emitting node's p (the node after the accepted path)
            node = torch.where(info.n_accepted > 0, info.path.gather(1, (info.n_accepted - 1).clamp(min=0).unsqueeze(1))[:, 0], 0)
            self.root_q = _gather_nodes(info.target_probs, node.unsqueeze(1))[:, 0]


class PACDrafter(JacobiDrafter):
    """SJD-PAC (arXiv 2603.18599; KangJialiang/SJD-PAC ``SJDPACSpeculativeSampler``) as a Jacobi
    drafter on ``pac_tree``; verification is the engine's (exact rule, recursive rejection over
    siblings). Derivation and the lab's verdict: docs/sjd_pac.md.

    "Adaptive continuation": upstream keeps testing the drafts after the first rejection against
    their stale target distribution p (computed with the rejected token in their context) and
    keeps a draft d the test accepts, else draws from Norm([p - q]_+). Nothing past the first
    rejection is emitted: what it produces is the next iteration's draft at that position, i.e.
    MC-SJD's maximal coupling of the old draft to p, distributed as p (``JacobiDrafter`` with
    ``coupling="maximal"``).

    "Proactive drafting": the next window is a tree. At each of its first ``depth - 1`` depths,
    ``width`` candidates shared by every node of that depth (upstream's layout: node token =
    candidate[rank, depth]): candidate 0 is the coupled draft, candidates 1.. are drawn without
    replacement from the same p with candidate 0 removed, so together they are ``width`` draws
    without replacement from p, and each node reports the conditional distribution it was drawn
    from (docs/methods.md#12-static-tree-drafting): p for rank 0, Norm(p without ranks < r) for rank r. A depth whose
    candidate 0 is a top-up (the position had no carried draft) gets no siblings (q = 0: skipped).

    Which p a position's next draft comes from: the target's distribution at the node of the
    depth before it on the line that continues the accepted path by rank-0 children (the rejected
    draft's line), or on the rank-0 chain where that line ends (a leaf of a sibling subtree). Any
    choice is lossless if reported; this one has the freshest context.

    Lossless for the same reason as MC-SJD (the chi-square tests decide,
    tests/engine/test_parallel_decoders.py): a position still drafted has never been tested, so given
    the tests so far its candidates are distributed as the conditionals they report. Upstream
    draws the siblings from the coupling's residual [p - q]_+ instead while reporting them as
    draws from p; reproduced in the lab, that showed no detectable distortion (docs/sjd_pac.md)."""

    def __init__(self, vocab_size: int, window: int, width: int, depth: int, token_range=None, active_range=None,
                 init: str = "random", grid_width: Optional[int] = None):
        super().__init__(vocab_size, window, token_range, active_range, "maximal", init, grid_width)
        tree = pac_tree(window, width, depth)
        self.K, self.S = width, max(depth - 1, 0)  # candidates per branching depth, branching depths
        self.node_depth, self.node_rank = tree.depth, tree.rank
        self.sib_nodes = torch.nonzero(tree.rank > 0).flatten()
        self.follow = self._follow_table(tree)

    def _follow_table(self, tree: Tree) -> torch.Tensor:
        """(n+1 nodes, n+1 depths): for node a and depth e > depth(a), the node at depth e on the
        line from a by rank-0 children, or the rank-0 chain's node at depth e where that line ends
        (e <= depth(a): a itself, never read)."""
        n = self.n
        chain = {0: 0}
        for i, p in enumerate(tree.paths, 1):
            if all(r == 0 for r in p):
                chain[len(p)] = i
        first_child = [kids[0] if kids and tree.rank[kids[0]] == 0 else -1 for kids in tree.children_list]
        table = torch.zeros(tree.n_nodes + 1, n + 1, dtype=torch.long, device="cpu")  # host-built; begin moves it
        for a in range(tree.n_nodes + 1):
            node, da = a, int(tree.depth[a])
            for e in range(n + 1):
                if e > da:
                    node = first_child[node] if node >= 0 and first_child[node] >= 0 else -1
                    table[a, e] = node if node >= 0 else chain[e]
                else:
                    table[a, e] = a
        return table

    def begin(self, cond, batch_size, first_token, target_out, n_tokens: Optional[int] = None):
        super().begin(cond, batch_size, first_token, target_out, n_tokens)
        # the tree's index tables follow the loop's device (made on the CPU at construction)
        dev = first_token.device
        self.node_depth, self.node_rank = self.node_depth.to(dev), self.node_rank.to(dev)
        self.sib_nodes, self.follow = self.sib_nodes.to(dev), self.follow.to(dev)
        self.sib = torch.zeros(batch_size, self.S, max(self.K - 1, 0), dtype=torch.long, device=dev)
        self.sib_q = None  # (B, S, K-1, V); None: no siblings yet (the first window)

    def propose(self, tree: Tree, rng, max_depth: torch.Tensor, depth_bound: Optional[int] = None,
                emitted: Optional[list] = None):
        chain_tokens, chain_q = super().propose(tree, rng, max_depth, emitted=emitted)  # (B, n+1), (B, n+1, V) by depth
        self._u_sib = rng.uniform(self.S, self.K - 1) if self.S and self.K > 1 else None
        tokens = chain_tokens[:, self.node_depth]
        q = chain_q[:, self.node_depth]
        if self.sib_nodes.numel():
            d, r = self.node_depth[self.sib_nodes] - 1, self.node_rank[self.sib_nodes] - 1
            tokens[:, self.sib_nodes] = self.sib[:, d, r]
            q[:, self.sib_nodes] = 0.0 if self.sib_q is None else self.sib_q[:, d, r].to(q.dtype)
        return tokens, q

    def observe(self, info: RoundInfo) -> None:
        n, B = self.n, info.tokens.shape[0]
        m = info.n_accepted
        last = torch.where(m > 0, info.path.gather(1, (m - 1).clamp(min=0).unsqueeze(1))[:, 0], 0)
        # slot k of the next window holds depth e = m + 2 + k of this one
        e = m.unsqueeze(1) + 2 + torch.arange(n, device=m.device)
        parent = self.follow[last.unsqueeze(1), (e - 1).clamp(max=n)]  # (B, n): the node whose p predicts depth e
        p = _gather_nodes(info.target_probs, parent)
        # maximal coupling to the old draft at depth e (none past this window: a fresh draw)
        old = (e - 1).clamp(max=n - 1)
        d = self._drafts.gather(1, old)
        q_old = _gather_nodes(self._q[:, 1:], old).to(p.dtype)
        pd = p.gather(-1, d.unsqueeze(-1)).squeeze(-1)
        qd = q_old.gather(-1, d.unsqueeze(-1)).squeeze(-1)
        inside = e <= n
        u = (e - 2).clamp(max=n - 1)  # the uniforms of depth e (MC-SJD's: the same tokens at width 1)
        u_next = self._u_next.gather(1, u)
        coupled = _maximal_coupling(d, q_old, p, qd, pd, self._u_keep.gather(1, u), u_next)
        cand = torch.where(inside, coupled, sample_inverse_cdf(p, u_next))  # past the window: a fresh draw
        self.carry_count = n - m
        self.carry_tokens, self.carry_q = cand, p
        if self._u_sib is not None:
            S = self.S
            base = self._sibling_base(p[:, :S], cand[:, :S])
            toks, cond = sample_without_replacement(base, self._u_sib, self.K - 1)
            carried = (torch.arange(S, device=m.device).unsqueeze(0) < self.carry_count.unsqueeze(1)).view(B, S, 1, 1)
            self.sib, self.sib_q = toks, torch.where(carried, cond, 0.0)
        self._advance(info)

    @staticmethod
    def _sibling_base(p: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """(B, S, V): the distribution the siblings are drawn from without replacement: p with
        candidate 0 removed (so all candidates are draws without replacement from p)."""
        return normalize(p.scatter(-1, cand.unsqueeze(-1), 0.0), 0.0)


def _maximal_coupling(d, q, p, qd, pd, u_keep, u_next):
    """MC-SJD's maximal coupling of a draft d ~ q to p (JacobiDrafter's class docstring): keep d
    with probability min(1, p(d) / q(d)), else draw from Norm([p - q]_+) (p where that has no
    mass). d, qd = q(d), pd = p(d), u_keep, u_next: (...); q, p: (..., V). Returns the coupled
    draft, distributed as p."""
    keep = u_keep * qd < pd
    resid = normalize(torch.clamp(p - q, min=0.0), p)
    return torch.where(keep, d, sample_inverse_cdf(resid, u_next))


def _gumbel(u: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log u) from uniforms u in [0, 1) (u = 0 maps to -inf: never the argmax)."""
    return -torch.log(-torch.log(u))


# drafter kind (a method's registered ``drafter``) -> factory (``coolsd.util.registry``); facts:
# ``jacobi`` (drafts from the target's own earlier samples, SJD's family) and ``row_parallel``
# (decodes several image rows a forward, ``coolsd.engine.rows``)
DRAFTERS = Registry("drafter kind", callables=True)


def register_drafter(kind: str, *, jacobi: bool = False, row_parallel: bool = False):
    """Register the factory of a drafter kind: ``factory(method, draft_model, sampling, vocab_size,
    token_range, grid_width)`` -> a drafter (``ModelDrafter``'s interface) or None (no drafts), or
    an object with ``own_loop(target, n_tokens, rng, sampling, cond, batch_size, sync, distortion)``
    that runs the whole generation instead of the round loop (``coolsd.engine.rows``);
    ``jacobi`` / ``row_parallel``: the facts above (``MethodInfo.jacobi``, ``.row_parallel``)."""
    return DRAFTERS.register(kind, jacobi=jacobi, row_parallel=row_parallel)


def build_drafter(method, draft_model: Optional[ARModel], sampling: SamplingConfig, vocab_size: int,
                  token_range=None, grid_width: Optional[int] = None):
    """The drafter of a method's registered kind (``DRAFTERS``): a model drafter, SJD's Jacobi
    drafter, SJD-PAC's, or none (AR). ``grid_width``: the image grid's width in tokens (SJD's
    spatial inits; None: no grid)."""
    if method.drafter not in DRAFTERS:
        raise ValueError(f"method {method.name!r}: {DRAFTERS.unknown(method.drafter)}")
    return DRAFTERS.get(method.drafter)(method, draft_model, sampling, vocab_size, token_range, grid_width)


@register_drafter("none")
def _no_drafter(method, draft_model, sampling, vocab_size, token_range, grid_width):
    return None


@register_drafter("model")
def _model_drafter(method, draft_model, sampling, vocab_size, token_range, grid_width):
    if draft_model is None:
        raise ValueError(f"method {method.name!r} needs a drafter model; none is configured")
    return ModelDrafter(draft_model, sampling)


def _active(p: dict):
    """SJD's active range from a method's ``active_start`` / ``active_end`` (None: everywhere)."""
    lo, hi = p.get("active_start"), p.get("active_end")
    return None if lo is None and hi is None else (lo or 0, hi if hi is not None else 1 << 62)


@register_drafter("jacobi", jacobi=True)
def _jacobi_drafter(method, draft_model, sampling, vocab_size, token_range, grid_width):
    p = method.params
    return JacobiDrafter(vocab_size, p["window"], token_range, _active(p), p.get("coupling"), p.get("init", "random"),
                         grid_width)


@register_drafter("pac", jacobi=True)
def _pac_drafter(method, draft_model, sampling, vocab_size, token_range, grid_width):
    p = method.params
    return PACDrafter(vocab_size, p["window"], p["tree_width"], p["tree_depth"], token_range, _active(p),
                      p.get("init", "random"), grid_width)
