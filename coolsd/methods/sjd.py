"""Speculative Jacobi Decoding (METHODS.md 4): a window of W-1 drafts verified as a chain with
the lossless rule; drafts come from the target's previous iteration (``JacobiDrafter``)."""
from coolsd.decoding.rules import ExactRule
from coolsd.decoding.trees import make_tree
from coolsd.methods.registry import register_method, require


@register_method("sjd")
def sjd(ctx, window=16, init="random", active_start=None, active_end=None):
    require(isinstance(window, int) and window >= 2, f"sjd window must be an integer >= 2, got {window!r}")
    require(init == "random", f"unknown sjd init {init!r}; valid: random")
    return ExactRule(), "jacobi", make_tree("chain", window - 1)
