"""A small AR model given by explicit next-token tables, usable as target or drafter.

``TabularAR(tables)``: ``tables[prefix_tuple]`` is the 1-D next-token distribution over V
tokens after ``prefix``, for every prefix shorter than N. As an ``ARModel`` it reads a BOS
token (id V) as the empty prefix, so the production loop can generate from the empty prefix.
"""
from __future__ import annotations

import itertools
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from coolsd.engine.model_protocol import StepOut


def _check_row(prefix, row, V):
    if row.ndim != 1 or row.shape[0] != V:
        raise ValueError(f"table row for prefix {prefix} must be 1-D with {V} entries, got shape {tuple(row.shape)}")
    bad = np.flatnonzero(~np.isfinite(row))
    if bad.size:
        raise ValueError(f"table row for prefix {prefix} has a NaN/inf probability at token {int(bad[0])}")
    neg = np.flatnonzero(row < 0)
    if neg.size:
        raise ValueError(f"table row for prefix {prefix} has a negative probability {row[neg[0]]:.4g} at token {int(neg[0])}")
    s = row.sum()
    if abs(s - 1.0) > 1e-6:
        raise ValueError(f"table row for prefix {prefix} sums to {s:.6g}, not 1")


class TabularAR:
    def __init__(self, tables: Mapping[tuple, Sequence[float]], codebook: Optional[torch.Tensor] = None):
        if not tables:
            raise ValueError("tables must not be empty")
        rows = {tuple(int(t) for t in k): np.asarray(v, dtype=np.float64) for k, v in tables.items()}
        V = len(next(iter(rows.values())))
        N = max(len(k) for k in rows) + 1
        for prefix in itertools.chain.from_iterable(
            itertools.product(range(V), repeat=n) for n in range(N)
        ):
            if prefix not in rows:
                raise ValueError(f"tables has no row for prefix {prefix}; every prefix shorter than {N} is needed")
            _check_row(prefix, rows[prefix], V)
        self.V, self.N, self.tables = V, N, rows
        self.offsets = [sum(V**j for j in range(n)) for n in range(N + 1)]
        flat = np.zeros((self.offsets[N], V))
        for prefix, row in rows.items():
            flat[self.prefix_id(prefix)] = row
        self.flat = torch.from_numpy(flat)
        self.vocab_size = V
        self.bos_token = V
        self.codebook = codebook if codebook is not None else torch.arange(V, dtype=torch.float64).unsqueeze(1)

    def prefix_id(self, prefix) -> int:
        idx = 0
        for t in prefix:
            idx = idx * self.V + int(t)
        return self.offsets[len(prefix)] + idx

    def probs(self, prefix) -> np.ndarray:
        return self.tables[tuple(prefix)]

    @staticmethod
    def random(V: int, N: int, seed: int, concentration: float = 1.0, codebook=None) -> "TabularAR":
        """Dirichlet(concentration) rows for every prefix; seeded."""
        rng = np.random.default_rng(seed)
        tables = {}
        for n in range(N):
            for prefix in itertools.product(range(V), repeat=n):
                tables[prefix] = rng.dirichlet(np.full(V, concentration))
        return TabularAR(tables, codebook)

    @staticmethod
    def mix(a: "TabularAR", b: "TabularAR", w: float) -> "TabularAR":
        """Row-wise mixture (1-w)*a + w*b: a drafter at a controlled distance from a target."""
        return TabularAR({k: (1 - w) * a.tables[k] + w * b.tables[k] for k in a.tables}, a.codebook)

    def warped(self, sampling) -> "TabularAR":
        """The model a loop run with ``sampling`` (a ``SamplingConfig``: temperature, top-k, top-p)
        samples from: each row warped as the loop warps the target's logits (log of the row)."""
        rows = {k: sampling.probs(torch.log(torch.as_tensor(v, dtype=torch.float64)).unsqueeze(0))[0].numpy()
                for k, v in self.tables.items()}
        return TabularAR(rows, self.codebook)

    def sequence_distribution(self) -> np.ndarray:
        """Exact probability of every length-N sequence, lexicographic index."""
        out = np.ones(1)
        for n in range(self.N):
            rows = np.stack([self.tables[p] for p in itertools.product(range(self.V), repeat=n)])
            out = (out[:, None] * rows).reshape(-1)
        return out

    # ---- ARModel protocol ---------------------------------------------------------------
    # Cache: per sample, (length, index) codes of the committed tail and of pending entries.
    def begin(self, cond, batch_size, context=None):
        self._tail_len = torch.full((batch_size,), -1, dtype=torch.long)
        self._tail_idx = torch.zeros(batch_size, dtype=torch.long)
        self._pend_len: list[torch.Tensor] = []
        self._pend_idx: list[torch.Tensor] = []
        return None

    def forward(self, tokens, positions, attend, features=None):
        B, m = tokens.shape
        P = len(self._pend_len)
        logits = torch.empty(B, m, self.V, dtype=torch.float64)
        for i in range(m):
            row = attend[i, : P + i]
            prior = torch.nonzero(row).flatten()
            if prior.numel():
                j = int(prior.max())
                plen, pidx = self._pend_len[j], self._pend_idx[j]
            else:
                plen, pidx = self._tail_len, self._tail_idx
            tok = tokens[:, i]
            is_bos = tok == self.bos_token
            new_len = torch.where(is_bos, torch.zeros_like(plen), plen + 1)
            new_idx = torch.where(is_bos, torch.zeros_like(pidx), pidx * self.V + tok.clamp(max=self.V - 1))
            self._pend_len.append(new_len)
            self._pend_idx.append(new_idx)
            ok = new_len < self.N
            rows = torch.tensor(self.offsets, dtype=torch.long)[new_len.clamp(0, self.N - 1)] + new_idx
            rows = torch.where(ok, rows, torch.zeros_like(rows))
            pr = self.flat[rows]
            pr = torch.where(ok.unsqueeze(-1), pr, torch.full_like(pr, 1.0 / self.V))
            logits[:, i] = torch.log(pr)
        return StepOut(logits=logits, hidden=None)

    def commit(self, keep, n_keep):
        if self._pend_len and (keep is None or keep.shape[1]):
            L = torch.stack(self._pend_len, 1)
            I = torch.stack(self._pend_idx, 1)
            last = (n_keep - 1).clamp(min=0) if keep is None else keep.gather(1, (n_keep - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
            has = n_keep > 0
            self._tail_len = torch.where(has, L.gather(1, last.unsqueeze(1)).squeeze(1), self._tail_len)
            self._tail_idx = torch.where(has, I.gather(1, last.unsqueeze(1)).squeeze(1), self._tail_idx)
        self._pend_len, self._pend_idx = [], []
