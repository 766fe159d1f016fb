"""UniformRSD and COOL-SD: a_j = omega_d * p_res with G* resampling (METHODS.md 1.3, 2)."""
from coolsd.decoding.rules import ScaledRule
from coolsd.decoding.schedules import omega_schedule
from coolsd.methods.registry import register_method, require_finite


@register_method("uniform_rsd")
def uniform_rsd(ctx, delta=2.0):
    require_finite("delta", delta, low=0, low_inclusive=False)
    return ScaledRule(omega_schedule("uniform", delta, ctx.tree.max_depth or 1)), "model", None


@register_method("coolsd")
def coolsd(ctx, delta=2.0, schedule="exp", nu=0.7, normalize="mean", slope=None):
    """COOL-SD's annealed schedule (``schedule`` in ``coolsd.decoding.schedules.SCHEDULES``).
    Note: with the default ``exp`` schedule, delta = 1 is NOT lossless (mean-normalised
    omega_1 > 1 > omega_L); delta = 1 reproduces EAGLE exactly only when omega = 1 at every
    depth: a flat schedule (``schedule=uniform`` or ``nu=0``) or ``toward_one``. ``toward_one``
    stays between delta and 1, so delta > 0 and nu >= 0 are all it needs."""
    require_finite("delta", delta, low=0, low_inclusive=False)
    require_finite("nu", nu, low=0)
    omega = omega_schedule(schedule, delta, ctx.tree.max_depth or 1, nu=nu, slope=slope, normalize=normalize)
    return ScaledRule(omega), "model", None
