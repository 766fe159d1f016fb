"""benchmarks/gpu_check.py, the prepared device check, in its CPU form (tiny fp64 models): every
registered discrete method runs eagerly on the LlamaGen and Lumina-mGPT classes within the sync
budget (the row-parallel ones on LlamaGen only; PJD's host-driven schedule outside the budget), MAR runs CSpD, the compiled branch (AR: one graph set, Inductor on a CPU is slow) emits the
eager tokens, and the JSON and the tables are written. One failing method is recorded without
hiding the others and makes the CLI exit non-zero in one line; the time budget skips and records
runs; bad flags are one-line errors."""
import json
from pathlib import Path

import pytest
import torch
from factories import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--tiny", "--device", "cpu"]  # fp64, chains of 3


def _bench():
    mod = load_benchmark("gpu_check")
    return mod


def test_tiny_cpu_check_covers_every_method_within_the_sync_budget(tmp_path, dynamo_only):
    """The check end to end on the CPU (tiny targets): every method eager within the sync budget, compiled
    AR traced by Dynamo (its Inductor code is tests/engine/test_compiled.py's) agreeing token for token."""
    bench = _bench()
    out = bench.main(TINY + ["--compiled-methods", "ar", "--out", str(tmp_path / "check")])
    assert out["failures"] == [] and out["skipped"] == []
    saved = json.loads((tmp_path / "check.json").read_text())
    assert saved["failures"] == [] and saved["device_type"] == "cpu" and saved["cudagraph_skips"] is None
    methods = bench.discrete_methods()
    assert {"ar", "eagle", "coolsd", "sjd", "lantern"} <= set(methods)
    for target in ("llamagen", "lumina"):
        eager = {r["method"]: r for r in saved["targets"][target]["runs"] if r["mode"] == "eager"}
        assert set(eager) == {m for m in methods if bench.runs_on(target, m)}, target
        for name, r in eager.items():
            assert r["status"] == "ok", (target, name, r.get("error"))
            assert r["extra_rounds"] >= bench.MIN_EXTRA_ROUNDS
            within = r["host_reads"] <= bench.EAGER_READS * r["extra_rounds"] + bench.OCCASIONAL_READS
            assert within != bool(r.get("known_over_budget")), (target, name, r["host_reads"], r["extra_rounds"])
            assert r["lifted"] == 0 or r.get("known_over_budget"), (target, name)
            assert r["tokens_per_round"] >= 1.0 and r["round_in_ar_steps"] > 0
        assert eager["ar"]["tokens_per_round"] == 1.0
    compiled = {r["method"]: r for r in saved["targets"]["llamagen"]["runs"] if r["mode"] == "compiled"}
    assert set(compiled) == {"ar"}
    ar = compiled["ar"]
    assert ar["status"] == "ok" and ar["token_agreement"] == 1.0 and ar["first_divergence"] is None
    assert ar["graphs_compiled_after_warmup"] == 0 and ar["graphs_compiled_in_count_run"] == 0
    assert ar["host_reads"] <= ar["extra_rounds"] + bench.COMPILED_SETUP_READS
    lumina = [r for r in saved["targets"]["lumina"]["runs"] if r["mode"] == "compiled"]
    assert [(r["method"], r["status"], r["token_agreement"]) for r in lumina] == [("ar", "ok", 1.0)]
    assert lumina[0]["graphs_compiled_in_count_run"] == 0
    mar = {r["method"]: r for r in saved["targets"]["mar"]["runs"]}
    assert set(mar) == {"ar", "cspd"} and all(r["status"] == "ok" and r["finite"] for r in mar.values())
    md = (tmp_path / "check.md").read_text()
    for line in ("## llamagen", "## lumina", "## mar", "| eagle | eager | ok |", "| ar | compiled | ok |",
                 "| cspd | eager | ok |", "all checks passed", "cudagraph_skips: not applicable"):
        assert line in md, line


def test_a_failing_method_is_recorded_beside_the_others_and_fails_the_cli(tmp_path, monkeypatch, capsys):
    bench = _bench()
    real = bench.build_method

    def build_method(name, **kw):
        if name == "sjd":
            raise RuntimeError("injected\nfailure")
        return real(name, **kw)

    monkeypatch.setattr(bench, "build_method", build_method)
    rc = bench.cli(TINY + ["--targets", "llamagen", "--modes", "eager", "--methods", "ar,sjd,coolsd",
                           "--out", str(tmp_path / "c")])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llamagen/sjd/eager: RuntimeError: injected failure" in err[0]
    runs = {r["method"]: r for r in json.loads((tmp_path / "c.json").read_text())["targets"]["llamagen"]["runs"]}
    assert runs["sjd"]["status"] == "failed" and "injected" in runs["sjd"]["traceback"]
    assert runs["ar"]["status"] == runs["coolsd"]["status"] == "ok"
    assert "| sjd | eager | failed: RuntimeError: injected failure |" in (tmp_path / "c.md").read_text()


def test_the_time_budget_skips_and_records_runs(tmp_path):
    out = _bench().main(TINY + ["--budget-s", "0", "--targets", "llamagen,mar", "--methods", "ar",
                                "--out", str(tmp_path / "b")])
    assert out["failures"] == []
    assert out["skipped"] == ["llamagen/ar/eager", "llamagen/ar/compiled", "mar/ar/eager", "mar/cspd/eager"]
    assert "skipped: llamagen/ar/eager, llamagen/ar/compiled" in (tmp_path / "b.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ar,nope"], "--methods: unknown nope; valid: ar,"),
    (["--targets", "sdxl"], "--targets: unknown sdxl; valid: llamagen, lumina, mar"),
    (["--modes", ""], "--modes: unknown (empty)"),
    (["--tree", "oak"], "--tree oak:"),
])
def test_bad_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(["--tiny", "--device", "cpu"] + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_rows_over_the_budget_fail_their_checks():
    """The budget arithmetic on made-up rows: an eager run over 2 reads a round (+ the occasional
    allowance) or lifting a tensor, a compiled one over 1 a round + set-up, a CUDA graph skipped."""
    bench = _bench()

    class Args:
        budget_s = 1.0

    ck = bench.Check(Args(), torch.device("cpu"), torch.float64)
    eager = {"method": "eagle", "mode": "eager", "extra_rounds": 10, "host_reads": 20 + bench.OCCASIONAL_READS,
             "lifted": 0, "syncs": None}
    bench.check_row(ck, "t", eager)
    assert ck.failures == []
    bench.check_row(ck, "t", {**eager, "host_reads": 21 + bench.OCCASIONAL_READS, "lifted": 1})
    assert len(ck.failures) == 2 and "lifted" in ck.failures[1]
    assert f"{21 + bench.OCCASIONAL_READS} host reads" in ck.failures[0]
    compiled = {"method": "ar", "mode": "compiled", "extra_rounds": 10, "lifted": 0, "syncs": None,
                "host_reads": 10 + bench.COMPILED_SETUP_READS, "graphs_compiled_after_warmup": 0,
                "graphs_compiled_in_count_run": 0, "cudagraph_skips": 1}
    bench.check_row(ck, "t", compiled)
    assert ck.failures[2:] == ["t/ar/compiled: cudagraph_skips = 1"]
    bench.check_row(ck, "t", {**compiled, "cudagraph_skips": 0, "host_reads": 11 + bench.COMPILED_SETUP_READS})
    assert len(ck.failures) == 4 and "host reads in 10 rounds" in ck.failures[3]
