"""CSpD on a flow model (coolsd.engine.continuous.generate's ``FlowFamily`` with
coolsd.engine.continuous.flow) on tiny random-weight xAR models: target-only sampling through the
loop is upstream's sampler (``coolsd.models.xar.sample``) given the same noise; the variance term
is one schedule constant (Sigma = 1, continuous_sd.md 2.3); identical draft and target accept
everything; a batch equals its samples alone; the exact prefix mode is lossless: every output
token's teacher-forced residual (x - mu_p) / s under the target, given the output's own earlier
steps and the position's aligned noise, is iid N(0, 1) (a test-side chain, independent of the loop),
and three broken variants fail the same test."""
import copy
import math

import pytest
import torch
from factories import tiny_xar
from scipy import stats

from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.continuous.flow import (DEFAULT_FINAL_STD, FlowConfig, cfg_schedule, guide, schedule_log_var_sum,
                                           time_grid, transition)
from coolsd.engine.continuous.generate import ar_generate, cspd_generate, position_noise
from coolsd.models.xar import cell_order, sample

N = 4  # SDE steps per unit
LABELS = torch.tensor([1, 2])


def blended(a, b, w):
    """The model with weights (1 - w) a + w b: a draft close to a (partial acceptance)."""
    m = copy.deepcopy(a)
    with torch.no_grad():
        for p, q in zip(m.parameters(), b.parameters()):
            p.mul_(1 - w).add_(w * q)
    return m


def upstream_noise(model, seeds):
    """The loop's aligned noise as ``sample``'s latents (n_cells, B, cell_len, C) and eps
    (n_cells, N - 1, B, cell_len, C): position j's x^(K) starts its cell's chain, eps_k drives step
    i = N - 1 - k."""
    c = model.config
    order = cell_order(c).view(c.n_cells, c.cell_len)
    lat = torch.zeros(c.n_cells, len(seeds), c.cell_len, c.token_dim, dtype=torch.float64)
    eps = torch.zeros(c.n_cells, N - 1, len(seeds), c.cell_len, c.token_dim, dtype=torch.float64)
    for b, seed in enumerate(seeds):
        for s in range(c.n_cells):
            for t, j in enumerate(order[s].tolist()):
                x, e = position_noise(seed, j, N, c.token_dim)
                lat[s, b, t] = x
                for i in range(N - 1):
                    eps[s, i, b, t] = e[N - 1 - i]
    return lat, eps


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_target_only_loop_is_the_upstream_sampler_given_the_same_noise(cfg):
    m = tiny_xar(0)
    lat, eps = upstream_noise(m, [7, 8])
    ref = sample(m, LABELS, N, cfg, latents=lat, eps=eps)  # (B, C, H, W)
    out = ar_generate(m, LABELS, [7, 8], FlowConfig(num_steps=N, cfg=cfg))
    got = out.tokens.transpose(1, 2).reshape(ref.shape)
    torch.testing.assert_close(got.float(), ref, rtol=0, atol=1e-6)  # sample stores fp32 cells
    assert all(c["target_forwards"] == m.config.n_cells for c in out.counters)


def test_the_variance_term_is_one_schedule_constant():
    """S = sum over the stochastic steps of C/2 log(2 t |dt|), whatever the model: log Sigma = 0.0."""
    grid = time_grid(N)
    want = sum(2.0 * math.log(2 * float(grid[i]) * abs(float(grid[i + 1] - grid[i]))) for i in range(N - 1))
    assert schedule_log_var_sum(N, 4) == pytest.approx(want, rel=1e-15)
    assert DEFAULT_FINAL_STD == pytest.approx(math.sqrt(2 * 0.04 * 0.04))
    assert cfg_schedule(3.0, 0, 4) == 1.0 and cfg_schedule(3.0, 3, 4) == 3.0
    v, vn = torch.ones(2, 3), torch.zeros(2, 3)
    assert torch.equal(guide(v, vn, torch.tensor([[1.0], [2.0]])), torch.tensor([[1.0] * 3, [2.0] * 3]))
    mean, std = transition(torch.zeros(3), torch.ones(3), 0.5, -0.25, last=False)
    assert torch.allclose(mean, torch.full((3,), -0.25 * 1.5)) and std == pytest.approx(0.5)


@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize("mode,verify,gamma,cfg", [("exact", "prefix", 3, 1.0), ("paper", "prefix", 2, 3.0),
                                                   ("paper", "parallel", 1, 2.0)])
