"""Exact per-token distortion of a verification rule at a chain node (docs/methods.md#10-exact-per-token-distortion;
derivations in docs/distortion.md).

At a chain node the round drafts ONE token x ~ q and verifies it against the target's p with
the method's rule (``coolsd.engine.decoding.rules``): accept x with probability f(x), else emit a token
from the rule's residual. Marginalised over the draft draw, the token the method emits at this
position is distributed as

    pi(y) = q(y) f(y) + sum_x q(x) (1 - f(x)) Norm(r_x)(y)

where r_x is the residual after rejecting x (``Norm`` falls back to p where r_x has no mass, as
``verify_tree`` does). ``emitted_distribution`` computes pi exactly and vectorised over the
batch, without enumerating x.

How pi is computed is a fact of the rule, not of this module, which knows no rule class
(``coolsd.engine.decoding.rules.Rule``): ``rule.emitted`` gives pi at a node, ``rule.is_exact(depth)``
says where pi = p exactly, ``rule.emitted_depths`` is a form vectorised over a chain's depths
(or None), ``rule.depth_independent`` lets a chain's depths go as one batch of rows, and
``rule.emitted_row_elements`` sizes the chunks of rows. Here they are batched, chunked and
scored (TV, KL, expected NLL). The rules' forms:

* the base class's default, for any rule whose residual does not depend on x (exact, scaled,
  GSD, LANTERN with ``resample=gstar``, and any ``Rule`` subclass that defines only its
  ``numerator``): pi = q f + beta Norm(r) with q f = ``rule.accepted`` (min(q, a)), r =
  ``rule.residual`` (G* = [p - min(q, a)]_+ by default) and beta = 1 - sum q f (COOL-SD Prop. 1);
  the exact rule (a = p) gives pi = p;
* LANTERN's own resampling zeroes q on the k+1 neighbours N(x) of x when relaxation was used at
  x, so r_x = r0 + Delta_x with r0 = [p - q]_+ and Delta_x = min(p, q) on N(x), 0 elsewhere; the
  sum over x is then one weighted copy of r0 plus a scatter of the Delta_x: O(V k), not O(V^2)
  (``LanternRule.emitted``).

Nodes with several siblings drawn without replacement are not covered (their marginal is not a
closed form here); the emitted token of a leaf's bonus draw is distributed as p (distortion 0).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from coolsd.engine.compiled import compiling
from coolsd.engine.decoding.rules import Rule

# A rule whose ``emitted`` holds per-row temporaries larger than a few (rows, V) tensors
# (``Rule.emitted_row_elements``) goes through its rows in chunks (``emitted_distribution``) of at
# most this many such elements. LANTERN's largest temporaries are (rows, V, k + 1) -- the
# neighbour gathers of ``lantern.neighbour_sum`` / ``reverse_sum`` and the first block and the
# continued prefixes of ``lantern.aggregate_all`` -- so each holds at most 2^26 elements (256 MiB of
# float32, 512 MiB of float64), whatever the rows of a deferred-signal flush; about 3.3 such
# temporaries are live at the peak (measured on the CPU at LANTERN's k = 1000, V = 16384, float32:
# 0.85 GiB extra in chunks of 4 rows, 1.60 GiB for 8 rows at once, growing with the rows). At that
# size a chunk is 4 rows; where one row alone has more entries (V (k + 1) > 2^26), a chunk is one row.
LANTERN_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(rule: Rule, V: int) -> Optional[int]:
    """Rows of one chunk of the rule's exact distortion (``LANTERN_CHUNK_ELEMENTS``), at least 1;
    None where the rule declares no per-row footprint (``Rule.emitted_row_elements``): unchunked."""
    per_row = rule.emitted_row_elements(V)
    return None if per_row is None else max(1, LANTERN_CHUNK_ELEMENTS // per_row)


lantern_chunk_rows = chunk_rows  # its name while LANTERN was the one chunked rule


def emitted_distribution(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """pi (B, V): the distribution of the token the rule emits at a chain node of ``depth``,
    marginalised over the draft x ~ q; p, q (B, V) the target's and the drafter's distributions.
    A rule with a per-row footprint (LANTERN) goes ``chunk_rows`` rows at a time: every step of
    its ``emitted`` is per row (formula (3) of docs/distortion.md and the G* aggregation), so the
    chunks' rows are the unchunked call's (bit for bit on the CPU, ``tests/models/test_memory_bounds.py``)."""
    n = chunk_rows(rule, p.shape[-1]) if p.dim() == 2 else None
    if n is not None and p.shape[0] > n:
        return torch.cat([_emitted(rule, p[i : i + n], q[i : i + n], depth) for i in range(0, p.shape[0], n)])
    return _emitted(rule, p, q, depth)


def _emitted(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """``emitted_distribution`` of one chunk of rows: p itself where the rule is exact at this
    depth (a = p: pi = p exactly, formula (2) would leave rounding residue), else ``rule.emitted``."""
    return p if rule.is_exact(depth) else rule.emitted(p, q, depth)


def tv(pi: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Total variation 1/2 sum |pi - p| along the last dim."""
    return 0.5 * (pi - p).abs().sum(-1)


