"""Grouped Speculative Decoding (GSD, ICCV 2025, arXiv 2508.07747; junhyukso/GSD): SJD's Jacobi
window (``sjd``'s drafter) verified with GSD's grouped acceptance (``coolsd.decoding.rules.GroupRule``):
a draft is accepted with probability min(1, p(G) / q(G)) over its group G of ``G`` tokens of
similar target probability (``p_thr``). Relaxed (not lossless). ``resample``: GSD's own [p - q]_+
or COOL-SD's G*."""
from coolsd.decoding.rules import GroupRule
from coolsd.methods.registry import register_method, require
from coolsd.methods.sjd import _jacobi


@register_method("gsd")
def gsd(ctx, G=14, p_thr=0.15, resample="sjd", window=16, coupling=None, init="random", active_start=None,
        active_end=None):
    require(isinstance(G, int) and G >= 1, f"gsd G must be an integer >= 1 (group size in ranks), got {G!r}")
    require(p_thr is None or (isinstance(p_thr, (int, float)) and p_thr > 0), f"gsd p_thr must be > 0 or null, got {p_thr!r}")
    require(resample in ("sjd", "gstar"), f"unknown gsd resample {resample!r}; valid: sjd, gstar")
    require(coupling in (None, "maximal", "gumbel"), f"unknown gsd coupling {coupling!r}; valid: maximal, gumbel or null")
    _, drafter, tree = _jacobi("gsd", window, init)
    return GroupRule(G, None if p_thr is None else float(p_thr), resample), drafter, tree