def test_identical_models_accept_all_and_match_target_only(unit, mode, verify, gamma, cfg):
    t = tiny_xar(0)
    fc = FlowConfig(num_steps=N, cfg=cfg, unit=unit)
    with batch_invariant():
        ar = ar_generate(t, LABELS, [0, 1], fc, final_noise=mode == "exact")
        sp = cspd_generate(t, t, LABELS, [0, 1], fc, gamma=gamma, mode=mode, verify=verify, prefill=0.1)
    assert torch.equal(sp.tokens, ar.tokens)
    steps = 16 // unit
    for b, c in enumerate(sp.counters):
        assert sp.acceptance_rate(b) == 1.0 and c["fallbacks"] == 0
        assert c["verified"] == c["drafted"] == c["draft_forwards"] * unit
        if verify == "prefix":  # ceil(0.1 steps) pre-filled, then rounds of gamma drafts + the bonus step
            n, rounds, drafted = math.ceil(0.1 * steps), 0, 0
            pre = n
            while n < steps:
                g = min(gamma, steps - n)
                n, rounds, drafted = n + g + (n + g < steps), rounds + 1, drafted + g
            assert (c["drafted"], c["target_forwards"]) == (drafted * unit, pre + rounds)


def test_parallel_verification_rejects_an_identical_model_past_gamma_1():
    t = tiny_xar(0)
    fc = FlowConfig(num_steps=N, cfg=1.0, unit=1)
    sp = cspd_generate(t, t, LABELS, [0, 1], fc, gamma=4, mode="exact", verify="parallel", prefill=0.0,
                       final_std=0.02)
    assert all(c["verified"] == 16 and c["target_forwards"] == 4 for c in sp.counters)
    assert min(sp.acceptance_rate(b) for b in range(2)) < 1.0


@pytest.mark.parametrize("verify", ["prefix", "parallel"])
def test_a_batch_equals_its_samples_alone(verify):
    t, d = tiny_xar(0), blended(tiny_xar(0), tiny_xar(1), 0.1)
    fc = FlowConfig(num_steps=N, cfg=2.0, unit=2)
    with batch_invariant():
        both = cspd_generate(t, d, LABELS, [5, 6], fc, gamma=3, mode="exact", verify=verify, final_std=0.05)
        for b, seed in enumerate([5, 6]):
            one = cspd_generate(t, d, LABELS[b:b + 1], [seed], fc, gamma=3, mode="exact", verify=verify,
                                final_std=0.05)
            assert torch.equal(one.tokens[0], both.tokens[b])
            assert one.counters[0] == both.counters[b]


# ------------------------------------------------------------------ losslessness of the exact prefix mode
S0 = 0.05  # the shared final std