def kl(pi: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(pi || p) = sum_y pi(y) (log pi(y) - log p(y)) along the last dim; inf where pi has mass
    outside p's support (log 0 = -inf), 0 log 0 = 0. Where pi(y) = 0, both logs read 1 instead
    (z = 1): the term is 0 * (0 - log(p + 1)) = 0, with no 0 * inf; elsewhere z = 0 changes
    nothing. ``torch.log`` and float masks are the vectorised kernels on the CPU
    (``torch.special.xlogy`` measured 5x the time of ``torch.log``, and the xlogy KL most of a
    scaled rule's signal cost); the result equals the xlogy form up to float rounding (log to
    within an ulp; the difference of the logs, not the log of the ratio, which overflows where p is
    subnormal)."""
    z = torch.eq(pi, 0, out=torch.empty_like(pi))  # 1.0 where pi = 0
    return (pi * (torch.log(pi + z) - torch.log(p + z))).sum(-1)


def expected_nll(pi: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sum_y pi(y) log p(y) along the last dim (0 log 0 = 0): the expected NLL of a token drawn
    from pi, i.e. the cross-entropy H(pi, p) (docs/distortion.md, Expected NLL); inf if pi has mass
    where p has none. ``logp`` must be finite (``coolsd.engine.signals.target_log_probs`` clamps -inf to the
    dtype's lowest value), so that 0 * log p = 0 without masking: one product."""
    return -torch.linalg.vecdot(pi, logp.to(pi.dtype))


def lossless(rule: Rule, depth: int) -> bool:
    """Whether the rule emits p itself at every chain depth 1..depth (``Rule.is_exact``: exact
    rules, omega = 1)."""
    return all(rule.is_exact(d) for d in range(1, depth + 1))


class ChainSignals(NamedTuple):
    """Per-depth signals of the emitted token along a chain, each (B, depth): TV(pi, p), KL(pi || p)
    and, when log-probabilities were given, the expected NLL -sum pi log p (else None)."""

    tv: torch.Tensor
    kl: torch.Tensor
    nll_expected: Optional[torch.Tensor] = None


# eager rows of a depth-independent rule (LANTERN) are selected (only the emitted depths computed)
# from this many rows on; fewer (batch 1) cost less computed whole than the selection's dozen ops
_SELECT_ROWS_FROM = 8


def chain_distortion(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int,
                     need: Optional[torch.Tensor] = None, logp: Optional[torch.Tensor] = None,
                     choices: Optional[torch.Tensor] = None) -> ChainSignals:
    """Per-depth (TV, KL) of the emitted token along a chain, each (B, depth): p (B, n+1, V) the
    target at every node (node d-1 verifies depth d), q (B, n+1, V) the draft distribution of
    every node's token (node d at depth d). All depths in one batched pass. ``logp`` (B, n+1, V):
    the log-probabilities the target's NLL scores tokens with (``coolsd.engine.signals.target_log_probs``);
    given, the result also holds each depth's expected NLL (``expected_nll`` of pi).

    How the depths go is the rule's: all at once where it has a vectorised form
    (``rule.emitted_depths``: scaled rules), one batch of rows of depth 1 where ``emitted`` does not
    depend on the depth (``rule.depth_independent``: LANTERN), else depth by depth. ``choices``
    (B, >= depth): the per-node relaxations a choosing rule's verification made (``Verdict.choices``),
    passed to its ``emitted_depths``; without them such a rule chooses again, depth by depth.

    ``need`` (B, depth) bool: the depths whose token the round emitted (verified there); for
    depth-independent rules in eager mode only those rows are computed (the others are 0: the round
    never reached them), about half of them at a typical acceptance, once there are
    ``_SELECT_ROWS_FROM`` rows. Other rules, and compiled rounds (static shapes), compute every row."""
    B, V = p.shape[0], p.shape[-1]
    P = p[:, :depth]
    L = logp[:, :depth] if logp is not None else None

    def signals(pi, P, L):
        return ChainSignals(tv(pi, P), kl(pi, P), expected_nll(pi, L) if L is not None else None)

    if depth == 0 or lossless(rule, depth):
        z = p.new_zeros(B, depth)  # lossless at every depth: pi = p exactly
        return ChainSignals(z, z, expected_nll(P, L) if L is not None else None)
    Q = q[:, 1 : depth + 1].to(p.dtype)  # (B, D, V)
    # cheap rows: every depth at once, where the rule has that form (a choosing rule's from the
    # choices its verification made, ``Verdict.choices``)
    pi = rule.emitted_depths(P, Q) if choices is None else rule.emitted_depths(P, Q, choices[:, :depth])
    if pi is not None:
        return signals(pi, P, L)
    if not rule.depth_independent:  # depth by depth
        pi = torch.stack([emitted_distribution(rule, P[:, d - 1], Q[:, d - 1], d) for d in range(1, depth + 1)], 1)
        return signals(pi, P, L)
    # depth-independent (LANTERN: O(V k) a row): every depth a row; eager computes only the rows the round emitted
    select = need is not None and not compiling() and B * depth >= _SELECT_ROWS_FROM
    rows = need.reshape(-1).nonzero().squeeze(1) if select else None
    if rows is not None:  # row b * depth + d - 1 (depth d of sample b) reads node d - 1 of p, node d of q
        n1 = p.shape[1]
        node = (rows // depth) * n1 + rows % depth
        P = p.reshape(-1, V).index_select(0, node)
        Q = q.reshape(-1, V).index_select(0, node + 1).to(p.dtype)
        L = logp.reshape(-1, V).index_select(0, node) if logp is not None else None
    else:
        P, Q = P.reshape(B * depth, V), Q.reshape(B * depth, V)
        L = L.reshape(B * depth, V) if L is not None else None
    out = signals(emitted_distribution(rule, P, Q, 1), P, L)
    if rows is not None:  # rows the round never reached: 0 (never written)
        out = ChainSignals(*(P.new_zeros(B * depth).index_copy_(0, rows, x) if x is not None else None for x in out))
    return ChainSignals(*(x.view(B, depth) if x is not None else None for x in out))
