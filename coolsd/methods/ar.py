"""Plain autoregressive decoding: no drafts, tau = 1."""
from coolsd.decoding.trees import EMPTY_TREE
from coolsd.methods.registry import register_method


@register_method("ar")
def ar(ctx):
    return None, "none", EMPTY_TREE
