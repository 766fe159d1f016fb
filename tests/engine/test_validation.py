"""Bad input gets a clear error before any work starts."""
import math

import pytest

from coolsd.engine.decoding.trees import build_tree, make_tree
from coolsd.engine.methods import build_method
from coolsd.theory import TabularAR, exact_stats, sample_stats

NB = TabularAR.random(3, 3, 0).codebook


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown method 'eagel'.*coolsd.*eagle.*lantern_pp"):
        build_method("eagel")
    with pytest.raises(ValueError, match=r"unknown schedule 'cosine'.*uniform, exp, exp_geomean, linear"):
        build_method("coolsd", draft_length=3, schedule="cosine")
    with pytest.raises(ValueError, match=r"unknown tree 'big'.*chain, mc_sim_7b_63, naive_extend_57"):
        make_tree("big")
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['lambda'\].*\['k', 'lam', 'resample'\]"):
        build_method("lantern_pp", draft_length=3, neighbours=NB, **{"lambda": 2})
    with pytest.raises(ValueError, match=r"unknown resample 'x'; valid: lantern, gstar"):
        build_method("lantern_pp", draft_length=3, neighbours=NB, resample="x")


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, "abc"])
@pytest.mark.parametrize("method", ["coolsd", "uniform_rsd"])
def test_delta_must_be_positive_finite(method, bad):
    with pytest.raises(ValueError, match="delta must be a"):
        build_method(method, draft_length=3, delta=bad)


def test_parameter_ranges():
    with pytest.raises(ValueError, match=r"nu must be a finite number >= 0, got -0.1"):
        build_method("coolsd", draft_length=3, nu=-0.1)
    with pytest.raises(ValueError, match=r"k must be an integer >= 1, got 0"):
        build_method("lantern_pp", draft_length=3, neighbours=NB, k=0)
    with pytest.raises(ValueError, match=r"lam must be a finite number >= 1, got 0.5"):
        build_method("lantern_pp", draft_length=3, neighbours=NB, lam=0.5)
    with pytest.raises(ValueError, match=r"delta must be a finite number > 0 and <= 1.0, got 2"):
        build_method("lantern", draft_length=3, neighbours=NB, delta=2)
    with pytest.raises(ValueError, match=r"draft length must be an integer >= 1, got 0"):
        build_method("eagle", draft_length=0)
    with pytest.raises(ValueError, match=r"linear schedule slope must be in"):
        build_method("coolsd", draft_length=5, schedule="linear", slope=0.9)
    with pytest.raises(ValueError, match=r"sjd window must be an integer >= 2"):
        build_method("sjd", window=1)
    with pytest.raises(ValueError, match="needs latent neighbourhoods"):
        build_method("lantern_pp", draft_length=3)


def test_malformed_trees():
    with pytest.raises(ValueError, match=r"path \[1, 0\] has no parent \[1\]"):
        build_tree([[0], [1, 0]])
    with pytest.raises(ValueError, match=r"path \[2\] skips rank 1"):
        build_tree([[0], [2]])


def test_probability_rows_are_checked():
    good = {(): [0.5, 0.5], (0,): [1.0, 0.0], (1,): [0.2, 0.8]}
    TabularAR(good)
    with pytest.raises(ValueError, match=r"prefix \(1,\) has a NaN/inf probability at token 0"):
        TabularAR({**good, (1,): [math.nan, 1.0]})
    with pytest.raises(ValueError, match=r"prefix \(0,\) has a negative probability -0.1 at token 1"):
        TabularAR({**good, (0,): [1.1, -0.1]})
    with pytest.raises(ValueError, match=r"no row for prefix \(1,\)"):
        TabularAR({(): [0.5, 0.5], (0,): [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"sums to 0.9"):
        TabularAR({**good, (): [0.5, 0.4]})


def test_lab_validates_before_work(monkeypatch):
    P = TabularAR.random(3, 3, 0)
    called = []
    monkeypatch.setattr("coolsd.theory.lab.speculative_generate", lambda *a, **k: called.append(1))
    with pytest.raises(ValueError, match="delta"):
        sample_stats(P, P, "coolsd", 2, 100, 0, delta=-1)
    with pytest.raises(ValueError, match="draft length"):
        exact_stats(P, P, "eagle", 0)
    assert not called


def test_sampling_resolves_target_defaults_then_overrides():
    from coolsd.engine.drafting import SamplingConfig

    target = {"temperature": 1.0, "top_k": 64, "top_p": 1.0}
    assert SamplingConfig.resolve(target, {"temperature": None, "top_k": None, "top_p": None}).top_k == 64
    assert SamplingConfig.resolve(target, {"top_k": 0}) == SamplingConfig(1.0, 0, 1.0)
    assert SamplingConfig.resolve(None, None) == SamplingConfig()
    with pytest.raises(ValueError, match=r"unknown sampling option 'topk'"):
        SamplingConfig.resolve(target, {"topk": 5})
    with pytest.raises(ValueError, match=r"invalid sampling.*top_k >= 0"):
        SamplingConfig.resolve(target, {"top_k": -1})
    with pytest.raises(ValueError, match=r"invalid sampling.*top_p <= 1"):
        SamplingConfig.resolve(target, {"top_p": 0.0})
