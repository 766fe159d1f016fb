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
* masked attention over keys of arbitrary positions (xAR's speculation, ``coolsd.models.xar.attention_per_query``)
  runs per query over its visible keys, and an elementwise GELU whose rows are no multiple of the CPU's
  vector length pads its rows (``row_aligned_gelu``: vector body and scalar tail round differently);
* a prefill of prompts of different lengths (Lumina-mGPT) runs each prompt alone;
* encoding the prompts and decoding tokens to pixels run prompt by prompt (``per_sample``:
  encoders batch their matrix products, convolutions choose their algorithm by batch size), and
  PyTorch's fused transformer-encoder fast path (which bypasses ``F.linear``) is off.

Norms, softmax, sampling and verification are row-independent already. The cost (measured in the
README) is the loss of batching in those operations; tokens and images then equal the batch-1
run's exactly, at the same thread count (records differ only in timings, ``batch_size`` and the
per-batch ``draft_forwards``). Checked on CPUs; on a GPU the same code runs, not yet verified
bit for bit there.
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
    original, fastpath = F.linear, torch.backends.mha.get_fastpath_enabled()
    F.linear = _rowwise_linear
    torch.backends.mha.set_fastpath_enabled(False)
    _ACTIVE[0] = True
    try:
        yield
    finally:
        F.linear = original
        torch.backends.mha.set_fastpath_enabled(fastpath)
        _ACTIVE[0] = False


def _concat(parts):
    first = parts[0]
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    return [x for p in parts for x in p]


def per_sample(fn, x):
    """``fn(x)`` over the first dim of ``x`` (a tensor, array or list); inside
    ``batch_invariant()`` one sample at a time, the outputs (tensors, arrays, lists, or dicts of
    them) concatenated."""
    if not _ACTIVE[0] or len(x) <= 1:
        return fn(x)
    return _concat([fn(x[b : b + 1]) for b in range(len(x))])
