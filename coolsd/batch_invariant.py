"""Batch invariance: results of a sample that do not depend on which other samples share its batch,
bit for bit, on any machine (``deterministic.batch_invariant=true``; the job enters
``batch_invariant()`` around generation).

Without it a batch equals its samples generated alone only in distribution: a GEMM's blocking,
hence its rounding, changes with the number of rows (and with the CPU or GPU), so batch-4 logits
differ from batch-1 logits in the last bits and now and then a sampled token flips. Inside the
context every operation whose result for one sample depends on the batch's shape computes each
sample as it would be computed alone:

* ``torch.nn.functional.linear`` multiplies each row by itself (a GEMM's blocking depends on the
  row count; one-row products do not);
* cached attention (``coolsd.models.kv_cache.KVCache.attend``) runs per sample over that
  sample's own span of keys (in a batch the span is the longest sample's, and a softmax or a
  weighted sum over more keys rounds differently even where the extra weights are 0);
* a prefill of prompts of different lengths (Lumina-mGPT) runs each prompt alone;
* decoding tokens to pixels runs image by image (``per_sample``: convolutions choose their
  algorithm by batch size).

Attention inside one sample, norms, softmax, sampling and verification are row-independent
already. The cost (measured in the README) is the loss of batching in those operations; tokens,
records and images then equal the batch-1 run's exactly, at the same thread count.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

_ACTIVE = [False]


def active() -> bool:
    """Whether the calling code runs inside ``batch_invariant()``."""
    return _ACTIVE[0]


def _rowwise_linear(x, weight, bias=None):
    shape = x.shape
    rows = x.reshape(-1, 1, shape[-1])
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], -1, -1)).squeeze(1)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], weight.shape[0])


@contextmanager
def batch_invariant(enabled: bool = True):
    """Compute every sample as it would be computed alone (see the module docstring);
    ``enabled=False`` is a no-op context."""
    if not enabled or _ACTIVE[0]:
        yield
        return
    original = F.linear
    F.linear = _rowwise_linear
    _ACTIVE[0] = True
    try:
        yield
    finally:
        F.linear = original
        _ACTIVE[0] = False


def per_sample(fn, x):
    """``fn(x)`` over the batch dim of ``x``; inside ``batch_invariant()`` one sample at a time,
    concatenated (numpy or torch, as ``fn`` returns)."""
    if not _ACTIVE[0] or len(x) <= 1:
        return fn(x)
    parts = [fn(x[b : b + 1]) for b in range(len(x))]
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else torch.cat(parts)
