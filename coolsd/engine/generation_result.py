"""What a generation returns (``GenerationResult``), and the check every loop runs on the target's
logits (``NonFiniteLogits``): shared by the one loop (``coolsd.engine.loop``) and its row-parallel
rounds (``coolsd.engine.rows``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, N)
    round_lengths: list[list[int]]  # per sample: tokens emitted in each round
    target_forwards: list[int]  # per sample: target forwards incl. prefill
    draft_forwards: int  # drafter forwards for the whole batch
    seconds: float  # wall time of the loop (prefill included, decoding to pixels excluded)
    first_from_prefill: bool = True
    # "signal_s": the eager loop's time on the quality signals (seconds, device-timed: CUDA events),
    # inside ``seconds``; absent for compiled rounds (their signals are fused into the round)
    extra: dict = field(default_factory=dict)
    # (B, N) per emitted token: TV and KL of the distribution it was emitted from to the target's
    # (coolsd.engine.decoding.distortion, docs/distortion.md); 0 for tokens drawn from p (AR, bonus, lossless
    # rules), NaN for trees with siblings (no closed form)
    step_tv: Optional[torch.Tensor] = None
    step_kl: Optional[torch.Tensor] = None
    # (B, N) per emitted token: -log p(x_t) under the target's guided distribution at the sampling
    # temperature, before top-k / top-p (``token_nll``); whether x_t lies outside the warped support
    # (``token_off_support``, 0/1: a relaxed rule can accept such a token); the round depth it was
    # verified at (``token_depth``: 1..L, 0 for a token drawn from p: the first, a bonus, AR);
    # ``token_nll_expected``: E[-log p(x_t) | prefix, round] = -sum_y pi_t(y) log p(y), the exact
    # conditional expectation of ``token_nll`` (the same mean, without the token draw's noise;
    # docs/distortion.md section 6), NaN where pi_t has no closed form (verified sibling nodes)
    token_nll: Optional[torch.Tensor] = None
    token_nll_expected: Optional[torch.Tensor] = None
    token_off_support: Optional[torch.Tensor] = None
    token_depth: Optional[torch.Tensor] = None

    def accepted_length(self, b: int) -> float:
        """tau: mean tokens per verification round (docs/methods.md#0-notation)."""
        r = self.round_lengths[b]
        return sum(r) / len(r) if r else float("nan")


class NonFiniteLogits(FloatingPointError):
    """The target produced NaN or inf logits for ``sample`` while predicting image token
    ``position`` (the sample cannot continue; a job records it as failed and goes on)."""

    def __init__(self, sample: int, position: int):
        super().__init__(f"non-finite (nan/inf) target logits for sample {sample} at image token position {position}")
        self.sample, self.position = sample, position


def _nonfinite(logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """(B,) active samples whose logits (B, m, V) are not all finite (no host read)."""
    return ~torch.isfinite(logits).all(-1).all(-1) & active.to(logits.device)


def _check_finite(logits: torch.Tensor, n_out: torch.Tensor, active: torch.Tensor) -> None:
    """logits (B, m, V): every active sample's rows must be finite (one reduction, one sync)."""
    bad = _nonfinite(logits, active)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise NonFiniteLogits(b, int(n_out[b]))
