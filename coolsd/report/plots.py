"""Pareto plots: quality metrics against accepted length and against speed-up, one curve per
method family across its delta / lambda sweep, 95% CIs as error bars (PNG + PDF). A sweep's image
grid is ``coolsd.util.image_grid.captioned_grid`` (every run's ``grid.png`` draws with it too)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from coolsd.metrics.registry import lower_is_better

X_LABELS = {"accepted_length": "accepted length (tokens / round)", "speedup": "speed-up over same-mode AR (same run)",
            "speedup_vs_fastest_ar": "speed-up over the fastest AR (same run)"}
DPI = 120
# where a point's label may go: offsets (points) from the point, nearest first, in 8 directions
LABEL_RADII = (4, 10, 18, 28, 40, 55, 72, 92, 115, 140)
LABEL_DIRECTIONS = ((1, 1), (1, -1), (-1, 1), (-1, -1), (1, 0), (-1, 0), (0, 1), (0, -1))
LABEL_FONTSIZE = 7
LABEL_LINE_CHARS = 28  # a longer label is wrapped at spaces into lines of about this many characters
LABEL_GAP = 2.0  # pixels kept clear around a label


def _overlap(a, b) -> float:
    """Area shared by two display-space boxes (0 where they only touch)."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def _inside(box, frame, pad: float = 1.0) -> bool:
    return box.x0 >= frame.x0 + pad and box.x1 <= frame.x1 - pad and box.y0 >= frame.y0 + pad and box.y1 <= frame.y1 - pad


def _nearest_free_spot(point, width: float, height: float, frame, taken, step: float = 6.0):
    """(box, centre) of the ``width`` x ``height`` box inside ``frame`` nearest to ``point`` (display
    space, on a ``step``-pixel lattice) that keeps ``LABEL_GAP`` clear of every box in ``taken``; None
    where there is none."""
    from matplotlib.transforms import Bbox

    half_w, half_h = width / 2 + 1.0, height / 2 + 1.0
    xs = np.arange(frame.x0 + half_w, frame.x1 - half_w, step)
    ys = np.arange(frame.y0 + half_h, frame.y1 - half_h, step)
    if not len(xs) or not len(ys):
        return None
    cx, cy = (a.ravel() for a in np.meshgrid(xs, ys))
    clear = np.ones(cx.shape, bool)
    g = LABEL_GAP
    for t in taken:
        clear &= ((cx + half_w + g <= t.x0) | (cx - half_w - g >= t.x1) | (cy + half_h + g <= t.y0)
                  | (cy - half_h - g >= t.y1))
    if not clear.any():
        return None
    k = np.flatnonzero(clear)[np.argmin(np.hypot(cx[clear] - point[0], cy[clear] - point[1]))]
    return Bbox([[cx[k] - width / 2, cy[k] - height / 2], [cx[k] + width / 2, cy[k] + height / 2]]), (cx[k], cy[k])


