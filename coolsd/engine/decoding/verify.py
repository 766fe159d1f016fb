"""Tree verification: recursive rejection over siblings, depth by depth (docs/methods.md#13-verification-at-one-tree-depth-d).

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
    """
    B, _, V = p.shape
    dev = p.device
    ar = torch.arange(B, device=dev)
    rows = ar.unsqueeze(1)
    node = torch.zeros(B, dtype=torch.long, device=dev)
    p_res = p[:, 0]
    D = tree.max_depth
    # deep[:, d] whether depth d + 1 may be verified (one op for every depth's test)
    deep = max_depth.unsqueeze(1) > torch.arange(D, device=dev) if D else None
    searching = deep[:, 0] if D else None
    path = []
    # a rule that chooses each node's relaxation from the node's (p_res, q) (``Rule.chooses``)
    # chooses a chain's nodes in one call: on a chain a live sample's p_res at depth d is p at
    # node d - 1 and its draft is node d (node j at depth j); elsewhere sibling by sibling
    chain, chooses = D > 0 and tree.max_children == 1, rule.chooses
    choices = rule.choose(p[:, :D], q[:, 1 : D + 1]) if chooses and chain else None
    # no early exit reads the host: every depth is walked, over the most children a node at the
    # depth above has (host-known from the static tree), dead samples masked (the round's one host
    # read is the loop's). What a depth's siblings need that does not change while they are walked
    # (their nodes, tokens, draft rows, uniforms, whether each is verified at all) is gathered once
    # a depth; the sibling steps read views of it.
    # a rule whose step is the base class's (``Rule.siblings_in_batch``) takes the per-depth form
    # below: the residual chain a depth's siblings would walk if every one were rejected does not
    # depend on the draws, so it is computed first (a few ops a sibling, in the same order and with
    # the same kernels as the sibling-by-sibling walk: bit for bit the same p_res and f), and the
    # depth's accept / reject outcome is then read off all siblings at once (the first verified
    # sibling with u < f). A rule whose step depends on the draft (LANTERN's own resampling) walks
    # the siblings one by one.
    batched = rule.siblings_in_batch
    for d in range(1, D + 1):
        R = tree.level_max_children[d - 1]
        kids = tree.children[node, :R]  # (B, R); -1 where the node has fewer children
        has = kids >= 0
        c = kids.clamp(min=0)  # where there is no such child: the root, never live
        x = torch.where(has, tokens.gather(1, c), 0)  # (the root's token may be no vocabulary id)
        qj = q[rows, c]  # (B, R, V)
        u = u_accept.gather(1, c)
        qx = qj.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # (B, R): q_j(x_j)
        # duplicates and q_j(x_j) <= 0 are skipped (docs/methods.md#13-verification-at-one-tree-depth-d)
        verified = has & (qx > 0)
        p_node = p[ar, node]  # an empty residual falls back to p at this node
        if batched:
            verified = verified & searching.unsqueeze(1)  # a sample that stopped keeps its p_res
            walk, a_x = p_res, []
            for r in range(R):
                choice = None if not chooses else choices[:, d - 1] if chain else rule.choose(walk, qj[:, r])
                acc_r = rule.accepted(walk, qj[:, r], d) if choice is None else \
                    rule.accepted(walk, qj[:, r], d, choice)
                a_x.append(take(acc_r, x[:, r]))
                rejected = normalize(rule.residual(walk, qj[:, r], acc_r), p_node)
                walk = torch.where(verified[:, r].unsqueeze(-1), rejected, walk)
            # f = min(1, a / q) where q > 0: for the verified siblings (q > 0) and u < 1, u < a / q
            # decides as u < f does (the sibling walk's ``acceptance_prob``)
            hit = verified & (u < torch.stack(a_x, 1) / qx)  # (B, R); the first hit is the accepted sibling
            found = hit.any(1)
            first = hit.to(torch.int8).argmax(1, keepdim=True)
            node = torch.where(found, c.gather(1, first).squeeze(1), node)
            p_res = torch.where(found.unsqueeze(-1), p[ar, node], walk)
        else:
            open_ = searching  # still looking for an accepted sibling at this depth
            for r in range(R):
                live = open_ & verified[:, r]
                if not chooses:
                    f, residual = rule.step(p_res, qj[:, r], x[:, r], d)
                else:
                    f, residual = rule.step(p_res, qj[:, r], x[:, r], d,
                                            choices[:, d - 1] if chain else rule.choose(p_res, qj[:, r]))
                acc = live & (u[:, r] < f)
                # acc is within live, and live within open_: ``^`` removes it
                p_res = torch.where((live ^ acc).unsqueeze(-1), normalize(residual, p_node), p_res)
                open_ = open_ ^ acc
                node = torch.where(acc, c[:, r], node)
            found = searching ^ open_
            p_res = torch.where(found.unsqueeze(-1), p[ar, node], p_res)
        path.append(torch.where(found, node, -1))
        if d < D:
            searching = found & deep[:, d]
    path = torch.stack(path, 1) if D else torch.empty(B, 0, dtype=torch.long, device=dev)
    n_acc = (path >= 0).sum(1) if D else torch.zeros(B, dtype=torch.long, device=dev)
    emitted = sample_inverse_cdf(p_res, u_emit)
    if emit_allowed_after is not None:
        emitted = torch.where(n_acc < emit_allowed_after, emitted, torch.full_like(emitted, -1))
    return Verdict(path, n_acc, emitted, p_res, choices)
