"""CSpD per-token rules and the aligned diffusion head (continuous_sd.md 4.2): the exact mode
reproduces the target Gaussian (mean, covariance, two-sample tests) in 1-D and 16-D, the
reflection coupling reaches 1 - TV, identical models accept everything bit-identically, the
variance term is exactly 0 in log (Sigma = 1) under fixed variance and has the derived sign, log
space equals linear space, no NaN at final std 6e-3 in 64-D, and the resample cap falls back and
is counted. A negative control shows the paper rule with Sigma != 1 is biased."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from coolsd.engine.continuous.cspd import log_normal, verify_exact, verify_paper, verify_reflection
from coolsd.engine.continuous.diffusion import Schedule, aligned_sample

G = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731


def _draft(mu_q, s_q, n, seed):
    return mu_q + s_q * torch.randn(n, mu_q.shape[-1], generator=G(seed), dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("C", [1, 16])
def test_exact_mode_reproduces_the_target_gaussian(C):
    n = 20000
    mu_q, mu_p = torch.zeros(n, C, dtype=torch.float64), torch.full((n, C), 0.05, dtype=torch.float64)
    ls_q, ls_p = torch.tensor(math.log(0.10), dtype=torch.float64), torch.tensor(math.log(0.12), dtype=torch.float64)
    x0 = _draft(mu_q, 0.10, n, 1)
    v = verify_exact(x0, mu_p, ls_p, mu_q, ls_q, G(2))
    out = v.tokens.numpy()
    se = 0.12 / math.sqrt(n)
    assert np.abs(out.mean(0) - 0.05).max() < 4.5 * se
    cov = np.cov(out, rowvar=False).reshape(C, C)
    assert np.abs(np.diag(cov) - 0.0144).max() < 0.0144 * 0.06
    if C > 1:
        assert np.abs(cov - np.diag(np.diag(cov))).max() < 0.0144 * 0.06
    direct = (0.05 + 0.12 * torch.randn(n, generator=G(3), dtype=torch.float64)).numpy()
    assert stats.ks_2samp(out[:, 0], direct).pvalue > 1e-3
    assert 0 < v.acceptance_rate < 1
    assert not v.fallback.any() and v.rounds[v.accepted].eq(0).all()


@pytest.mark.slow
def test_reflection_coupling_reaches_one_minus_tv_and_is_exact():
    n, C, s = 20000, 16, 0.1
    mu_q, mu_p = torch.zeros(n, C, dtype=torch.float64), torch.full((n, C), 0.05, dtype=torch.float64)
    xi = torch.randn(n, C, generator=G(4), dtype=torch.float64)
    v = verify_reflection(xi, mu_p, mu_q, s, G(5))
    one_minus_tv = 2 * stats.norm.cdf(-math.sqrt(C) * 0.05 / (2 * s))
    assert abs(v.acceptance_rate - one_minus_tv) < 4 * math.sqrt(one_minus_tv * (1 - one_minus_tv) / n)
    out = v.tokens.numpy()
    assert np.abs(out.mean(0) - 0.05).max() < 4.5 * s / math.sqrt(n)
    assert np.abs(out.std(0) - s).max() < 0.03 * s


@pytest.mark.slow
def test_paper_rule_with_sigma_not_one_is_biased():
    """Negative control (continuous_sd.md 4.4): with log Sigma = +3 the output mean moves toward
    the draft, so the exactness test above can fail."""
    n, C = 20000, 16
    mu_q, mu_p = torch.zeros(n, C, dtype=torch.float64), torch.full((n, C), 0.05, dtype=torch.float64)
    ls_q, ls_p = torch.tensor(math.log(0.10), dtype=torch.float64), torch.tensor(math.log(0.12), dtype=torch.float64)
    x0 = _draft(mu_q, 0.10, n, 1)
    s_p = torch.zeros(n, dtype=torch.float64)
    v = verify_paper(x0, mu_p, ls_p, mu_q, ls_q, s_p, s_p + 3.0, G(2))
    assert v.tokens.mean().item() < 0.03  # far from 0.05 (SE ~1e-4)
    exact = verify_paper(x0, mu_p, ls_p, mu_q, ls_q, s_p, s_p, G(2))  # Sigma = 1: the exact rule
    assert abs(exact.tokens.mean().item() - 0.05) < 0.002


def _head(scale, v_value=None):
    """A hand-built head: eps = tanh(scale * x + z), v = v_value or tanh(x)."""
    def head(x, k, z):
        eps = torch.tanh(scale * x + z)
        v = torch.full_like(x, v_value) if v_value is not None else torch.tanh(x + 0.1 * k)
        return eps, v
    return head


def _chain_inputs(K, n, C):
    """(schedule, condition, initial noise, per-step noise): the shared randomness of alignment."""
    sched = Schedule.respaced(K)
    return (sched, torch.randn(n, C, generator=G(0), dtype=torch.float64),
            torch.randn(n, C, generator=G(1), dtype=torch.float64),
            torch.randn(sched.K, n, C, generator=G(2), dtype=torch.float64))


def test_identical_models_accept_everything_bit_identically():
    sched, z, noise, eps = _chain_inputs(20, 64, 8)
    q = aligned_sample(_head(0.7), z, noise, eps, sched, tau=1.0)
    p = aligned_sample(_head(0.7), z, noise, eps, sched, tau=1.0)
    v = verify_paper(q.x0, p.mu0, p.log_std0, q.mu0, q.log_std0, p.s, q.s, G(3))
    assert v.accepted.all() and torch.equal(v.tokens, p.x0) and v.rounds.eq(0).all()


def test_variance_term_is_one_under_fixed_variance_and_has_the_derived_sign():
    n, C = 16, 4
    sched, z, noise, eps = _chain_inputs(10, n, C)
    a = aligned_sample(_head(0.5), z, noise, eps, sched, fixed_v=0.3)
    b = aligned_sample(_head(1.5), z, noise, eps, sched, fixed_v=0.3)
    assert torch.equal(a.s - b.s, torch.zeros(n, dtype=torch.float64))  # log Sigma = 0 exactly
    big = aligned_sample(_head(0.5, v_value=1.0), z, noise, eps, sched)  # largest variances
    small = aligned_sample(_head(0.5, v_value=-1.0), z, noise, eps, sched)
    want = sum(0.5 * C * (sched.coefficients(k)["lmax"] - sched.coefficients(k)["lmin"]) for k in range(1, sched.K))
    # log Sigma = S_q - S_p: a draft with the larger variances gives Sigma > 1
    assert torch.allclose(big.s - small.s, torch.full((n,), want, dtype=torch.float64)) and want > 0


def test_log_space_equals_linear_space():
    g = G(7)
    for _ in range(20):
        mu_p, mu_q = torch.randn(1, 2, generator=g, dtype=torch.float64), torch.randn(1, 2, generator=g, dtype=torch.float64)
        ls_p, ls_q = 0.3 * torch.randn(1, 2, generator=g, dtype=torch.float64), 0.3 * torch.randn(1, 2, generator=g, dtype=torch.float64)
        x = torch.randn(1, 2, generator=g, dtype=torch.float64)
        lin = lambda m, ls: stats.multivariate_normal(m[0].numpy(), np.diag(np.exp(2 * ls[0].numpy()))).pdf(x[0].numpy())  # noqa: E731
        assert math.isclose(float(torch.exp(log_normal(x, mu_p, ls_p))), lin(mu_p, ls_p), rel_tol=1e-10)
        ratio = min(1.0, lin(mu_p, ls_p) / lin(mu_q, ls_q))
        log_r = float(log_normal(x, mu_p, ls_p) - log_normal(x, mu_q, ls_q))
        assert math.isclose(math.exp(min(0.0, log_r)), ratio, rel_tol=1e-10)


def test_no_nan_at_tiny_final_std_in_64_dims():
    n, C = 256, 64
    mu_q = torch.zeros(n, C, dtype=torch.float32)
    mu_p = torch.full((n, C), 0.05, dtype=torch.float32)
    ls = torch.tensor(math.log(6e-3), dtype=torch.float32)
    x0 = mu_q.clone()  # MAR: x0 = mu_q0 (no final noise)
    s = torch.zeros(n, dtype=torch.float32)
    v = verify_paper(x0, mu_p, ls, mu_q, ls, s, s + 40.0, G(0))  # |log Sigma| large as well
    assert torch.isfinite(v.tokens).all() and not v.accepted.any()
    assert torch.isfinite(log_normal(x0, mu_p, ls)).all()


def test_resample_cap_falls_back_to_a_target_sample_and_counts_it():
    n, C = 50, 4
    mu = torch.zeros(n, C, dtype=torch.float64)
    ls = torch.zeros((), dtype=torch.float64)
    x0 = mu + 5.0  # far out: rejected
    s = torch.zeros(n, dtype=torch.float64)
    v = verify_paper(x0, mu, ls, mu, ls, s, s - 5.0, G(1), max_rounds=7)  # log Sigma = -5: alpha_s = 0 everywhere
    assert v.fallback.sum() == (~v.accepted).sum() > 0 and v.rounds[~v.accepted].eq(7).all()
    assert torch.isfinite(v.tokens).all() and v.tokens[~v.accepted].abs().max() < 6  # target samples, not zeros
