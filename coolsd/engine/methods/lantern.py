"""LANTERN (absolute TV budget delta <= 1) and LANTERN++ (relative budget lam), docs/methods.md#3-lantern-and-lantern."""
from coolsd.engine.decoding.rules import LanternRule
from coolsd.engine.methods.registry import Param, register_method, require

RESAMPLE = Param("lantern", str, choices=("lantern", "gstar"), doc="LANTERN's own residual or COOL-SD's G*")


def _neighbours(ctx):
    require(ctx.neighbours is not None, "LANTERN needs latent neighbourhoods: the target's tokenizer must provide a codebook")
    return ctx.neighbours


@register_method("lantern", params={"delta": Param(0.1, float, low=0, low_open=True, high=1.0,
                                                  doc="the neighbourhood's absolute TV budget"),
                                    "k": Param(1000, int, low=1, doc="neighbours per token"), "resample": RESAMPLE})
def lantern(ctx, delta, k, resample):
    """LANTERN: the acceptance mass of a neighbourhood within TV budget delta."""
    return LanternRule(_neighbours(ctx), k, delta=float(delta), resample=resample), None


@register_method("lantern_pp", params={"lam": Param(2.0, float, low=1, doc="the aggregated probability's cap: "
                                                                         "lam * p(x)"),
                                       "k": Param(10, int, low=1, doc="neighbours per token"), "resample": RESAMPLE})
def lantern_pp(ctx, lam, k, resample):
    """LANTERN++: a static neighbourhood of k tokens, relative budget lam."""
    return LanternRule(_neighbours(ctx), k, lam=float(lam), resample=resample), None
