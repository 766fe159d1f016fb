"""The one generation loop (METHODS.md 1.3, 4): every discrete method runs through here.

Round: the drafter proposes a tree rooted at the last emitted token; ONE target forward scores
the root and every node under the tree mask; ``verify_tree`` walks it with the method's rule;
the target commits the root and the accepted path; the drafter observes the result.
Plain AR is the same loop with the empty tree (tau = 1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from coolsd.decoding.rules import Rule
from coolsd.decoding.sampling import sample_inverse_cdf
from coolsd.decoding.trees import EMPTY_TREE, Tree
from coolsd.compiled import compiled_for
from coolsd.decoding.verify import Verdict, verify_tree
from coolsd.drafting import RoundInfo, SamplingConfig
from coolsd.protocols import ARModel


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, N)
    round_lengths: list[list[int]]  # per sample: tokens emitted in each round
    target_forwards: list[int]  # per sample: target forwards incl. prefill
    draft_forwards: int  # drafter forwards for the whole batch
    seconds: float  # wall time of the loop (prefill included, decoding to pixels excluded)
    first_from_prefill: bool = True
    extra: dict = field(default_factory=dict)

    def accepted_length(self, b: int) -> float:
        """tau: mean tokens per verification round (METHODS.md 0)."""
        r = self.round_lengths[b]
        return sum(r) / len(r) if r else float("nan")


class NonFiniteLogits(FloatingPointError):
    """The target produced NaN or inf logits for ``sample`` while predicting image token
    ``position`` (the sample cannot continue; a job records it as failed and goes on)."""

    def __init__(self, sample: int, position: int):
        super().__init__(f"non-finite (nan/inf) target logits for sample {sample} at image token position {position}")
        self.sample, self.position = sample, position


def _check_finite(logits: torch.Tensor, n_out: torch.Tensor, active: torch.Tensor) -> None:
    """logits (B, m, V): every active sample's rows must be finite (one reduction, one sync)."""
    bad = ~torch.isfinite(logits).all(-1).all(-1) & active.to(logits.device)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise NonFiniteLogits(b, int(n_out[b]))


