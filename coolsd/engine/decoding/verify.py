"""Tree verification: recursive rejection over siblings (docs/methods.md#13-verification-at-one-tree-depth-d), every node's children at once.

One function serves every discrete method; only the ``Rule`` differs. Batched over samples:
each sample walks its own path through the same static tree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from coolsd.engine.decoding.rules import Rule, take
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

    The walk of docs/methods.md#13-verification-at-one-tree-depth-d, for every node at once: what
    the walk does at a node (its children's acceptance draws, in rank order, and the residual chain
    of their rejections) depends only on the node's own p and its children's q, tokens and uniforms,
    not on how the walk reached it. So every node with children (``Tree.expanded``) walks its
    children together, rank by rank (``Tree.max_children`` steps for the whole tree, each the same
    kernels on the same rows as the node's own walk: bit for bit its p_res and f), each node's
    accepted child (or none) is read off, and the accepted path follows those pointers from the
    root. Nodes deeper than a sample's ``max_depth`` are never verified. No step reads the host (the
    round's one host read is the loop's).
    """
    B, _, V = p.shape
    dev = p.device
    D = tree.max_depth
    if not D:  # a plain AR step: the token is drawn from p at the root
        p_res = p[:, 0]
        emitted = sample_inverse_cdf(p_res, u_emit)
        n_acc = torch.zeros(B, dtype=torch.long, device=dev)
        if emit_allowed_after is not None:
            emitted = torch.where(n_acc < emit_allowed_after, emitted, torch.full_like(emitted, -1))
        return Verdict(torch.empty(B, 0, dtype=torch.long, device=dev), n_acc, emitted, p_res, None)
    R, E = tree.expanded_children.shape
    kids = tree.expanded_children  # (R, E), rank-major: an absent rank holds a real child (never verified)
    flat = kids.view(1, R * E).expand(B, -1)
    x = tokens.gather(1, flat).view(B, R, E)
    qj = q[:, kids]  # (B, R, E, V)
    u = u_accept.gather(1, flat).view(B, R, E)
    qx = qj.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # (B, R, E): q_j(x_j)
    # duplicates and q_j(x_j) <= 0 are skipped (docs/methods.md#13-verification-at-one-tree-depth-d),
    # and so are children deeper than the sample's max_depth
    verified = tree.expanded_has & (qx > 0) & (max_depth.view(B, 1, 1) >= tree.expanded_depth)
    p_node = p[:, tree.expanded]  # (B, E, V): each node's p, where its walk starts (and the
    # fallback of an empty residual)
    depths, chooses = tree.expanded_depths, rule.chooses
    chain = tree.max_children == 1  # a chain's choices go to the signals (``Verdict.choices``)
    walk, choices = p_node, None
    if rule.siblings_in_batch:
        # the residual chain each node's children would walk if every one were rejected does not
        # depend on the draws; the node's outcome is then read off all its children at once (the
        # first verified child with u < f)
        a_x = []
        for r in range(R):
            qr = qj[:, r]
            choice = rule.choose(walk, qr) if chooses else None
            choices = choice if chain else None
            acc_r = rule.accepted_rows(walk, qr, depths, choice)
            a_x.append(take(acc_r, x[:, r]))
            rejected = normalize(rule.residual(walk, qr, acc_r), p_node)
            walk = torch.where(verified[:, r].unsqueeze(-1), rejected, walk)
        # f = min(1, a / q) where q > 0: for the verified children (q > 0) and u < 1, u < a / q
        # decides as u < f does (the sibling walk's ``acceptance_prob``)
        hit = verified & (u < torch.stack(a_x, 1) / qx)  # (B, R, E)
        found = hit.any(1)
        first = hit.to(torch.int8).argmax(1, keepdim=True)
        child = torch.where(found, kids.expand(B, R, E).gather(1, first).squeeze(1), -1)
    else:
        # a rule whose residual depends on the rejected draft: each node's children one by one,
        # the chain advancing only past a verified child that is rejected
        child = torch.full((B, E), -1, dtype=torch.long, device=dev)
        for r in range(R):
            qr = qj[:, r]
            choice = rule.choose(walk, qr) if chooses else None
            choices = choice if chain else None
            f, residual = rule.step_rows(walk, qr, x[:, r], depths, choice)
            live = verified[:, r] & (child < 0)
            acc = live & (u[:, r] < f)
            walk = torch.where((live ^ acc).unsqueeze(-1), normalize(residual, p_node), walk)
            child = torch.where(acc, kids[r], child)
    path, n_acc, last = _accepted_path(tree, child)
    # the round ends at the path's last node: p there if none of its children was verified (a
    # leaf, or below the sample's max_depth), else the residual its rejected children left
    row = tree.expanded_row[last]
    at = torch.arange(B, device=dev)
    p_res = torch.where((row >= 0).unsqueeze(-1), walk[at, row.clamp(min=0)], p[at, last])
    emitted = sample_inverse_cdf(p_res, u_emit)
    if emit_allowed_after is not None:
        emitted = torch.where(n_acc < emit_allowed_after, emitted, torch.full_like(emitted, -1))
    return Verdict(path, n_acc, emitted, p_res, choices)


def _accepted_path(tree: Tree, child: torch.Tensor) -> tuple:
    """(path (B, D), n_accepted (B,), the last node of the path (B,): the root where none) from
    each expanded node's accepted child ``child`` (B, E), -1 where none: from the root, the accepted
    child of the node accepted one depth above, while there is one. On a chain (node d at depth d)
    the path is the run of acceptances from the root; on a tree, D - 1 pointer steps."""
    B, D = child.shape[0], tree.max_depth
    if tree.max_children == 1:
        ok = (child >= 0).cumprod(1).bool()  # (B, D): depth d + 1 accepted, and every depth above
        path = torch.where(ok, child, -1)
    else:
        # nxt[b, i]: node i's accepted child, and -1 -> the last column, which points to itself
        n1 = tree.parent.shape[0]
        nxt = torch.full((B, n1 + 1), n1, dtype=torch.long, device=child.device)
        nxt[:, tree.expanded] = torch.where(child >= 0, child, n1)
        steps = [nxt[:, 0]]
        for _ in range(D - 1):
            steps.append(nxt.gather(1, steps[-1].unsqueeze(1)).squeeze(1))
        path = torch.stack(steps, 1)
        path = torch.where(path < n1, path, -1)
    n_acc = (path >= 0).sum(1)
    # nodes are numbered by depth, so the path's last node is its largest
    return path, n_acc, path.amax(1).clamp(min=0)
