"""GSD's token groups (Grouped Speculative Decoding, arXiv 2508.07747; junhyukso/GSD
``scheduler/jacobi_iteration_lumina_mgpt.py``, ``SpeculativeSampler.__call__``).

A draft x at a node is tested with the masses of its GROUP instead of its own probabilities:
accept with probability min(1, p(G_x) / q(G_x)). Upstream forms G_x from the target's logits at
the node: the tokens whose rank in the ascending logit order lies in [r(x) - 7, r(x) + 7) (14
ranks, x included), kept where |p(y) - p(x)| < p_thr (0.15) and where the input-embedding
distance to x is below d_thr (0.5, squared L2; not reproduced here: it needs the target's
embedding table, which the harness does not hand to rules). Here the window is ``size`` ranks,
[r - size // 2, r - size // 2 + size), clipped to the vocabulary; the probability filter is kept.

Since p is sorted, the filter |p(y) - p(x)| < p_thr is also an interval of ranks, so every
token's group is one interval [lo, hi) of the sorted order and its masses are differences of
two prefix sums (float64): all V groups in O(V log V) per row, as the exact distortion
(``coolsd.engine.decoding.distortion``) and G* resampling need them at every token, not only at x.
"""
from __future__ import annotations

from typing import Optional

import torch


def group_masses(p: torch.Tensor, q: torch.Tensor, size: int, p_thr: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(p(G_y), q(G_y)) at every token y, each (..., V) in p's dtype; ties in p ordered by token
    id (a stable sort), so groups are deterministic."""
    V = p.shape[-1]
    ps, order = torch.sort(p, dim=-1, stable=True)  # ascending, as upstream's logits.sort()
    qs = q.to(p.dtype).gather(-1, order)
    r = torch.arange(V, device=p.device)
    start = r - size // 2
    lo = start.clamp(min=0).expand_as(ps)
    hi = (start + size).clamp(max=V).expand_as(ps)  # exclusive
    if p_thr is not None:  # |p(y) - p(x)| < p_thr: ranks with p in (p_x - thr, p_x + thr)
        psc = ps.contiguous()
        lo = torch.maximum(lo, torch.searchsorted(psc, (ps - p_thr).contiguous(), right=True))
        hi = torch.minimum(hi, torch.searchsorted(psc, (ps + p_thr).contiguous(), right=False))
    zero = torch.zeros(*ps.shape[:-1], 1, dtype=torch.float64, device=p.device)
    cp = torch.cat([zero, ps.to(torch.float64).cumsum(-1)], -1)
    cq = torch.cat([zero, qs.to(torch.float64).cumsum(-1)], -1)
    pg = (cp.gather(-1, hi) - cp.gather(-1, lo)).clamp(min=0)
    qg = (cq.gather(-1, hi) - cq.gather(-1, lo)).clamp(min=0)
    back = torch.empty_like(order).scatter_(-1, order, r.expand_as(order))  # rank of each token
    return pg.gather(-1, back).to(p.dtype), qg.gather(-1, back).to(p.dtype)