@torch.no_grad()
def teacher_forced_residuals(model, tokens, labels, seeds, unit):
    """(x - mu_p) / s of every token of ``tokens`` (B, L, C) image order: mu_p is the target's final
    mean of the token's step given the output's own earlier steps and the position's aligned noise,
    by a cache-free pass per chain step over [earlier steps clean at t = 0 | this step at t] with a
    step-causal mask (``XAR.attend``; not the loop's context / velocity_at / family)."""
    c = model.config
    order = cell_order(c)
    B, L, C = tokens.shape
    cells = tokens[:, order]  # cell order
    noise = torch.zeros(B, L, C, dtype=torch.float64)
    eps = torch.zeros(N, B, L, C, dtype=torch.float64)
    for b, seed in enumerate(seeds):
        for i, j in enumerate(order.tolist()):
            noise[b, i], eps[:, b, i] = position_noise(seed, j, N, C)
    res = torch.zeros(B, L, C, dtype=torch.float64)
    step_of = torch.arange(L) // unit
    grid = time_grid(N)
    for s in range(L // unit):
        lo, hi = s * unit, (s + 1) * unit
        vis = (step_of[None, :hi] <= step_of[:hi, None]).expand(B, hi, hi)
        x = noise[:, lo:hi]
        for i in range(N):
            t, dt = float(grid[i]), float(grid[i + 1] - grid[i])
            inp = torch.cat([cells[:, :lo], x], 1)
            tt = torch.cat([torch.zeros(B, lo), torch.full((B, unit), t)], 1)
            cond = model.class_emb(model.class_index(labels))[:, None] + model.time_embed((tt.float() * 1000).long())
            v = model.attend(inp, torch.arange(hi).expand(B, hi), cond, None, vis)[0][:, lo:hi]
            mean, std = transition(x, v, t, dt, last=i == N - 1)
            x = mean + std * eps[N - 1 - i, :, lo:hi] if std else mean
        res[:, lo:hi] = (cells[:, lo:hi] - x) / S0
    return res


def residual_pvalue(res):
    return stats.kstest(res.reshape(-1).numpy(), "norm").pvalue


N_SEEDS = 120  # p-values of the broken variants < 1e-100 at n = 150 (measured)


@pytest.fixture(scope="module")
def pair():
    t = tiny_xar(0)
    return t, blended(t, tiny_xar(1), 0.1)


@pytest.mark.parametrize("unit", [1, 2])
def test_exact_prefix_mode_is_lossless(pair, unit):
    t, d = pair
    fc = FlowConfig(num_steps=N, cfg=1.0, unit=unit)
    labels = torch.arange(N_SEEDS) % 10
    seeds = list(range(N_SEEDS))
    sp = cspd_generate(t, d, labels, seeds, fc, gamma=3, mode="exact", verify="prefix", prefill=0.0, final_std=S0)
    res = teacher_forced_residuals(t, sp.tokens, labels, seeds, unit)
    rate = sum(c["accepted"] for c in sp.counters) / sum(c["verified"] for c in sp.counters)
    assert 0.1 < rate < 0.9, rate  # both the accept and the resample paths are exercised
    assert residual_pvalue(res) > 1e-3
    assert abs(float(res.mean())) < 4 / math.sqrt(res.numel())
    chi = (res ** 2).sum(-1).reshape(-1).numpy()  # sum of C squares per token: chi-square(C)
    assert stats.kstest(chi, "chi2", args=(res.shape[-1],)).pvalue > 1e-3


@pytest.mark.parametrize("broken", ["draft_only", "paper_lam42", "parallel_all"])
def test_the_residual_test_detects_a_biased_sampler(pair, broken):
    """Negative controls for the test above, same n: the draft's own samples; the paper rule at
    lam = 42 (it keeps nearly every noiseless draft); parallel mode with every step in one round
    (the target sees nothing)."""
    t, d = pair
    unit = 1
    fc = FlowConfig(num_steps=N, cfg=1.0, unit=unit)
    labels = torch.arange(N_SEEDS) % 10
    seeds = list(range(N_SEEDS))
    if broken == "draft_only":
        tokens = ar_generate(d, labels, seeds, fc, final_noise=True, final_std=S0).tokens
    elif broken == "paper_lam42":
        tokens = cspd_generate(t, d, labels, seeds, fc, gamma=3, mode="paper", verify="prefix", prefill=0.0,
                               final_std=S0, inner_temperature=42.0).tokens
    else:
        tokens = cspd_generate(t, d, labels, seeds, fc, gamma=16, mode="exact", verify="parallel", prefill=0.0,
                               final_std=S0).tokens
    assert residual_pvalue(teacher_forced_residuals(t, tokens, labels, seeds, unit)) < 1e-6


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="num_steps"):
        FlowConfig(num_steps=1)
    with pytest.raises(ValueError, match="unit"):
        FlowConfig(unit=0)
    with pytest.raises(ValueError, match="cfg"):
        FlowConfig(cfg=0.5)
    with pytest.raises(ValueError, match="does not divide"):
        ar_generate(tiny_xar(0), LABELS, [0, 1], FlowConfig(num_steps=N, unit=3))
    with pytest.raises(ValueError, match="disagree"):
        cspd_generate(tiny_xar(0), tiny_xar(0, grid=2, cell=1), LABELS, [0, 1], FlowConfig(num_steps=N), gamma=2)
    from factories import tiny_mar_reference
    with pytest.raises(ValueError, match="flow model"):
        ar_generate(tiny_mar_reference(), LABELS, [0, 1], FlowConfig(num_steps=N))


def test_prefix_rounds_stop_at_the_first_step_with_a_rejected_token(pair, monkeypatch):
    """A step of ``unit`` tokens is accepted iff all its tokens are; a round keeps its steps up to and
    including the first step with a rejection (docs/methods.md#5-continuous-speculative-decoding)."""
    import coolsd.engine.continuous.generate as gen

    t, d = pair
    seen, count = [], gen._count
    monkeypatch.setattr(gen, "_count", lambda c, v, take, drafted: (seen.append((v.accepted.clone(), take)),
                                                                     count(c, v, take, drafted)))
    cspd_generate(t, d, torch.arange(8) % 10, list(range(8)), FlowConfig(num_steps=N, unit=2), gamma=4, mode="exact",
                  verify="prefix", prefill=0.0, final_std=S0)
    assert any(not bool(a.all()) and bool(a.any()) for a, _ in seen)  # mixed steps occur
    for accepted, take in seen:
        steps = accepted.view(-1, 2).all(1).tolist()
        assert take == 2 * (steps.index(False) + 1 if False in steps else len(steps))
