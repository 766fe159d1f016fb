"""``method.num_iter``: the target alone (``ar``) run with a given number of AR steps, the baseline
with as many target forwards as a CSpD or DiSA run (docs/methods.md#53-the-equal-forwards-baseline):
MAR's and Harmon's MaskGIT-cosine ``num_iter``, a flow model's unit = tokens / num_iter."""
import json

import pytest

from coolsd.engine.continuous.flow import FlowConfig


def _records(path):
    return [json.loads(x) for x in (path / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("target,n", [("toy_continuous", 7), ("mar_h", 5), ("harmon_1_5b", 3), ("xar_h", 4)])
def test_the_target_alone_takes_num_iter_forwards(target, n, compose, world_overrides, tmp_path):
    from coolsd.cli.runner import run

    run(compose(*world_overrides(target), "method=ar", f"method.num_iter={n}", "dataset.n_prompts=2",
                f"+out_dir={tmp_path}"))
    recs = _records(tmp_path)
    assert {r["params"]["num_iter"] for r in recs} == {n}
    assert [r["target_forwards"] for r in recs] == [n, n]


def test_disa_pairs_with_num_iter_and_its_baseline_drops_it(compose, world_overrides, tmp_path):
    from coolsd.cli.runner import run

    run(compose(*world_overrides("mar_h"), "method=disa", "method.head_steps=6", "method.lower_steps=2",
                "method.num_iter=4", "dataset.n_prompts=1", f"+out_dir={tmp_path}"))
    by = {r["method"]: r for r in _records(tmp_path)}
    assert by["disa"]["target_forwards"] == 4 and by["disa"]["params"]["num_iter"] == 4
    assert by["ar"]["params"] == {"method": "ar"} and by["ar"]["target_forwards"] > 4  # the target's own steps


def test_a_flow_models_num_iter_must_give_a_unit_dividing_the_cell():
    assert FlowConfig(num_iter=8).unit_for(16, 4) == 8
    assert FlowConfig(num_iter=64).unit_for(16, 4) == 1
    with pytest.raises(ValueError, match=r"num_iter 3: 64 tokens in AR steps of a whole divisor of the 16-token cell "
                                         r"need num_iter in \{4, 8, 16, 32, 64\}"):
        FlowConfig(num_iter=3).unit_for(16, 4)
    with pytest.raises(ValueError, match="num_iter=8 and unit=2 both set a flow model's AR steps: give one"):
        FlowConfig(num_iter=8, unit=2)


def test_a_num_iter_a_flow_target_cannot_take_is_refused_before_work(compose, world_overrides, tmp_path):
    """Only the loaded model tells a flow target's cell: the world checks the method's settings when
    it builds the method, before a run folder is claimed or a sample made."""
    from coolsd.cli.runner import run
    from coolsd.util.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^method=ar: num_iter 3: 16 tokens in AR steps of a whole divisor of "
                                          r"the 4-token cell need num_iter in \{4, 8, 16\}$"):
        run(compose(*world_overrides("xar_h"), "method=ar", "method.num_iter=3", "dataset.n_prompts=1",
                    f"+out_dir={tmp_path}"))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=r"^method=ar: num_iter 65 > the target's 64 tokens: every AR step makes at "
                                          r"least one token \(num_iter <= 64\)$"):
        run(compose(*world_overrides("toy_continuous"), "method=ar", "method.num_iter=65", "dataset.n_prompts=1",
                    f"+out_dir={tmp_path}"))


@pytest.mark.parametrize("target", ["toy_continuous", "xar_h"])
def test_settings_added_since_leave_older_run_folders_identity_alone(target, compose, world_overrides):
    """run.json's head settings name DiSA's annealing and a flow model's num_iter only where set: a
    folder made before they existed resumes (its identity is compared key for key)."""
    from coolsd.worlds import load_world

    world = load_world(compose(*world_overrides(target), "method=ar", "dataset.n_prompts=1"))
    head = world.settings()["head"]
    assert not {"anneal", "lower_steps"} & set(head) and ("num_iter" in head) == (target != "xar_h")
