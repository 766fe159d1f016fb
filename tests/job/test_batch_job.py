"""Batch > 1 in the job: each prompt of a batch gets its own seed and accepted lengths
(per-sample KV commits), so under ``deterministic.batch_invariant=true`` a batched run writes the
same tokens, images and rounds as the batch-1 run, on any machine; only timings differ (the
engine-level test of every method is tests/engine/test_generate.py test_batch_of_four_equals_four_single_runs;
every world, with its AR baseline: tests/worlds/test_worlds.py). 3 prompts at batch_size=2: a full batch
and a remainder batch, the two shapes a batch-4 run of 5 prompts has; ``baseline=false``: the AR
baseline is not what is tested here."""
import json

import numpy as np
import pytest
from PIL import Image

from coolsd.cli.runner import run

TIMING = ("latency_s", "signal_s", "decode_s", "hardware", "batch_size", "draft_forwards")  # draft_forwards: counted per batch


@pytest.mark.parametrize("method", ["coolsd", "lantern_pp", "sjd"])
def test_a_batch_and_its_remainder_equal_single_prompts(method, tmp_path, compose):
    out = {}
    for b in (1, 2):
        folder = tmp_path / f"b{b}"
        s = run(compose(f"method={method}", "dataset.n_prompts=3", f"batch_size={b}", f"+out_dir={folder}",
                        "baseline=false", "deterministic.batch_invariant=true"))
        assert s["batch_size"] == b and s["batch_invariant"] and "images_per_s" in s["results"][method]
        out[b] = [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]
    key = lambda r: (r["prompt_index"], r["method"])  # noqa: E731
    one, two = sorted(out[1], key=key), sorted(out[2], key=key)
    assert len(one) == 3 and {r["method"] for r in one} == {method}
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in one] == \
           [{k: v for k, v in r.items() if k not in TIMING} for r in two]
    assert {r.get("batch_size", 1) for r in two} == {2, 1}  # 3 prompts: a batch of 2, then a batch of 1
    for r in one:
        a = np.asarray(Image.open(tmp_path / "b1" / r["image"]))
        assert np.array_equal(a, np.asarray(Image.open(tmp_path / "b2" / r["image"])))
