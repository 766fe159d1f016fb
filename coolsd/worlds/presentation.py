"""How a world's run is shown: the printed summary table's columns, per-prompt rows and the
hint printed after a run. Presentation only: what a world computes (its record metrics, paired
differences, quality) stays on the world (``coolsd.worlds.base``); the paper's metric names per
target are the report's (``coolsd.report.table2.paper_metrics``), each metric's header and decimals
its registry entry's (``coolsd.metrics.registry``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from coolsd.metrics.registry import METRICS, metric


class Column(NamedTuple):
    """A column of the printed summary table: a key of the summary (a mean with ``ci95``, a
    bootstrap ``fid`` with ``lo``/``hi``), its header and decimals."""

    key: str
    header: str
    digits: int = 3


# the two speed-ups, labelled apart: against AR in the run's own mode, and against the fastest AR the
# run timed (coolsd.job.summary.FASTEST_AR_REFERENCE)
SPEEDUP_COLUMNS = (Column("speedup", "speed-up (same-mode AR)"), Column("speedup_vs_fastest_ar", "speed-up (fastest AR)"))
SPEED_COLUMNS = (Column("accepted_length", "accepted length"), Column("latency_s", "latency s"), *SPEEDUP_COLUMNS)
# the discrete worlds' eager runs time their quality signals apart: the speed-up without that work beside it
DISCRETE_SPEED_COLUMNS = SPEED_COLUMNS + (Column("speedup_without_signals", "speed-up w/o signals"),)
# the exact distortion and the likelihood shift of what was emitted (docs/signals.md): rank methods at equal speed
SIGNAL_COLUMNS = (Column("step_tv", "step TV (sum/image)", 2), Column("target_nll_minus_ar", "NLL - AR", 3),
                  Column("target_nll_expected_minus_ar", "E[NLL] - AR", 3))
CONTINUOUS_COLUMNS = (Column("acceptance_rate", "acceptance"), Column("accepted_length", "tokens/target fwd"),
                      Column("latency_s", "latency s"), *SPEEDUP_COLUMNS)


def metric_column(name: str) -> Column:
    """The column of a registered metric: its header and decimals (``coolsd.metrics.registry``)."""
    m = metric(name)
    return Column(name, m.header, m.digits)


# the toy worlds' own quality numbers that stand in for the field's metrics (toy_clip, toy_fid)
TOY_COLUMNS = tuple(metric_column(n) for n in METRICS.names(computed_by="world", stands_for=lambda v: v is not None))
REAL_TARGET_HINT = "image metrics: python -m coolsd.cli.evaluate {out_dir}"


@dataclass(frozen=True)
class Presentation:
    """``columns``: the printed summary table; ``per_prompt``: record fields also printed one row
    per prompt; ``next_step``: printed after a run, formatted with ``out_dir``."""

    columns: tuple[Column, ...]
    per_prompt: tuple[str, ...] = ()
    next_step: str = ""
