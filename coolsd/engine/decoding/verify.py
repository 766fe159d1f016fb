"""Tree verification: recursive rejection over siblings, depth by depth (docs/methods.md#13-verification-at-one-tree-depth-d).

One function serves every discrete method; only the ``Rule`` differs. Batched over samples:
each sample walks its own path through the same static tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from coolsd.engine.decoding.rules import Rule
from coolsd.engine.decoding.sampling import normalize, sample_inverse_cdf
from coolsd.engine.decoding.trees import Tree


@dataclass
class Verdict:
    path: torch.Tensor  # (B, D) accepted node indices in depth order, -1 padded
    n_accepted: torch.Tensor  # (B,) accepted draft tokens
    emitted: torch.Tensor  # (B,) correction or bonus token (-1 where none is emitted)
    emit_probs: torch.Tensor  # (B, V) the distribution the emitted token was drawn from
    # (B, D) on a chain, for a rule that chooses each node's relaxation (``Rule.chooses``): the
    # choice the node at depth d was verified with, column d - 1; else None
    choices: torch.Tensor | None = None


def verify_tree(
    p: torch.Tensor,
    q: torch.Tensor,
    tokens: torch.Tensor,
    tree: Tree,
    rule: Rule,
    u_accept: torch.Tensor,
    u_emit: torch.Tensor,
    max_depth: torch.Tensor,
    emit_allowed_after: torch.Tensor | None = None,
) -> Verdict:
    """Verify one drafted tree per sample.

    p: (B, n+1, V) target distribution at every node (node 0 = root); q: (B, n+1, V) the
    conditional draft distribution each node's token was drawn from (q_j of docs/methods.md#12-static-tree-drafting);
    tokens: (B, n+1); u_accept: (B, n+1) one uniform per node; u_emit: (B,);
    max_depth: (B,) nodes deeper than this are not verified (0 = plain AR step);
    emit_allowed_after: (B,) the round emits its correction/bonus token only if fewer than this
    many drafts were accepted (room left in the sequence); default: always.
    """
    B, _, V = p.shape
    dev = p.device
    ar = torch.arange(B, device=dev)
    node = torch.zeros(B, dtype=torch.long, device=dev)
    p_res = p[:, 0]
    searching = max_depth > 0
    n_acc = torch.zeros(B, dtype=torch.long, device=dev)
    D = tree.max_depth
    path = torch.full((B, max(D, 1)), -1, dtype=torch.long, device=dev)
    # a rule that chooses each node's relaxation from the node's (p_res, q) (``Rule.chooses``)
    # chooses a chain's nodes in one call: on a chain a live sample's p_res at depth d is p at
    # node d - 1 and its draft is node d (node j at depth j); elsewhere sibling by sibling
    chain, chooses = D > 0 and tree.max_children == 1, rule.chooses
    choices = rule.choose(p[:, :D], q[:, 1 : D + 1]) if chooses and chain else None
    # no early exit reads the host: every depth is walked, over the most children a node at the
    # depth above has (host-known from the static tree), dead samples masked (the round's one host
    # read is the loop's)
    for d in range(1, D + 1):
        found = torch.zeros(B, dtype=torch.bool, device=dev)
        chosen = node.clone()
        for r in range(tree.level_max_children[d - 1]):
            child = tree.children[node, r]
            c = child.clamp(min=0)
            x = torch.where(child >= 0, tokens[ar, c], 0)
            qj = q[ar, c]
            # duplicates and q_j(x_j) <= 0 are skipped (docs/methods.md#13-verification-at-one-tree-depth-d)
            live = searching & ~found & (child >= 0) & (qj[ar, x] > 0)
            if not chooses:
                f, residual = rule.step(p_res, qj, x, d)
            else:
                f, residual = rule.step(p_res, qj, x, d, choices[:, d - 1] if chain else rule.choose(p_res, qj))
            acc = live & (u_accept[ar, c] < f)
            rej = live & ~acc
            # an empty residual falls back to p at this node
            p_res = torch.where(rej.unsqueeze(-1), normalize(residual, p[ar, node]), p_res)
            found |= acc
            chosen = torch.where(acc, c, chosen)
        node = torch.where(found, chosen, node)
        p_res = torch.where(found.unsqueeze(-1), p[ar, node], p_res)
        path[:, d - 1] = torch.where(found, node, path[:, d - 1])
        n_acc += found.long()
        searching = found & (max_depth > d)
    emitted = sample_inverse_cdf(p_res, u_emit)
    if emit_allowed_after is not None:
        emitted = torch.where(n_acc < emit_allowed_after, emitted, torch.full_like(emitted, -1))
    return Verdict(path[:, :D] if D else path[:, :0], n_acc, emitted, p_res, choices)
