"""Grouped Speculative Decoding (GSD, ICCV 2025, arXiv 2508.07747; junhyukso/GSD): SJD's Jacobi
window (``sjd``'s drafter) verified with GSD's grouped acceptance (``coolsd.engine.decoding.rules.GroupRule``):
a draft is accepted with probability min(1, p(G) / q(G)) over its group G of ``G`` tokens of
similar target probability (``p_thr``). Relaxed (not lossless). ``resample``: GSD's own [p - q]_+
or COOL-SD's G*."""
from coolsd.engine.decoding.rules import GroupRule
from coolsd.engine.methods.registry import Param, register_method
from coolsd.engine.methods.sjd import COUPLINGS, WINDOW, chain


@register_method("gsd", drafter="jacobi", params={
    "G": Param(14, int, low=1, doc="group size in ranks, centred on the draft in the target's order (upstream "
                                   "code: ranks r-7 .. r+6; the paper reports G = 25 / 50)"),
    "p_thr": Param(0.15, float, low=0, low_open=True, nullable=True,
                   doc="the group's probability filter |p(y) - p(x)| < p_thr (upstream's; null: none)"),
    "resample": Param("sjd", str, choices=("sjd", "gstar"), doc="sjd: [p - q]_+, GSD's; gstar: COOL-SD's G*"),
    **WINDOW,
    "coupling": Param(None, str, choices=COUPLINGS, nullable=True,
                      doc="MC-SJD's draft coupling (null: SJD's independent draws)"),
})
def gsd(ctx, G, p_thr, resample, window, init, active_start, active_end, coupling):
    """GSD: SJD's window, each draft accepted by the target mass of its group."""
    return GroupRule(G, None if p_thr is None else float(p_thr), resample), chain(window)
