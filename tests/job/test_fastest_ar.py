"""Speed-ups against AR in the same mode and against the fastest AR (coolsd.job.summary,
coolsd.job.generation): every summary reports ``speedup`` (against ``ar``, AR in the run's own mode)
and ``speedup_vs_fastest_ar`` (against the one of ``ar`` and ``ar_compiled`` with the lower mean
latency, named by ``fastest_ar``), paired by prompt; the two ARs are kept apart by tag.

The summary is checked on made-up records (compiled AR faster, slower, absent, alone). The job's
wiring (the compiled twin interleaved with the run, shards and their merge) runs on the toy world
with the twin loaded eagerly and its latencies halved (``eager_twin``): compiling the toy AR with
Inductor's C++ backend takes ~35 s on 2 cores. One tiny run compiles for real
(``test_a_cpu_run_forced_on_times_compiled_ar_after_its_warm_up``)."""
import copy
import json
from types import SimpleNamespace

import pytest
import torch

import coolsd.job.generation as job
from coolsd.cli.merge import merge
from coolsd.cli.runner import run
from coolsd.job.summary import FASTEST_AR, FASTEST_AR_REFERENCE, results_table, summarize, summary_lines
from coolsd.util.stats import ratio_ci
from coolsd.worlds.presentation import SPEED_COLUMNS, Presentation
from factories import compose

# a world that summarises latency only (no images, no quality): the summary's arithmetic alone
WORLD = SimpleNamespace(record_metrics=("latency_s",), paired_metrics=(), makes_images=False,
                        quality=lambda outputs, prompts, files: {}, presentation=Presentation(SPEED_COLUMNS))
AR_LAT = [1.0, 1.2, 0.9, 1.1, 1.3, 1.0]
METHOD_LAT = [0.5, 0.55, 0.5, 0.45, 0.6, 0.5]


def _rows(tag: str, latencies, order=None) -> list[dict]:
    idx = order or range(len(latencies))
    return [{"prompt_index": i, "method": tag, "params": {"method": tag}, "latency_s": latencies[i]} for i in idx]


def _table(**lat) -> dict:
    return results_table(WORLD, {tag: (_rows(tag, x), None) for tag, x in lat.items()}, [], {})


@pytest.mark.parametrize("scale, fastest", [(0.4, "ar_compiled"), (1.5, "ar")])
def test_speedup_vs_fastest_ar_is_against_the_faster_of_the_two_ars(scale, fastest):
    compiled = [scale * x for x in AR_LAT]
    t = _table(ar=AR_LAT, ar_compiled=compiled, coolsd=METHOD_LAT)
    e = t["coolsd"]
    assert e["speedup"] == ratio_ci(AR_LAT, METHOD_LAT, paired=True)  # against ar, as before
    ref = compiled if fastest == "ar_compiled" else AR_LAT
    assert e["fastest_ar"] == fastest and e["speedup_vs_fastest_ar"] == ratio_ci(ref, METHOD_LAT, paired=True)
    assert e["speedup_vs_fastest_ar"]["mean"] == pytest.approx(sum(ref) / sum(METHOD_LAT))
    # the compiled AR's own entry: its speed-up over eager AR, 1 / scale
    assert t["ar_compiled"]["speedup"]["mean"] == pytest.approx(1 / scale)
    assert all(x["fastest_ar"] == fastest for x in t.values())
    if fastest == "ar_compiled":
        assert e["speedup_vs_fastest_ar"]["mean"] < e["speedup"]["mean"]
    else:
        assert e["speedup_vs_fastest_ar"] == e["speedup"]


def test_with_one_ar_the_fastest_is_that_one():
    t = _table(ar=AR_LAT, coolsd=METHOD_LAT)  # the CPU default: no compiled AR beside the run
    assert t["coolsd"]["fastest_ar"] == "ar" and t["coolsd"]["speedup_vs_fastest_ar"] == t["coolsd"]["speedup"]
    t = _table(ar_compiled=AR_LAT, coolsd=METHOD_LAT)  # baseline=false fastest_ar=true: compiled AR alone
    assert "speedup" not in t["coolsd"] and t["coolsd"]["fastest_ar"] == "ar_compiled"
    assert t["coolsd"]["speedup_vs_fastest_ar"] == ratio_ci(AR_LAT, METHOD_LAT, paired=True)
    t = _table(coolsd=METHOD_LAT)  # no AR at all: no speed-up of either kind
    assert not {"speedup", "speedup_vs_fastest_ar", "fastest_ar"} & set(t["coolsd"])


def test_the_fastest_ar_is_paired_by_prompt_not_by_position():
    compiled = [0.5 * x for x in AR_LAT]
    outputs = {"ar": (_rows("ar", AR_LAT), None), "coolsd": (_rows("coolsd", METHOD_LAT), None),
               FASTEST_AR: (_rows(FASTEST_AR, compiled, order=[5, 3, 1, 0, 2, 4]), None)}
    e = results_table(WORLD, outputs, [], {})["coolsd"]
    assert e["speedup_vs_fastest_ar"] == ratio_ci(compiled, METHOD_LAT, paired=True)


def test_the_summary_names_the_fastest_ar_and_prints_both_columns():
    outputs = {tag: (_rows(tag, x), None) for tag, x in
               (("ar", AR_LAT), (FASTEST_AR, [0.5 * x for x in AR_LAT]), ("coolsd", METHOD_LAT))}
    ident = {"target": "t", "methods": {t: {"method": t} for t in outputs}, "settings": {}, "device": "cpu",
             "threads": 1, "world": {}, "method": "coolsd"}
    s = summarize(WORLD, ident, outputs, [], {})
    assert s["fastest_ar"] == FASTEST_AR and s["fastest_ar_reference"] == FASTEST_AR_REFERENCE
    head = summary_lines(WORLD, s["results"])[0]
    assert "speed-up (same-mode AR)" in head and "speed-up (fastest AR)" in head


