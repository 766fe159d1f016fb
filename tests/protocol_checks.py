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
