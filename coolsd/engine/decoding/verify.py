"""Tree verification: recursive rejection over siblings, every node's children at once
(docs/methods.md#13-verification-at-one-tree-depth-d).

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
    not on how the walk reached it. So the nodes with children (``Tree.walk_nodes``) walk their
    children together, rank by rank (``Tree.max_children`` steps for the whole tree, rank r over the
    nodes that have an r-th child: every drafted node once), each node's rows through the same
    kernels in the same order as its own walk (bit for bit its p_res and f); each node's accepted
    child (or none) is read off, and the accepted path follows those pointers from the root. Nodes
    deeper than a sample's ``max_depth`` are never verified. Rows are node-major, (node, sample),
    so a rank's rows are a contiguous block. No step reads the host (the round's one host read is
    the loop's).
    """
    B, _, V = p.shape
    dev = p.device
    D = tree.max_depth
    if not D:  # a plain AR step: the token is drawn from p at the root
        path, n_acc, p_res, choices = torch.empty(B, 0, dtype=torch.long, device=dev), \
            torch.zeros(B, dtype=torch.long, device=dev), p[:, 0], None
    else:
        path, n_acc, p_res, choices = _walk_tree(p, q, tokens, tree, rule, u_accept, max_depth)
    emitted = sample_inverse_cdf(p_res, u_emit)
    if emit_allowed_after is not None:
        emitted = torch.where(n_acc < emit_allowed_after, emitted, torch.full_like(emitted, -1))
    return Verdict(path, n_acc, emitted, p_res, choices)


def _walk_tree(p, q, tokens, tree: Tree, rule: Rule, u_accept, max_depth) -> tuple:
    """(path, n_accepted, p_res, choices) of a tree with drafts (``verify_tree``'s docstring)."""
    B, dev = p.shape[0], p.device
    kids, counts = tree.walk_children, tree.walk_rank_counts  # rank r: rows off_r .. off_r + counts[r]
    x = tokens.t().index_select(0, kids)  # (n, B)
    qj = q.transpose(0, 1).index_select(0, kids)  # (n, B, V): each drafted node's q_j
    u = u_accept.t().index_select(0, kids)
    qx = qj.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # (n, B): q_j(x_j)
    # duplicates and q_j(x_j) <= 0 are skipped (docs/methods.md#13-verification-at-one-tree-depth-d),
    # and so are nodes deeper than the sample's max_depth
    verified = (qx > 0) & (max_depth >= tree.walk_child_depth.unsqueeze(1))
    # (E, B, V): each walk node's p, where its walk starts (and the fallback of an empty residual)
    p_node = p.transpose(0, 1).index_select(0, tree.walk_nodes)
    depths, chooses = tree.walk_depths, rule.chooses
    chain = tree.max_children == 1  # a chain's choices go to the signals (``Verdict.choices``)
    walk, done, choices, a_x = p_node, [], None, []
    batched = rule.siblings_in_batch
    if not batched:
        child = torch.full(p_node.shape[:2], -1, dtype=torch.long, device=dev)
    off = 0
    for r, c in enumerate(counts):
        rows = slice(off, off + c)
        w, qr, pn = walk[:c], qj[rows], p_node[:c]
        choice = rule.choose(w, qr) if chooses else None
        choices = choice if chain else None
        if batched:
            # the residual chain each node's children would walk if every one were rejected does
            # not depend on the draws; the node's outcome is read off all its children after it
            acc_r = rule.accepted_rows(w, qr, depths[:c], choice)
            a_x.append(take(acc_r, x[rows]))
            walk = torch.where(verified[rows].unsqueeze(-1), normalize(rule.residual(w, qr, acc_r), pn), w)
        else:
            # a rule whose residual depends on the rejected draft: the chain advances only past a
            # verified child that is rejected
            f, residual = rule.step_rows(w, qr, x[rows], depths[:c], choice)
            live = verified[rows] & (child[:c] < 0)
            acc = live & (u[rows] < f)
            walk = torch.where((live ^ acc).unsqueeze(-1), normalize(residual, pn), w)
            child[:c] = torch.where(acc, kids[rows].unsqueeze(1), child[:c])
        nxt = counts[r + 1] if r + 1 < len(counts) else 0
        done.append(walk[nxt:])  # the walk nodes without a child at the next rank are finished
        off += c
    walk = torch.cat(done[::-1]) if len(done) > 1 else done[0]  # (E, B, V), walk-node order
    if batched:
        # f = min(1, a / q) where q > 0: for the verified children (q > 0) and u < 1, u < a / q
        # decides as u < f does (the sibling walk's ``acceptance_prob``); a node's accepted child
        # is its verified child with u < f of lowest rank
        hit = verified & (u < torch.cat(a_x) / qx)  # (n, B)
        R = tree.max_children
        first = torch.full(p_node.shape[:2], R, dtype=torch.long, device=dev).scatter_reduce_(
            0, tree.walk_child_row.unsqueeze(1).expand_as(hit), torch.where(hit, tree.walk_child_rank.unsqueeze(1), R),
            "amin")
        child = tree.walk_rank_children.unsqueeze(-1).expand(-1, -1, B).gather(0, first.unsqueeze(0)).squeeze(0)
    path, n_acc, last = _accepted_path(tree, child)
    # the round ends at the path's last node: p there if none of its children was verified (a
    # leaf, or below the sample's max_depth), else the residual its rejected children left
    row = tree.walk_row[last]
    at = torch.arange(B, device=dev)
    p_res = torch.where((row >= 0).unsqueeze(-1), walk[row.clamp(min=0), at], p[at, last])
    return path, n_acc, p_res, None if choices is None else choices.t()


def _accepted_path(tree: Tree, child: torch.Tensor) -> tuple:
    """(path (B, D), n_accepted (B,), the last node of the path (B,): the root where none) from
    each walk node's accepted child ``child`` (E, B), -1 where none: from the root, the accepted
    child of the node accepted one depth above, while there is one. On a chain (walk node d at
    depth d) the path is the run of acceptances from the root; on a tree, D - 1 pointer steps."""
    D = tree.max_depth
    if tree.max_children == 1:
        ok = (child >= 0).cumprod(0).bool()  # (D, B): depth d + 1 accepted, and every depth above
        path = torch.where(ok, child, -1).t()
    else:
        # nxt[i]: node i's accepted child; none -> the last row, which points to itself
        n1 = tree.parent.shape[0]
        nxt = torch.full((n1 + 1, child.shape[1]), n1, dtype=torch.long, device=child.device)
        nxt[tree.walk_nodes] = torch.where(child >= 0, child, n1)
        steps = [nxt[0]]
        for _ in range(D - 1):
            steps.append(nxt.gather(0, steps[-1].unsqueeze(0)).squeeze(0))
        path = torch.stack(steps, 1)
        path = torch.where(path < n1, path, -1)
    n_acc = (path >= 0).sum(1)
    # nodes are numbered by depth (``build_tree``), so the path's last node is its largest
    return path, n_acc, path.amax(1).clamp(min=0)
