"""LANTERN / LANTERN++ latent neighbourhoods and aggregated probabilities (METHODS.md 3)."""
from __future__ import annotations

import torch


def neighbours_from_codebook(codebook: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """For every code, the other codes by increasing L2 distance of raw codebook vectors.

    Self is excluded; ties break by code index (stable sort). Returns (V, k) long, k <= V-1.
    """
    cb = codebook.double()
    V = cb.shape[0]
    k = V - 1 if k is None else min(int(k), V - 1)
    dist = torch.cdist(cb, cb)
    dist.fill_diagonal_(float("inf"))
    order = torch.sort(dist, dim=1, stable=True).indices
    return order[:, :k].contiguous()


def aggregate(
    p: torch.Tensor,
    neighbours: torch.Tensor,
    tokens: torch.Tensor | None,
    *,
    lam: float | None = None,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Aggregated probability p~(x) = p(x) + c_{m*} and whether m* exists.

    ``p`` (B, V); ``neighbours`` (V, k); ``tokens`` (B,) to evaluate at one token per row, or
    None for every token (B, V). c_m = sum_{j<=m} p(n_j(x)); m* is the largest m <= k with
    c_m <= delta (LANTERN) or c_m <= (lam - 1) * p(x) (LANTERN++). Since c_m is non-decreasing
    the admissible m form a prefix, so m* = their count.
    """
    if tokens is None:
        c = at_neighbours(p, neighbours).cumsum(-1)  # (B, V, k)
        px = p
    else:
        nb = neighbours[tokens]  # (B, k)
        px = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        c = torch.gather(p, -1, nb).cumsum(-1)
    budget = (lam - 1) * px.unsqueeze(-1) if lam is not None else torch.full_like(px, delta).unsqueeze(-1)
    count = (c <= budget).sum(-1)
    c_star = torch.where(
        count > 0, c.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros_like(px)
    )
    return px + c_star, count > 0


def at_neighbours(v: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """v (N, V) at every token's neighbours nb (V, m): (N, V, m), v[n, nb[x, j]] at [n, x, j].
    One index_select with the flat (V m,) index: no (N, V, m) index tensor is materialised
    (``v[:, nb]`` and ``gather`` with an expanded index cost 3-5x more on the CPU)."""
    return v.index_select(1, nb.reshape(-1)).view(v.shape[0], *nb.shape)
