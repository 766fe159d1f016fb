"""LANTERN / LANTERN++ latent neighbourhoods and aggregated probabilities (METHODS.md 3)."""
from __future__ import annotations

from typing import Optional

import torch

from coolsd.compiled import compiling

# compiled code reads neighbour columns one by one (k gathers fused into one loop over (N, V))
# for up to this many columns; more (LANTERN's k = 1000) would unroll into a huge graph
UNROLL_MAX = 33


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
    if tokens is None and _unroll(p, neighbours):
        return _aggregate_unrolled(p, neighbours, lam, delta)
    if tokens is None:
        c = at_neighbours(p, neighbours).cumsum(-1)  # (B, V, k)
        px = p
    else:
        nb = neighbours[tokens]  # (B, k)
        px = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        c = torch.gather(p, -1, nb).cumsum(-1)
    budget = (lam - 1) * px.unsqueeze(-1) if lam is not None else torch.full_like(px, delta).unsqueeze(-1)
    count = admissible_count(c, budget)
    c_star = torch.where(
        count > 0, c.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), torch.zeros_like(px)
    )
    return px + c_star, count > 0


def _unroll(p: torch.Tensor, nb: torch.Tensor) -> bool:
    """Whether the all-vocabulary kernels go column by column: in compiled code, where Inductor
    fuses the k gathers into one pass over (N, V), for k <= UNROLL_MAX. Eager code keeps the
    (N, V, k) form: column by column measured no faster there (each column's gather, float64
    round trip and compare are separate passes), even on the many rows of
    ``generate._DeferredSignals``."""
    return compiling() and nb.shape[1] <= UNROLL_MAX


def admissible_count(c: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """m* = #{m : c_m <= budget} (..., ) for c (..., k) non-decreasing along its last dim (partial
    sums of probabilities, rounded monotonically) and budget (..., 1): a binary search per row,
    equal to ``(c <= budget).sum(-1)`` without materialising the (..., k) comparison and its int64
    sum (6x less time for the all-vocabulary aggregation of ``distortion._aggregate_all``)."""
    return torch.searchsorted(c.contiguous(), budget.to(c.dtype).contiguous(), right=True).squeeze(-1)


def _aggregate_unrolled(p: torch.Tensor, nb: torch.Tensor, lam, delta) -> tuple[torch.Tensor, torch.Tensor]:
    """``aggregate(p, nb, None)`` column by column (``_unroll``), bit for bit on the CPU: c_m accumulated column
    by column in float64 and rounded to p's dtype (what the CPU's ``cumsum`` does for float32 and
    float64 alike), and since c_m is non-decreasing the last admissible c_m is the largest, so p~ =
    p + the running max-admissible value and m* > 0 iff c_1 is admissible. Inductor fuses the k
    gathers into one pass over (N, V) instead of materialising (N, V, k) and scanning it (6x less
    time on the toy world's shapes, ``benchmarks/signal_overhead.py``)."""
    budget = (lam - 1) * p if lam is not None else torch.full_like(p, delta)
    acc = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
    best = torch.zeros_like(p)
    relaxed = None
    for j in range(nb.shape[1]):
        acc = acc + p.index_select(1, nb[:, j]).to(torch.float64)
        c = acc.to(p.dtype)
        ok = c <= budget
        best = torch.where(ok, c, best)
        relaxed = ok if relaxed is None else relaxed
    return p + best, relaxed


def neighbour_sum(v: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """(N, V): sum_j v[n, nb[x, j]] at [n, x], the sum of v over each token's neighbours."""
    if _unroll(v, nb):  # column by column (see _aggregate_unrolled)
        out = v.index_select(1, nb[:, 0])
        for j in range(1, nb.shape[1]):
            out = out + v.index_select(1, nb[:, j])
        return out
    return at_neighbours(v, nb).sum(-1)


def reverse_neighbours(nb: torch.Tensor) -> torch.Tensor:
    """(V, W) long: row y lists the tokens x with y among nb[x] (in increasing x), padded with V
    (an index past the vocabulary: ``reverse_sum`` reads 0 there); W = the largest in-degree."""
    V, k = nb.shape
    flat = nb.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # by target y, sources x increasing within each y
    y = flat[order]
    counts = torch.bincount(flat, minlength=V)
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(flat.numel(), device=nb.device) - start[y]
    rev = torch.full((V, max(int(counts.max()), 1)), V, dtype=torch.long, device=nb.device)
    rev[y, rank] = order // k
    return rev


def reverse_sum(c: torch.Tensor, nb: torch.Tensor, rev: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, V): sum over the x with y in nb[x] of c[n, x], at [n, y] (the transpose of
    ``neighbour_sum``); ``rev`` = ``reverse_neighbours(nb)`` or None. Compiled with a reverse table:
    fused gathers through it (no scatter); otherwise one index_add over nb's flat index."""
    N, V = c.shape
    if compiling() and rev is not None and rev.shape[1] <= 4 * UNROLL_MAX:
        padded = torch.cat([c, torch.zeros(N, 1, dtype=c.dtype, device=c.device)], 1)
        out = padded[:, rev[:, 0]]
        for j in range(1, rev.shape[1]):
            out = out + padded[:, rev[:, j]]
        return out
    k = nb.shape[1]
    return torch.zeros_like(c).index_add_(1, nb.reshape(-1), c.unsqueeze(-1).expand(N, V, k).reshape(N, V * k))


def at_neighbours(v: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """v (N, V) at every token's neighbours nb (V, m): (N, V, m), v[n, nb[x, j]] at [n, x, j].
    One index_select with the flat (V m,) index: no (N, V, m) index tensor is materialised
    (``v[:, nb]`` and ``gather`` with an expanded index cost 3-5x more on the CPU)."""
    return v.index_select(1, nb.reshape(-1)).view(v.shape[0], *nb.shape)
