"""Mixed precision of drafter training: fp32 master weights, the target's dtype under autocast.

A drafter head trains with its parameters, gradients and AdamW state in at least fp32 (fp64 stays
fp64) whatever the target's dtype; with a bf16 target the forward (head and the frozen target
``lm_head`` projections) runs under ``torch.autocast(dtype=torch.bfloat16)`` and the loss
reductions (SmoothL1, softmax cross-entropy) in the master dtype. This is the recipe of the
reference trainers: EAGLE and LANTERN keep fp32 master weights for their drafters (``accelerate``'s
bf16 mixed precision: fp32 parameters, bf16 autocast), never training the target's bf16 copy.

Why not bf16 parameters: AdamW's step is at most about ``lr`` per element (``m / sqrt(v)``, exactly
+-1 on the first step), and a bf16 weight w in [2^e, 2^(e+1)) only moves if the step exceeds half
its spacing, 2^(e-8) (8 significand bits), i.e. between |w| 2^-9 and |w| 2^-8. At lr 3e-5 every
weight with |w| >= 2^-7 keeps its value: 72% of a 1280x1280 layer at PyTorch's default init
(U(+-1/sqrt(1280)) = U(+-0.028)); fp32 (24 bits) keeps those updates.

fp16 targets (none configured) train without autocast, in fp32: fp16 autocast would need loss
scaling for its narrow exponent range. Saved drafters hold the master weights (fp32); the loaders
(``coolsd.models.eagle.model.load_eagle_head``, ``eagle_lumina.load_lumina_eagle_head``) cast them to
the running target's dtype, one round-to-nearest per weight.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

# forward dtypes that run under autocast; others (fp16: no loss scaling here) run in the master dtype
AUTOCAST_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class TrainPrecision:
    """``master``: parameters, gradients, optimiser state and the loss; ``compute``: the
    autocast dtype of forwards (None: forwards in ``master``); ``device_type`` for autocast."""

    master: torch.dtype
    compute: Optional[torch.dtype]
    device_type: str

    @classmethod
    def of(cls, target_dtype: torch.dtype, head_dtype: torch.dtype, device) -> "TrainPrecision":
        """The policy for a head of ``head_dtype`` drafting a target whose weights (its
        ``lm_head``) and features are ``target_dtype``: master = at least fp32 and never below the
        head's own dtype; autocast in the target's dtype when it is bf16."""
        master = torch.promote_types(head_dtype, torch.float32)
        compute = target_dtype if target_dtype in AUTOCAST_DTYPES else None
        return cls(master, compute, torch.device(device).type)

    @classmethod
    def for_head(cls, head: nn.Module, lm_head_weight: torch.Tensor) -> "TrainPrecision":
        """``of`` for a head (``.dtype`` / ``.device``) and the target's frozen ``lm_head`` weight,
        whose dtype is the target's."""
        return cls.of(lm_head_weight.dtype, head.dtype, head.device)

    def autocast(self):
        """The forward context: ``torch.autocast`` in ``compute``, or nothing."""
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute)

    def master_weights(self, head: nn.Module) -> nn.Module:
        """``head`` with its parameters (and buffers) in ``master``, in place (before the optimiser
        is built, so its state is ``master`` too). A bf16 head's values are exact in fp32."""
        return head.to(dtype=self.master)

    def describe(self) -> dict:
        """For a training record: {"master_dtype": ..., "autocast_dtype": ... or None}."""
        return {"master_dtype": _name(self.master), "autocast_dtype": _name(self.compute)}


def _name(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


__all__ = ["AUTOCAST_DTYPES", "TrainPrecision"]
