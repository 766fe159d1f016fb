"""The rule interface of the exact distortion (``coolsd.engine.decoding.rules.Rule``, docs/distortion.md
"Where the facts live"): a rule defined outside the package, as a researcher would in their own
file, gets exact per-token distortion without an edit to ``coolsd.engine.decoding.distortion``, which
knows no rule class. Each rule's emitted distribution is checked against an independent
enumeration of the draft in numpy (pi = sum_x q(x) [f(x) 1{y = x} + (1 - f(x)) Norm(r)(y)],
which for an x-independent residual r is q f + (1 - sum q f) Norm(r)), and through the
production loop (``speculative_generate`` with distortion on) on a tabular target."""
import numpy as np
import pytest
import torch

from coolsd.engine.decoding import distortion
from coolsd.engine.decoding.distortion import chain_distortion, emitted_distribution, kl, tv
from coolsd.engine.decoding.rules import Rule, ScaledRule
from coolsd.engine.decoding.sampling import normalize
from factories import emitted_tokens

V, B = 6, 4


class _DepthBoost(Rule):
    """a_d = min(0.2, (1 + d / 2) p_res): a depth-dependent, capped weight no registered rule has;
    only ``numerator`` is defined (the base class's G* form does the rest)."""

    name = "depth_boost"

    def numerator(self, p_res, depth):
        return torch.clamp((1.0 + 0.5 * depth) * p_res, max=0.2)


class _CappedScaled(ScaledRule):
    """A ScaledRule subclass with its own numerator, min(omega_d p_res, 0.15): the parent's
    vectorised a = omega_d p does not hold for it (at omega_d = 2 the cap binds), nor does the
    parent's ``is_exact`` (omega_d = 1; here a <= p there, so pi = p still, now computed)."""

    name = "capped_scaled"

    def numerator(self, p_res, depth):
        return torch.clamp(self.weight(depth) * p_res, max=0.15)


class _OwnResidual(Rule):
    """a = 0.6 p_res with GSD's / SJD's resampling [p_res - q]_+ instead of G*: one ``residual``
    override, which both the sampling step and the emitted distribution read."""

    name = "own_residual"

    def numerator(self, p_res, depth):
        return 0.6 * p_res

    def residual(self, p_res, q, accepted):
        return torch.clamp(p_res - q, min=0.0)


def _np_numerator(name, p, depth):
    if name == "depth_boost":
        return np.minimum((1.0 + 0.5 * depth) * p, 0.2)
    if name == "capped_scaled":
        return np.minimum(OMEGA[min(depth, len(OMEGA)) - 1] * p, 0.15)
    return 0.6 * p


def _np_residual(name, p, q, a):
    return np.maximum(p - q, 0.0) if name == "own_residual" else np.maximum(p - np.minimum(q, a), 0.0)


def _enumerated(name, p, q, depth):
    """pi of one row (numpy float64) by enumerating the draft x: f(x) = min(1, a(x) / q(x)), a
    rejection resamples from Norm(r) (p where r has no mass, as verify_tree does)."""
    a = _np_numerator(name, p, depth)
    r = _np_residual(name, p, q, a)
    norm_r = r / r.sum() if r.sum() > 1e-30 else p
    pi = np.zeros_like(p)
    for x in range(len(p)):
        if q[x] <= 0:
            continue
        f = min(1.0, a[x] / q[x])
        pi[x] += q[x] * f
        pi += q[x] * (1 - f) * norm_r
    return pi


OMEGA = [1.0, 2.0, 0.5]
RULES = {"depth_boost": _DepthBoost(), "capped_scaled": _CappedScaled(torch.tensor(OMEGA)),
         "own_residual": _OwnResidual()}


