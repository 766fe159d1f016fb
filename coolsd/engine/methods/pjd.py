"""PJD, 2D parallel Jacobi decoding (arXiv 2606.05703, CVPR 2026; boyaliao/PJD): SJD's window on
several image rows at once, row r+1 starting once ``start`` tokens of row r are committed; the top
row is verified as SJD, the rows below commit only the drafts they accept (docs/methods.md section
8.2, ``coolsd.engine.rows.pjd_generate``). Training-free and lossy."""
from coolsd.engine.decoding.trees import EMPTY_TREE
from coolsd.engine.methods.registry import Param, register_method


def _not_batch_invariant(params, cfg, world_cls) -> None:
    """Each forward is padded to the batch's longest schedule: a batch of several prompts is not
    batch-invariant (the config check, ``register_method(config_checks=...)``)."""
    invariant = bool((cfg.get("deterministic") or {}).get("batch_invariant") or False)
    if invariant and int(cfg.get("batch_size") or 1) > 1:
        raise ValueError("method=pjd pads each forward to the batch's longest schedule, which is not batch-invariant: "
                         "set batch_size=1 or deterministic.batch_invariant=false")

@register_method("pjd", drafter="pjd", config_checks=(_not_batch_invariant,), params={
    "window": Param(8, int, low=1, doc="a row's anchor and drafts a forward at most (upstream window_size 8)"),
    "start": Param(8, int, low=1, doc="committed tokens of row r after which row r+1 starts (upstream c = 8; "
                                             "at the latest when row r is complete)"),
    "keep_above": Param(0.5, float, low=0, high=1, nullable=True,
                        doc="after a row's first rejection, a later draft stays a draft if its acceptance probability "
                            "exceeds this (upstream 0.5); null: never (SJD's fresh sample)")})
def pjd(ctx, window, start, keep_above):
    """PJD: one forward verifies every active row's window."""
    return None, EMPTY_TREE  # no tree: coolsd.engine.rows feeds the rows itself
