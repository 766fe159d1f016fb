"""Continuous speculative decoding (CSpD; docs/methods.md#5-continuous-speculative-decoding, continuous_sd.md 2) for diffusion-head and flow
targets, and the continuous family's method object: its settings, its baseline and the call of
its loop (``coolsd.engine.continuous.generate``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coolsd.engine.continuous.generate import MODES, VERIFY, ar_generate, check_settings, cspd_generate
from coolsd.engine.methods.registry import Param, register_method

CONTINUOUS_METHODS = ("ar", "cspd")


@dataclass(frozen=True)
class ContinuousMethod:
    """``ar`` (the target alone) or ``cspd`` (conf/method/cspd.yaml)."""

    name: str = "cspd"
    gamma: int = 8
    mode: str = "paper"
    verify: str = "parallel"
    prefill: float = 0.05
    max_rounds: int = 100
    final_std: float | None = None
    inner_temperature: float = 1.0
    family = "continuous"

    def __post_init__(self):
        if self.name not in CONTINUOUS_METHODS:
            raise ValueError(f"continuous targets run method={' or method='.join(CONTINUOUS_METHODS)}, not {self.name!r}")
        check_settings(self.gamma, self.mode, self.verify, self.prefill, self.max_rounds, self.final_std,
                       self.inner_temperature)

    @property
    def final_noise(self) -> bool:  # the exact rule samples the final step (continuous_sd.md 2.9)
        return self.mode == "exact"

    def describe(self) -> dict:
        """Record parameters (``method`` first, as the discrete methods'); AR names only how it
        samples: the exact mode's baseline has a stochastic final step."""
        if self.name == "ar":
            return {"method": "ar", **({"final_noise": True} if self.final_noise else {}),
                    **({"final_std": self.final_std} if self.final_std is not None else {})}
        d = dataclasses.asdict(self)
        return {"method": d.pop("name"), **d}

    def baseline(self) -> "ContinuousMethod":
        """The target alone, sampled as this method samples (the exact mode's final-step noise)."""
        return dataclasses.replace(self, name="ar")

    def generate(self, target, draft, labels, seeds, head):
        """One batch through the continuous loop: the target alone (``ar``) or CSpD."""
        if self.name == "ar":
            return ar_generate(target, labels, seeds, head, final_noise=self.final_noise, final_std=self.final_std)
        return cspd_generate(target, draft, labels, seeds, head, gamma=self.gamma, mode=self.mode, verify=self.verify,
                             prefill=self.prefill, max_rounds=self.max_rounds, final_std=self.final_std,
                             inner_temperature=self.inner_temperature)


# lossless only with the exact rule AND prefix verification (docs/methods.md#5-continuous-speculative-decoding):
# parallel verification keeps every token, with no rollback
@register_method("cspd", families=("continuous",), lossless=lambda p: p["mode"] == "exact" and p["verify"] == "prefix",
                 params={
    "gamma": Param(8, int, low=1, doc="drafted steps a round (a step: one token, or a flow model's unit)"),
    "mode": Param("paper", str, choices=MODES, doc="paper: the paper's rule; exact: the exact-prefix rule"),
    "verify": Param("parallel", str, choices=VERIFY),
    "prefill": Param(0.05, float, low=0, high=1, doc="the fraction of tokens the target makes first"),
    "max_rounds": Param(100, int, low=1, doc="rejection-sampling rounds before a fallback"),
    "final_std": Param(None, float, low=0, low_open=True, nullable=True),
    "inner_temperature": Param(1.0, float, low=0, low_open=True),
})
def cspd(ctx, gamma, mode, verify, prefill, max_rounds, final_std, inner_temperature):
    """Continuous speculative decoding: a draft diffusion-head or flow model's tokens verified by the target's."""
    return ContinuousMethod("cspd", gamma, mode, verify, prefill, max_rounds, final_std, inner_temperature)