class _World:
    compiles = True

    def __init__(self, device="cuda", compiled=False):
        self.device, self.compiled = torch.device(device), compiled


@pytest.mark.parametrize("value, world, methods, on", [
    ("auto", _World("cuda"), {"ar": 0, "coolsd": 0}, True),
    ("auto", _World("cpu"), {"ar": 0, "coolsd": 0}, False),  # the CPU: off unless forced
    ("auto", _World("cuda", compiled=True), {"ar": 0, "coolsd": 0}, False),  # compile=true: ar is compiled AR
    ("auto", _World("cuda"), {"coolsd": 0}, False),  # baseline=false: the run times no AR
    (False, _World("cuda"), {"ar": 0, "coolsd": 0}, False),
    (True, _World("cpu"), {"coolsd": 0}, True),
])
def test_fastest_ar_auto_is_on_for_eager_cuda_runs_that_time_ar(value, world, methods, on):
    cfg = compose(f"fastest_ar={str(value).lower()}")
    assert job.wants_fastest_ar(cfg, world, methods) is on


def test_auto_is_on_cuda_only_so_a_cpu_run_times_no_compiled_ar():
    cfg = compose("method=coolsd", "dataset.n_prompts=1")
    assert cfg.fastest_ar == "auto"
    world = job.load_world(cfg)
    assert not job.wants_fastest_ar(cfg, world, job.job_methods(world, cfg))


@pytest.fixture
def eager_twin(monkeypatch):
    """The run's compiled twin loaded eagerly (marked compiled) and ``ar_compiled``'s latencies
    halved, so that it is the fastest AR whatever the machine does."""
    real_load, real_records = job.load_world, job.generate_records

    def load(cfg):
        if not cfg.get("compile"):
            return real_load(cfg)
        eager = copy.deepcopy(cfg)
        eager.compile = False
        world = real_load(eager)
        world.compiled = True
        return world

    def records(world, method, prompts, idxs, seeds, tag):
        out = real_records(world, method, prompts, idxs, seeds, tag)
        return [({**r, "latency_s": r["latency_s"] / 2} if tag == FASTEST_AR else r, img) for r, img in out]

    monkeypatch.setattr(job, "load_world", load)
    monkeypatch.setattr(job, "generate_records", records)


def _records(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _check(summary, records):
    """The summary's two speed-ups, recomputed from the records: ar and ar_compiled apart."""
    by = {t: sorted((r for r in records if r["method"] == t), key=lambda r: r["prompt_index"])
          for t in ("ar", FASTEST_AR, "coolsd")}
    lat = {t: [r["latency_s"] for r in rs] for t, rs in by.items()}
    e = summary["results"]["coolsd"]
    assert summary["fastest_ar"] == e["fastest_ar"] == FASTEST_AR
    assert e["speedup"] == ratio_ci(lat["ar"], lat["coolsd"], paired=True)
    assert e["speedup_vs_fastest_ar"] == ratio_ci(lat[FASTEST_AR], lat["coolsd"], paired=True)
    assert all(r["params"]["compiled"] is True for r in by[FASTEST_AR]) and all("compiled" not in r["params"]
                                                                                  for r in by["ar"])


def test_a_forced_run_times_compiled_ar_beside_itself_in_each_shard_and_the_merge_keeps_it_apart(tmp_path,
                                                                                                 eager_twin):
    out = tmp_path / "run"
    for k in (0, 1):  # one prompt each
        run(compose("method=coolsd", "dataset.n_prompts=2", "fastest_ar=true", f"+out_dir={out}",
                    f"shard.index={k}", "shard.count=2"))
    methods = json.loads((out / "run.json").read_text())["methods"]
    assert list(methods) == ["ar", FASTEST_AR, "coolsd"]
    assert methods[FASTEST_AR]["compiled"] is True and "compiled" not in methods["ar"]
    s = merge(out, track=False)
    assert s["method"]["method"] == "coolsd" and s["n_prompts"] == 2
    _check(s, _records(out / "samples.jsonl"))


def test_a_cpu_run_forced_on_times_compiled_ar_after_its_warm_up(tmp_path, capsys):
    """The one real compile: method=ar (the run's eager ar and ar_compiled), 2 prompts."""
    s = run(compose("method=ar", "dataset.n_prompts=2", "fastest_ar=true", f"+out_dir={tmp_path / 'run'}"))
    printed = capsys.readouterr().out
    assert f"speed-up (fastest AR): against {s['fastest_ar']}" in printed and "speed-up (same-mode AR)" in printed
    recs = _records(tmp_path / "run" / "samples.jsonl")
    compiled = [r for r in recs if r["method"] == FASTEST_AR]
    assert len(compiled) == 2 and all(r["params"]["compiled"] is True and "compilations" in r for r in compiled)
    assert s["compile"]["graphs_compiled_after_warmup"] == 0 and "compiled" not in s  # the run itself is eager
    mean = {t: s["results"][t]["latency_s"]["mean"] for t in ("ar", FASTEST_AR)}
    assert s["fastest_ar"] == min(mean, key=mean.get)
    e = s["results"]["ar"]  # eager AR against the fastest: 1 where it is itself the fastest, else below 1
    assert e["speedup_vs_fastest_ar"]["mean"] == pytest.approx(mean[s["fastest_ar"]] / mean["ar"])
    assert e["speedup_vs_fastest_ar"]["mean"] <= 1.0 + 1e-12
