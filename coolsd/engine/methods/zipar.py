"""ZipAR (arXiv 2412.04062, ICML 2025; ThisisBillhe/ZipAR): row-parallel "zip" decoding, row r+1
starting once ``window`` tokens of row r are decoded (docs/methods.md section 8.1,
``coolsd.engine.rows``). Training-free and lossy: a token is drawn without the part of the row above
that is not decoded yet; its exact per-token distortion is ``step_tv``."""
import math

from coolsd.engine.decoding.trees import EMPTY_TREE
from coolsd.engine.methods.registry import Param, register_method


def _window_within_a_row(params, cfg, world_cls) -> None:
    """A set ``window`` lies within a row of a row-parallel target's square grid (the config check,
    ``register_method(config_checks=...)``)."""
    window = params.get("window")
    if window is None or not world_cls.row_parallel:
        return
    n = world_cls.image_tokens(cfg)
    side = math.isqrt(n) if n else 0
    if side and side * side == n and not (isinstance(window, int) and 1 <= window < side):
        raise ValueError(f"method.window={window!r} is invalid: it must be an integer in [1, {side - 1}] "
                         f"(target {cfg.target.name}'s grid is {side} tokens wide)")


@register_method("zipar", drafter="rows", config_checks=(_window_within_a_row,), params={
    "window": Param(None, int, low=1, nullable=True,
                    doc="tokens of row r decoded before row r+1 starts; null: upstream's 8, or half a row on rows "
                        "of fewer than 16 tokens")})
def zipar(ctx, window):
    """ZipAR: every forward advances every active row by one token; no verification."""
    return None, EMPTY_TREE  # no tree: coolsd.engine.rows feeds the rows itself
