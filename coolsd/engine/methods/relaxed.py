"""UniformRSD and COOL-SD: a_j = omega_d * p_res with G* resampling (docs/methods.md#13-verification-at-one-tree-depth-d, #2-relaxation-schedules)."""
from coolsd.engine.decoding.rules import ScaledRule
from coolsd.engine.decoding.schedules import EXP_NORMALIZATIONS, SCHEDULES, omega_schedule
from coolsd.engine.methods.registry import Param, register_method

DELTA = Param(2.0, float, low=0, low_open=True, doc="the relaxation: omega's mean over the draft depths")


@register_method("uniform_rsd", params={"delta": DELTA})
def uniform_rsd(ctx, delta):
    """UniformRSD: omega_d = delta at every depth."""
    return ScaledRule(omega_schedule("uniform", delta, ctx.tree.max_depth or 1)), None


@register_method("coolsd", params={
    "delta": DELTA,
    "schedule": Param("exp", str, choices=SCHEDULES,
                      doc="omega_d over the draft depths d (docs/methods.md#2-relaxation-schedules); toward_one: "
                          "1 + (delta-1) exp(-nu (d-1)), from delta toward 1, never crossing it"),
    "nu": Param(0.7, float, low=0, doc="the schedule's decay rate (exp, exp_geomean and toward_one)"),
    "normalize": Param("mean", str, choices=EXP_NORMALIZATIONS,
                       doc="exp: how mu is set (mean: omega's mean is delta; geomean: its geometric mean)"),
    "slope": Param(None, float, nullable=True, doc="linear: s (null: 2/(L+1)); its range depends on L"),
})
def coolsd(ctx, delta, schedule, nu, normalize, slope):
    """COOL-SD's annealed schedule (``schedule`` in ``coolsd.engine.decoding.schedules.SCHEDULES``).
    Note: with the default ``exp`` schedule, delta = 1 is NOT lossless (mean-normalised
    omega_1 > 1 > omega_L); delta = 1 reproduces EAGLE exactly only when omega = 1 at every
    depth: a flat schedule (``schedule=uniform`` or ``nu=0``) or ``toward_one``. ``toward_one``
    stays between delta and 1, so delta > 0 and nu >= 0 are all it needs."""
    omega = omega_schedule(schedule, delta, ctx.tree.max_depth or 1, nu=nu, slope=slope, normalize=normalize)
    return ScaledRule(omega), None
