"""Timing that cannot flatter (docs/methods.md#6-evaluation-protocol): the quality signals' work is timed on the device
(``coolsd.engine.timing.IntervalTimer``: events on CUDA, the host clock on the CPU), recorded per image as
``signal_s`` inside ``latency_s``, and every summary reports the speed-up with and without it, side
by side, from the same run."""
import json
import time

import pytest

from coolsd.cli.runner import run
from coolsd.util.stats import ratio_ci
from coolsd.engine.timing import IntervalTimer
from factories import compose


def test_interval_timer_sums_its_stretches_only():
    t = IntervalTimer("cpu")
    for _ in range(3):
        t.start()
        time.sleep(0.02)
        t.stop()
        time.sleep(0.02)  # outside a stretch: not counted
    assert 0.055 <= t.seconds() < 0.1


def test_a_run_reports_the_speedup_with_and_without_its_signal_work(tmp_path, capsys):
    out = tmp_path / "run"
    s = run(compose("method=coolsd", "dataset.n_prompts=3", f"+out_dir={out}"))
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        assert 0.0 < r["signal_s"] < r["latency_s"]
    ar, m = (sorted((r for r in rows if r["method"] == t), key=lambda r: r["prompt_index"]) for t in ("ar", "coolsd"))
    want = ratio_ci([r["latency_s"] - r["signal_s"] for r in ar], [r["latency_s"] - r["signal_s"] for r in m],
                    paired=True)
    got = s["results"]["coolsd"]
    assert got["speedup_without_signals"]["mean"] == pytest.approx(want["mean"])
    assert got["speedup"]["mean"] != got["speedup_without_signals"]["mean"]
    assert "speed-up w/o signals" in capsys.readouterr().out