def place_labels(ax, xs, ys, texts, obstacles=()) -> list:
    """Annotate point i of ``ax`` with ``texts[i]``, each label placed at the nearest offset (in
    ``LABEL_RADII`` x ``LABEL_DIRECTIONS``) where it lies inside the axes and clear of every label
    placed before, every point's marker and ``obstacles`` (display-space boxes, e.g. the legend);
    a label away from its point gets a thin leader line. Where no offset is clear, the label goes to
    the clear spot of the axes nearest to its point (``_nearest_free_spot``); only where the axes
    have none left does it take the offset inside the axes with the least overlap. Labels longer
    than ``LABEL_LINE_CHARS`` are wrapped. Call after the figure's layout is final: the check is
    in display space. Returns the annotations."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    pts = ax.transData.transform(np.column_stack([xs, ys])) if len(xs) else np.empty((0, 2))
    marker = 4.0 * ax.figure.dpi / 72  # half a marker's size in pixels
    taken = list(obstacles) + [Bbox([[x - marker, y - marker], [x + marker, y + marker]]) for x, y in pts]
    align = {"ha": {1: "left", 0: "center", -1: "right"}, "va": {1: "bottom", 0: "center", -1: "top"}}
    placed = []
    for point, x, y, text in zip(pts, xs, ys, texts):
        text = "\n".join(textwrap.wrap(text, LABEL_LINE_CHARS, break_on_hyphens=False)) or text
        probe = ax.annotate(text, (x, y), xytext=(0, 0), textcoords="offset points", fontsize=LABEL_FONTSIZE,
                            annotation_clip=False)
        best = None  # (cost, radius, direction)
        for r in LABEL_RADII:
            for dx, dy in LABEL_DIRECTIONS:
                probe.xyann = (dx * r, dy * r)
                probe.set_ha(align["ha"][dx])
                probe.set_va(align["va"][dy])
                box = probe.get_window_extent(renderer)
                spaced = box.expanded(1.0, 1.0).padded(LABEL_GAP)  # labels that only touch read as one
                cost = (0.0 if _inside(box, frame) else 1e12) + sum(_overlap(spaced, t) for t in taken)
                if best is None or cost < best[0]:
                    best = (cost, r, (dx, dy), box)
                if cost == 0.0:
                    break
            if best[0] == 0.0:
                break
        probe.remove()
        _, r, (dx, dy), box = best
        xytext, ha, va = (dx * r, dy * r), align["ha"][dx], align["va"][dy]
        if best[0] > 0.0:  # nothing clear near the point: the clear spot of the axes nearest to it
            free = _nearest_free_spot(point, box.width, box.height, frame, taken)
            if free is not None:
                box, (cx, cy) = free
                to_points = 72.0 / ax.figure.dpi
                xytext = ((cx - point[0]) * to_points, (cy - point[1]) * to_points)
                ha, va, r = "center", "center", max(LABEL_RADII)
        leader = {"arrowprops": {"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0, "shrinkB": 3}
                  } if r > LABEL_RADII[1] else {}
        ann = ax.annotate(text, (x, y), xytext=xytext, textcoords="offset points", fontsize=LABEL_FONTSIZE,
                          ha=ha, va=va, annotation_clip=False, **leader)
        ann.set_in_layout(False)
        taken.append(box)
        placed.append(ann)
    return placed


def pareto_figure(df: pd.DataFrame, metrics: list[str], title: str,
                  xs: tuple[str, ...] = ("accepted_length", "speedup")):
    """The figure of ``pareto_plot``: its axes laid out first, then each point labelled by its
    ``tag`` inside its axes, no two labels overlapping (``place_labels``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in metrics if m in df and df[m].notna().any()]
    if not metrics:
        raise ValueError(f"none of the metrics {metrics} has values to plot")
    fig, axes = plt.subplots(len(metrics), len(xs), figsize=(6 * len(xs), 4.2 * len(metrics)), squeeze=False,
                             dpi=DPI)
    points = {}
    for row, metric in enumerate(metrics):
        for col, x in enumerate(xs):
            ax = axes[row, col]
            shown = []
            for family, g in df.groupby("family", sort=False):
                g = g.dropna(subset=[x, metric]).sort_values(x)
                if g.empty:
                    continue
                # a bootstrap interval need not hold its point (FID's resamples are biased up): bars clipped at 0
                bar = lambda c: [(g[c] - g[c + "_lo"]).clip(lower=0), (g[c + "_hi"] - g[c]).clip(lower=0)]  # noqa: E731
                ax.errorbar(g[x], g[metric], yerr=bar(metric), xerr=bar(x), fmt="o-" if len(g) > 1 else "o",
                            capsize=2, label=family)
                shown.append(g[[x, metric, "tag"]].to_numpy())
            points[row, col] = np.concatenate(shown) if shown else np.empty((0, 3), dtype=object)
            ax.set_xlabel(X_LABELS.get(x, x))
            lower = lower_is_better(metric)  # the metric's registered direction (None: not a registered metric)
            ax.set_ylabel(metric + ("" if lower is None else " (lower is better)" if lower else " (higher is better)"))
            ax.grid(alpha=0.3)
            ax.margins(0.15)  # room inside the axes for the labels of the outermost points
    legend = axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.canvas.draw()
    for (row, col), pts in points.items():
        obstacles = [legend.get_window_extent()] if (row, col) == (0, 0) else []
        place_labels(axes[row, col], pts[:, 0].astype(float), pts[:, 1].astype(float), list(pts[:, 2]), obstacles)
    return fig


def pareto_plot(df: pd.DataFrame, path: Path, metrics: list[str], title: str,
                xs: tuple[str, ...] = ("accepted_length", "speedup")) -> list[Path]:
    """``df``: one row per configuration with columns tag, family, and for every metric m and
    x: m, m_lo, m_hi. Metrics absent from ``df`` (or all NaN) are skipped. Returns the files."""
    import matplotlib.pyplot as plt

    fig = pareto_figure(df, metrics, title, xs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return [path, path.with_suffix(".pdf")]