def speculative_generate(
    target: ARModel,
    n_tokens: int,
    rng,
    *,
    rule: Optional[Rule] = None,
    drafter=None,
    tree: Tree = EMPTY_TREE,
    sampling: SamplingConfig = SamplingConfig(),
    cond: Any = None,
    batch_size: int = 1,
    bos_token: Optional[int] = None,
    sync: Callable[[], None] = lambda: None,
) -> GenerationResult:
    """Generate ``n_tokens`` per sample.

    If ``bos_token`` is None the first token is sampled from the prefill output and is not a
    round (EAGLE/LANTERN convention); otherwise the first round is rooted at ``bos_token``
    (the theory lab: generation from the empty prefix, every token from a round).
    ``rng`` gives uniforms per sample (``coolsd.decoding.rng``).
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if drafter is None:
        tree = EMPTY_TREE
    if rule is None and tree.n_nodes > 0:
        raise ValueError("a drafted tree needs an acceptance rule")
    B = batch_size
    sync()
    t0 = time.perf_counter()
    prefill = target.begin(cond, B)
    forwards = torch.ones(B, dtype=torch.long) if prefill is not None else torch.zeros(B, dtype=torch.long)
    out = torch.zeros(B, n_tokens, dtype=torch.long)
    n_out = torch.zeros(B, dtype=torch.long)
    if bos_token is None:
        if prefill is None:
            raise ValueError("a target without a condition needs bos_token")
        _check_finite(prefill.logits[:, -1:], n_out, torch.ones(B, dtype=torch.bool))
        u0 = rng.uniform(1)[:, 0]
        root = sample_inverse_cdf(sampling.probs(prefill.logits[:, -1]), u0)
        out[:, 0] = root
        n_out += 1
    else:
        root = torch.full((B,), int(bos_token), dtype=torch.long)
    n_out0 = 0 if bos_token is not None else 1
    if drafter is not None:
        drafter.begin(cond, B, root, prefill)
    round_fn = compiled_for(target, "round", verify_round) if getattr(target, "compiled", False) else verify_round
    buf = torch.zeros(B, n_tokens + tree.max_depth + 2, dtype=torch.long)
    buf[:, : out.shape[1]] = out
    round_log: list[torch.Tensor] = []
    t_len = torch.zeros(B, dtype=torch.long)  # committed target entries after the condition
    n1 = tree.n_nodes + 1
    more = n_out0 < n_tokens  # host-known: every sample starts with the same count
    while more:
        active = n_out < n_tokens
        remaining = n_tokens - n_out
        max_depth = torch.clamp(remaining, max=tree.max_depth) if tree.n_nodes else torch.zeros_like(remaining)
        cap = drafter.depth_cap(n_out) if drafter is not None else None
        if cap is not None:
            max_depth = torch.minimum(max_depth, cap)
        max_depth = torch.where(active, max_depth, torch.zeros_like(max_depth))
        u_accept = rng.uniform(n1)
        u_emit = rng.uniform(1)[:, 0]
        if drafter is not None:
            tokens, q = drafter.propose(tree, rng, max_depth)
        else:
            tokens, q = root.unsqueeze(1), None
        hidden, p, path, n_accepted, emitted, n_keep, bad = round_fn(
            target, tokens, t_len, tree, q, rule or _NO_RULE, u_accept, u_emit, max_depth, remaining, active, sampling)
        verdict = Verdict(path, n_accepted, emitted, None)
        forwards += active.long()
        t_len += n_keep
        # append accepted drafts then the emitted token at each sample's end
        D = verdict.path.shape[1]
        vals = torch.cat([tokens.gather(1, verdict.path.clamp(min=0)), torch.zeros(B, 1, dtype=torch.long)], 1)
        vals.scatter_(1, verdict.n_accepted.unsqueeze(1), verdict.emitted.clamp(min=0).unsqueeze(1))
        n_new = verdict.n_accepted + (verdict.emitted >= 0).long()
        n_new = torch.where(active, n_new, torch.zeros_like(n_new))
        cols = torch.arange(D + 1).unsqueeze(0)
        write = cols < n_new.unsqueeze(1)
        where = torch.where(write, n_out.unsqueeze(1) + cols, n_tokens + D)  # dump column
        buf.scatter_(1, where, torch.where(write, vals, 0))
        n_out += n_new
        round_log.append(torch.where(active, n_new, -1))
        if drafter is not None:
            drafter.observe(
                RoundInfo(tokens, verdict.path, verdict.n_accepted, verdict.emitted, p, hidden)
            )
        root = torch.where(verdict.emitted >= 0, verdict.emitted, root)
        # the round's one host read (compiled mode; eager drafting and verification add early exits)
        failed, more = torch.stack([bad.any(), (n_out < n_tokens).any()]).tolist()
        if failed:
            b = int(bad.nonzero()[0, 0])
            raise NonFiniteLogits(b, int(n_out[b] - n_new[b]))
    sync()
    seconds = time.perf_counter() - t0
    out = buf[:, :n_tokens]
    log = torch.stack(round_log, 1).tolist() if round_log else [[] for _ in range(B)]
    rounds = [[n for n in row if n >= 0] for row in log]
    return GenerationResult(
        tokens=out,
        round_lengths=rounds,
        target_forwards=forwards.tolist(),
        draft_forwards=getattr(drafter, "forwards", 0),
        seconds=seconds,
        first_from_prefill=bos_token is None,
    )


def verify_round(target, tokens, t_len, tree: Tree, q, rule: Rule, u_accept, u_emit, max_depth, remaining, active,
                 sampling: SamplingConfig):
    """The target's side of a round (one compiled call under ``compile=true``): ONE forward over
    the root and the drafted tree, the method's verification walk, the commit of the root and
    the accepted path. Returns (hidden, p, path, n_accepted, emitted, n_keep, bad) with ``bad``
    (B,) marking active samples whose logits are not finite (the caller raises; nothing here
    reads the host)."""
    B = tokens.shape[0]
    positions = t_len.unsqueeze(1) + tree.depth.unsqueeze(0)
    step = target.forward(tokens, positions, tree.ancestors, None)
    bad = ~torch.isfinite(step.logits).all(-1).all(-1) & active
    p = sampling.probs(step.logits)
    if q is None:
        q = torch.zeros_like(p)
    verdict = verify_tree(p, q.to(p.dtype), tokens, tree, rule, u_accept, u_emit, max_depth,
                          emit_allowed_after=remaining)
    keep = torch.cat([torch.zeros(B, 1, dtype=torch.long), verdict.path.clamp(min=0)], dim=1)
    n_keep = torch.where(active, verdict.n_accepted + 1, torch.zeros_like(verdict.n_accepted))
    target.commit(keep, n_keep)
    return step.hidden, p, verdict.path, verdict.n_accepted, verdict.emitted, n_keep, bad


class _NoRule(Rule):
    name = "none"

    def numerator(self, p_res, depth):  # never called: the empty tree has no siblings
        return p_res


_NO_RULE = _NoRule()
