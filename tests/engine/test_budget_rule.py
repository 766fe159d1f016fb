"""Relaxation by price (``BudgetRule``, ``method=budget``; docs/methods.md#21-relaxation-by-budget).

* The identity behind it: for G* with omega >= 1, the TV of the emitted distribution to p equals the
  acceptance probability gained over exact verification, TV(pi(omega), p) = alpha(omega) - alpha(1),
  to rounding; it fails for omega < 1 (so the check can fail).
* Consequence, checked: with ``cost="tv"`` every node chooses omega = 1 when the price exceeds 1 and the
  largest omega when it is below 1; with ``cost="kl"`` the choice is interior for some nodes and never
  grows with the price, and it is the first maximum of the objective computed the long way (pi formed
  per candidate, its KL summed), in float64 and float32, with or without residual mass.
* Verification makes each node's choice once and hands it on (``Rule.chooses``): the same verdicts
  as choosing inside every ``accepted`` call, on a chain and on a tree with siblings.
* ``price=null`` is the exact rule (the same accepted mass, and the lab's chi-square: lossless).
The per-token distortion against the independent oracle is tests/theory/test_distortion_lab.py.
"""
import numpy as np
import pytest
import torch

from coolsd.engine.decoding import rules
from coolsd.engine.decoding.rules import BUDGET_OMEGAS, BudgetRule, ExactRule, ScaledRule
from coolsd.engine.decoding.trees import build_tree, chain_paths
from coolsd.engine.decoding.verify import verify_tree
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
    assert (BudgetRule(1.5, "tv").choose(p, q) == 0).all()  # omega = 1 everywhere
    k = BudgetRule(0.5, "tv").choose(p, q)  # the largest acceptance: the largest omega
    assert (k == len(BUDGET_OMEGAS) - 1).all()
    assert (BudgetRule(1.0, "tv").choose(p, q) == 0).all()  # a tie: the smallest omega


def _objective_the_long_way(price, p, q):
    """alpha - price * KL(pi || p) (n, K) at every candidate, pi formed per candidate (float64)."""
    cols = []
    for w in BUDGET_OMEGAS.tolist():
        pi = ScaledRule(torch.tensor([w])).emitted(p, q, 1)
        kl = torch.where(pi > 0, pi * (pi / torch.where(p > 0, p, 1.0)).log(), 0.0).sum(-1)
        cols.append(torch.minimum(q, w * p).sum(-1) - price * kl)
    return torch.stack(cols, 1)


@pytest.mark.parametrize("path", ["eager chunks", "one expression", "device chunks"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_kl_choice_is_the_first_maximum_of_the_objective(dtype, path, monkeypatch):
    """Every spelling of the choice: in place in reused buffers, 7 rows at a time (the last chunk
    short); the plain expressions compiled code runs; and those an accelerator runs eagerly, 11
    rows at a time."""
    if path == "eager chunks":
        monkeypatch.setattr(rules, "CHOOSE_CHUNK_ELEMENTS", 7 * len(BUDGET_OMEGAS) * 30)
    elif path == "device chunks":
        monkeypatch.setattr(rules, "_on_host", lambda t: False)
        monkeypatch.setattr(rules, "DEVICE_CHOOSE_CHUNK_ELEMENTS", 11 * len(BUDGET_OMEGAS) * 30)
    else:
        monkeypatch.setattr(rules, "compiling", lambda: True)
    p, q = _pairs(n=400, V=30, seed=3)
    p[:50, :6] = 0  # tokens outside p's support
    p[:50] /= p[:50].sum(-1, keepdim=True)
    q[50:60] = p[50:60]  # no residual mass: Norm falls back to p
    q[60:70, ::2] = 0  # tokens outside q's support
    q[60:70] /= q[60:70].sum(-1, keepdim=True)
    for price in (0.05, 0.4, 2.0, 9.0):
        k = BudgetRule(price, "kl").choose(p.to(dtype), q.to(dtype))
        j = _objective_the_long_way(price, p, q)
        if dtype == torch.float64:
            assert torch.equal(k, j.argmax(1)), price
        else:  # float32 rounding may pick a candidate whose objective ties the best's to ~1e-6
            assert (j.max(1).values - j.gather(1, k.unsqueeze(1))[:, 0]).max() < 1e-5, price
        assert (k > 0).any() and (k < len(BUDGET_OMEGAS) - 1).any()
    # one rule, its buffers reused and grown, against fresh rules on the same shapes (choices are
    # compared shape for shape only: float32 near-ties may round another way in another shape)
    rule, few, alls = BudgetRule(0.4, "kl"), (p[:3].to(dtype), q[:3].to(dtype)), (p.to(dtype), q.to(dtype))
    first = rule.choose(*few)
    assert torch.equal(rule.choose(*alls), BudgetRule(0.4, "kl").choose(*alls))
    assert torch.equal(rule.choose(*few), first) and torch.equal(first, BudgetRule(0.4, "kl").choose(*few))


def test_a_kl_price_chooses_inside_and_relaxes_less_as_it_rises():
    p, q = _pairs()
    prev = None
    for price in (0.1, 0.5, 2.0, 8.0, 1e6):
        k = BudgetRule(price, "kl").choose(p, q)
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
    for bad in ([1.5, 2.0], [1.0, 3.0, 2.0]):  # not starting at 1, not ascending
        with pytest.raises(ValueError, match="omegas must start at 1"):
            BudgetRule(1.0, omegas=torch.tensor(bad))


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


class _ChoosesInside(BudgetRule):
    """The same rule with no hand-over: every ``accepted`` call chooses for itself."""

    chooses = False


@pytest.mark.parametrize("paths", [chain_paths(4), [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]])
def test_verification_hands_each_node_its_own_choice(paths):
    """``verify_tree`` chooses for every node with a child at a rank in one call, rank by rank
    (``Rule.chooses``; a chain's nodes: one call): the verdicts equal those of the rule choosing
    inside ``accepted`` at every sibling, draw for draw, and on a chain ``Verdict.choices`` holds node d's choice at column d - 1."""
    tree = build_tree(paths)
    B, n, V = 300, tree.n_nodes, 12
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(2.0 * torch.randn(B, n + 1, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2.0 * torch.randn(B, n + 1, V, generator=g, dtype=torch.float64), -1)
    tokens = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, n + 1)
    u_accept, u_emit = torch.rand(B, n + 1, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64)
    max_depth = torch.full((B,), tree.max_depth)
    verdicts = [verify_tree(p, q, tokens, tree, r, u_accept, u_emit, max_depth) for r in (BudgetRule(0.3), _ChoosesInside(0.3))]
    handed, inside = verdicts
    assert torch.equal(handed.path, inside.path) and torch.equal(handed.emitted, inside.emitted)
    assert torch.equal(handed.emit_probs, inside.emit_probs) and inside.choices is None
    assert handed.n_accepted.float().mean() > 0.5
    if tree.max_children == 1:
        want = torch.stack([BudgetRule(0.3).choose(p[:, d - 1], q[:, d]) for d in range(1, n + 1)], 1)
        assert torch.equal(handed.choices, want) and (want > 0).any() and (want != want[:, :1]).any()
    else:
        assert handed.choices is None
