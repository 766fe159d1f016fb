"""Checks every ARModel target shares (coolsd.engine.model_protocol): one tree round through a KV cache."""
import torch


def run_tree_round(target, cond, prefix, tree_tokens, tree, split):
    """Prefill, commit ``prefix`` (B, n) in one chunk, then forward ``tree`` with ``tree_tokens``
    (in one call, or level by level so that the second call has pending entries). Returns the
    tree logits (B, n_nodes + 1, V)."""
    B, n = prefix.shape
    target.begin(cond, B)
    target.forward(prefix, torch.arange(n).expand(B, -1), torch.ones(n, n, dtype=torch.bool).tril())
    target.commit(torch.arange(n).expand(B, -1), torch.full((B,), n))
    positions = n + tree.depth.expand(B, -1)
    if not split:
        return target.forward(tree_tokens, positions, tree.ancestors).logits
    a = int((tree.depth <= 1).sum())
    l1 = target.forward(tree_tokens[:, :a], positions[:, :a], tree.ancestors[:a, :a]).logits
    l2 = target.forward(tree_tokens[:, a:], positions[:, a:], tree.ancestors[a:]).logits
    return torch.cat([l1, l2], dim=1)


def path_to(tree, i: int) -> list[int]:
    """Node indices root..i of ``tree``."""
    out = []
    while i >= 0:
        out.append(i)
        i = int(tree.parent[i])
    return out[::-1]


def commit_and_continue(target, prompts, rows, kept, tree, draw):
    """For the samples ``rows`` of a batch of 2 (``prompts[b]``, ``kept[b]``): a ``tree`` round after
    3 committed codes, commit of each sample's kept path (different lengths), a second tree round in
    two calls at each sample's own positions, commit of root -> node 3, then 3 more codes.
    ``draw(*shape, seed=)``: codes. Returns the second round's and the last logits, the committed
    code sequences, the second tree's and the last codes."""
    prefix = draw(2, 3, seed=3)[rows]
    t1, t2 = draw(2, tree.n_nodes + 1, seed=4)[rows], draw(2, tree.n_nodes + 1, seed=6)[rows]
    new = draw(2, 3, seed=10)[rows]
    B = len(rows)
    run_tree_round(target, [prompts[b] for b in rows], prefix, t1, tree, split=False)
    keep = torch.zeros(B, 4, dtype=torch.long)  # columns past n_keep are ignored
    for i, b in enumerate(rows):
        keep[i, : len(kept[b])] = torch.tensor(kept[b])
    n_keep = torch.tensor([len(kept[b]) for b in rows])
    target.commit(keep, n_keep)
    t_len = 3 + n_keep
    pos = t_len[:, None] + tree.depth
    a = int((tree.depth <= 1).sum())
    l1 = target.forward(t2[:, :a], pos[:, :a], tree.ancestors[:a, :a]).logits
    l2 = target.forward(t2[:, a:], pos[:, a:], tree.ancestors[a:]).logits
    p3 = path_to(tree, 3)
    target.commit(torch.tensor(p3).expand(B, -1), torch.full((B,), len(p3)))
    t_len = t_len + len(p3)
    last = target.forward(new, t_len[:, None] + torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril()).logits
    seqs = [torch.cat([prefix[i], t1[i, kept[b]]]) for i, b in enumerate(rows)]
    return torch.cat([l1, l2], 1), last, seqs, t2, new


def reused_cache_check(make_target, short, long, n_tokens: int, vocab: int) -> float:
    """A target reuses its KV cache across batches. Begun on the prompt ``short``, then on the
    longer ``long`` (a cache that still holds it), its AR logits over a whole image of random codes
    must be a fresh target's on ``long``: the cache's host bound of the committed length must be
    the new sequence's (a bound kept from the short prompt hides the last committed entries from
    the last tokens). Returns the largest difference."""
    codes = torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(5))

    def logits(target, cond):
        outs = [target.begin([cond], 1).logits]
        for t in range(n_tokens - 1):
            outs.append(target.forward(codes[:, t : t + 1], torch.tensor([[t]]), torch.ones(1, 1, dtype=torch.bool)).logits)
            target.commit(None, torch.ones(1, dtype=torch.long))
        return torch.cat(outs, 1)

    reused = make_target()
    logits(reused, short)
    cache = reused.cache
    got = logits(reused, long)
    assert reused.cache is cache, "the check needs a reused cache: make the long prompt fit the short one's cache"
    return float((got - logits(make_target(), long)).abs().max())
