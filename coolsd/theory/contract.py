"""The contract every acceptance rule owes the signals: the token a chain node emits is distributed
as the rule's ``emitted(p, q, depth)`` says (docs/distortion.md formula (2) / (4); every
per-token distortion signal, step TV and KL, the expected NLL, is computed from ``emitted``).

A rule that changes how it samples without changing ``emitted`` (overriding ``step`` alone, say)
would sample one distribution and report another: the records would call a lossy method lossless.
``check_emitted`` catches that by sampling: for a few random (p, q) pairs at chain depths 1..3 it
verifies ``n`` drafts x ~ q at once through the production ``verify_tree`` (the one verification
engine, with the method's own built rule) and holds the emitted tokens' counts against ``emitted``
with a chi-square test (Bonferroni over the cases). ``python -m coolsd.theory --check <method>``
runs it for any registered discrete method, one from ``--include`` too; the test suite runs it for
every registered rule.

To reach depth d the chain's first d - 1 nodes carry a point mass on one token, in p and in q
alike, so a rule accepts them surely (every rule here has a(t) >= p(t) = q(t) = 1 there; a rule that
does not is reported, not checked, at that depth). The node at depth d then sees the case's (p, q):
its token is the drafted one where the node is accepted, else the correction the round emits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from coolsd.engine.decoding.sampling import sample_inverse_cdf
from coolsd.engine.decoding.trees import make_tree
from coolsd.engine.decoding.verify import verify_tree
from coolsd.engine.methods import method_info
from coolsd.theory.lab import _method
from coolsd.theory.stats import chi_square_pvalue, total_variation
from coolsd.theory.tabular import TabularAR

ALPHA = 1e-4  # family-wise: a correct rule fails the check with probability at most this


@dataclass
class Case:
    """One (p, q) at one depth: the sampled and the claimed distribution of the emitted token."""

    depth: int
    pair: int
    sampled: np.ndarray  # (V,) frequencies of the emitted token
    claimed: np.ndarray  # (V,) ``rule.emitted(p, q, depth)``
    pvalue: float
    tv: float  # TV between sampled and claimed
    skipped: str = ""  # why the case was not checked ('' if it was)


def _pairs(V: int, n_pairs: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (p, q) rows of Dirichlet(0.7), the last pair with disjoint zeros (q puts mass where p
    has none and misses some of p's tokens: off-support drafts and residual-only tokens)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_pairs):
        p, q = rng.dirichlet(np.full(V, 0.7)), rng.dirichlet(np.full(V, 0.7))
        if i == n_pairs - 1 and V >= 4:
            p[0], q[1] = 0.0, 0.0
            p, q = p / p.sum(), q / q.sum()
        out.append((torch.tensor(p), torch.tensor(q)))
    return out


def check_emitted(method: str, *, n: int = 20_000, vocab: int = 6, pairs: int = 4, depths=(1, 2, 3),
                  seed: int = 0, alpha: float = ALPHA, **params) -> dict:
    """Sample the emitted token of ``method``'s rule at chain nodes and test it against the rule's
    ``emitted`` (module docstring). Returns ``{"method", "params", "ok", "alpha", "cases": [Case]}``;
    ``ok`` is False if any case's p-value is below ``alpha`` / (cases checked). A method without a
    rule (AR) or of the continuous family is refused with the reason."""
    info = method_info(method)
    if "discrete" not in info.families:
        raise ValueError(f"--check {method}: a continuous method; the check samples discrete rules (token targets)")
    D = max(depths)
    lab = TabularAR.random(vocab, 2, seed=seed)  # only for its codebook (LANTERN's neighbourhoods)
    m = _method(lab, method, D, "chain", params)
    if m.rule is None:
        raise ValueError(f"--check {method}: the method has no acceptance rule (no token it emits goes through "
                         "verify_tree): nothing to check")
    rule = m.rule
    gen = torch.Generator().manual_seed(seed)
    cases: list[Case] = []
    for i, (p_case, q_case) in enumerate(_pairs(vocab, pairs, seed)):
        claimed = {d: rule.emitted(p_case[None], q_case[None], d)[0].double() for d in depths}  # rows (1, V)
        for d in depths:
            tree = make_tree("chain", d)
            point = torch.zeros(vocab, dtype=torch.float64)
            point[0] = 1.0
            p = point.repeat(n, d + 1, 1)  # nodes 0..d-2: the forced prefix's p_res
            q = point.repeat(n, d + 1, 1)
            p[:, d - 1], q[:, d] = p_case, q_case
            p[:, d] = 1.0 / vocab  # the bonus token's distribution, never read by the check
            tokens = torch.zeros(n, d + 1, dtype=torch.long)
            tokens[:, d] = sample_inverse_cdf(q[:, d], torch.rand(n, generator=gen, dtype=torch.float64))
            u_accept = torch.rand(n, d + 1, generator=gen, dtype=torch.float64)
            u_emit = torch.rand(n, generator=gen, dtype=torch.float64)
            verdict = verify_tree(p, q, tokens, tree, rule, u_accept, u_emit, torch.full((n,), d))
            if bool((verdict.n_accepted < d - 1).any()):
                cases.append(Case(d, i, np.zeros(vocab), claimed[d].numpy(), float("nan"), float("nan"),
                                  skipped=f"the rule rejected a point-mass draft before depth {d}"))
                continue
            token = torch.where(verdict.n_accepted == d, tokens[:, d], verdict.emitted)
            counts = torch.bincount(token, minlength=vocab).double().numpy()
            pi = claimed[d].numpy()
            cases.append(Case(d, i, counts / n, pi, chi_square_pvalue(counts, pi), total_variation(counts / n, pi)))
    checked = [c for c in cases if not c.skipped]
    ok = bool(checked) and all(c.pvalue >= alpha / len(checked) for c in checked)
    return {"method": method, "params": m.describe(), "ok": ok, "alpha": alpha, "n": n, "cases": cases}


def report(result: dict) -> str:
    """The check's verdict, a line per case: depth, pair, TV(sampled, emitted), p-value."""
    checked = [c for c in result["cases"] if not c.skipped]
    level = result["alpha"] / max(len(checked), 1)
    head = (f"{result['method']} {result['params']}: the emitted token "
            + ("follows" if result["ok"] else "does NOT follow")
            + f" the rule's emitted() ({len(checked)} cases, n = {result['n']} each, chi-square at family-wise "
              f"level {result['alpha']:g})")
    lines = [head]
    for c in result["cases"]:
        if c.skipped:
            lines.append(f"  depth {c.depth} pair {c.pair}: not checked ({c.skipped})")
            continue
        flag = "" if c.pvalue >= level else "   <-- sampled != emitted()"
        lines.append(f"  depth {c.depth} pair {c.pair}: TV(sampled, emitted) {c.tv:.4f}  p = {c.pvalue:.3g}{flag}")
        if flag:
            lines.append(f"    sampled  {np.array2string(c.sampled, precision=3)}")
            lines.append(f"    emitted  {np.array2string(c.claimed, precision=3)}")
    if not result["ok"]:
        lines.append("  The rule samples another distribution than emitted() says: the distortion signals would be "
                     "wrong. Override emitted() (and accepted / residual, which it reads) together with step "
                     "(docs/add_method.md).")
    return "\n".join(lines)
