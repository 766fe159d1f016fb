"""A run's summary after its generation: float noise below a bound is the bound, a bug is still an
error, and a summary that fails leaves the records resumable with one line that says how to
summarise them (coolsd.util.stats.clamp_to_domain, the metrics' registered noise (coolsd.metrics.signal_metrics), coolsd.job.generation.summary_failed).
"""
import json

import pytest

import coolsd.job.generation as job
from coolsd.util.errors import SummaryError
from coolsd.cli.merge import main as merge_main
from coolsd.cli.runner import one_line_errors, run
from coolsd.util.stats import FRACTION, mean_ci
from coolsd.job.summary import metric_ci
from coolsd.metrics.signal_metrics import TOKEN_SUM_NOISE
from factories import compose

N = 3  # prompts: ar + coolsd on the toy world, 6 records


def _toy(out):
    return compose("method=coolsd", f"dataset.n_prompts={N}", f"+out_dir={out}")


def test_float_noise_below_a_bound_is_the_bound_and_a_real_violation_names_the_key():
    # an exact 0 that float32 rounding put below it (a relaxed method near lossless): CI from 0
    c = metric_ci("step_kl", [-8.358e-7, 0.0, 0.0, 0.0])
    assert c["mean"] == 0.0 and c["lo"] == 0.0 and c["ci95"] == [0.0, 0.0]
    c = metric_ci("step_kl", [-8.358e-7, 0.02, 0.05, 0.01])
    assert c["interval"] == "log" and 0.0 <= c["lo"] < c["mean"] == pytest.approx(0.02)
    assert metric_ci("step_kl", [-0.9 * TOKEN_SUM_NOISE, 0.0])["mean"] == 0.0  # the stated bound, inclusive
    with pytest.raises(ValueError, match=r"step_kl: a quantity >= 0 has value -0\.1, more than float noise"):
        metric_ci("step_kl", [-0.1, 0.2, 0.3])
    # a quantity computed to float precision keeps a tight bound: 1e-3 below is an error, not noise
    with pytest.raises(ValueError, match="latency_s: a quantity >= 0 has value -0.001"):
        metric_ci("latency_s", [-1e-3, 0.2])
    c = mean_ci([1.0 + 1e-9, 1.0, 0.0], domain=FRACTION, name="acceptance_rate")  # 0/1 data: Wilson, within [0, 1]
    assert c["interval"] == "wilson" and c["hi"] <= 1.0
    with pytest.raises(ValueError, match=r"acceptance_rate: a fraction in \[0, 1\]"):
        mean_ci([1.01, 0.5], domain=FRACTION, name="acceptance_rate")


def test_a_run_whose_records_hold_float_noise_summarises(tmp_path, monkeypatch):
    """The record that crashed a summary after a whole run had generated (step_kl -8.358e-7)."""
    real = job.generate_records

    def noisy(world, method, prompts, idxs, seeds, tag):
        out = real(world, method, prompts, idxs, seeds, tag)
        return [({**r, "step_kl": -8.358e-7} if tag == "coolsd" and r["prompt_index"] == 1 else r, img)
                for r, img in out]

    monkeypatch.setattr(job, "generate_records", noisy)
    s = run(_toy(tmp_path / "run"))
    assert s["results"]["coolsd"]["step_kl"]["lo"] >= 0.0


def test_a_failed_summary_keeps_the_records_says_so_in_one_line_and_a_rerun_summarises(tmp_path, monkeypatch,
                                                                                       capsys, caplog):
    out = tmp_path / "run"
    real_summarize = job.summarize

    def broken(*a, **k):
        raise ValueError("step_kl: a quantity >= 0.0 has value -8.358e-07\n(second line)")

    monkeypatch.setattr(job, "summarize", broken)
    monkeypatch.delenv("COOLSD_VERBOSE", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e, one_line_errors():
        run(_toy(out))
    assert e.value.code == 3
    err = capsys.readouterr().err
    err = err[err.index("error: "):]  # after the progress bar
    assert err.count("\n") == 1 and err.startswith(f"error: summarising {out} failed (ValueError: step_kl: "), err
    assert "-8.358e-07 (second line)" in err and "6 records are kept" in err
    assert f"python -m coolsd.cli.merge {out}" in err and f"out_dir={out}" in err and "Traceback" not in err
    # the same line goes to the job's log (run.log under run.py: coolsd.util.log)
    assert [r.getMessage() for r in caplog.records if r.name == "coolsd" and r.levelname == "ERROR"] == [err.strip()]
    kept = (out / "samples.jsonl").read_text()
    assert len(kept.splitlines()) == 2 * N and not (out / "summary.json").exists()

    with monkeypatch.context() as m:  # COOLSD_VERBOSE=1: the traceback, the failure chained as its cause
        m.setenv("COOLSD_VERBOSE", "1")
        with pytest.raises(SummaryError) as e, one_line_errors():
            run(_toy(out))
        assert isinstance(e.value.__cause__, ValueError)

    # the summary again, as the line says: the same job in the same folder generates nothing
    monkeypatch.setattr(job, "summarize", real_summarize)
    monkeypatch.setattr(job, "generate_records", lambda *a, **k: pytest.fail("a rerun generated again"))
    s = run(_toy(out))
    assert s["n_prompts"] == N and set(s["results"]) == {"ar", "coolsd"}
    assert (out / "samples.jsonl").read_text() == kept and json.loads((out / "summary.json").read_text())["n_prompts"] == N
    (out / "summary.json").unlink()
    m = merge_main([str(out)])  # or python -m coolsd.cli.merge <folder>: the same records, summarised
    assert m["prompts_missing"] == [] and m["results"]["coolsd"]["accepted_length"]["n"] == N
    assert (out / "summary.json").exists()
