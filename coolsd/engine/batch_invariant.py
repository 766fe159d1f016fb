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
* ``torch.nn.functional.gelu`` pads every row to a multiple of the CPU's vector length (a kernel's
  vector body and scalar tail approximate erf with different rounding, so with a width such as
  xAR's int(8 D / 3) an element's result depends on its row's place in the batch);
* masked attention over keys at arbitrary positions (``masked_attention``, xAR's speculation) runs
  per query over its visible keys;
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

from coolsd.engine.model_protocol import StepOut

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


_ORIGINAL_GELU = F.gelu
GELU_ALIGN = 64  # elements: a multiple of every CPU vector length in fp32 / fp64


def _row_aligned_gelu(input, approximate: str = "none"):
    """GELU with every row padded to a multiple of ``GELU_ALIGN`` elements, so every row starts on a
    vector boundary and rounds alike wherever it sits in the batch (module docstring)."""
    w = input.shape[-1]
    pad = -w % GELU_ALIGN
    if not pad:
        return _ORIGINAL_GELU(input, approximate=approximate)
    return _ORIGINAL_GELU(F.pad(input, (0, pad)), approximate=approximate)[..., :w]


def masked_attention(q, k, v, visible):
    """``scaled_dot_product_attention(q, k, v, attn_mask=visible)`` (q (E, h, T, d), k / v (E, h, S, d),
    visible (E, 1 or h, T, S) bool); inside ``batch_invariant()`` computed for each (row, query) over
    its visible keys only, in key order, so the result does not depend on how many masked keys, other
    queries or other rows share the call (a softmax or a weighted sum over more keys rounds
    differently even where the extra weights are 0), as ``coolsd.models.kv_cache.KVCache.attend``
    does per sample."""
    if not _ACTIVE[0] or visible is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    out = torch.empty_like(q)
    for e in range(q.shape[0]):
        for i in range(q.shape[2]):
            keep = visible[e, 0, i].nonzero().squeeze(1)
            out[e:e + 1, :, i:i + 1] = F.scaled_dot_product_attention(q[e:e + 1, :, i:i + 1], k[e:e + 1, :, keep],
                                                                      v[e:e + 1, :, keep])
    return out


@contextmanager
def batch_invariant(enabled: bool = True):
    """Compute every sample as it would be computed alone (see the module docstring);
    ``enabled=False`` is a no-op context."""
    if not enabled or _ACTIVE[0]:
        yield
        return
    original, fastpath = F.linear, torch.backends.mha.get_fastpath_enabled()
    F.linear, F.gelu = _rowwise_linear, _row_aligned_gelu
    torch.backends.mha.set_fastpath_enabled(False)
    _ACTIVE[0] = True
    try:
        yield
    finally:
        F.linear, F.gelu = original, _ORIGINAL_GELU
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


def forward_each(targets: list, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor, **kw):
    """``ARModel.forward`` of a batch held as one batch-1 target per sample (a target whose prefill
    of prompts of different lengths runs each prompt alone): each sample's rows to its own target,
    the outputs stacked. ``positions`` (B, m) or (1, m); ``attend`` (m, P+m) or (B, m, P+m); ``kw``
    (``by_position=``) to every target."""
    outs = [t.forward(tokens[b : b + 1], positions[b : b + 1] if positions.shape[0] > 1 else positions,
                      attend[b : b + 1] if attend.dim() == 3 else attend, **kw)
            for b, t in enumerate(targets)]
    return StepOut(logits=torch.cat([o.logits for o in outs]), hidden=torch.cat([o.hidden for o in outs]))


def commit_each(targets: list, keep, n_keep: torch.Tensor) -> None:
    """``ARModel.commit`` of a batch held as one batch-1 target per sample (``forward_each``)."""
    for b, t in enumerate(targets):
        t.commit(None if keep is None else keep[b : b + 1], n_keep[b : b + 1])
