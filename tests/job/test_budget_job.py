"""``method=budget method.tv_per_image=...`` through the job on the toy world: every record carries the
price it was generated at (``budget_price``, one a batch), the price moves batch by batch exactly as
the controller's rule says (docs/methods.md#21-relaxation-by-budget), an interrupted run resumes
at the same prices (the controller replays the finished images), and bad combinations are refused."""
import json
import math

import numpy as np
import pytest

from coolsd.cli.runner import run
from factories import compose

RATE, BUDGET, PRICE0 = 0.5, 0.8, 0.3


def _cfg(out, *extra):
    return compose("target=toy", "method=budget", f"method.price={PRICE0}", f"method.tv_per_image={BUDGET}",
                   f"method.rate={RATE}", "tree=chain", "tree.draft_length=4", "dataset.n_prompts=5", "baseline=false", "batch_size=2",
                   f"+out_dir={out}", *extra)


def _records(folder):
    return sorted((json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()),
                  key=lambda r: r["prompt_index"])


def test_the_price_follows_the_controller_and_resumes(tmp_path):
    run(_cfg(tmp_path / "a"))
    recs = _records(tmp_path / "a")
    assert len(recs) == 5 and recs[0]["budget_price"] == recs[1]["budget_price"] == PRICE0
    batches = [recs[0:2], recs[2:4], recs[4:5]]  # batch_size 2: one price a batch
    for batch, nxt in zip(batches, batches[1:]):  # log price += rate * mean (tv - budget) / budget
        assert len({r["budget_price"] for r in batch}) == 1
        excess = np.mean([(r["step_tv"] - BUDGET) / BUDGET for r in batch])
        want = batch[0]["budget_price"] * math.exp(RATE * excess)
        assert abs(nxt[0]["budget_price"] - want) < 1e-12 * want
    assert len({r["budget_price"] for r in recs}) == 3 and all(r["params"]["price"] == PRICE0 for r in recs)
    # an interrupted run: two records written, then resumed in the same folder
    b = tmp_path / "b"
    run(_cfg(b))
    lines = (b / "samples.jsonl").read_text().splitlines()
    (b / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n")  # the first batch
    run(_cfg(b))
    timing = ("latency_s", "decode_s", "signal_s", "hardware", "image")
    again = _records(b)
    assert [{k: v for k, v in r.items() if k not in timing} for r in again] == \
           [{k: v for k, v in r.items() if k not in timing} for r in recs]


def test_bad_combinations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="set compile=false"):
        run(_cfg(tmp_path / "c", "compile=true"))
    with pytest.raises(ValueError, match="use tree=chain"):
        run(_cfg(tmp_path / "t", "tree=mc_sim_7b_63", "tree.draft_length=null"))
    with pytest.raises(ValueError, match="give price a number"):
        run(_cfg(tmp_path / "p", "method.price=null"))
