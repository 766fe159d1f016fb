"""Exact emitted-token distributions at a chain node (coolsd.engine.decoding.distortion)
against brute force: enumerate every draft x ~ q, run the production rule's ``step`` on it
(accept with f(x), else Norm(residual) with the loop's fallback to p) and sum."""
import pytest
import torch

from coolsd.engine.decoding.distortion import emitted_distribution, kl, tv
from coolsd.engine.decoding.lantern import neighbours_from_codebook
from coolsd.engine.decoding.rules import ExactRule, LanternRule, ScaledRule
from coolsd.engine.decoding.sampling import normalize
from factories import emitted_tokens

V, B = 12, 5


def _dists(seed: int):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(B, V, generator=g, dtype=torch.float64) ** 3
    p[:, : V // 4] = 0  # a warped support (top-k zeroes part of the vocabulary)
    q = torch.rand(B, V, generator=g, dtype=torch.float64) ** 2
    q[0, :] = 0  # a drafter that puts all its mass off p's support in one row
    q[0, 0] = 1
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def _brute_force(rule, p, q, depth):
    pi = torch.zeros_like(p)
    for x in range(V):
        xs = torch.full((B,), x, dtype=torch.long)
        f, residual = rule.step(p, q, xs, depth)
        qx = q[:, x]
        pi[:, x] += qx * f
        pi += (qx * (1 - f)).unsqueeze(-1) * normalize(residual, p)
    return pi


NB = neighbours_from_codebook(torch.randn(V, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64))
RULES = {
    "exact": ExactRule(),
    "scaled_up": ScaledRule(torch.tensor([3.0, 2.0, 1.5])),
    "scaled_down": ScaledRule(torch.tensor([0.6, 0.8])),
    "lantern_pp": LanternRule(NB, 3, lam=2.0),
    "lantern_pp_gstar": LanternRule(NB, 3, lam=2.0, resample="gstar"),
    "lantern_delta": LanternRule(NB, 4, delta=0.2),
    "lantern_everyone": LanternRule(NB, 1000, delta=0.3),  # N(x) = every other token (k + 1 >= V - 1)
}


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emitted_distribution_equals_brute_force(name, depth, seed):
    p, q = _dists(seed)
    pi = emitted_distribution(RULES[name], p, q, depth)
    torch.testing.assert_close(pi, _brute_force(RULES[name], p, q, depth), rtol=0, atol=1e-12)
    torch.testing.assert_close(pi.sum(-1), torch.ones(B, dtype=torch.float64), rtol=0, atol=1e-12)


def test_lossless_rule_emits_p_and_relaxed_rules_distort():
    p, q = _dists(3)
    exact = emitted_distribution(ExactRule(), p, q, 1)
    torch.testing.assert_close(exact, p, rtol=0, atol=1e-12)
    assert float(tv(exact, p).max()) < 1e-12 and float(kl(exact, p).abs().max()) < 1e-12
    relaxed = emitted_distribution(RULES["scaled_up"], p, q, 1)
    # row 0 drafts only off p's support: nothing is ever accepted, the residual is p itself
    assert float(tv(relaxed, p)[0]) < 1e-12
    assert bool((tv(relaxed, p)[1:] > 1e-3).all()) and bool((kl(relaxed, p)[1:] > 0).all())
    # omega >= 1 keeps pi on p's support (KL finite); LANTERN's aggregation can leave it
    assert bool(torch.isfinite(kl(relaxed, p)).all())


def _independent_tv(p, q, omega):
    """TV(pi, p) of a scaled rule from formula (2) of docs/distortion.md, in numpy."""
    import numpy as np

    acc = np.minimum(q, omega * p)
    g = np.maximum(p - acc, 0.0)
    pi = acc + (1 - acc.sum()) * (g / g.sum() if g.sum() > 1e-12 else p)
    return 0.5 * np.abs(pi - p).sum()


@pytest.mark.parametrize("method, params", [("coolsd", {"delta": 2.0}), ("uniform_rsd", {"delta": 1.5}),
                                            ("eagle", {}), ("sjd", {})])
def test_loop_distortion_equals_independent_computation_in_the_lab(lab_pair, method, params):
    """The production loop's per-token step_tv on a tabular target equals TV(pi_t, p_t) computed
    from the exact conditionals p(.|prefix), q(.|prefix) at the depth each token was verified
    (1e-9); lossless methods give exactly 0."""
    from coolsd.engine.decoding.rng import SharedRNG
    from coolsd.engine.drafting import SamplingConfig, build_drafter
    from coolsd.engine.loop import speculative_generate
    from coolsd.theory.lab import _method

    P, Q = lab_pair
    L = 2
    m = _method(P, method, L, "chain", dict(params))
    res = speculative_generate(P, P.N, SharedRNG(64, 3), rule=m.rule, drafter=build_drafter(m, Q, SamplingConfig(), P.V),
                               tree=m.tree, sampling=SamplingConfig(), batch_size=64, bos_token=P.bos_token)
    if method in ("eagle", "sjd"):
        assert float(res.step_tv.abs().max()) == 0.0 and float(res.step_kl.abs().max()) == 0.0
        return
    omega = [float(w) for w in m.rule.omega]
    for b, t, j, max_depth, prefix in emitted_tokens(res, L, P.N):
        want = _independent_tv(P.probs(prefix), Q.probs(prefix), omega[j - 1]) if j <= max_depth else 0.0
        assert abs(float(res.step_tv[b, t]) - want) < 1e-9, (b, t, j)


@pytest.mark.parametrize("name", list(RULES))
def test_chain_distortion_batches_the_depths_exactly(name):
    """``chain_distortion`` (all depths in one pass) equals ``emitted_distribution`` depth by depth."""
    from coolsd.engine.decoding.distortion import chain_distortion

    D = 3
    g = torch.Generator().manual_seed(11)
    p = torch.rand(B, D + 1, V, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(B, D + 1, V, generator=g, dtype=torch.float64) ** 2
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    tv_d, kl_d, none = chain_distortion(RULES[name], p, q, D)
    assert none is None  # no log-probabilities given: no expected NLL
    for d in range(1, D + 1):
        pi = emitted_distribution(RULES[name], p[:, d - 1], q[:, d], d)
        torch.testing.assert_close(tv_d[:, d - 1], tv(pi, p[:, d - 1]), rtol=0, atol=1e-12)
        torch.testing.assert_close(kl_d[:, d - 1], kl(pi, p[:, d - 1]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["lantern_pp", "lantern_delta", "lantern_everyone"])
@pytest.mark.parametrize("block", [1, 2, 16])
def test_aggregation_over_the_vocabulary_is_bit_exact(monkeypatch, name, block, dtype):
    """``lantern.aggregate_all`` (the eager early exit over neighbour blocks, and the one-pass path)
    returns LANTERN's own aggregation ``coolsd.engine.decoding.lantern.aggregate`` bit for bit, and the
    emitted distribution through the blocked path still equals brute force."""
    from coolsd.engine.decoding import lantern
    from coolsd.engine.decoding.lantern import aggregate

    monkeypatch.setattr(lantern, "_FIRST_BLOCK", block)
    rule = RULES[name]
    for seed in range(3):
        p, q = _dists(seed)
        p = torch.cat([p, torch.full((1, V), 1.0 / V, dtype=p.dtype)]).to(dtype)  # ties: equal neighbours
        want = aggregate(p, rule.nb_k, None, lam=rule.lam, delta=rule.delta)
        got = lantern.aggregate_all(p, rule.nb_k, lam=rule.lam, delta=rule.delta)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        pi = emitted_distribution(rule, *_dists(seed), 1)
        torch.testing.assert_close(pi, _brute_force(rule, *_dists(seed), 1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["scaled_up", "lantern_pp", "lantern_pp_gstar", "lantern_delta"])
def test_chain_distortion_computes_only_the_needed_depths_in_eager_mode(name):
    """``need``: LANTERN rows the round emitted are computed exactly as without it, the rest are 0;
    other rules (cheap rows) compute every row anyway."""
    from coolsd.engine.decoding.distortion import chain_distortion

    D = 3
    g = torch.Generator().manual_seed(12)
    p = torch.rand(B, D + 1, V, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(B, D + 1, V, generator=g, dtype=torch.float64) ** 2
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    need = torch.arange(1, D + 1).unsqueeze(0) <= torch.tensor([0, 1, 2, 3, 3]).unsqueeze(1)
    full, part = chain_distortion(RULES[name], p, q, D), chain_distortion(RULES[name], p, q, D, need)
    skips = name.startswith("lantern")
    for f, s in zip(full[:2], part[:2]):
        torch.testing.assert_close(s, torch.where(need, f, 0) if skips else f, rtol=0, atol=0)
    assert float(full[0][0].abs().sum()) > 0  # the unneeded row 0 has distortion: zeroing it is visible


def _compiled_kernels(monkeypatch):
    """Run the code paths compiled rounds take (fused column-by-column gathers, the reverse table)
    eagerly, so that they can be compared with the eager ones bit for bit."""
    from coolsd.engine.decoding import distortion, lantern

    monkeypatch.setattr(lantern, "compiling", lambda: True)
    monkeypatch.setattr(distortion, "compiling", lambda: True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lam, delta", [(2.0, None), (3.0, None), (None, 0.2)])
def test_compiled_aggregation_is_the_eager_one_bit_for_bit(monkeypatch, dtype, lam, delta):
    from coolsd.engine.decoding import lantern

    g = torch.Generator().manual_seed(5)
    p = torch.rand(7, V, generator=g, dtype=torch.float64).to(dtype) ** 3
    p = p / p.sum(-1, keepdim=True)
    eager = lantern.aggregate(p, NB[:, :5], None, lam=lam, delta=delta)
    _compiled_kernels(monkeypatch)
    fused = lantern.aggregate(p, NB[:, :5], None, lam=lam, delta=delta)
    assert torch.equal(eager[0], fused[0]) and torch.equal(eager[1], fused[1])
    assert bool(eager[1].any()) and not bool(eager[1].all())  # both kinds of token occur


def test_reverse_neighbours_list_every_token_that_has_y_as_a_neighbour():
    from coolsd.engine.decoding.lantern import reverse_neighbours, reverse_sum

    nb = NB[:, :4]
    rev = reverse_neighbours(nb)
    for y in range(V):
        want = sorted(x for x in range(V) if y in nb[x].tolist())
        assert [x for x in rev[y].tolist() if x < V] == want
    c = torch.rand(3, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    scatter = reverse_sum(c, nb)  # eager: the index_add
    gather = torch.cat([c, c.new_zeros(3, 1)], 1)[:, rev].sum(-1)
    torch.testing.assert_close(gather, scatter, rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["lantern_pp", "lantern_pp_gstar", "lantern_delta", "lantern_everyone"])
@pytest.mark.parametrize("seed", [0, 1])
def test_compiled_kernels_emit_the_brute_force_distribution(monkeypatch, name, seed):
    """The compiled rounds' LANTERN kernels give the brute-force pi too (1e-12)."""
    p, q = _dists(seed)
    want = _brute_force(RULES[name], p, q, 1)
    _compiled_kernels(monkeypatch)
    torch.testing.assert_close(emitted_distribution(RULES[name], p, q, 1), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lam, delta", [(2.0, None), (1.5, None), (None, 0.3)])
def test_token_major_aggregation_is_the_rules_bit_for_bit(dtype, lam, delta):
    """The distortion's token-major LANTERN aggregation (``lantern.aggregate_token_major``, used for
    many eager rows) returns exactly what the rule's own ``aggregate`` does on the same rows, with
    ties, zeros and one-hot rows among them."""
    from coolsd.engine.decoding.lantern import aggregate, aggregate_token_major

    g = torch.Generator().manual_seed(11)
    V, k = 40, 10
    nb = neighbours_from_codebook(torch.randn(V, 3, generator=g))[:, :k]
    p = torch.softmax(2 * torch.randn(48, V, generator=g), -1).to(dtype)
    p[0] = 0
    p[0, 3] = 1  # one-hot
    p[1, :20] = p[1, 20:]  # ties
    p[2, ::2] = 0  # zeros
    p = p / p.sum(-1, keepdim=True)
    want, want_relaxed = aggregate(p, nb, None, lam=lam, delta=delta)
    got, got_relaxed = aggregate_token_major(p.t().contiguous(), nb, lam=lam, delta=delta)
    assert torch.equal(got.t(), want) and torch.equal(got_relaxed.t(), want_relaxed)
