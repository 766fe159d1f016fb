"""The loop's per-token quality signals (docs/signals.md, docs/distortion.md): for every emitted
token its exact distortion (step TV / KL of the rule's emitted distribution against the
target's), its target NLL and that NLL's expectation, whether it is off the target's support,
and the round depth it came from. ``round_signals`` computes one round's, the same function
inline in a compiled round and for many rounds at once in an eager loop (``DeferredSignals``).
"""
from __future__ import annotations

from typing import Any

import torch

from coolsd.engine.decoding.distortion import chain_distortion, expected_nll, lossless
from coolsd.engine.decoding.rules import Rule
from coolsd.engine.decoding.trees import Tree
from coolsd.engine.drafting import SamplingConfig
from coolsd.engine.model_protocol import ARModel
from coolsd.engine.timing import IntervalTimer

TOKEN_SIGNALS = ("tv", "kl", "nll", "nll_expected", "off_support", "depth")  # the loop's per-token channels
TV, KL, NLL, XNLL, OFF, DEPTH = range(len(TOKEN_SIGNALS))



def target_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """log p (..., V) of the target's guided distribution at the sampling temperature (1 for
    greedy), before top-k / top-p truncation: what the target_nll signal scores tokens with; in
    the logits' precision (at least float32); finite (``distortion.expected_nll`` relies on it)."""
    t = sampling.temperature if sampling.temperature > 0 else 1.0
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    # masked tokens (-inf logits) get the lowest finite value: products with a 0 probability stay 0
    return torch.log_softmax(x / t if t != 1.0 else x, -1).clamp_(min=torch.finfo(x.dtype).min)


def write_signals(dist, signals, where, write) -> None:
    """Scatter signals (B, C, W) to ``dist`` (B, C, T) at the token columns ``where`` (B, W) where
    ``write``; unwritten entries go to ``where``'s dump column as 0 (every dump write is 0, so
    duplicates there are harmless; every other column is written at most once)."""
    B, C, W = signals.shape
    dist.scatter_(2, where.unsqueeze(1).expand(B, C, W), torch.where(write.unsqueeze(1), signals, 0))


