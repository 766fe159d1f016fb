"""Exactness of the whole decoding stack in the theory lab: the production loop, drafters and
verification (sample_stats) against an independent exact computation (exact_stats)."""
import math

import numpy as np
import pytest
import torch

from coolsd.engine.decoding.rules import Rule
from coolsd.engine.methods import register_method
from coolsd.theory import TabularAR, chi_square_pvalue, exact_stats, sample_stats

N_SAMPLES = 20_000
ALPHA = 1e-3  # fixed seeds: each test is deterministic; a real discrepancy gives p ~ 0


class _AlwaysAccept(Rule):
    name = "always_accept"

    def step(self, p_res, q, x, depth):
        return torch.ones(p_res.shape[0], dtype=p_res.dtype), p_res


@register_method("_always_accept", drafter="model")
def _always_accept(ctx):
    """Negative control: accepts every draft; must fail the losslessness test."""
    return _AlwaysAccept(), None


LAB_CASES = [
    ("ar", {}),
    ("eagle", {}),
    ("uniform_rsd", {"delta": 2.0}),
    ("coolsd", {"delta": 2.0}),
    ("coolsd", {"delta": 1.5, "schedule": "exp", "normalize": "geomean"}),
    ("coolsd", {"delta": 1.5, "schedule": "exp_geomean"}),
    ("coolsd", {"delta": 3.0, "schedule": "linear"}),
    ("coolsd", {"delta": 0.8, "schedule": "uniform"}),
    ("coolsd", {"delta": 2.5, "schedule": "toward_one"}),
    ("lantern", {"delta": 0.2, "k": 2}),
    ("lantern", {"delta": 0.2, "k": 2, "resample": "gstar"}),
    ("lantern_pp", {"lam": 2.0, "k": 2}),
    ("lantern_pp", {"lam": 3.0, "k": 1, "resample": "gstar"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("method,params", LAB_CASES, ids=[f"{m}-{p}" for m, p in LAB_CASES])
def test_sampled_matches_exact(lab_pair, method, params):
    P, Q = lab_pair
    e = exact_stats(P, Q, method, 3, **params)
    s = sample_stats(P, Q, method, 3, N_SAMPLES, seed=11, **params)
    assert chi_square_pvalue(s["counts"], e["distribution"]) > ALPHA
    # mean rounds: z-test against the exact expectation
    z = (s["mean_rounds"] - e["expected_rounds"]) / (s["rounds_std"] / math.sqrt(s["n"]) + 1e-12)
    assert abs(z) < 4, (s["mean_rounds"], e["expected_rounds"])


@pytest.mark.slow
def test_sjd_is_lossless_in_the_lab(lab_pair):
    P, _ = lab_pair
    s = sample_stats(P, P, "sjd", 3, N_SAMPLES, seed=12)
    assert chi_square_pvalue(s["counts"], P.sequence_distribution()) > ALPHA
    assert s["accepted_length"] > 1.05  # random drafts and carried samples do get accepted
    with pytest.raises(ValueError, match="use sample_stats"):
        exact_stats(P, P, "sjd", 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("L", [1, 2, 4])
def test_eagle_exact_tv_is_zero(seed, L):
    P = TabularAR.random(3, 4, seed=seed, concentration=0.5)
    Q = TabularAR.random(3, 4, seed=seed + 100, concentration=0.5)
    e = exact_stats(P, Q, "eagle", L)
    assert e["tv"] < 1e-12
    assert e["accepted_length"] > 1.0
    np.testing.assert_allclose(e["distribution"].sum(), 1.0)


def test_relaxation_trades_tv_for_length(lab_pair):
    P, Q = lab_pair
    prev = exact_stats(P, Q, "eagle", 3)
    for delta in (1.5, 2.0, 4.0):
        cur = exact_stats(P, Q, "uniform_rsd", 3, delta=delta)
        assert cur["accepted_length"] > prev["accepted_length"]
        assert cur["tv"] > prev["tv"]
        prev = cur
    # omega <= 1 everywhere is lossless (Prop. 1 regime), just slower
    slow = exact_stats(P, Q, "coolsd", 3, delta=0.7, schedule="uniform")
    assert slow["tv"] < 1e-12
    assert slow["accepted_length"] < exact_stats(P, Q, "eagle", 3)["accepted_length"]


def test_exp_schedule_at_delta_one_is_not_lossless(lab_pair):
    """docs/methods.md#2-relaxation-schedules's mean-normalised exp schedule has omega_1 > 1 at delta = 1, so
    only a flat schedule reproduces EAGLE at delta = 1 (see the coolsd method docstring)."""
    P, Q = lab_pair
    assert exact_stats(P, Q, "coolsd", 3, delta=1.0)["tv"] > 1e-3
    assert exact_stats(P, Q, "coolsd", 3, delta=1.0, nu=0.0)["tv"] < 1e-12


@pytest.mark.parametrize(
    "method,params",
    [("uniform_rsd", {"delta": 1.0}), ("coolsd", {"delta": 1.0, "schedule": "uniform"}),
     ("coolsd", {"delta": 1.0, "nu": 0.0}), ("lantern_pp", {"lam": 1.0, "k": 3, "resample": "gstar"})],
)
def test_delta_one_emits_eagle_tokens(method, params):
    P = TabularAR.random(4, 5, seed=3)
    Q = TabularAR.mix(P, TabularAR.random(4, 5, seed=4), 0.6)
    for tree in ("chain", [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]):
        ref = sample_stats(P, Q, "eagle", 3, 3000, seed=5, tree=tree)
        got = sample_stats(P, Q, method, 3, 3000, seed=5, tree=tree, **params)
        assert torch.equal(got["tokens"], ref["tokens"])


DEPTH3_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]


@pytest.fixture(scope="module")
def tree_pair():
    P = TabularAR.random(4, 4, seed=21)
    return P, TabularAR.mix(P, TabularAR.random(4, 4, seed=22), 0.7)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "sjd"])
def test_tree_verification_is_lossless(tree_pair, method):
    P, Q = tree_pair
    tree = DEPTH3_TREE if method == "eagle" else "chain"
    s = sample_stats(P, Q, method, 3, N_SAMPLES, seed=31, tree=tree)
    assert chi_square_pvalue(s["counts"], P.sequence_distribution()) > ALPHA
    if method == "eagle":  # the tree accepts more than the chain of the same depth
        chain = exact_stats(P, Q, "eagle", 3)["accepted_length"]
        assert s["accepted_length"] > chain


@pytest.mark.slow
def test_negative_control_fails_the_lossless_test(tree_pair):
    P, Q = tree_pair
    s = sample_stats(P, Q, "_always_accept", 3, N_SAMPLES, seed=31, tree=DEPTH3_TREE)
    assert chi_square_pvalue(s["counts"], P.sequence_distribution()) < 1e-6
