"""Per-step kernels against the closed forms of docs/methods.md#13-verification-at-one-tree-depth-d and COOL-SD Theorem 2."""
import itertools

import pytest
import torch

from coolsd.engine.decoding.lantern import aggregate, neighbours_from_codebook
from coolsd.engine.decoding.rules import ExactRule, LanternRule, ScaledRule, acceptance_prob, gstar_residual
from coolsd.engine.decoding.sampling import normalize, sample_inverse_cdf, sample_without_replacement, warp_probs
from coolsd.engine.decoding.schedules import omega_schedule


def rand_dist(g, *shape, zeros=0.0):
    x = torch.rand(*shape, generator=g, dtype=torch.float64) ** 3
    if zeros:
        x = x * (torch.rand(*shape, generator=g, dtype=torch.float64) > zeros)
        x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


def step_marginal(rule, p, q, depth=1):
    """Output distribution of one verification step of the production rule:
    sum_x q(x) f(x) [emit x] + sum_x q(x)(1 - f(x)) Norm(residual_x)."""
    B, V = p.shape
    out = torch.zeros_like(p)
    for x in range(V):
        xs = torch.full((B,), x)
        f, res = rule.step(p, q, xs, depth)
        out[:, x] += q[:, x] * f
        out += (q[:, x] * (1 - f)).unsqueeze(-1) * normalize(res, p)
    return out


@pytest.mark.parametrize("omega", [0.05, 0.3, 0.7, 1.0])
def test_omega_at_most_one_returns_exactly_p(omega):
    g = torch.Generator().manual_seed(0)
    p, q = rand_dist(g, 64, 9, zeros=0.3), rand_dist(g, 64, 9, zeros=0.3)
    m = step_marginal(ScaledRule(torch.tensor([omega], dtype=torch.float64)), p, q)
    torch.testing.assert_close(m, p, atol=1e-12, rtol=0)


@pytest.mark.parametrize("omega", [0.4, 1.0, 1.7, 5.0])
def test_qf_plus_beta_gstar_equals_stated_marginal(omega):
    """q*f + beta*G* = min(q, w p) + beta * Norm([p - min(q, w p)]_+), with the closed forms
    G* = Norm([p - q]_+) for w >= 1 (Prop. 1) and Norm(max(p - q, (1 - w) p)) for w < 1."""
    g = torch.Generator().manual_seed(1)
    p, q = rand_dist(g, 64, 7, zeros=0.2), rand_dist(g, 64, 7, zeros=0.2)
    a = omega * p
    qf = torch.minimum(q, a)
    beta = 1 - qf.sum(-1, keepdim=True)
    closed = torch.clamp(p - q, min=0) if omega >= 1 else torch.maximum(p - q, (1 - omega) * p)
    gstar = normalize(gstar_residual(p, q, a), p)
    torch.testing.assert_close(gstar, normalize(closed, p), atol=1e-12, rtol=0)
    stated = qf + beta * normalize(closed, p)
    torch.testing.assert_close(step_marginal(ScaledRule(torch.tensor([omega], dtype=torch.float64)), p, q), stated, atol=1e-12, rtol=0)
    torch.testing.assert_close(stated.sum(-1), torch.ones(64, dtype=torch.float64))


def test_gstar_minimises_tv_among_resampling_distributions():
    """COOL-SD Theorem 2: for fixed acceptance, G* gives the smallest TV to p."""
    g = torch.Generator().manual_seed(2)
    p, q = rand_dist(g, 1, 6), rand_dist(g, 1, 6)
    for omega in (0.5, 2.0):
        qf = torch.minimum(q, omega * p)
        beta = 1 - qf.sum()
        best = 0.5 * (qf + beta * normalize(gstar_residual(p, q, omega * p), p) - p).abs().sum()
        for _ in range(200):
            G = rand_dist(g, 1, 6)
            assert best <= 0.5 * (qf + beta * G - p).abs().sum() + 1e-12


def test_exact_rule_is_lossless_per_step():
    g = torch.Generator().manual_seed(3)
    p, q = rand_dist(g, 32, 11, zeros=0.4), rand_dist(g, 32, 11, zeros=0.4)
    torch.testing.assert_close(step_marginal(ExactRule(), p, q), p, atol=1e-12, rtol=0)


def test_acceptance_prob():
    a = torch.tensor([0.2, 0.5, 0.1, 0.3])
    q = torch.tensor([0.4, 0.25, 0.0, 0.3])
    assert acceptance_prob(a, q).tolist() == [0.5, 1.0, 0.0, 1.0]


