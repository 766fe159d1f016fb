"""Continuous speculative decoding (CSpD; docs/methods.md#5-continuous-speculative-decoding, continuous_sd.md 2) for diffusion-head and flow
targets, and the continuous family's method object: its settings, its baseline and the call of
its loop (``coolsd.engine.continuous.generate``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from coolsd.engine.continuous.annealing import STRATEGIES
from coolsd.engine.continuous.diffusion import SAMPLERS, check_sampler
from coolsd.engine.continuous.generate import MODES, VERIFY, HeadConfig, ar_generate, check_settings, cspd_generate
from coolsd.engine.methods.registry import Param, method_names, register_method

# the method's overrides of the target's diffusion-head settings (HeadConfig), shared by cspd and its
# baseline ar so that a speed-up compares one sampler (docs/methods.md#5-continuous-speculative-decoding)
HEAD_PARAMS = {
    "sampler": Param(None, str, choices=SAMPLERS, nullable=True, families=("continuous",),
                     doc="the head's chain: ddpm or ddim (docs/methods.md#51-ddim-head-sampler; null: the target's "
                         "head.sampler)"),
    "eta": Param(None, float, low=0, high=1, nullable=True, families=("continuous",),
                 doc="DDIM's noise scale, 0 = deterministic steps (null: the target's head.eta)"),
    "head_steps": Param(None, int, low=2, nullable=True, families=("continuous",),
                        doc="respaced diffusion steps of the head (null: the target's head.steps; the paper's DDIM "
                            "runs: 100); with anneal, the first AR iteration's"),
    "anneal": Param(None, str, choices=STRATEGIES, nullable=True, families=("continuous",),
                    doc="DiSA: the head's steps annealed from head_steps (first AR iteration) to lower_steps (last) "
                        "(docs/methods.md#52-disa; null: every token runs head_steps)"),
    "lower_steps": Param(None, int, low=2, nullable=True, families=("continuous",),
                         doc="DiSA's head steps of the last AR iteration (with anneal)"),
    "num_iter": Param(None, int, low=1, nullable=True, families=("continuous",),
                      doc="AR steps (target forwards of the target alone): MAR's / Harmon's MaskGIT-cosine num_iter; "
                          "a flow target's unit = tokens / num_iter (null: the target's head.num_iter / flow.unit)"),
}


def check_head_params(p: dict) -> None:
    """sampler and eta together (``check_sampler``): eta != 0 needs ddim, or the target's sampler (null);
    DiSA's annealing (``anneal``) with its ``lower_steps``, on the ddpm head sampler, and neither
    without the other."""
    sampler, eta = p.get("sampler"), p.get("eta")
    check_sampler("ddim" if sampler is None else sampler, 0.0 if eta is None else eta)
    anneal, lower = p.get("anneal"), p.get("lower_steps")
    if (anneal is None) != (lower is None):
        raise ValueError("anneal and lower_steps go together (DiSA: the head's steps annealed from head_steps to "
                         f"lower_steps), got anneal={anneal!r}, lower_steps={lower!r}")
    if anneal is not None and sampler == "ddim":
        raise ValueError("DiSA's annealing runs the ddpm head sampler: set sampler=ddpm or null")
    if anneal is not None and p.get("head_steps") is not None and lower > p["head_steps"]:
        raise ValueError(f"DiSA anneals from head_steps to lower_steps: lower_steps={lower} > head_steps="
                         f"{p['head_steps']}")


# the head settings a flow target (FlowConfig) takes: its SDE steps per unit, DiSA's annealing of them and
# its AR steps (``FlowConfig.num_iter``: the unit they imply)
FLOW_KEYS = {"head_steps": "num_steps", "anneal": "anneal", "lower_steps": "lower_steps", "num_iter": "num_iter"}


def refuse_flow_head_params(params: dict) -> None:
    """A flow target (``FlowConfig``: xAR's Euler-Maruyama sampler) has no diffusion head: no ddpm/ddim
    sampler and no eta (its steps, ``head_steps``, and DiSA's annealing of them apply)."""
    given = [f"method.{k}={params[k]}" for k in HEAD_PARAMS if k not in FLOW_KEYS and params.get(k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: a flow target (FlowConfig, xAR's Euler-Maruyama sampler) has no "
                         f"diffusion head, so no ddpm/ddim sampler or eta; leave them null (its steps: "
                         f"method.head_steps or target.flow.num_steps)")


@dataclass(frozen=True)
class ContinuousMethod:
    """``ar`` (the target alone) or ``cspd`` (its builder, below). ``sampler`` / ``eta`` /
    ``head_steps``: the target's ``HeadConfig`` with these in place (None: the target's own)."""

    name: str = "cspd"
    gamma: int = 8
    mode: str = "paper"
    verify: str = "parallel"
    prefill: float = 0.05
    max_rounds: int = 100
    final_std: float | None = None
    inner_temperature: float = 1.0
    sampler: str | None = None
    eta: float | None = None
    head_steps: int | None = None
    anneal: str | None = None
    lower_steps: int | None = None
    num_iter: int | None = None
    family = "continuous"

    def __post_init__(self):
        if self.name not in method_names("continuous"):  # the registry's continuous family
            raise ValueError(f"continuous targets run method={' or method='.join(method_names('continuous'))}, "
                             f"not {self.name!r}")
        check_settings(self.gamma, self.mode, self.verify, self.prefill, self.max_rounds, self.final_std,
                       self.inner_temperature)
        check_head_params({"sampler": self.sampler, "eta": self.eta, "anneal": self.anneal,  # the target's: at generate
                           "lower_steps": self.lower_steps, "head_steps": self.head_steps})
        if self.head_steps is not None and (isinstance(self.head_steps, bool) or int(self.head_steps) != self.head_steps
                                            or self.head_steps < 2):
            raise ValueError(f"head_steps (diffusion steps of the head) must be an integer >= 2, got {self.head_steps!r}")

    @property
    def alone(self) -> bool:
        """The target alone (``ar``, ``disa``): no draft, no verification."""
        return self.name != "cspd"

    @property
    def final_noise(self) -> bool:  # the exact rule samples the final step (continuous_sd.md 2.9)
        return self.mode == "exact"

    def _head_record(self) -> dict:
        return {k: getattr(self, k) for k in HEAD_PARAMS if getattr(self, k) is not None}

    def describe(self) -> dict:
        """Record parameters (``method`` first, as the discrete methods'); AR names only how it
        samples: the exact mode's baseline has a stochastic final step. The head overrides appear
        when set (records of runs before them are unchanged)."""
        if self.alone:  # how the target alone samples
            return {"method": self.name, **({"final_noise": True} if self.final_noise else {}),
                    **({"final_std": self.final_std} if self.final_std is not None else {}), **self._head_record()}
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in HEAD_PARAMS}
        return {"method": d.pop("name"), **d, **self._head_record()}

    def baseline(self) -> "ContinuousMethod":
        """The target alone, sampled as this method samples (the exact mode's final-step noise, the
        head overrides); DiSA's: the target's own head steps and AR steps, without the annealing (and
        the iteration count it pairs with) that it measures."""
        if self.name == "disa":
            return dataclasses.replace(self, name="ar", head_steps=None, anneal=None, lower_steps=None, num_iter=None)
        return dataclasses.replace(self, name="ar")

    def head_config(self, head):
        """The sampling settings this method runs: the target's ``head`` with the overrides in place
        (validated by ``HeadConfig``); ``sampler=ddpm`` without ``eta`` sets eta = 0. A flow target's
        ``FlowConfig`` with any override is refused."""
        over = {"sampler": self.sampler, "eta": self.eta, "steps": self.head_steps, "anneal": self.anneal,
                "lower_steps": self.lower_steps, "num_iter": self.num_iter}
        over = {k: v for k, v in over.items() if v is not None}
        if not over:
            return head
        if not isinstance(head, HeadConfig):  # a flow model: its SDE steps and their annealing (DiSA)
            refuse_flow_head_params(self._head_record())
            flow = {FLOW_KEYS[k]: v for k, v in self._head_record().items()}
            return dataclasses.replace(head, **flow, **({"unit": None} if "num_iter" in flow else {}))
        if self.sampler == "ddpm" and self.eta is None:
            over["eta"] = 0.0
        return dataclasses.replace(head, **over)

    def generate(self, target, draft, labels, seeds, head):
        """One batch through the continuous loop: the target alone (``ar``) or CSpD."""
        head = self.head_config(head)
        if self.alone:
            return ar_generate(target, labels, seeds, head, final_noise=self.final_noise, final_std=self.final_std)
        return cspd_generate(target, draft, labels, seeds, head, gamma=self.gamma, mode=self.mode, verify=self.verify,
                             prefill=self.prefill, max_rounds=self.max_rounds, final_std=self.final_std,
                             inner_temperature=self.inner_temperature)


# lossless only with the exact rule AND prefix verification (docs/methods.md#5-continuous-speculative-decoding):
# parallel verification keeps every token, with no rollback
@register_method("cspd", families=("continuous",), lossless=lambda p: p["mode"] == "exact" and p["verify"] == "prefix",
                 checks=(check_head_params,), params={
    "gamma": Param(8, int, low=1, doc="drafted steps a round (a step: one token, or a flow model's unit)"),
    "mode": Param("paper", str, choices=MODES,
                  doc="paper: log Sigma and final-step densities, MAR's noiseless final step; exact: final-step "
                      "noise, no Sigma (exact given the shared noise)"),
    "verify": Param("parallel", str, choices=VERIFY,
                    doc="parallel: the paper's MAR setting (the target sees the verified tokens only, every token "
                        "kept, no rollback); prefix: stop at the first rejection (lossless with mode=exact)"),
    "prefill": Param(0.05, float, low=0, high=1, doc="the fraction of tokens the target makes first"),
    "max_rounds": Param(100, int, low=1, doc="rejection-sampling rounds before a fallback (a plain target sample, "
                                             "counted)"),
    "final_std": Param(None, float, low=0, low_open=True, nullable=True,
                       doc="the final step's std s for draft, target and AR (null: the head's own, ~6e-3); the exact "
                           "mode's smoothing, the target convolved with N(0, s^2) (continuous_sd.md 2.9)"),
    "inner_temperature": Param(1.0, float, low=0, low_open=True,
                               doc="the paper rule's exponents use std * this (1: the paper's formula; the official "
                                   "code's 42 is lossy, continuous_sd.md 2.7 b)"),
    **HEAD_PARAMS,
})
def cspd(ctx, gamma, mode, verify, prefill, max_rounds, final_std, inner_temperature, sampler, eta, head_steps, anneal,
         lower_steps, num_iter):
    """Continuous speculative decoding: a draft diffusion-head or flow model's tokens verified by the target's."""
    return ContinuousMethod("cspd", gamma, mode, verify, prefill, max_rounds, final_std, inner_temperature, sampler,
                            eta, head_steps, anneal, lower_steps, num_iter)


# DiSA alone: the target with its head's steps annealed (MAR's recipe: 50 -> 5, linear, with num_iter 64);
# lossy (fewer head steps than the target's own), its baseline the target's own steps
@register_method("disa", families=("continuous",), lossless=False, drafter="none", checks=(check_head_params,),
                 params={
    "head_steps": Param(50, int, low=2, doc="the head's steps at the first AR iteration (DiSA's diff_upper_steps)"),
    "lower_steps": Param(5, int, low=2, doc="the head's steps at the last AR iteration (diff_lower_steps)"),
    "anneal": Param("linear", str, choices=STRATEGIES, doc="how the steps fall over the AR iterations "
                                                          "(diff_annealing_strategy; docs/methods.md#52-disa)"),
    "num_iter": Param(None, int, low=1, nullable=True, doc="the AR steps DiSA pairs with (MAR: 64, its --num_iter; "
                                                          "null: the target's head.num_iter / flow.unit)"),
})
def disa(ctx, head_steps, lower_steps, anneal, num_iter):
    """DiSA: the target alone with its diffusion head's steps annealed over the AR iterations (training-free)."""
    return ContinuousMethod("disa", head_steps=head_steps, anneal=anneal, lower_steps=lower_steps, num_iter=num_iter)