class DeferredSignals:
    """The eager loop's signal sink: each round's inputs to ``round_signals`` are copied into
    preallocated buffers and computed for many rounds in one call, stacked along the batch dim:
    every one of its ops is per row (a sample's round), so R rounds of B samples are R*B rows, and
    the ~100 small ops a round's signals take at batch 1 are paid once per ``flush`` instead of once
    per round (< 5% of decode time). Copies into buffers allocated once, not kept round
    tensors: holding the rounds' own (B, n+1, V) tensors would keep the allocator from reusing
    their memory, and every round would fault in fresh pages (measured: +10% decode time at batch
    16 for LANTERN++ with 5% spent in the signals themselves). Flushed when the buffers are full
    (at most ``max_elements`` per buffer: bounded memory on a real target's vocabulary) and when
    the loop ends. On the CPU the buffers hold at most ``cpu_max_elements``: a flush's ~200 ops
    are still paid once per ~50 rows on the toy world (3 rounds at batch 16, 51 at batch 1), while
    the buffers and a flush's temporaries stay a few hundred KiB, which the allocator reuses from
    flush to flush; buffers of 16 MiB and flushes of all of a run's rounds at once were fresh
    pages from the OS at every run (measured on the toy world at batch 16: 4-16 thousand page
    faults a run, up to a third of the signal time; ~0 now). The values are those of the inline
    (compiled) path, up to per-row float reductions."""

    max_elements = 1 << 22  # rounds * B * (n+1) * V elements per buffer at most (16 MiB of float32)
    cpu_max_elements = 1 << 17  # the same on the CPU (512 KiB of float32): see above
    max_rounds = 64

    def __init__(self, dist, tree: Tree, rule: Rule, sampling: SamplingConfig):
        self.dist, self.tree, self.rule, self.sampling = dist, tree, rule, sampling
        self.big = None  # (logits, p, q) buffers, each (rounds, B, n+1, V)
        self.small: list[tuple] = []  # per round: path, n_accepted, vals, max_depth, where, write
        self.timer = IntervalTimer(dist.device)  # the device's time spent here (events on CUDA: no sync)

    @property
    def seconds(self) -> float:
        """Time spent on the signals (after the loop's final sync on CUDA)."""
        return self.timer.seconds()

    def add(self, logits, p, q, path, n_accepted, vals, max_depth, where, write, choices=None) -> None:
        self.timer.start()
        if self.big is None:
            limit = self.cpu_max_elements if p.device.type == "cpu" else self.max_elements
            rounds = max(1, min(self.max_rounds, limit // p.numel()))
            self.big = tuple(torch.empty((rounds, *x.shape), dtype=x.dtype, device=x.device) for x in (logits, p, q))
        i = len(self.small)
        for buf, x in zip(self.big, (logits, p, q)):
            buf[i].copy_(x)
        self.small.append((path, n_accepted, vals, max_depth, where, write, choices))
        self.timer.stop()
        if len(self.small) == self.big[0].shape[0]:
            self.flush()

    def flush(self) -> None:
        if not self.small:
            return
        self.timer.start()
        self._flush()
        self.timer.stop()

    def _flush(self) -> None:
        R = len(self.small)
        logits, p, q = (buf[:R].flatten(0, 1) for buf in self.big)  # (R*B, n+1, V) views, round-major
        path, n_accepted, vals, max_depth, where, write, choices = (
            torch.cat(x) if x[0] is not None else None for x in zip(*self.small))
        B = self.big[0].shape[1]
        self.small = []
        sig = round_signals(logits, p, q, path, n_accepted, vals, self.tree, self.rule, max_depth, self.sampling,
                             self.dist.dtype, choices)  # (R*B, C, W), round-major rows
        C, W = sig.shape[1:]
        per_sample = lambda x: x.view(R, B, *x.shape[1:]).transpose(0, 1)  # noqa: E731  (B, R, ...)
        sig = per_sample(sig).permute(0, 2, 1, 3).reshape(B, C, R * W)
        write_signals(self.dist, sig, per_sample(where).reshape(B, R * W), per_sample(write).reshape(B, R * W))


def round_signals(logits, p, q, path, n_accepted, vals, tree: Tree, rule: Rule, max_depth, sampling: SamplingConfig,
                   dtype, choices=None):
    """(B, len(TOKEN_SIGNALS), D + 1): the signals of the round's candidate tokens ``vals`` (the
    accepted path, then the emitted token), position j = round depth j + 1. The token at depth j+1
    was verified at that depth if j < max_depth, else drawn from p (a bonus, the image's end); its
    parent node (whose p it was drawn or verified against) is the root for j = 0, else path[j-1].
    Few, batched ops: at batch 1 on a small target their count, not their size, is the cost.
    ``choices`` (B, D): the round's ``Verdict.choices`` (a rule that chooses per node), or None."""
    B, D = path.shape
    V, dev = p.shape[-1], p.device
    parent = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), path.clamp(min=0)], 1)  # (B, D+1)
    # positions past the round's tokens (never written) may hold the BOS id
    at = parent * V + vals.clamp(max=V - 1)
    logp = target_log_probs(logits, sampling)  # (B, n+1, V) at every node
    nll = -logp.flatten(1).gather(1, at)
    off = p.flatten(1).gather(1, at) <= 0  # p(x) at the parent node
    depth = torch.arange(1, D + 2, device=dev).unsqueeze(0)
    verified = depth <= max_depth.unsqueeze(1)  # (B, D+1)
    drawn = expected_nll(p, logp)  # (B, n+1): E[-log p(x)] for a token drawn from p at each node
    if tree.n_nodes == 0 or lossless(rule, D):  # pi = p at the emitting node: distortion 0, E[NLL] that of p
        # at the parent (AR: the root only; a tree's siblings change nothing: recursive rejection is exact,
        # docs/methods.md#13-verification-at-one-tree-depth-d)
        tv_kl, xnll = torch.zeros(B, 2, D + 1, dtype=dtype, device=dev), drawn.gather(1, parent)
    elif tree.max_children == 1:  # chain: exact per depth (docs/distortion.md), at the depths the round emitted
        need = (verified & (depth <= n_accepted.unsqueeze(1) + 1))[:, :D]
        d = chain_distortion(rule, p, q, D, need, logp, choices)
        per_depth = torch.nn.functional.pad(torch.stack(d, 1), (0, 1))  # (B, 3, D+1): tv, kl, E nll; bonus column 0
        tv_kl = torch.where(verified.unsqueeze(1), per_depth[:, :2], 0).to(dtype)
        xnll = torch.where(verified, per_depth[:, 2], drawn[:, : D + 1])
    else:  # siblings drawn without replacement: no closed form (docs/distortion.md); a draw from p has one
        tv_kl = torch.full((B, 2, D + 1), float("nan"), dtype=dtype, device=dev)
        xnll = torch.where(verified, float("nan"), drawn.gather(1, parent))
    rest = torch.stack([nll, xnll, off.to(nll.dtype), torch.where(verified, depth, 0).to(nll.dtype)], 1)
    return torch.cat([tv_kl, rest.to(dtype)], 1)


def teacher_forced_probs(target: ARModel, tokens: torch.Tensor, cond: Any, sampling: SamplingConfig) -> torch.Tensor:
    """(B, N, V): the target's (warped) distribution of each of ``tokens`` (B, N) given the tokens
    before it, scored the way AR decoding scores them (the prefill for token 0, then ONE causal
    forward over tokens 0..N-2 at the loop's positions 0..N-2), outside any decoding loop: the
    reference a decoded sequence's per-token draws are tested against
    (``coolsd.engine.decoding.sampling.randomized_pit``, benchmarks/exactness.py). Targets with a
    condition (a prefill) only. Leaves the target's cache with N-1 pending entries; the next
    ``begin`` resets it."""
    B, N = tokens.shape
    prefill = target.begin(cond, B)
    if prefill is None:
        raise ValueError("teacher_forced_probs needs a target with a condition (its prefill scores token 0)")
    p0 = sampling.probs(prefill.logits[:, -1:])
    if N == 1:
        return p0
    dev = tokens.device
    positions = torch.arange(N - 1, device=dev).unsqueeze(0).expand(B, N - 1)
    causal = torch.ones(N - 1, N - 1, dtype=torch.bool, device=dev).tril()
    step = target.forward(tokens[:, : N - 1], positions, causal, None)
    return torch.cat([p0, sampling.probs(step.logits).to(p0.dtype)], 1)
