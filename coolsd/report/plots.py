"""Pareto plots: quality metrics against accepted length and against speed-up, one curve per
method family across its delta / lambda sweep, 95% CIs as error bars (PNG + PDF)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

LOWER_IS_BETTER = {"fid", "toy_fid", "step_tv", "step_kl", "off_support"}  # the exact distortion signals
X_LABELS = {"accepted_length": "accepted length (tokens / round)", "speedup": "speed-up over same-mode AR (same run)",
            "speedup_vs_fastest_ar": "speed-up over the fastest AR (same run)"}


def pareto_plot(df: pd.DataFrame, path: Path, metrics: list[str], title: str,
                xs: tuple[str, ...] = ("accepted_length", "speedup")) -> list[Path]:
    """``df``: one row per configuration with columns tag, family, and for every metric m and
    x: m, m_lo, m_hi. Metrics absent from ``df`` (or all NaN) are skipped. Returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in metrics if m in df and df[m].notna().any()]
    if not metrics:
        raise ValueError(f"none of the metrics {metrics} has values to plot")
    fig, axes = plt.subplots(len(metrics), len(xs), figsize=(5 * len(xs), 3.8 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        for col, x in enumerate(xs):
            ax = axes[row, col]
            for family, g in df.groupby("family", sort=False):
                g = g.dropna(subset=[x, metric]).sort_values(x)
                if g.empty:
                    continue
                ax.errorbar(g[x], g[metric], yerr=[g[metric] - g[metric + "_lo"], g[metric + "_hi"] - g[metric]],
                            xerr=[g[x] - g[x + "_lo"], g[x + "_hi"] - g[x]], fmt="o-" if len(g) > 1 else "o",
                            capsize=2, label=family)
                for _, r in g.iterrows():
                    ax.annotate(r["tag"], (r[x], r[metric]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            ax.set_xlabel(X_LABELS.get(x, x))
            ax.set_ylabel(metric + (" (lower is better)" if metric in LOWER_IS_BETTER else " (higher is better)"))
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return [path, path.with_suffix(".pdf")]
