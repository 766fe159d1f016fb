"""Logit processing and sampling from explicit uniforms.

Every random choice in decoding is a deterministic function of uniforms drawn by the caller
(``coolsd.engine.decoding.rng``), so the same kernels serve the per-sample seeded image loop and the
vectorised theory lab, and batch composition never changes a sample's draws.
"""
from __future__ import annotations

import torch

_TINY = 1e-12


def cfg_combine(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance on logits: uncond + s * (cond - uncond)."""
    return uncond + scale * (cond - uncond)


def warp_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Next-token distribution after temperature -> top-k -> top-p (HF warper order).

    ``temperature == 0`` gives a one-hot distribution at the argmax (greedy decoding), so greedy
    decoding runs through the same verification code as sampling.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if temperature == 0:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if temperature != 1:  # x / 1 is x: no kernel
        logits = logits / temperature
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        drop_full = torch.zeros_like(drop).scatter(-1, order, drop)
        logits = logits.masked_fill(drop_full, float("-inf"))
    return logits.softmax(-1)


def normalize(v: torch.Tensor, fallback: torch.Tensor | float) -> torch.Tensor:
    """Norm(v) = v / sum(v) along the last dim; rows without mass take ``fallback`` (a tensor, or a
    number: 0.0 for an all-zero row). (Rows without mass divide by their tiny or zero sum in the
    branch ``where`` discards: four kernels, no guard.)"""
    s = v.sum(-1, keepdim=True)
    return torch.where(s > _TINY, v / s, fallback)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor | float, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row of ``probs`` (..., V) using uniforms ``u`` (...,) in [0, 1).

    Zero-probability tokens are never returned (right-continuous inverse CDF): the token is the
    first i with cdf(i) > u * total, so cdf rises at i. Rounding can put u * total (u < 1) at the
    total itself, where no cdf value exceeds it: the target is then the largest float below the
    total, which gives the first token at which the cdf reaches its total (the last token with mass,
    unless masses too small to change the float sum follow it). A row without mass gives the last
    token (never verified: its q is 0). Six kernels, no flip of the row; five where the caller
    hands over ``zero``, a 0-dim zero of the dtype and device (made once by a caller drawing often).
    """
    cdf = probs.cumsum(-1)
    total = cdf[..., -1:]
    u = u.unsqueeze(-1) if isinstance(u, torch.Tensor) else u  # (...,) or one number for every row
    target = torch.minimum(u * total, torch.nextafter(total, total.new_zeros(()) if zero is None else zero))
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def randomized_pit(probs, tokens, u, order: str = "rank"):
    """Randomised probability integral transform of discrete draws: v = F(x-) + u p(x) with F the
    CDF of ``probs`` (..., V) in a fixed token order, x = ``tokens`` (...), u (...) independent
    uniforms. If every x is drawn from its row of ``probs``, every v is Uniform(0, 1), and the v of
    a sequence whose each token is drawn from its conditional given the tokens before it are
    i.i.d. Uniform(0, 1) (each is uniform given the past), so a uniformity test of all of them
    (``scipy.stats.kstest``) tests that the sequence was sampled from the product of conditionals
    (in id order, ``sample_inverse_cdf`` is its inverse).
    ``order``: ``"rank"`` (descending probability, ties by token id: a draw biased towards likely or
    unlikely tokens, the direction an NLL shift measures, moves v's mean) or ``"id"``. Float64."""
    p = torch.as_tensor(probs).double()
    x = torch.as_tensor(tokens).long().unsqueeze(-1)
    u = torch.as_tensor(u).double()
    if order not in ("rank", "id"):
        raise ValueError(f"randomized_pit: order must be 'rank' or 'id', got {order!r}")
    if x.shape[:-1] != p.shape[:-1] or u.shape != x.shape[:-1]:
        raise ValueError(f"randomized_pit: probs {tuple(p.shape)}, tokens {tuple(x.shape[:-1])} and u "
                         f"{tuple(u.shape)} must agree on all but the vocabulary dimension")
    px = p.gather(-1, x).squeeze(-1)
    if order == "id":
        below = (p.cumsum(-1) - p).gather(-1, x).squeeze(-1)
    else:
        perm = torch.argsort(-p, dim=-1, stable=True)  # the token at each rank
        ps = p.gather(-1, perm)
        rank = torch.argsort(perm, dim=-1).gather(-1, x)  # x's rank
        below = (ps.cumsum(-1) - ps).gather(-1, rank).squeeze(-1)
    return (below + u * px).clamp(0.0, 1.0)


def sample_without_replacement(
    probs: torch.Tensor, u: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws without replacement by successive sampling, in sampling order: draw j is the
    inverse-CDF draw (``sample_inverse_cdf``) with uniform ``u[..., j]`` from ``Norm(probs with
    the first j-1 draws zeroed)`` (the same distribution as Gumbel-top-k, from k uniforms
    instead of V: a round's randomness is one uniform per drafted node).

    ``probs`` (..., V), ``u`` (..., >= k). Returns ``tokens`` (..., k) and ``cond_probs``
    (..., k, V): for the j-th draw, the distribution it was drawn from (docs/methods.md#12-static-tree-drafting). Draws
    beyond the support get an all-zero conditional and must be skipped.
    """
    rest, tokens, rests = probs, [], []
    zero = probs.new_zeros(()) if k > 1 else None
    for j in range(k):
        rests.append(rest)
        x = sample_inverse_cdf(rest, u[..., j], zero)
        tokens.append(x)
        if j + 1 < k:
            rest = rest.scatter(-1, x.unsqueeze(-1), 0.0)
    # every draw's conditional normalised at once (each row as it would be alone: a row's sum
    # over the vocabulary does not depend on the rows beside it)
    return torch.stack(tokens, -1), normalize(torch.stack(rests, -2), 0.0)
