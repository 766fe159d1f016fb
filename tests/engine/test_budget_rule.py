"""Relaxation by price (``BudgetRule``, ``method=budget``; docs/methods.md#21-relaxation-by-budget).

* The identity behind it: for G* with omega >= 1, the TV of the emitted distribution to p equals the
  acceptance probability gained over exact verification, TV(pi(omega), p) = alpha(omega) - alpha(1),
  to rounding; it fails for omega < 1 (so the check can fail).
* Consequence, checked: with ``cost="tv"`` every node chooses omega = 1 when the price exceeds 1 and the
  largest acceptance (the smallest omega reaching it) when it is below 1; with ``cost="kl"`` the choice is interior for some nodes and never
  grows with the price.
* ``price=null`` is the exact rule (the same accepted mass, and the lab's chi-square: lossless).
The per-token distortion against the independent oracle is tests/theory/test_distortion_lab.py.
"""
import numpy as np
import pytest
import torch

from coolsd.engine.decoding.rules import BUDGET_OMEGAS, BudgetRule, ExactRule, ScaledRule
from coolsd.engine.methods import build_method, method_info
from coolsd.theory import TabularAR, chi_square_pvalue, sample_stats


def _pairs(n=64, V=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2.0 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    return p, q


def _tv(a, b):
    return 0.5 * (a - b).abs().sum(-1)


def test_tv_of_gstar_is_the_acceptance_gained_for_omega_at_least_one():
    p, q = _pairs()
    exact = torch.minimum(q, p).sum(-1)
    for w in (1.0, 1.3, 2.0, 7.5, 64.0):
        pi = ScaledRule(torch.tensor([w], dtype=torch.float64)).emitted(p, q, 1)
        gained = torch.minimum(q, w * p).sum(-1) - exact
        assert (_tv(pi, p) - gained).abs().max() < 1e-12, w
        if w > 1:
            assert gained.min() > 0
    pi = ScaledRule(torch.tensor([0.6], dtype=torch.float64)).emitted(p, q, 1)  # stricter: pi = p, acceptance lost
    assert (_tv(pi, p) - (torch.minimum(q, 0.6 * p).sum(-1) - exact)).abs().max() > 1e-3


def test_a_tv_price_chooses_all_or_nothing():
    p, q = _pairs()
    assert (BudgetRule(1.5, "tv").choice(p, q) == 0).all()  # omega = 1 everywhere
    k = BudgetRule(0.5, "tv").choice(p, q)  # the largest acceptance, at the smallest omega that reaches it
    alpha = torch.minimum(q.unsqueeze(1), BUDGET_OMEGAS.view(-1, 1) * p.unsqueeze(1)).sum(-1)  # (n, K)
    assert torch.equal(alpha.gather(1, k.unsqueeze(1))[:, 0], alpha[:, -1]) and (k > 0).all()
    assert (k == len(BUDGET_OMEGAS) - 1).sum() > len(k) // 2


def test_a_kl_price_chooses_inside_and_relaxes_less_as_it_rises():
    p, q = _pairs()
    prev = None
    for price in (0.1, 0.5, 2.0, 8.0, 1e6):
        k = BudgetRule(price, "kl").choice(p, q)
        if price == 2.0:
            assert ((k > 0) & (k < len(BUDGET_OMEGAS) - 1)).any()  # interior choices
        if prev is not None:
            assert (k <= prev).all()
        prev = k
    assert (prev == 0).all()  # a price high enough: exact everywhere


def test_null_price_is_the_exact_rule_and_lossless():
    p, q = _pairs()
    rule = BudgetRule(None)
    assert torch.equal(rule.accepted(p, q, 1), ExactRule().accepted(p, q, 1)) and rule.is_exact(1)
    assert method_info("budget").is_lossless({"price": None}) and not method_info("budget").is_lossless({})
    P = TabularAR.random(3, 3, seed=5)
    Q = TabularAR.mix(P, TabularAR.random(3, 3, seed=6), 0.6)
    st = sample_stats(P, Q, "budget", 2, 4000, 7, price=None)
    assert chi_square_pvalue(np.asarray(st["counts"]), P.sequence_distribution()) > 1e-3
    relaxed = sample_stats(P, Q, "budget", 2, 4000, 7, price=0.2)
    assert chi_square_pvalue(np.asarray(relaxed["counts"]), P.sequence_distribution()) < 1e-6  # the check can fail


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="price"):
        build_method("budget", price=-1.0)
    with pytest.raises(ValueError, match="cost"):
        build_method("budget", cost="js")


def test_the_controller_meets_the_budget_on_average_up_to_its_last_move():
    """log price += rate * mean over a batch of (tv - budget) / budget telescopes: over K images in
    batches of b the mean summed step TV is budget (1 + b log(price_K / price_0) / (rate K)) exactly,
    whatever the images were."""
    tvs = list(np.random.default_rng(0).gamma(2.0, 1.1, size=200))
    for b in (1, 8):
        rule = BudgetRule(1.0, tv_per_image=2.0, rate=0.3)
        assert rule.adaptive and rule.describe()["price"] == 1.0
        copy = rule.on("meta")  # a device copy shares the price
        for k in range(0, len(tvs), b):
            rule.observe(tvs[k:k + b])
        assert copy.price == rule.price != 1.0
        want = 2.0 * (1 + b * np.log(rule.price / 1.0) / (0.3 * len(tvs)))
        assert abs(np.mean(tvs) - want) < 1e-9, b
    with pytest.raises(ValueError, match="tree=chain"):
        rule.observe([None])
    zero = BudgetRule(1.0, tv_per_image=0.0)  # a budget of 0: the exact rule, nothing tuned
    assert zero.is_exact(1) and not zero.adaptive and method_info("budget").is_lossless({"tv_per_image": 0.0})
