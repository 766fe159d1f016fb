"""Speculative Jacobi Decoding (METHODS.md 4): a window of W-1 drafts verified as a chain with
the lossless rule; drafts come from the target's previous iteration (``JacobiDrafter``).

``mc_sjd`` (MC-SJD / SCD, arXiv 2510.24211, junhyukso/SCD): the same, with each position's next
draft coupled to its previous one (``coupling=maximal``: keep the old draft x with probability
min(1, p_new(x) / p_old(x)), else draw from Norm([p_new - p_old]_+); ``coupling=gumbel``: one
Gumbel noise vector per position, shared by all its draws). Lossless like SJD (the coupled draft
is still distributed as the p it reports; ``JacobiDrafter``), but consecutive drafts agree more
often, so more of them survive verification.

``sjd_pac`` (SJD-PAC, arXiv 2603.18599, KangJialiang/SJD-PAC): MC-SJD's maximal coupling (upstream's
"adaptive continuation") on a tree whose first ``tree_depth - 1`` depths hold ``tree_width``
candidates drawn without replacement ("proactive drafting"; ``coolsd.drafting.PACDrafter``,
docs/sjd_pac.md). Lossless with that bookkeeping (the lab's chi-square tests)."""
from coolsd.decoding.rules import ExactRule
from coolsd.decoding.trees import make_tree, pac_tree
from coolsd.methods.registry import register_method, require

INITS = ("random", "repeat_horizon", "sample_horizon", "vertical_repeat")  # coolsd.drafting.JacobiDrafter


def _jacobi(name, window, init):
    require(isinstance(window, int) and window >= 2, f"{name} window must be an integer >= 2, got {window!r}")
    require(init in INITS, f"unknown {name} init {init!r}; valid: {', '.join(INITS)}")
    return ExactRule(), "jacobi", make_tree("chain", window - 1)


@register_method("sjd")
def sjd(ctx, window=16, init="random", active_start=None, active_end=None):
    return _jacobi("sjd", window, init)


@register_method("mc_sjd")
def mc_sjd(ctx, window=16, coupling="maximal", init="random", active_start=None, active_end=None):
    require(coupling in ("maximal", "gumbel"), f"unknown mc_sjd coupling {coupling!r}; valid: maximal, gumbel")
    return _jacobi("mc_sjd", window, init)


@register_method("sjd_pac")
def sjd_pac(ctx, window=16, tree_width=4, tree_depth=3, init="random", active_start=None, active_end=None):
    rule, drafter, _ = _jacobi("sjd_pac", window, init)
    require(isinstance(tree_width, int) and tree_width >= 1, f"sjd_pac tree_width must be an integer >= 1, got {tree_width!r}")
    require(isinstance(tree_depth, int) and 1 <= tree_depth <= window,
            f"sjd_pac tree_depth must be an integer in 1..window ({window}), got {tree_depth!r}")
    return rule, drafter, pac_tree(window, tree_width, tree_depth)