def test_schedules_match_research_table():
    # research/coolsd_lantern.md 1.3: L=5, nu=0.7, arithmetic-mean normalisation
    w = omega_schedule("exp", 1.0, 5, nu=0.7)
    torch.testing.assert_close(w, torch.tensor([2.595, 1.289, 0.640, 0.318, 0.158], dtype=torch.float64), atol=1e-3, rtol=0)
    assert omega_schedule("exp", 2.0, 4).mean().item() == pytest.approx(2.0)
    geo = omega_schedule("exp_geomean", 1.5, 5)
    assert torch.exp(torch.log(geo).mean()).item() == pytest.approx(1.5)
    lin = omega_schedule("linear", 2.0, 5, slope=0.5)
    assert lin.mean().item() == pytest.approx(2.0) and lin[-1].item() == pytest.approx(0.0)
    assert omega_schedule("uniform", 1.3, 3).tolist() == [1.3] * 3
    assert omega_schedule("exp", 2.0, 5, nu=0.0).tolist() == pytest.approx([2.0] * 5)


def test_lantern_aggregate_matches_definition():
    g = torch.Generator().manual_seed(4)
    V, k = 12, 4
    cb = torch.randn(V, 3, generator=g, dtype=torch.float64)
    nb = neighbours_from_codebook(cb)
    d = torch.cdist(cb, cb)
    for x in range(V):  # neighbours sorted by distance, self excluded
        assert x not in nb[x].tolist()
        assert torch.all(d[x, nb[x]][1:] >= d[x, nb[x]][:-1])
    p = rand_dist(g, 5, V)
    for kw in ({"lam": 2.0}, {"delta": 0.15}):
        full, relaxed_full = aggregate(p, nb[:, :k], None, **kw)
        for b, x in itertools.product(range(5), range(V)):
            budget = (kw["lam"] - 1) * p[b, x] if "lam" in kw else kw["delta"]
            c, best, rel = 0.0, 0.0, False
            for m in range(k):
                c += p[b, nb[x, m]].item()
                if c <= budget:
                    best, rel = c, True
            assert full[b, x].item() == pytest.approx(p[b, x].item() + best, abs=1e-12)
            assert bool(relaxed_full[b, x]) == rel
        one, _ = aggregate(p, nb[:, :k], torch.arange(5) % V, **kw)
        torch.testing.assert_close(one, full[torch.arange(5), torch.arange(5) % V])


def test_lantern_pp_with_lam_one_is_eagle_acceptance():
    g = torch.Generator().manual_seed(5)
    V = 8
    nb = neighbours_from_codebook(torch.randn(V, 2, generator=g, dtype=torch.float64))
    p, q = rand_dist(g, 16, V), rand_dist(g, 16, V)
    x = torch.randint(0, V, (16,), generator=g)
    f1, r1 = LanternRule(nb, 3, lam=1.0, resample="gstar").step(p, q, x, 1)
    f2, r2 = ExactRule().step(p, q, x, 1)
    torch.testing.assert_close(f1, f2)
    torch.testing.assert_close(r1, r2)


def test_sampling_helpers():
    g = torch.Generator().manual_seed(6)
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5]], dtype=torch.float64)
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    toks = sample_inverse_cdf(p.expand(2000, 4), u)
    assert set(toks.tolist()) == {1, 3}
    assert sample_inverse_cdf(p, torch.tensor([0.0])).item() == 1
    assert sample_inverse_cdf(p, torch.tensor([1.0 - 1e-16])).item() == 3
    # without replacement: distinct tokens, conditionals renormalised with earlier draws removed
    probs = rand_dist(g, 3, 6)
    toks, cond = sample_without_replacement(probs, torch.rand(3, 6, generator=g, dtype=torch.float64), 3)
    for b in range(3):
        assert len(set(toks[b].tolist())) == 3
        for j in range(3):
            expect = probs[b].clone()
            expect[toks[b, :j]] = 0
            torch.testing.assert_close(cond[b, j], expect / expect.sum())
    # greedy and top-k / top-p warpers
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert warp_probs(logits, temperature=0).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert (warp_probs(logits, top_k=2) > 0).tolist() == [[False, True, True, False]]
    assert (warp_probs(logits, top_p=0.5) > 0).tolist() == [[False, True, False, False]]


def test_gumbel_top_k_first_draw_is_distributed_as_probs():
    g = torch.Generator().manual_seed(7)
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    n = 40000
    toks, _ = sample_without_replacement(probs.expand(n, 4), torch.rand(n, 4, generator=g, dtype=torch.float64), 2)
    freq = torch.bincount(toks[:, 0], minlength=4).double() / n
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)
    # second draw: P(second = j) = sum_i p_i p_j / (1 - p_i)
    second = torch.bincount(toks[:, 1], minlength=4).double() / n
    expect = torch.tensor([sum(probs[i] * probs[j] / (1 - probs[i]) for i in range(4) if i != j) for j in range(4)])
    torch.testing.assert_close(second, expect, atol=0.01, rtol=0)
