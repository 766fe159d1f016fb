"""Batch > 1 in the job: each prompt of a batch gets its own seed and accepted lengths
(per-sample KV commits), so under ``deterministic.batch_invariant=true`` a batch-4 run writes the
same tokens, images and rounds as the batch-1 run, on any machine; only timings differ (the
engine-level test of every method is tests/test_generate.py test_batch_of_four_equals_four_single_runs;
every world: tests/test_worlds.py)."""
import json

import numpy as np
import pytest
from PIL import Image

from coolsd.runner import run

TIMING = ("latency_s", "decode_s", "hardware", "batch_size", "draft_forwards")  # draft_forwards: counted per batch


@pytest.mark.parametrize("method", ["coolsd", "lantern_pp", "sjd"])
def test_batch_of_four_equals_four_single_prompts(method, tmp_path, compose):
    out = {}
    for b in (1, 4):
        folder = tmp_path / f"b{b}"
        s = run(compose(f"method={method}", "dataset.n_prompts=5", f"batch_size={b}", f"+out_dir={folder}",
                        "deterministic.batch_invariant=true"))
        assert s["batch_size"] == b and s["batch_invariant"] and "images_per_s" in s["results"][method]
        out[b] = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    key = lambda r: (r["prompt_index"], r["method"])  # noqa: E731
    one, four = sorted(out[1], key=key), sorted(out[4], key=key)
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in one] == \
           [{k: v for k, v in r.items() if k not in TIMING} for r in four]
    assert {r.get("batch_size", 1) for r in four} == {4, 1}  # 5 prompts: a batch of 4, then a batch of 1
    for r in one:
        a = np.asarray(Image.open(tmp_path / "b1" / r["image"]))
        assert np.array_equal(a, np.asarray(Image.open(tmp_path / "b4" / r["image"])))
