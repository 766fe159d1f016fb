"""Speculative Jacobi Decoding (docs/methods.md#4-sjd): a window of W-1 drafts verified as a chain with
the lossless rule; drafts come from the target's previous iteration (``JacobiDrafter``).

``mc_sjd`` (MC-SJD / SCD, arXiv 2510.24211, junhyukso/SCD): the same, with each position's next
draft coupled to its previous one (``coupling=maximal``: keep the old draft x with probability
min(1, p_new(x) / p_old(x)), else draw from Norm([p_new - p_old]_+); ``coupling=gumbel``: one
Gumbel noise vector per position, shared by all its draws). Lossless like SJD (the coupled draft
is still distributed as the p it reports; ``JacobiDrafter``), but consecutive drafts agree more
often, so more of them survive verification.

``sjd_pac`` (SJD-PAC, arXiv 2603.18599, KangJialiang/SJD-PAC): MC-SJD's maximal coupling (upstream's
"adaptive continuation") on a tree whose first ``tree_depth - 1`` depths hold ``tree_width``
candidates drawn without replacement ("proactive drafting"; ``coolsd.engine.drafting.PACDrafter``,
docs/sjd_pac.md). Lossless with that bookkeeping (the lab's chi-square tests)."""
from coolsd.engine.decoding.rules import ExactRule
from coolsd.engine.decoding.trees import make_tree, pac_tree
from coolsd.engine.methods.registry import Param, register_method

INITS = ("random", "repeat_horizon", "sample_horizon", "vertical_repeat")  # coolsd.engine.drafting.JacobiDrafter
# the Jacobi window's parameters, shared by every method of SJD's family (sjd, mc_sjd, sjd_pac, gsd)
WINDOW = {
    "window": Param(16, int, low=2, doc="W: the root and W-1 drafts a round"),
    "init": Param("random", str, choices=INITS, doc="what the top-up drafts are"),
    "active_start": Param(None, int, low=0, nullable=True,
                          doc="Jacobi window only from this emitted token on (null: from the first)"),
    "active_end": Param(None, int, low=0, nullable=True, doc="... and before this one (null: to the end)"),
}
COUPLINGS = ("maximal", "gumbel")


def chain(window: int):
    """SJD's tree: a chain of the window's W-1 drafts."""
    return make_tree("chain", window - 1)


@register_method("sjd", lossless=True, drafter="jacobi", params=WINDOW)
def sjd(ctx, window, init, active_start, active_end):
    """SJD: each round's drafts are the previous round's target samples, drawn independently."""
    return ExactRule(), chain(window)


@register_method("mc_sjd", lossless=True, drafter="jacobi",
                 params={**WINDOW, "coupling": Param("maximal", str, choices=COUPLINGS,
                                                     doc="maximal: keep the old draft w.p. min(1, p_new/p_old), else "
                                                         "draw from Norm([p_new - p_old]_+); gumbel: shared Gumbel "
                                                         "noise per position")})
def mc_sjd(ctx, window, init, active_start, active_end, coupling):
    """MC-SJD: SJD with each position's draws coupled across rounds."""
    return ExactRule(), chain(window)


def _pac_depth(p):
    if p["tree_depth"] > p["window"]:
        raise ValueError(f"sjd_pac tree_depth must be <= window ({p['window']}), got {p['tree_depth']!r}")


@register_method("sjd_pac", lossless=True, drafter="pac", checks=(_pac_depth,),
                 params={**WINDOW, "tree_width": Param(4, int, low=1, doc="candidates at each branching depth"),
                         "tree_depth": Param(3, int, low=1, doc="levels counting the root, as upstream's tree_depth: "
                                                                "siblings at depths 1 .. tree_depth-1 (<= window)")})
def sjd_pac(ctx, window, init, active_start, active_end, tree_width, tree_depth):
    """SJD-PAC: MC-SJD's maximal coupling on a tree of candidates drawn without replacement.
    The paper's setting: width 4, depth 3, window 64 (the default window here is 16, as sjd's)."""
    return ExactRule(), pac_tree(window, tree_width, tree_depth)
