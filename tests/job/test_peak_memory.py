"""Peak device memory per run: on CUDA the query (``coolsd.engine.timing.peak_memory_gib``) is
``torch.cuda.max_memory_allocated(device) / 2**30`` after ``torch.cuda.reset_peak_memory_stats``
(``reset_peak_memory``) at the start of each batch's generation; every CUDA record carries its
batch's peak, the summary the run's (the maximum) and each method's; on the CPU no record has the
field, the summary's ``peak_memory_gib`` is null and no line is printed (no made-up number). The
CUDA calls are monkeypatched: no GPU needed."""
import json
from types import SimpleNamespace

import pytest
import torch

import coolsd.job.generation as job
from coolsd.job.generation import TIMING_KEYS, generate_records
from coolsd.cli.runner import run
from coolsd.engine.timing import peak_memory_gib, reset_peak_memory
from factories import compose

GiB = 2**30


class FakeCuda:
    """torch.cuda's counters as the caching allocator keeps them: ``allocated`` bytes held now,
    ``peak`` the most since the last reset (which sets it to what is held)."""

    def __init__(self, monkeypatch, allocated=0.5 * GiB):
        self.allocated, self.peak, self.calls = allocated, allocated, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.max_allocated)

    def reset(self, device=None):
        self.calls.append(("reset", torch.device(device)))
        self.peak = self.allocated

    def max_allocated(self, device=None):
        self.calls.append(("max", torch.device(device)))
        return self.peak

    def hold(self, nbytes):
        """A generation that briefly holds ``nbytes`` more."""
        self.peak = max(self.peak, self.allocated + nbytes)


def test_the_query_reads_max_memory_allocated_on_cuda_and_nothing_on_the_cpu(monkeypatch):
    cuda = FakeCuda(monkeypatch, allocated=1 * GiB)
    reset_peak_memory("cuda:0")
    cuda.hold(2 * GiB)
    assert peak_memory_gib("cuda:0") == 3.0
    assert cuda.calls == [("reset", torch.device("cuda:0")), ("max", torch.device("cuda:0"))]
    cuda.calls.clear()
    reset_peak_memory("cpu")
    assert peak_memory_gib("cpu") is None and peak_memory_gib(torch.device("cpu")) is None
    assert cuda.calls == []  # the CPU never asks CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_memory_gib("cuda") is None


class StubWorld:
    """A world on ``device`` whose batch of n prompts holds n GiB while it generates."""

    compiled = False

    def __init__(self, device, cuda=None):
        self.device, self.cuda = device, cuda

    def generate(self, method, prompts, seeds):
        if self.cuda is not None:
            self.cuda.hold(len(prompts) * GiB)
        return [SimpleNamespace(fields={"latency_s": 0.1}, image=None) for _ in prompts]


METHOD = SimpleNamespace(describe=lambda: {"method": "ar"})


def _prompts(n):
    return [SimpleNamespace(caption=f"p{i}") for i in range(n)]


def test_every_cuda_record_carries_its_batchs_peak_from_a_reset_at_the_batchs_start(monkeypatch):
    cuda = FakeCuda(monkeypatch, allocated=0.5 * GiB)
    world = StubWorld("cuda", cuda)
    cuda.hold(10 * GiB)  # an earlier batch (or the warm-up) peaked higher: not this batch's number
    out = generate_records(world, METHOD, _prompts(2), [0, 1], [5, 6], "ar")
    assert [r["peak_memory_gib"] for r, _ in out] == [2.5, 2.5]  # 0.5 held + 2 GiB for the batch
    assert cuda.calls[0][0] == "reset" and cuda.calls[-1][0] == "max"
    assert "peak_memory_gib" in TIMING_KEYS  # machine-dependent: ignored where merge compares shards' records


def test_cpu_records_have_no_peak_memory_field():
    out = generate_records(StubWorld("cpu"), METHOD, _prompts(2), [0, 1], [5, 6], "ar")
    assert all("peak_memory_gib" not in r for r, _ in out)


def test_the_summary_carries_the_runs_and_each_methods_peak_on_cuda(monkeypatch, tmp_path, capsys):
    """The real job (toy world on the CPU) with the device query answering as CUDA would: the
    records, summary.json and the printed table carry it; the run's value is the max."""
    peaks = iter([1.0, 3.0, 2.0, 1.5, 1.25, 2.5, 0.75, 4.0])
    monkeypatch.setattr(job, "reset_peak_memory", lambda device: None)
    monkeypatch.setattr(job, "peak_memory_gib", lambda device: next(peaks))
    out = tmp_path / "run"
    s = run(compose("method=coolsd", "dataset.n_prompts=2", f"+out_dir={out}"))
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(r["peak_memory_gib"], float) for r in rows)
    by = {t: max(r["peak_memory_gib"] for r in rows if r["method"] == t) for t in ("ar", "coolsd")}
    assert s["peak_memory_gib"] == max(by.values())
    for t, v in by.items():
        assert s["results"][t]["peak_memory_gib"] == v
    assert json.loads((out / "summary.json").read_text())["peak_memory_gib"] == s["peak_memory_gib"]
    assert f"peak device memory over generation: {s['peak_memory_gib']:.2f} GiB" in capsys.readouterr().out


def test_a_cpu_run_reports_null_peak_memory(tmp_path, capsys):
    out = tmp_path / "run"
    s = run(compose("method=coolsd", "dataset.n_prompts=2", f"+out_dir={out}"))
    assert s["peak_memory_gib"] is None and json.loads((out / "summary.json").read_text())["peak_memory_gib"] is None
    assert all("peak_memory_gib" not in e for e in s["results"].values())
    assert all("peak_memory_gib" not in json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines())
    assert "peak device memory" not in capsys.readouterr().out


@pytest.mark.parametrize("rows,want", [([{"peak_memory_gib": 1.0}, {"peak_memory_gib": 2.5}, {}], 2.5),
                                       ([{}, {"peak_memory_gib": None}], None)])
def test_records_of_mixed_or_older_runs_summarise_cleanly(rows, want):
    from coolsd.job.summary import _peak_memory

    assert _peak_memory(rows) == want
