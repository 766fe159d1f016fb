"""EAGLE-1: lossless static-tree speculative sampling (docs/methods.md#13-verification-at-one-tree-depth-d, a_j = p_res)."""
from coolsd.engine.decoding.rules import ExactRule
from coolsd.engine.methods.registry import register_method


@register_method("eagle", lossless=True, drafter="model")
def eagle(ctx):
    """EAGLE-1: a model-drafted tree, verified with recursive rejection."""
    return ExactRule(), None
