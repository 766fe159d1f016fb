"""LANTERN / LANTERN++ latent neighbourhoods and aggregated probabilities (docs/methods.md#3-lantern-and-lantern)."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Optional

import torch

from coolsd.engine.compiled import compiling

# compiled code reads neighbour columns one by one (k gathers fused into one loop over (N, V))
# for up to this many columns; more (LANTERN's k = 1000) would unroll into a huge graph
UNROLL_MAX = 33


# rows of the distance matrix sorted at once by ``neighbours_from_codebook``: blocks of at most
# this many entries (2^24: 1024 rows of LlamaGen's 16384 codes, 128 MiB of float64 distances, plus
# the sort's values and int64 indices of the same size), not the whole (V, V) matrix
NEIGHBOUR_BLOCK_ELEMENTS = 1 << 24
# neighbour columns kept per codebook at least (``neighbour_table``): LANTERN's default k = 1000
# reads k + 1 = 1001 of them (``rules.LanternRule.nb_k1``), so one table serves every default method
NEIGHBOURS_KEPT = 1024
_TABLES_KEPT = 4  # codebooks whose tables ``neighbour_table`` keeps (least recently used dropped)
_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def neighbours_from_codebook(codebook: torch.Tensor, k: int | None = None, *,
                             block_rows: int | None = None) -> torch.Tensor:
    """For every code, the other codes by increasing L2 distance of raw codebook vectors
    (docs/methods.md#3-lantern-and-lantern).

    Self is excluded; ties break by code index (stable sort). Returns (V, k) long, k <= V-1.
    Computed in float64 over blocks of ``block_rows`` rows (default: ``NEIGHBOUR_BLOCK_ELEMENTS``
    distances a block), each row sorted on its own: the table equals the whole (V, V) matrix's
    sort wherever a row's distances do not depend on the other rows of its block (checked on the
    CPU: random 16384 x 8 codebooks, raw and L2-normalised, blocks of 7 to 4096 rows, and
    tests/models/test_memory_bounds.py with exact ties; float32 distances reorder the first 1025 neighbours
    of 1700-1900 of the 16384 rows there, so float64 stays). Transient memory: one block's
    distances, sorted values and indices (384 MiB at LlamaGen's V = 16384; the whole matrix: 7 GiB measured)."""
    cb = codebook.detach().double()
    V = cb.shape[0]
    k = V - 1 if k is None else min(int(k), V - 1)
    rows = max(1, NEIGHBOUR_BLOCK_ELEMENTS // max(V, 1)) if block_rows is None else max(1, int(block_rows))
    out = torch.empty(V, k, dtype=torch.long, device=cb.device)
    for start in range(0, V, rows):
        dist = torch.cdist(cb[start : start + rows], cb)  # (rows, V)
        n = dist.shape[0]
        self_col = torch.arange(start, start + n, device=cb.device)
        dist[torch.arange(n, device=cb.device), self_col] = float("inf")  # self last
        out[start : start + n] = torch.sort(dist, dim=1, stable=True).indices[:, :k]
        del dist
    return out


def _codebook_key(codebook: torch.Tensor) -> tuple:
    """What identifies a codebook's neighbour table: its shape, device and float64 content
    (``neighbours_from_codebook`` reads nothing else), hashed."""
    cb = codebook.detach().double().cpu().contiguous()
    return tuple(cb.shape), str(codebook.device), hashlib.sha256(cb.numpy().tobytes()).hexdigest()


def neighbour_table(codebook: torch.Tensor, width: int) -> torch.Tensor:
    """``neighbours_from_codebook(codebook, w)`` with w >= min(width, V - 1) columns, built once per
    codebook content in a process (a sweep of LANTERN methods over one tokenizer sorts its codebook
    once): at least ``NEIGHBOURS_KEPT`` columns, rebuilt wider only for a wider request (any k
    works; k >= NEIGHBOURS_KEPT costs one more sort). Its first columns are those of any narrower
    table (the same stable order), so callers slice ``[:, :k]``. Tables stay on the codebook's
    device, ``_TABLES_KEPT`` codebooks at most."""
    V = codebook.shape[0]
    width = min(int(width), V - 1)
    key = _codebook_key(codebook)
    table = _TABLES.get(key)
    if table is None or table.shape[1] < width:  # one spare column: LanternRule reads k, then k + 1
        table = neighbours_from_codebook(codebook, min(max(width + 1, NEIGHBOURS_KEPT), V - 1))
        _TABLES[key] = table
    _TABLES.move_to_end(key)
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return table


class CodebookNeighbours:
    """A world's LANTERN neighbourhoods (docs/methods.md#3-lantern-and-lantern), indexed as the (V, V - 1) table
    ``neighbours_from_codebook(codebook)`` but built on the first read, with the columns that
    read needs (``neighbour_table``, shared per codebook): a world that never builds a LANTERN
    method never sorts its codebook, and ``rules.LanternRule``'s ``[:, :k]`` / ``[:, :k + 1]``
    keep ``NEIGHBOURS_KEPT`` columns (LlamaGen: 16384 x 1024 int64, 128 MiB), not V - 1 (2 GiB).
    Reads without a leading column slice ``[:, :m]`` build every column."""

    def __init__(self, codebook: torch.Tensor):
        self.codebook = codebook.detach()
        V = self.codebook.shape[0]
        self.shape = torch.Size((V, V - 1))
        self._table: Optional[torch.Tensor] = None  # the widest table this object read

    def columns(self, width: int) -> torch.Tensor:
        """A table of at least min(width, V - 1) columns (the first ones of the full table)."""
        width = min(int(width), self.shape[1])
        if self._table is None or self._table.shape[1] < width:
            self._table = neighbour_table(self.codebook, width)
        return self._table

    def __getitem__(self, key):
        cols = key[1] if isinstance(key, tuple) and len(key) == 2 else None
        prefix = isinstance(cols, slice) and cols.start in (None, 0) and cols.step in (None, 1) \
            and cols.stop is not None and cols.stop >= 0
        return self.columns(cols.stop if prefix else self.shape[1])[key]

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"CodebookNeighbours(V={self.shape[0]}, built={self._table is not None})"


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


# neighbour columns of the first block of the eager early-exit aggregation (``aggregate_all``)
_FIRST_BLOCK = 16
# eager aggregation over the vocabulary goes token-major (``token_major``, bit for bit the same
# values) from this many rows on: measured on the toy world (V = 512, k = 10), the same time either
# way at 16 rows, 0.7x token-major at 64 rows (a deferred-signal call: ~80 rows)
_TOKEN_MAJOR_FROM = 16


def aggregate_all(p: torch.Tensor, nb: torch.Tensor, *, lam=None, delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(p~, relaxed) at every token, each (N, V): ``aggregate(p, nb, None, lam=lam, delta=delta)``
    (== ``rules.LanternRule.numerator``), which it calls with k <= 32 (LANTERN++'s k = 10) or
    compiled (static shapes, no host reads); eager with many rows and k <= UNROLL_MAX,
    ``aggregate_token_major`` on the transpose gives the same values bit for bit. In eager
    mode with a larger k (LANTERN's k = 1000) it gives the same values bit for bit at a fraction of
    the cost: c_m = sum_{j<=m} p(n_j(x)) is
    non-decreasing in m, so the admissible m (c_m <= budget) form a prefix and m* is their count;
    the neighbour columns come in blocks (16, then doubling), each computed only for the (row,
    token) pairs whose prefix is still admissible through the previous block, from their float64
    partial sum (the CPU's ``cumsum`` of a float32 tensor accumulates in float64 and rounds each
    partial sum, so this reproduces it), and most neighbours are never read. It serves the exact
    distortion (``rules.LanternRule.emitted``); the rule's sampling step keeps ``aggregate``."""
    N, V = p.shape
    k = nb.shape[1]
    if token_major(p, nb, _TOKEN_MAJOR_FROM):  # eager rows in bulk, k <= UNROLL_MAX: bit for bit
        p_tilde, relaxed = aggregate_token_major(p.t().contiguous(), nb, lam=lam, delta=delta)
        return p_tilde.t().contiguous(), relaxed.t().contiguous()
    if compiling() or k <= 2 * _FIRST_BLOCK:  # every column at once: the rule's own aggregation
        return aggregate(p, nb, None, lam=lam, delta=delta)
    budget = (lam - 1) * p if lam is not None else torch.full_like(p, delta)
    first = _FIRST_BLOCK
    c = at_neighbours(p, nb[:, :first]).to(torch.float64).cumsum(-1)  # (N, V, first): c_1..c_first
    count = admissible_count(c.to(p.dtype), budget.unsqueeze(-1))
    relaxed = count > 0  # m* > 0
    c_star = torch.where(relaxed, c.gather(-1, (count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    # eager, large k: continue the prefixes admissible through the whole block
    c_star, count, c = c_star.reshape(-1), count.reshape(-1), c.view(N * V, first)
    rows = (count == first).nonzero().squeeze(1)  # flat (n, x) pairs, n * V + x
    carry = c[rows, -1]  # their partial sum c_start, float64
    start, width = first, 2 * _FIRST_BLOCK
    while start < k and rows.numel():
        stop = min(start + width, k)
        idx = (rows - rows % V).unsqueeze(1) + nb[rows % V, start:stop]  # flat index of p(n_j(x))
        cb = torch.cat([carry.unsqueeze(1), p.reshape(-1)[idx].to(torch.float64)], 1).cumsum(1)[:, 1:]
        cnt = admissible_count(cb.to(p.dtype), budget.reshape(-1)[rows].unsqueeze(1))
        hit = cnt > 0
        c_star[rows[hit]] = cb[hit].gather(1, (cnt[hit] - 1).unsqueeze(1)).squeeze(1)
        full = cnt == stop - start
        rows, carry = rows[full], cb[full, -1]
        start, width = stop, 2 * width
    c_star = c_star.view(N, V)
    return p + c_star.to(p.dtype), relaxed


def vocab_sum(xT: torch.Tensor) -> torch.Tensor:
    """(1, N): the sum over the vocabulary of xT (V, N), taken on the row-major copy, whose row sums
    do not depend on N; a reduction along dim 0 does (measured: 124 of 300 columns of a (512, 300)
    tensor summed alone differ in the last bit from the same columns summed together)."""
    return xT.t().contiguous().sum(-1).unsqueeze(0)


def token_major(p: torch.Tensor, nb: torch.Tensor, rows_from: int) -> bool:
    """Whether eager all-vocabulary kernels on p (N, V) should work on its transpose (V, N)
    (``aggregate_token_major``, ``neighbour_sum_token_major``, ``reverse_sum_token_major``): there,
    reading every token's j-th neighbour is a copy of whole rows (``index_select`` along dim 0)
    instead of an element gather, and sums over the k neighbours accumulate one column at a time in
    place, with no (N, V, k) tensor. For eager float32 / float64 p with at least ``rows_from`` rows
    (below, the (N, V, k) form's fewer ops cost less) and k <= UNROLL_MAX (LANTERN's k = 1000 keeps
    the blocked early exit of ``aggregate_all``). The LANTERN rule's sampling step keeps
    ``aggregate``: these serve its exact distortion (``rules.LanternRule.emitted``)."""
    return (not compiling() and p.dim() == 2 and p.shape[0] >= rows_from and nb.shape[1] <= UNROLL_MAX
            and p.dtype in (torch.float32, torch.float64))


def aggregate_token_major(pT: torch.Tensor, nb: torch.Tensor, *, lam=None,
                          delta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aggregate(pT.t(), nb, None)`` transposed, bit for bit for finite p >= 0: pT (V, N) float32 /
    float64 -> (p~, relaxed), each (V, N). c_m is accumulated column by column in float64 and
    rounded to pT's dtype after each column, which is what the CPU's ``cumsum`` does for float32
    and float64 alike (a float64 accumulator, each partial sum rounded). c_m is non-decreasing in m
    (sums of values >= 0, rounded monotonically), so the admissible m (c_m <= budget) form a prefix
    and the last admissible c_m is the largest: best = max(best, c_m * [c_m <= budget]) keeps it
    (c_m * 1 = c_m and c_m * 0 = 0 exactly; best >= 0), and m* > 0 iff c_1 is admissible
    (docs/methods.md#3-lantern-and-lantern). The masks are float 0/1: float compares, products and maxima are the fast
    kernels here (boolean outputs and ``where`` measured 3x slower a pass on the CPU)."""
    if lam is not None:  # (lam - 1) p(x); 1.0 * p is p exactly (LANTERN++'s lam = 2): no copy
        budget = pT if lam - 1 == 1.0 else (lam - 1) * pT
    else:
        budget = torch.full_like(pT, delta)
    p64, nbt = pT.to(torch.float64), nb.t().contiguous()  # nbt[j]: every token's j-th neighbour
    acc = p64.index_select(0, nbt[0])  # c_1 = p(n_1(x)) at row x: whole rows of N
    c = acc.to(pT.dtype)
    relaxed = c <= budget
    okf, col = torch.empty_like(pT), torch.empty_like(acc)
    best = c * relaxed
    for j in range(1, nb.shape[1]):
        torch.index_select(p64, 0, nbt[j], out=col)
        acc.add_(col)  # the float64 accumulator
        c.copy_(acc)  # c_j rounded to p's dtype, as cumsum's output
        torch.le(c, budget, out=okf)
        torch.maximum(best, okf.mul_(c), out=best)
    return best.add_(pT), relaxed  # p~ = p + c_{m*} (0 where no m is admissible)


def _unroll(p: torch.Tensor, nb: torch.Tensor) -> bool:
    """Whether the all-vocabulary kernels go column by column: in compiled code, where Inductor
    fuses the k gathers into one pass over (N, V), for k <= UNROLL_MAX. Eager code keeps the
    (N, V, k) form: column by column measured no faster there (each column's gather, float64
    round trip and compare are separate passes), even on the many rows of
    ``coolsd.engine.signals.DeferredSignals``."""
    return compiling() and nb.shape[1] <= UNROLL_MAX


def admissible_count(c: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """m* = #{m : c_m <= budget} (..., ) for c (..., k) non-decreasing along its last dim (partial
    sums of probabilities, rounded monotonically) and budget (..., 1): a binary search per row,
    equal to ``(c <= budget).sum(-1)`` without materialising the (..., k) comparison and its int64
    sum (6x less time for the all-vocabulary aggregation of ``aggregate_all``)."""
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


def neighbour_sum_token_major(vT: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """``neighbour_sum(vT.t(), nb)`` transposed, vT (V, N) -> (V, N), up to float summation order:
    one neighbour column at a time (a copy of whole rows, added in place), no (V, k, N) tensor."""
    nbt = nb.t().contiguous()
    out, col = vT.index_select(0, nbt[0]), torch.empty_like(vT)
    for j in range(1, nbt.shape[0]):
        out.add_(torch.index_select(vT, 0, nbt[j], out=col))
    return out


def reverse_sum_token_major(cT: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """``reverse_sum(cT.t(), nb)`` transposed, cT (V, N) -> (V, N), up to float summation order: row
    c[x] added into row nb[x, j], one neighbour column j at a time (whole rows, in place)."""
    out = torch.zeros_like(cT)
    for j in range(nb.shape[1]):
        out.index_add_(0, nb[:, j], cT)
    return out


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
