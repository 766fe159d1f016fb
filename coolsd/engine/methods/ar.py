"""Plain autoregressive decoding: the target alone (tau = 1), in every family."""
from coolsd.engine.decoding.trees import EMPTY_TREE
from coolsd.engine.methods.cspd import HEAD_PARAMS, ContinuousMethod, check_head_params
from coolsd.engine.methods.registry import register_method


# sampler / eta / head_steps / anneal / lower_steps / num_iter: continuous targets only (the target's head settings overridden, as cspd's)
@register_method("ar", families=("discrete", "continuous"), lossless=True, drafter="none", params=HEAD_PARAMS,
                 checks=(check_head_params,))
def ar(ctx, sampler=None, eta=None, head_steps=None, anneal=None, lower_steps=None, num_iter=None):
    """The target alone (the speed-up reference): one token a forward; a continuous target in
    ``num_iter`` AR steps where set (docs/methods.md#53-the-equal-forwards-baseline)."""
    if ctx.family == "continuous":
        return ContinuousMethod(name="ar", sampler=sampler, eta=eta, head_steps=head_steps, anneal=anneal,
                                lower_steps=lower_steps, num_iter=num_iter)
    return None, EMPTY_TREE
