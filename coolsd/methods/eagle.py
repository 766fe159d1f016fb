"""EAGLE-1: lossless static-tree speculative sampling (METHODS.md 1.3, a_j = p_res)."""
from coolsd.decoding.rules import ExactRule
from coolsd.methods.registry import register_method


@register_method("eagle", lossless=True, drafter="model")
def eagle(ctx):
    """EAGLE-1: a model-drafted tree, verified with recursive rejection."""
    return ExactRule(), None
