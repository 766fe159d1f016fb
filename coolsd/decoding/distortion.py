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

import torch

from coolsd.decoding import lantern as _lantern
from coolsd.decoding.rules import ExactRule, LanternRule, Rule, ScaledRule, acceptance_prob, gstar_residual
from coolsd.decoding.sampling import _TINY, normalize


def emitted_distribution(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
    """pi (B, V): the distribution of the token the rule emits at a chain node of ``depth``,
    marginalised over the draft x ~ q; p, q (B, V) the target's and the drafter's distributions."""
    if isinstance(rule, LanternRule) and rule.resample != "gstar":
        return _lantern_emitted(rule, p, q)
    if isinstance(rule, ExactRule) or (isinstance(rule, ScaledRule) and rule.weight(depth) == 1.0):
        return p  # a = p: lossless, pi = p exactly (formula (2) would leave rounding residue)
    a = rule.numerator(p, depth)
    accepted = torch.minimum(q, a)  # q(y) f(y) = min(q(y), a(y)) wherever q(y) > 0
    beta = (1 - accepted.sum(-1, keepdim=True)).clamp(min=0)
    return accepted + beta * normalize(gstar_residual(p, q, a), p)


def _lantern_emitted(rule: LanternRule, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    B, V = p.shape
    tokens = torch.arange(V, device=p.device).expand(B, V)
    p_tilde, relaxed = _lantern.aggregate(p, rule.nb_k, None, lam=rule.lam, delta=rule.delta)
    f = acceptance_prob(p_tilde, q)  # f(x) at every x, as LanternRule.step evaluates it at the draft
    w = q * (1 - f)  # probability of drafting x and rejecting it
    r0 = torch.clamp(p - q, min=0.0)
    nb = rule.nb_k1[tokens]  # (B, V, k+1): N(x)
    gain = torch.gather(torch.minimum(p, q), 1, nb.flatten(1)).view(nb.shape)  # Delta_x on N(x)
    s = r0.sum(-1, keepdim=True) + torch.where(relaxed.unsqueeze(-1), gain, 0).sum(-1)  # (B, V): mass of r_x
    ok = s > _TINY
    c = torch.where(ok, w / torch.where(ok, s, torch.ones_like(s)), 0)  # weight of Norm(r_x)
    pi = q * f + c.sum(-1, keepdim=True) * r0 + (w * ~ok).sum(-1, keepdim=True) * p  # massless r_x: p
    spread = torch.where(relaxed.unsqueeze(-1), c.unsqueeze(-1) * gain, 0)
    return pi.scatter_add(1, nb.flatten(1), spread.flatten(1))


def tv(pi: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Total variation 1/2 sum |pi - p| along the last dim."""
    return 0.5 * (pi - p).abs().sum(-1)


def kl(pi: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(pi || p) along the last dim; inf where pi has mass outside p's support."""
    terms = torch.where(pi > 0, pi * (torch.log(pi) - torch.log(p)), torch.zeros_like(pi))
    return terms.sum(-1)


def chain_distortion(rule: Rule, p: torch.Tensor, q: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth (TV, KL) of the emitted token along a chain, each (B, depth): p (B, n+1, V) the
    target at every node (node d-1 verifies depth d), q (B, n+1, V) the draft distribution of
    every node's token (node d at depth d). All depths in one batched pass."""
    B, V = p.shape[0], p.shape[-1]
    if depth == 0:
        z = p.new_zeros(B, 0)
        return z, z
    P, Q = p[:, :depth], q[:, 1 : depth + 1].to(p.dtype)  # (B, D, V)
    if isinstance(rule, ExactRule):
        pi = P
    elif isinstance(rule, ScaledRule):
        w = torch.tensor([rule.weight(d) for d in range(1, depth + 1)], dtype=P.dtype, device=P.device)
        accepted = torch.minimum(Q, w[:, None] * P)
        beta = (1 - accepted.sum(-1, keepdim=True)).clamp(min=0)
        pi = accepted + beta * normalize(torch.clamp(P - accepted, min=0.0), P)
        pi = torch.where((w == 1.0)[:, None], P, pi)  # a = p at that depth: lossless, exactly p
    elif isinstance(rule, LanternRule):  # depth-independent: every depth as one batch
        pi = emitted_distribution(rule, P.reshape(B * depth, V), Q.reshape(B * depth, V), 1).view(B, depth, V)
    else:
        pi = torch.stack([emitted_distribution(rule, P[:, d - 1], Q[:, d - 1], d) for d in range(1, depth + 1)], 1)
    return tv(pi, P), kl(pi, P)
