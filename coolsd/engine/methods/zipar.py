"""ZipAR (arXiv 2412.04062, ICML 2025; ThisisBillhe/ZipAR): row-parallel "zip" decoding, row r+1
starting once ``window`` tokens of row r are decoded (docs/methods.md section 8.1,
``coolsd.engine.rows``). Training-free and lossy: a token is drawn without the part of the row above
that is not decoded yet; its exact per-token distortion is ``step_tv``."""
from coolsd.engine.decoding.trees import EMPTY_TREE
from coolsd.engine.methods.registry import Param, register_method


@register_method("zipar", drafter="rows", params={
    "window": Param(None, int, low=1, nullable=True,
                    doc="tokens of row r decoded before row r+1 starts; null: upstream's 8, or half a row on rows "
                        "of fewer than 16 tokens")})
def zipar(ctx, window):
    """ZipAR: every forward advances every active row by one token; no verification."""
    return None, EMPTY_TREE  # no tree: coolsd.engine.rows feeds the rows itself
