"""LANTERN (absolute TV budget delta <= 1) and LANTERN++ (relative budget lam), METHODS.md 3."""
from coolsd.decoding.rules import LanternRule
from coolsd.methods.registry import register_method, require, require_finite

RESAMPLE = ("lantern", "gstar")


def _common(ctx, k, resample):
    require(isinstance(k, int) and not isinstance(k, bool) and k >= 1, f"k must be an integer >= 1, got {k!r}")
    require(resample in RESAMPLE, f"unknown resample {resample!r}; valid: {', '.join(RESAMPLE)}")
    require(
        ctx.neighbours is not None,
        "LANTERN needs latent neighbourhoods: the target's tokenizer must provide a codebook",
    )


@register_method("lantern")
def lantern(ctx, delta=0.1, k=1000, resample="lantern"):
    _common(ctx, k, resample)
    delta = require_finite("delta", delta, low=0, low_inclusive=False, high=1.0)
    return LanternRule(ctx.neighbours, k, delta=delta, resample=resample), "model", None


@register_method("lantern_pp")
def lantern_pp(ctx, lam=2.0, k=10, resample="lantern"):
    _common(ctx, k, resample)
    lam = require_finite("lam", lam, low=1)
    return LanternRule(ctx.neighbours, k, lam=lam, resample=resample), "model", None
