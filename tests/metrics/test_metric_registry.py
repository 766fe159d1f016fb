"""Metrics and evaluation protocols as registered entries (coolsd.metrics.registry): every fact in
one place, read by evaluate, the summaries, the reports, the page and its plots; no list of their
names outside the registries; a metric from outside the package (examples/metric) runs through
``python -m coolsd.cli.evaluate --include`` and shows up in ``--list metrics``, metrics.json and the
comparison page."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coolsd.cli.evaluate import main as evaluate
from coolsd.metrics.registry import (
    METRICS,
    PROTOCOLS,
    MetricInfo,
    declare_metric,
    lower_is_better,
    metric,
    protocol_inputs,
    register_metric,
)
from coolsd.util.records import RecordWriter
from name_scan import name_lists

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "metric"

# lists whose strings are metric names on purpose: the paper's Table 2 layout (its columns, in its
# order), a world's declaration of the record fields it carries, a module's export list
NOT_METRIC_LISTS = {"coolsd/report/paper.py": ("TABLE2_COLUMNS",)}
DECLARATIONS = ("record_metrics", "paired_metrics", "__all__")


@pytest.fixture(autouse=True)
def included_entries_stay_in_the_test(monkeypatch):
    """What a test includes (examples/metric) is registered for that test only: the registries and
    the loaded files are restored after it, so other tests in the process see the package's own."""
    from coolsd.engine import plugins

    for reg in (METRICS, PROTOCOLS):
        reg._all()  # the package's own entries first
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))
    monkeypatch.setattr(plugins, "_LOADED", dict(plugins._LOADED))


def _name_lists(path: Path, names: set) -> list:
    """``name_lists`` less the declarations and the paper's layout (``NOT_METRIC_LISTS``)."""
    return name_lists(path, names, DECLARATIONS + NOT_METRIC_LISTS.get(str(Path(path).relative_to(ROOT)), ()))


@pytest.mark.parametrize("what", ["metrics", "protocols"])
def test_no_list_of_metric_or_protocol_names_outside_their_registries(what):
    """What a metric is (its direction, who computes it, its header, the toy metric standing in for
    it) is asked of the registry. Before: lists of names in report/plots.py (LOWER_IS_BETTER),
    report/page.py (PARETO_METRICS), report/table2.py, report/sota.py (QUALITY), job/summary.py,
    worlds/presentation.py, cli/evaluate.py (METRICS) and metrics/protocols.py (PROTOCOLS)."""
    names = set(METRICS.names() if what == "metrics" else PROTOCOLS.names())
    found = {str(p.relative_to(ROOT)): lists for p in sorted((ROOT / "coolsd").rglob("*.py"))
             if (lists := _name_lists(p, names))}
    assert found == {}
    for path, assigned in NOT_METRIC_LISTS.items():
        assert all(a in (ROOT / path).read_text() for a in assigned), f"{path}: {assigned} is gone: drop the entry"


def test_the_scan_finds_a_list_of_metric_names(tmp_path, monkeypatch):
    """The scan is not blind: a plain list of two metric names is found; the same list assigned to a
    world's record declaration is not."""
    f = ROOT / "coolsd" / "_scan_probe.py"
    try:
        f.write_text('QUALITY = ("fid", "clip_score")\nrecord_metrics = ("step_tv", "step_kl")\n')
        assert _name_lists(f, set(METRICS.names())) == [(1, ["fid", "clip_score"])]
    finally:
        f.unlink()


def test_every_fact_of_the_builtin_metrics_is_in_their_entries():
    for name in METRICS.names():
        m = metric(name)
        assert METRICS.entry(name).builtin and m.doc, name
        assert lower_is_better(name) == (not m.higher_is_better)
        if m.computed_by == "evaluate":  # every input it reads resolves under every protocol
            for p in PROTOCOLS.names():
                assert all(s.flag.startswith("--") for s in protocol_inputs(PROTOCOLS.get(p), m))
        if m.stands_for is not None:  # a toy metric stands in for a registered metric, under its own name
            assert m.stands_for in METRICS and m.stands_for != name and name.startswith("toy_")
    assert lower_is_better("fid") and not lower_is_better("clip_score") and lower_is_better("step_tv")
    assert lower_is_better("latency_s") is None  # not a metric: no direction claimed