def _dists(seed, shape=(B,)):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(*shape, V, generator=g, dtype=torch.float64) ** 3
    p[..., :1] = 0  # a warped support
    q = torch.rand(*shape, V, generator=g, dtype=torch.float64) ** 2
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_rule_defined_outside_the_package_gets_its_exact_emitted_distribution(name, depth):
    p, q = _dists(depth)
    pi = emitted_distribution(RULES[name], p, q, depth)
    want = torch.tensor(np.stack([_enumerated(name, p[b].numpy(), q[b].numpy(), depth) for b in range(B)]))
    torch.testing.assert_close(pi, want, rtol=0, atol=1e-12)
    if name == "capped_scaled" and OMEGA[depth - 1] <= 1:  # a <= p: G* resampling restores p exactly
        assert float(tv(pi, p).max()) < 1e-12
    else:
        assert float(tv(pi, p).max()) > 1e-3  # relaxed: pi is not p
    # the sampling step reads the same facts: enumerating the production step gives pi too
    step_pi = torch.zeros_like(p)
    for x in range(V):
        f, residual = RULES[name].step(p, q, torch.full((B,), x), depth)
        step_pi[:, x] += q[:, x] * f
        step_pi += (q[:, x] * (1 - f)).unsqueeze(-1) * normalize(residual, p)
    torch.testing.assert_close(step_pi, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(RULES))
def test_chain_distortion_of_a_rule_defined_outside_the_package(name):
    """Every depth of a chain (``chain_distortion``, as the loop calls it), TV and KL."""
    D = 3
    p, q = _dists(5, (B, D + 1))
    tv_d, kl_d, _ = chain_distortion(RULES[name], p, q, D)
    assert not distortion.lossless(RULES[name], D)
    for d in range(1, D + 1):
        want = torch.tensor(np.stack([_enumerated(name, p[b, d - 1].numpy(), q[b, d].numpy(), d) for b in range(B)]))
        torch.testing.assert_close(tv_d[:, d - 1], tv(want, p[:, d - 1]), rtol=0, atol=1e-12)
        torch.testing.assert_close(kl_d[:, d - 1], kl(want, p[:, d - 1]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", list(RULES))
def test_loop_distortion_of_a_rule_defined_outside_the_package_in_the_lab(lab_pair, name):
    """The production loop (``speculative_generate``, distortion on) with a researcher's rule on a
    tabular target: each token's step_tv / step_kl equal TV / KL of the enumerated pi_t at the
    exact conditionals p(.|prefix), q(.|prefix) and the depth the token was verified at (0 for a
    bonus token), 1e-9."""
    from coolsd.engine.decoding.rng import SharedRNG
    from coolsd.engine.drafting import SamplingConfig, build_drafter
    from coolsd.engine.loop import speculative_generate
    from coolsd.theory.lab import _method

    P, Q = lab_pair
    L = 3
    m = _method(P, "coolsd", L, "chain", {"delta": 2.0})  # its drafter and chain; the rule is ours
    rule = RULES[name]
    res = speculative_generate(P, P.N, SharedRNG(64, 4), rule=rule, drafter=build_drafter(m, Q, SamplingConfig(), P.V),
                               tree=m.tree, sampling=SamplingConfig(), batch_size=64, bos_token=P.bos_token)
    seen = set()
    for b, t, j, max_depth, prefix in emitted_tokens(res, L, P.N):
        want_tv = want_kl = 0.0
        if j <= max_depth:
            p_t, q_t = P.probs(prefix), Q.probs(prefix)
            pi = _enumerated(name, p_t, q_t, j)
            want_tv = 0.5 * np.abs(pi - p_t).sum()
            want_kl = float(np.sum(np.where(pi > 0, pi * (np.log(np.where(pi > 0, pi, 1)) - np.log(p_t)), 0)))
            seen.add(j)
        assert abs(float(res.step_tv[b, t]) - want_tv) < 1e-9, (b, t, j)
        assert abs(float(res.step_kl[b, t]) - want_kl) < 1e-9, (b, t, j)
    assert seen == {1, 2, 3}  # every depth of the chain was reached
    assert float(res.step_tv.sum()) > 0
