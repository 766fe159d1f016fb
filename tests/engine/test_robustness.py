"""Faults a long run meets: non-finite target logits (the sample fails with a record naming
prompt and position; the run goes on and the summary counts it), a full disk (a clear error, no
half-written record), and merging a run with failed samples."""
import errno
import json

import numpy as np
import pytest

import coolsd.job.generation as job
import coolsd.util.records as records
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.drafting import SamplingConfig
from coolsd.engine.loop import NonFiniteLogits, speculative_generate
from coolsd.cli.merge import merge
from coolsd.models.llamagen import LlamaGenTarget
from coolsd.cli.runner import run
from factories import compose as _compose, engine_cond as cond, engine_model

TARGET_MODEL = engine_model(0)


class NaNAt(LlamaGenTarget):
    """Returns NaN logits for one sample at its k-th forward after the prefill."""

    def __init__(self, sample: int, k: int):
        super().__init__(TARGET_MODEL, cfg_scale=3.0)
        self.sample, self.k, self.calls = sample, k, 0

    def forward(self, *a, **kw):
        out = super().forward(*a, **kw)
        self.calls += 1
        if self.calls == self.k:
            out.logits[self.sample] = float("nan")
        return out


def test_engine_names_sample_and_position_of_non_finite_logits():
    with pytest.raises(NonFiniteLogits) as e:  # AR: forward k (after the prefill) predicts image token k
        speculative_generate(NaNAt(1, 5), 16, PerSampleRNG([0, 1]), sampling=SamplingConfig(), cond=cond([4, 6]),
                             batch_size=2)
    assert (e.value.sample, e.value.position) == (1, 5) and "position 5" in str(e.value)


def test_failed_sample_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    real = job.generate_records

    def flaky(world, method, prompts, idxs, seeds, tag):
        if 2 in idxs and tag == "eagle":
            raise NonFiniteLogits(idxs.index(2), 17)
        return real(world, method, prompts, idxs, seeds, tag)

    monkeypatch.setattr(job, "generate_records", flaky)
    out = tmp_path / "run"
    s = run(_compose("method=eagle", "dataset.n_prompts=4", "batch_size=2", f"+out_dir={out}"))
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    bad = [r for r in recs if "error" in r]
    assert len(recs) == 8 and len(bad) == 1 and bad[0]["prompt_index"] == 2 and "image token 17" in bad[0]["error"]
    assert "image" not in bad[0] and s["failures"] == {"eagle": [2]}
    assert s["results"]["eagle"]["accepted_length"]["n"] == 3  # compared on the 3 prompts both methods completed
    again = run(_compose("method=eagle", "dataset.n_prompts=4", "batch_size=2", f"+out_dir={out}"))  # resumes: nothing to redo
    assert again["failures"] == {"eagle": [2]}
    m = merge(out)
    assert m["failures"] == {"eagle": [2]} and m["prompts_missing"] == []


def test_full_disk_is_a_clear_error_and_writes_no_record(tmp_path, monkeypatch):
    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records, "save_png_atomic", full)
    w = records.RecordWriter(tmp_path)
    with pytest.raises(OSError, match="out of disk space writing to .*run the same command again: it resumes"):
        w.append({"prompt_index": 0}, np.zeros((4, 4, 3), np.uint8), "x/00000.png")
    assert not w.path.exists() or w.path.read_text() == ""