def test_wrong_metric_entries_are_refused():
    with pytest.raises(ValueError, match="computed_by must be one of evaluate, world, loop"):
        MetricInfo("x", True, "somewhere")
    with pytest.raises(ValueError, match="needs build"):
        MetricInfo("x", True, "evaluate")
    with pytest.raises(ValueError, match=r"metric 'fid' is registered twice: at coolsd/metrics/image_metrics\.py:\d+ "
                                         r"and at tests/metrics/test_metric_registry\.py:\d+"):
        register_metric("fid", higher_is_better=False)(lambda ctx: None)
    with pytest.raises(ValueError, match="metric 'toy_clip' is registered twice"):
        declare_metric("toy_clip", higher_is_better=True, computed_by="world", doc="again")
    with pytest.raises(ValueError, match=r"unknown metric 'clip_scor' \(did you mean 'clip_score'\?\)"):
        metric("clip_scor")


def _run(root, n=3):
    r = np.random.default_rng(0)
    w = RecordWriter(root)
    for i in range(n):
        for m in ("ar", "coolsd"):
            img = r.integers(0, 256, (24, 24, 3), dtype=np.uint8)
            if m == "ar":
                img[..., 1:] = img[..., :1]  # grey: colourfulness 0
            w.append({"method": m, "prompt_index": i, "caption": "a red cat", "seed": i, "latency_s": 0.1 + 0.01 * i,
                      "accepted_length": 1.0 if m == "ar" else 2.0 + 0.1 * i,
                      "params": {"method": m}}, img, f"{m}/{i:05d}.png")
    return root


def test_a_metric_from_outside_the_package_runs_through_evaluate_and_shows_on_the_page(tmp_path, capsys):
    """examples/metric (one file, ~30 lines): registered by --include, computed from the run's
    images, written to metrics.json with its protocol, printed with its header, listed by
    ``--list metrics`` and plotted and tabled by the comparison page."""
    run = _run(tmp_path / "run")
    out = evaluate([str(run), "--include", str(EXAMPLE), "--metrics", "colorfulness"])
    ar, co = out["per_method"]["ar"]["colorfulness"], out["per_method"]["coolsd"]["colorfulness"]
    assert ar["mean"] == pytest.approx(0.0, abs=1e-12) and co["mean"] > 10  # grey vs uniform random colour
    assert co["protocol"] == "lantern" and len(out["per_sample"]["coolsd"]["colorfulness"]) == 3
    assert json.loads((run / "metrics.json").read_text())["per_method"]["coolsd"]["colorfulness"]["mean"] == co["mean"]
    assert "colourfulness" in capsys.readouterr().out
    info = metric("colorfulness")
    assert not METRICS.entry("colorfulness").builtin and info.higher_is_better and info.pareto
    files = [p for p in EXAMPLE.glob("*.py")]
    assert len(files) == 1 and len(files[0].read_text().splitlines()) <= 40

    from coolsd.report.page import build_page, load_runs

    runs = load_runs([run])
    assert runs[0].table["coolsd"]["colorfulness"]["mean"] == co["mean"]  # the page reads the run's metrics.json
    html = build_page(runs, tmp_path / "page.html")
    assert "<th" in html and ">colorfulness" in html and 'id="pareto" alt="Pareto plots"' in html

    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--include", str(EXAMPLE), "--list", "metrics"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "colorfulness  (computed by evaluate; higher is better; examples/metric/colorfulness.py:" in proc.stdout


def test_evaluate_refuses_an_unknown_metric_with_the_registered_ones(tmp_path):
    from coolsd.util.errors import ConfigError

    run = _run(tmp_path / "run")
    with pytest.raises(ConfigError, match=r"unknown metric\(s\) \['colorfulnes'\]; valid: clip_score, fid, hpsv2, image_reward$"):
        evaluate([str(run), "--metrics", "colorfulnes"])
