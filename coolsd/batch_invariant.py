"""``batch_invariant()``: a context in which every ``torch.nn.functional.linear`` computes each
row by its own matrix product, so a row's result does not depend on how many rows share the
call (a GEMM's blocking, hence its rounding, changes with the row count: 1e-15 relative in fp64
on CPU). Attention, norms and pointwise ops are already row-independent. Used where a result
must be equal bit for bit across different batch shapes (identical draft and target in
speculative decoding, tests/test_cspd_generate.py); about 3x slower linears on CPU.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F


def _rowwise_linear(x, weight, bias=None):
    shape = x.shape
    rows = x.reshape(-1, 1, shape[-1])
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], -1, -1)).squeeze(1)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


@contextmanager
def batch_invariant():
    original = F.linear
    F.linear = _rowwise_linear
    try:
        yield
    finally:
        F.linear = original
