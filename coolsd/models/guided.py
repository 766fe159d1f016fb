"""What every cached image model here does the same way: its KV cache, reused across sequences, and
the two halves of classifier-free guidance. ``GuidedCacheModel`` is a mixin of the targets
(LlamaGen, Lumina-mGPT, Janus-Pro, Emu3-Gen) and of the Lumina EAGLE drafter.

Invariants:
* Guided, the internal batch is [cond; uncond] (upstream's order): row b and row B + b hold the
  same tokens, positions and committed lengths (``_double``). The returned logits are
  ``cfg_combine(cond, uncond, cfg_scale)``; the returned hidden states are (B, m, 2, H) = [cond,
  uncond] (``_halves``), which EAGLE drafters run their own guidance on. Unguided, the batch is
  the B samples and both come back as they are.
* ``_cache_for`` sizes the cache to the sequence's known maximum (so an eager decode never grows
  it) and reuses the last one where its shape matches and it holds that many slots
  (``KVCache.reset``: a reused cache keeps every buffer's address, so captured graphs stay valid);
  otherwise the old one is dropped before the new one is allocated (peak: one cache).
"""
from __future__ import annotations

from typing import Optional

import torch

from coolsd.engine.decoding.sampling import cfg_combine
from coolsd.engine.model_protocol import StepOut
from coolsd.models.kv_cache import KVCache


class GuidedCacheModel:
    """Mixin: the owner sets ``cfg_scale``, ``model`` (with a ``device``; or overrides ``device``)
    and, when it compiles, ``compiled`` (a static cache); its ``begin`` sets ``batch_size`` (the
    caller's B) and ``cache`` (``_cache_for``)."""

    cfg_scale: float
    cache: Optional[KVCache] = None  # before the first begin
    batch_size: int = 0
    compiled: bool = False

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def guided(self) -> bool:
        """Whether the [cond; uncond] halves run: any scale but 1 (LlamaGen: above 1, as upstream)."""
        return self.cfg_scale != 1.0

    def _double(self, x: torch.Tensor) -> torch.Tensor:
        """A per-sample tensor for the internal batch: both halves when guided."""
        return torch.cat([x, x]) if self.guided else x

    def _halves(self, hidden: torch.Tensor) -> torch.Tensor:
        """(2B, ...) -> (B, m, 2, ...) = [cond, uncond] when guided; unguided, ``hidden`` itself."""
        B = self.batch_size
        return torch.stack([hidden[:B], hidden[B:]], dim=2) if self.guided else hidden

    def _guided_out(self, logits: torch.Tensor, hidden: torch.Tensor) -> StepOut:
        """The internal batch's logits and hidden states as the caller gets them (module docstring)."""
        if self.guided:
            B = self.batch_size
            logits = cfg_combine(logits[:B], logits[B:], self.cfg_scale)
        return StepOut(logits=logits, hidden=self._halves(hidden))

    def _cache_for(self, shape: tuple, need: int, round_to: int, max_committed: int) -> KVCache:
        """``self.cache`` for a sequence of at most ``need`` entries (committed and pending), at most
        ``max_committed`` of them committed. ``shape``: (layers, rows, heads, head_dim, dtype,
        device); a new cache holds ``need`` rounded up to a multiple of ``round_to`` slots."""
        if self.cache is not None and self.cache.matches(*shape) and self.cache.fits(need):
            self.cache.reset(max_committed=max_committed)
            return self.cache
        self.cache = None  # the old cache's last reference: freed before the new one is allocated (peak: one cache)
        self.cache = KVCache(*shape[:4], -(-need // round_to) * round_to, *shape[4:], static=self.compiled,
                             max_committed=max_committed)
        return self.cache


def right_padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The prefill's rows (the cond prompts, then the uncond ones when guided) as one batch: ids
    (n, L), right padded with id 0 (a pad is never attended: the prefill's ``valid`` and the
    committed lengths stop before it), each row's length (n,), and L, known on the host."""
    lens = torch.tensor([len(r) for r in rows], device=device)
    L = max(len(r) for r in rows)  # host-known: no read of ``lens``
    ids = torch.zeros(len(rows), L, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, device=device)
    return ids, lens, L


__all__ = ["GuidedCacheModel", "right_padded"]
