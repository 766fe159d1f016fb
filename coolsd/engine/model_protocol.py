"""The two protocols every model implements; ``coolsd.engine.loop`` is written against them only.

Cache semantics shared by targets and model drafters: a model holds, per sample, COMMITTED
entries (always visible to new tokens) and PENDING entries (added by ``forward`` during a
round). ``forward`` appends its m tokens as pending entries; ``attend[i, j]`` says whether new
token i sees pending entry j (existing pending first, then the new ones). ``commit`` keeps the
chosen pending entries, in the given order, as committed and drops all other pending entries.
``positions`` are logical positions (RoPE), independent of where an entry sits in the cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, runtime_checkable

import torch

# Continuous-token models (``coolsd.engine.continuous.generate``) take class labels; this label asks for
# the unconditional branch of classifier-free guidance (MAR's ``fake_latent``).
NULL_LABEL = -1


def id_list(ids) -> list[int]:
    """A ``cond``'s prompt ids (Lumina-mGPT, Janus-Pro, Emu3) as a list: a list or tuple as it is
    (host data: no tensor made and read back), a tensor flattened."""
    if isinstance(ids, (list, tuple)):
        return [int(i) for i in ids]
    return torch.as_tensor(ids, dtype=torch.long, device="cpu").flatten().tolist()


@dataclass
class StepOut:
    logits: torch.Tensor  # (B, m, V), already CFG-combined
    hidden: Optional[torch.Tensor] = None  # (B, m, H) features for EAGLE-style drafters


@runtime_checkable
class ARModel(Protocol):
    vocab_size: int

    def begin(self, cond: Any, batch_size: int, context: Optional[StepOut] = None) -> Optional[StepOut]:
        """Reset caches and prefill the condition. Returns the output at the last condition
        position as a (B, 1, V) StepOut, or None for models without a condition.
        ``context`` carries the target's prefill output to a drafter."""
        ...

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attend: torch.Tensor,
        features: Optional[torch.Tensor] = None,
    ) -> StepOut:
        ...

    def commit(self, keep: Optional[torch.Tensor], n_keep: torch.Tensor) -> None:
        """keep: (B, K) indices into pending entries, or None for the first pending entries in
        order (AR steps, accepted chain prefixes: nothing moves); n_keep: (B,) how many of them to
        keep. Reads nothing on the host (the loop's sync budget, docs/gpu.md)."""
        ...


class ImageTarget(ARModel, Protocol):
    """A target that also turns its token grid into pixels."""

    n_image_tokens: int

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, n_image_tokens) -> images (B, 3, H, W) in [0, 1]."""
        ...
