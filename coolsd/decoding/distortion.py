"""Exact per-token distortion of a verification rule at a chain node (issue 15, METHODS.md 10;
derivations in docs/distortion.md).

At a chain node the round drafts ONE token x ~ q and verifies it against the target's p with
the method's rule (``coolsd.decoding.rules``): accept x with probability f(x), else emit a token
from the rule's residual. Marginalised over the draft draw, the token the method emits at this
position is distributed as

    pi(y) = q(y) f(y) + sum_x q(x) (1 - f(x)) Norm(r_x)(y)

where r_x is the residual after rejecting x (``Norm`` falls back to p where r_x has no mass, as
``verify_tree`` does). ``emitted_distribution`` computes pi exactly and vectorised over the
batch, without enumerating x:

* rules whose residual does not depend on x (exact, scaled, LANTERN with ``resample=gstar``):
  q f = min(q, a) and r = G* = [p - min(q, a)]_+, so pi = min(q, a) + beta Norm(G*) with
  beta = 1 - sum min(q, a) (COOL-SD Prop. 1); the exact rule (a = p) gives pi = p;
* LANTERN's own resampling zeroes q on the k+1 neighbours N(x) of x when relaxation was used at
  x, so r_x = r0 + Delta_x with r0 = [p - q]_+ and Delta_x = min(p, q) on N(x), 0 elsewhere; the
  sum over x is then one weighted copy of r0 plus a scatter of the Delta_x: O(V k), not O(V^2).

Nodes with several siblings drawn without replacement are not covered (their marginal is not a
closed form here); the emitted token of a leaf's bonus draw is distributed as p (distortion 0).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from coolsd.compiled import compiling
from coolsd.decoding import lantern as _lantern
from coolsd.decoding.rules import ExactRule, GroupRule, LanternRule, Rule, ScaledRule, acceptance_prob
from coolsd.decoding.sampling import _TINY, normalize


# LANTERN's exact distortion goes through its rows in chunks (``emitted_distribution``) of at most
# this many (row, token, neighbour) entries: its largest temporaries are (rows, V, k + 1) -- the
# neighbour gathers of ``lantern.neighbour_sum`` / ``reverse_sum`` and the first block and the
# continued prefixes of ``_aggregate_all`` -- so each holds at most 2^26 elements (256 MiB of float32,
# 512 MiB of float64), whatever the rows of a deferred-signal flush; about 3.3 such temporaries are
# live at the peak (measured on the CPU at LANTERN's k = 1000, V = 16384, float32: 0.85 GiB extra
# in chunks of 4 rows, 1.60 GiB for 8 rows at once, growing with the rows). At that size a chunk
# is 4 rows; where one row alone has more entries (V (k + 1) > 2^26), a chunk is one row.
LANTERN_CHUNK_ELEMENTS = 1 << 26


def lantern_chunk_rows(rule: LanternRule, V: int) -> int:
    """Rows of one chunk of LANTERN's exact distortion (``LANTERN_CHUNK_ELEMENTS``), at least 1."""
    return max(1, LANTERN_CHUNK_ELEMENTS // (V * rule.nb_k1.shape[1]))


def emitted_distribution(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """pi (B, V): the distribution of the token the rule emits at a chain node of ``depth``,
    marginalised over the draft x ~ q; p, q (B, V) the target's and the drafter's distributions.
    LANTERN rules go ``lantern_chunk_rows`` rows at a time: every step of formula (3) of
    docs/distortion.md (and of the G* aggregation) is per row, so the chunks' rows are the
    unchunked call's (bit for bit on the CPU, ``tests/test_memory_bounds.py``)."""
    if isinstance(rule, LanternRule) and p.dim() == 2:
        n = lantern_chunk_rows(rule, p.shape[-1])
        if p.shape[0] > n:
            return torch.cat([_emitted(rule, p[i : i + n], q[i : i + n], depth) for i in range(0, p.shape[0], n)])
    return _emitted(rule, p, q, depth)


def _emitted(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """``emitted_distribution`` of one chunk of rows."""
    if isinstance(rule, LanternRule) and rule.resample != "gstar":
        return _lantern_emitted(rule, p, q)
    if isinstance(rule, GroupRule):  # q f depends on q; the residual does not depend on x
        accepted = rule.accepted(p, q)
        beta = (1 - accepted.sum(-1, keepdim=True)).clamp(min=0)
        return accepted + beta * normalize(rule.residual(p, q, accepted), p)
    if isinstance(rule, ExactRule) or (isinstance(rule, ScaledRule) and rule.weight(depth) == 1.0):
        return p  # a = p: lossless, pi = p exactly (formula (2) would leave rounding residue)
    # LANTERN (gstar): a = p~ over the vocabulary, as rule.numerator computes it but cheaper
    a = _aggregate_all(rule, p)[0] if isinstance(rule, LanternRule) else rule.numerator(p, depth)
    return _gstar_emitted(p, q, a)


def _gstar_emitted(p: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """pi = min(q, a) + beta Norm(G*), formula (2) of docs/distortion.md, for any numerator a (..., V)."""
    accepted = torch.minimum(q, a)  # q(y) f(y) = min(q(y), a(y)) wherever q(y) > 0
    beta = (1 - accepted.sum(-1, keepdim=True)).clamp(min=0)
    return accepted + beta * normalize(torch.clamp(p - accepted, min=0.0), p)  # G* = gstar_residual(p, q, a)


# neighbour columns of the first block of the eager early-exit aggregation (_aggregate_all)
_FIRST_BLOCK = 16
# eager LANTERN aggregation over the vocabulary goes token-major (``lantern.token_major``, bit for bit
# the same values) from this many rows on: measured on the toy world (V = 512, k = 10), the same time
# either way at 16 rows, 0.7x token-major at 64 rows (a deferred-signal call: ~80 rows)
_TOKEN_MAJOR_FROM = 16


def _aggregate_all(rule: LanternRule, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p~, relaxed) at every token, each (N, V): ``coolsd.decoding.lantern.aggregate(p, rule.nb_k,
    None, ...)`` (== ``rule.numerator``), which it calls with k <= 32 (LANTERN++'s k = 10) or
    compiled (static shapes, no host reads); eager with many rows and k <= lantern.UNROLL_MAX,
    ``lantern.aggregate_token_major`` on the transpose gives the same values bit for bit. In eager
    mode with a larger k (LANTERN's k = 1000) it gives the same values bit for bit at a fraction of
    the cost: c_m = sum_{j<=m} p(n_j(x)) is
    non-decreasing in m, so the admissible m (c_m <= budget) form a prefix and m* is their count;
    the neighbour columns come in blocks (16, then doubling), each computed only for the (row,
    token) pairs whose prefix is still admissible through the previous block, from their float64
    partial sum (the CPU's ``cumsum`` of a float32 tensor accumulates in float64 and rounds each
    partial sum, so this reproduces it), and most neighbours are never read."""
    nb = rule.nb_k
    N, V = p.shape
    k = nb.shape[1]
    if _lantern.token_major(p, nb, _TOKEN_MAJOR_FROM):  # eager rows in bulk, k <= UNROLL_MAX: bit for bit
        p_tilde, relaxed = _lantern.aggregate_token_major(p.t().contiguous(), nb, lam=rule.lam, delta=rule.delta)
        return p_tilde.t().contiguous(), relaxed.t().contiguous()
    if compiling() or k <= 2 * _FIRST_BLOCK:  # every column at once: the rule's own aggregation
        return _lantern.aggregate(p, nb, None, lam=rule.lam, delta=rule.delta)
    budget = (rule.lam - 1) * p if rule.lam is not None else torch.full_like(p, rule.delta)
    first = _FIRST_BLOCK
    c = _lantern.at_neighbours(p, nb[:, :first]).to(torch.float64).cumsum(-1)  # (N, V, first): c_1..c_first
    count = _lantern.admissible_count(c.to(p.dtype), budget.unsqueeze(-1))
    relaxed = count > 0  # m* > 0
    c_star = torch.where(relaxed, c.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    # eager, large k: continue the prefixes admissible through the whole block
    c_star, count, c = c_star.reshape(-1), count.reshape(-1), c.view(N * V, first)
    rows = (count == first).nonzero().squeeze(1)  # flat (n, x) pairs, n * V + x
    carry = c[rows, -1]  # their partial sum c_start, float64
    start, width = first, 2 * _FIRST_BLOCK
    while start < k and rows.numel():
        stop = min(start + width, k)
        idx = (rows - rows % V).unsqueeze(1) + nb[rows % V, start:stop]  # flat index of p(n_j(x))
        cb = torch.cat([carry.unsqueeze(1), p.reshape(-1)[idx].to(torch.float64)], 1).cumsum(1)[:, 1:]
        cnt = _lantern.admissible_count(cb.to(p.dtype), budget.reshape(-1)[rows].unsqueeze(1))
        hit = cnt > 0
        c_star[rows[hit]] = cb[hit].gather(1, (cnt[hit] - 1).unsqueeze(1)).squeeze(1)
        full = cnt == stop - start
        rows, carry = rows[full], cb[full, -1]
        start, width = stop, 2 * width
    c_star = c_star.view(N, V)
    return p + c_star.to(p.dtype), relaxed


def _lantern_emitted(rule: LanternRule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Formula (3) of docs/distortion.md, vectorised over rows and every draft x at once.

    pi(y) gets c(x) Delta_x(y) from every relaxed x with y in N(x); neighbourhoods are not
    symmetric, so that sum is a scatter over (x, j) -> y = nb_k1[x, j]. Since Delta_x(y) =
    min(p, q)(y) for y in N(x) does not depend on x, it factors: sum_x c(x) Delta_x(y) =
    min(p, q)(y) * sum_{x relaxed, y in N(x)} c(x), so only the (N, V) weights c are scattered
    (``lantern.reverse_sum``: an index_add with the flat (V (k+1),) index in eager code, a gather
    through the reverse neighbour table in compiled code). Eager code (k + 1 <= lantern.UNROLL_MAX)
    goes to ``_lantern_emitted_token_major``, the same formula, for any number of rows: a row's
    value may not depend on which rows share its call (coolsd.batch_invariant), and the two
    paths differ in the last bits."""
    nb1 = rule.nb_k1
    if _lantern.token_major(p, nb1, 1):  # eager: every row count alike (a row's value must not depend on N)
        return _lantern_emitted_token_major(rule, p.t().contiguous(), q.t().contiguous()).t().contiguous()
    N, V = p.shape
    p_tilde, relaxed = _aggregate_all(rule, p)
    f = acceptance_prob(p_tilde, q)  # f(x) at every x, as LanternRule.step evaluates it at the draft
    w = q * (1 - f)  # probability of drafting x and rejecting it
    r0 = torch.clamp(p - q, min=0.0)
    m = torch.minimum(p, q)  # Delta_x on N(x)
    everyone = nb1.shape[1] == V - 1  # N(x) = every token but x (LANTERN's k = 1000 on a small vocabulary)
    if everyone:  # the sums over N(x) are the total less x's own term: O(V), not O(V^2)
        gain = m.sum(-1, keepdim=True) - m
    else:
        gain = _lantern.neighbour_sum(m, nb1)  # (N, V): sum_{y in N(x)} min(p, q)(y)
    s = r0.sum(-1, keepdim=True) + torch.where(relaxed, gain, torch.zeros_like(gain))  # (N, V): mass of r_x
    ok = s > _TINY
    c = torch.where(ok, w / torch.where(ok, s, torch.ones_like(s)), torch.zeros_like(s))  # weight of Norm(r_x)
    pi = q * f + c.sum(-1, keepdim=True) * r0 + (w * ~ok).sum(-1, keepdim=True) * p  # massless r_x: p
    cr = torch.where(relaxed, c, torch.zeros_like(c))
    if everyone:
        into = cr.sum(-1, keepdim=True) - cr  # sum over x != y
    else:
        into = _lantern.reverse_sum(cr, nb1, rule.rev_k1)  # (N, V): sum_{x relaxed, y in N(x)} c(x)
    return pi + m * into


def _lantern_emitted_token_major(rule: LanternRule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``_lantern_emitted`` on the transposes: p, q (V, N) -> pi (V, N), formula (3) of
    docs/distortion.md with the same elementwise steps (bit for bit); the sums over N(x) and the
    reverse scatter add in another order (equal up to float rounding). Each column's value does not
    depend on the other columns (``_vocab_sum``). Token-major, every neighbour read
    is a copy of whole rows (``lantern.aggregate_token_major``, ``neighbour_sum_token_major``,
    ``reverse_sum_token_major``, no (N, V, k) tensor), and the steps run in place on a few (V, N)
    buffers: fresh large tensors are fresh pages from the OS, whose faults measured as much as the
    arithmetic on the toy world. Masks are float 0/1 (a boolean ``where`` / ``masked_fill`` on
    (512, 80) measured 25x the time of a product with a float mask on the CPU): x * mask for
    where(mask, x, 0), equal for the finite x here, and a safe divisor d + (1 - mask), equal to d
    where the mask is 1. Needs k + 1 <= lantern.UNROLL_MAX neighbours."""
    nb1 = rule.nb_k1
    f, relaxed = _lantern.aggregate_token_major(p, rule.nb_k, lam=rule.lam, delta=rule.delta)  # f <- p~
    relaxed = relaxed.to(p.dtype)  # float masks from here on (see the docstring)
    drafted = torch.gt(q, 0, out=torch.empty_like(q))  # rules.acceptance_prob, in place:
    f.div_(q + (1 - drafted)).clamp_(max=1.0).mul_(drafted)  # min(1, p~ / q) where q > 0 (q + 0 = q), else 0
    w = f.neg().add_(1.0).mul_(q)  # q (1 - f): probability of drafting x and rejecting it
    r0 = torch.sub(p, q).clamp_(min=0.0)
    m = torch.minimum(p, q)  # Delta_x on N(x)
    s = _lantern.neighbour_sum_token_major(m, nb1).mul_(relaxed)  # sum_{y in N(x)} min(p, q)(y) if relaxed(x)
    s.add_(_vocab_sum(r0))  # mass of r_x at every x
    ok = torch.gt(s, _TINY, out=torch.empty_like(s))
    notok = 1 - ok
    c = torch.div(w, s.add_(notok), out=s).mul_(ok)  # weight of Norm(r_x): w / s, 0 where r_x has no mass
    massless = _vocab_sum(w.mul_(notok))  # weight of the fallback to p
    pi = f.mul_(q).add_(r0.mul_(_vocab_sum(c))).add_(p * massless)  # q f + (sum c) r0 + ... p
    into = _lantern.reverse_sum_token_major(c.mul_(relaxed), nb1)  # sum_{x relaxed, y in N(x)} c(x)
    return pi.add_(m.mul_(into))


def _vocab_sum(xT: torch.Tensor) -> torch.Tensor:
    """(1, N): the sum over the vocabulary of xT (V, N), taken on the row-major copy, whose row sums
    do not depend on N; a reduction along dim 0 does (measured: 124 of 300 columns of a (512, 300)
    tensor summed alone differ in the last bit from the same columns summed together)."""
    return xT.t().contiguous().sum(-1).unsqueeze(0)


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
    where p has none. ``logp`` must be finite (``generate.target_log_probs`` clamps -inf to the
    dtype's lowest value), so that 0 * log p = 0 without masking: one product."""
    return -torch.linalg.vecdot(pi, logp.to(pi.dtype))


def lossless(rule: Rule, depth: int) -> bool:
    """Whether the rule emits p itself at every chain depth 1..depth (a = p: exact rules, omega = 1)."""
    return isinstance(rule, ExactRule) or (isinstance(rule, ScaledRule)
                                           and all(rule.weight(d) == 1.0 for d in range(1, depth + 1)))


class ChainSignals(NamedTuple):
    """Per-depth signals of the emitted token along a chain, each (B, depth): TV(pi, p), KL(pi || p)
    and, when log-probabilities were given, the expected NLL -sum pi log p (else None)."""

    tv: torch.Tensor
    kl: torch.Tensor
    nll_expected: Optional[torch.Tensor] = None


# eager LANTERN rows are selected (only the emitted depths computed) from this many rows on; fewer
# (batch 1) cost less computed whole than the selection's dozen ops
_SELECT_ROWS_FROM = 8


def chain_distortion(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int,
                     need: Optional[torch.Tensor] = None, logp: Optional[torch.Tensor] = None) -> ChainSignals:
    """Per-depth (TV, KL) of the emitted token along a chain, each (B, depth): p (B, n+1, V) the
    target at every node (node d-1 verifies depth d), q (B, n+1, V) the draft distribution of
    every node's token (node d at depth d). All depths in one batched pass. ``logp`` (B, n+1, V):
    the log-probabilities the target's NLL scores tokens with (``generate.target_log_probs``);
    given, the result also holds each depth's expected NLL (``expected_nll`` of pi).

    ``need`` (B, depth) bool: the depths whose token the round emitted (verified there); for LANTERN
    rules in eager mode only those rows are computed (the others are 0: the round never reached
    them), about half of them at a typical acceptance, once there are ``_SELECT_ROWS_FROM`` rows.
    Other rules, and compiled rounds (static shapes), compute every row."""
    B, V = p.shape[0], p.shape[-1]
    P = p[:, :depth]
    L = logp[:, :depth] if logp is not None else None

    def signals(pi, P, L):
        return ChainSignals(tv(pi, P), kl(pi, P), expected_nll(pi, L) if L is not None else None)

    if depth == 0 or lossless(rule, depth):
        z = p.new_zeros(B, depth)  # lossless at every depth: pi = p exactly
        return ChainSignals(z, z, expected_nll(P, L) if L is not None else None)
    Q = q[:, 1 : depth + 1].to(p.dtype)  # (B, D, V)
    if isinstance(rule, ScaledRule):  # cheap rows: every depth at once, omega_d broadcast over the batch
        omega = [rule.weight(j) for j in range(1, depth + 1)]
        w = torch.tensor(omega, dtype=P.dtype, device=P.device).view(1, depth, 1)
        pi = _gstar_emitted(P, Q, w * P)
        if 1.0 in omega:  # a = p at that depth: exactly p (formula (2) would leave rounding residue)
            pi = torch.where(w == 1.0, P, pi)
        return signals(pi, P, L)
    if not isinstance(rule, LanternRule):  # any other rule: depth by depth
        pi = torch.stack([emitted_distribution(rule, P[:, d - 1], Q[:, d - 1], d) for d in range(1, depth + 1)], 1)
        return signals(pi, P, L)
    # LANTERN: depth-independent, O(V k) a row; eager computes only the rows the round emitted
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
