"""A researcher's method, defined outside the package (docs/add_method.md): ``power_rsd``
accepts a draft x with probability min(1, p_res(x)^gamma / q(x)) (gamma in (0, 1]: gamma = 1 is
EAGLE's exact rule, smaller gamma accepts more) and resamples from COOL-SD's G*, the ``Rule``
base class's default. ``python run.py --include examples/method method=power_rsd``."""
import torch

from coolsd.engine.decoding.rules import Rule
from coolsd.engine.methods import Param, register_method


class PowerRule(Rule):
    name = "power"

    def __init__(self, gamma: float):
        self.gamma = float(gamma)

    def numerator(self, p_res: torch.Tensor, depth: int) -> torch.Tensor:
        return p_res ** self.gamma

    def describe(self) -> dict:
        return {"rule": self.name, "gamma": self.gamma}


@register_method("power_rsd", drafter="model", lossless=lambda p: p["gamma"] == 1.0,
                 params={"gamma": Param(0.8, float, low=0, low_open=True, high=1.0, doc="a = p_res ** gamma")})
def power_rsd(ctx, gamma):
    """Power-relaxed speculative decoding: a = p_res ** gamma, G* resampling."""
    return PowerRule(gamma), None
