"""Where on the image a method distorts, and at which round depth.

From the per-token arrays a discrete run records per image (``token_tv``: TV(pi_t, p_t) of each
token's emitted distribution, docs/distortion.md; ``token_depth``: the round depth it was verified
at, 0 if drawn from p), per method:

* the **distortion map**: mean over prompts of token_tv, laid out on the image's token grid in
  generation (raster) order;
* the **depth curve**: mean token_tv of the tokens verified at depth d = 1..L (with the count of
  such tokens: deep drafts are rarer).

``distortion_figure`` draws both, one panel per method and one panel of curves.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def token_grid(n: int) -> tuple[int, int] | None:
    """(rows, cols) of a square image of ``n`` tokens in raster order (every current target: LlamaGen,
    the toy world, Lumina-mGPT at square sizes, whose row-end tokens are forced, not generated); None
    otherwise (no map is drawn)."""
    h = math.isqrt(n)
    return (h, h) if h * h == n else None


def _token_rows(records: list[dict]) -> tuple[np.ndarray, np.ndarray] | None:
    rows = [r for r in records if r.get("token_tv") is not None and r.get("token_depth") is not None]
    if not rows:
        return None
    return (np.asarray([r["token_tv"] for r in rows], dtype=np.float64),
            np.asarray([r["token_depth"] for r in rows], dtype=np.int64))


def distortion_map(records: list[dict]) -> np.ndarray | None:
    """(rows, cols) mean token_tv over the records that have per-token values; None if none do
    (or the image is not a square grid)."""
    got = _token_rows(records)
    return None if got is None else _map(got[0])


def depth_curve(records: list[dict]) -> dict | None:
    """{"depth": [1..L], "mean_tv": [...], "count": [...]}: mean token_tv of the tokens verified at
    each depth (tokens drawn from p, depth 0, excluded); None without per-token values or drafts."""
    got = _token_rows(records)
    return None if got is None else _curve(*got)


def _map(tv: np.ndarray) -> np.ndarray | None:
    grid = token_grid(tv.shape[1])
    return None if grid is None else tv.mean(0).reshape(grid)


def _curve(tv: np.ndarray, depth: np.ndarray) -> dict | None:
    depths = sorted(int(d) for d in np.unique(depth) if d > 0)
    if not depths:
        return None
    return {"depth": depths, "mean_tv": [float(tv[depth == d].mean()) for d in depths],
            "count": [int((depth == d).sum()) for d in depths]}


def distortion_figure(records_by_tag: dict, path: Path, title: str = "") -> Path | None:
    """One distortion map per method with drafted tokens (shared colour scale) and the depth
    curves; PNG at ``path``. None (nothing written) if no method has per-token values."""
    arrays = {t: got for t, r in records_by_tag.items() if (got := _token_rows(r)) is not None}
    maps = {t: _map(tv) for t, (tv, _) in arrays.items()}
    curves = {t: _curve(tv, depth) for t, (tv, depth) in arrays.items()}
    tags = [t for t in arrays if maps[t] is not None and curves[t] is not None]
    if not tags:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vmax = max(float(maps[t].max()) for t in tags) or 1.0
    ncols = min(len(tags) + 1, 6)  # maps, then the depth curves, in rows of at most 6 panels
    nrows = -(-(len(tags) + 1) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.6 * ncols + 1, 2.9 * nrows), squeeze=False, layout="constrained")
    cells = list(axes.flat)
    for ax, t in zip(cells, tags):
        im = ax.imshow(maps[t], cmap="magma", vmin=0, vmax=vmax)
        ax.set_title(f"{t}\nsum {maps[t].sum():.2f} / image", fontsize=8)
        ax.set_xticks([]), ax.set_yticks([])
    fig.colorbar(im, ax=cells[: len(tags)], shrink=0.8, label="mean TV(pi_t, p_t) per token")
    ax = cells[len(tags)]
    for ax_unused in cells[len(tags) + 1:]:
        ax_unused.axis("off")
    for t in tags:
        c = curves[t]
        ax.plot(c["depth"], c["mean_tv"], "o-", ms=3, label=t)
    ax.set_xticks(range(1, max(max(curves[t]["depth"]) for t in tags) + 1))
    ax.set_xlabel("round depth the token was verified at", fontsize=8)
    ax.set_ylabel("mean TV(pi_t, p_t)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
