"""Plain autoregressive decoding: the target alone (tau = 1), in every family."""
from coolsd.engine.decoding.trees import EMPTY_TREE
from coolsd.engine.methods.cspd import ContinuousMethod
from coolsd.engine.methods.registry import register_method


@register_method("ar", families=("discrete", "continuous"), lossless=True, drafter="none")
def ar(ctx):
    """The target alone, one token a forward (the speed-up reference)."""
    if ctx.family == "continuous":
        return ContinuousMethod(name="ar")
    return None, EMPTY_TREE
