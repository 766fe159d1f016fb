"""The DDIM head sampler of the continuous loop (coolsd.engine.continuous.diffusion;
docs/methods.md#51-ddim-head-sampler): the default DDPM chain is bit-identical to
a frozen copy of the formulas it had before the sampler option; one DDIM step is eq. 12 of Song et
al. 2021, computed here from an independent cosine schedule; eta = 1 is DDPM with the fixed small
variance; eta = 0 is deterministic given the initial noise; the S term is a schedule constant (0 at
eta = 0), so log Sigma = 0 for any two heads, and the final step is DDPM's; CSpD's exact prefix mode
with DDIM keeps the target's distribution (a negative control shows the check has power); the
method's sampler / eta / head_steps override the target's head for CSpD and its baseline alike;
bad values and a flow target are refused in one line; run.py end to end on the toy continuous world."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

import coolsd.engine.continuous.generate as generate
from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.continuous.diffusion import Schedule, aligned_sample, step_gaussian
from coolsd.engine.continuous.flow import FlowConfig
from coolsd.engine.continuous.generate import HeadConfig, ar_generate, cspd_generate
from coolsd.engine.methods import build_method
from coolsd.engine.methods.cspd import ContinuousMethod
from test_cspd_generate import LABELS, GaussianHead, _with_head, tiny_mar

K, C = 8, 4


# ----------------------------------------------------------------- the DDPM formulas before DDIM, frozen
def _old_coefficients(ab_all, k):
    ab = float(ab_all[k])
    ab_prev = float(ab_all[k - 1]) if k > 0 else 1.0
    beta = 1 - ab / ab_prev
    beta_tilde = beta * (1 - ab_prev) / (1 - ab)
    if k == 0:
        b1 = 1 - float(ab_all[1]) / float(ab_all[0])
        lmin = math.log(b1 * (1 - float(ab_all[0])) / (1 - float(ab_all[1])))
    else:
        lmin = math.log(beta_tilde)
    return {"ab": ab, "ab_prev": ab_prev, "beta": beta, "lmin": lmin, "lmax": math.log(beta),
            "c1": beta * math.sqrt(ab_prev) / (1 - ab), "c2": (1 - ab_prev) * math.sqrt(1 - beta) / (1 - ab)}


def _old_step(head, x, k, ab_all, ts, z_c, z_u=None, cfg=1.0, fixed_v=None, clip_x0=None):
    c = _old_coefficients(ab_all, k)
    t = int(ts[k])
    if z_u is None:
        eps, v_c = head(x, t, z_c)
    else:
        e, v = head(torch.cat([x, x]), t, torch.cat([z_c, z_u]))
        eps_c, eps_u = e.chunk(2)
        eps, v_c = eps_u + cfg * (eps_c - eps_u), v[: x.shape[0]]
    x0_hat = (x - math.sqrt(1 - c["ab"]) * eps) / math.sqrt(c["ab"])
    if clip_x0 is not None:
        x0_hat = x0_hat.clamp(-clip_x0, clip_x0)
    mu = c["c1"] * x0_hat + c["c2"] * x
    v = torch.full_like(v_c, float(fixed_v)) if fixed_v is not None else v_c.clamp(-1, 1)
    f = (v + 1) / 2
    return mu, f * c["lmax"] + (1 - f) * c["lmin"]


def _old_aligned_sample(head, z_c, noise, eps, sched, *, z_u=None, cfg=1.0, tau=1.0, final_noise=False, fixed_v=None,
                        clip_x0=None, final_std=None):
    ab_all, ts = sched.alphas_bar, sched.timesteps
    x, s = noise, torch.zeros(noise.shape[0], dtype=noise.dtype, device=noise.device)
    for k in range(len(ab_all) - 1, 0, -1):
        mu, log_var = _old_step(head, x, k, ab_all, ts, z_c, z_u, cfg, fixed_v, clip_x0)
        s = s + 0.5 * log_var.sum(-1)
        x = mu + tau * torch.exp(0.5 * log_var) * eps[k]
    mu0, log_var0 = _old_step(head, x, 0, ab_all, ts, z_c, z_u, cfg, fixed_v, clip_x0)
    log_std0 = 0.5 * log_var0 + math.log(tau) if final_std is None else torch.full_like(mu0, math.log(final_std))
    x0 = mu0 + torch.exp(log_std0) * eps[0] if final_noise else mu0
    return generate.HeadSample(x0, mu0, log_std0, s)


def _independent_schedule(K, T=1000, s=0.008):
    """(alpha_bar of each respaced step, its original timestep) in numpy, from the cosine formula."""
    f = lambda t: math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    ab = np.cumprod([1 - min(1 - f(t + 1) / f(t), 0.999) for t in range(T)])
    keep = np.rint(np.linspace(0, T - 1, K)).astype(int)
    return ab[keep], keep


def _inputs(seed=3, N=5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return r(N, 16), r(N, 16), r(N, C), r(K, N, C)  # z, z_u, x^(K), eps


CASES = [dict(), dict(cfg=2.5, tau=0.9, uncond=True), dict(final_noise=True), dict(fixed_v=0.3, clip_x0=2.0),
         dict(final_noise=True, final_std=0.05, uncond=True, row_cfg=1.7)]


def _kw(case, zu, N):
    kw = {k: v for k, v in case.items() if k not in ("uncond", "row_cfg")}
    if case.get("uncond"):
        kw["z_u"] = zu
    if "row_cfg" in case:
        kw["cfg"] = torch.full((N, 1), case["row_cfg"], dtype=torch.float64)
    return kw


@pytest.mark.parametrize("case", CASES)
def test_ddpm_default_is_bit_identical_to_the_frozen_formulas(case):
    """Schedule.respaced(K) and aligned_sample as before the sampler option, to the last bit
    (torch.equal), for CFG (scalar and per-row), temperature, fixed v, clipping, final noise and std."""
    head = tiny_mar(0).head
    z, zu, noise, eps = _inputs()
    sched = Schedule.respaced(K)
    ab, keep = _independent_schedule(K)
    assert sched.sampler == "ddpm" and sched.eta == 0.0
    assert torch.equal(sched.timesteps, torch.from_numpy(keep)) and np.allclose(sched.alphas_bar.numpy(), ab, rtol=1e-12)
    kw = _kw(case, zu, z.shape[0])
    new, old = aligned_sample(head, z, noise, eps, sched, **kw), _old_aligned_sample(head, z, noise, eps, sched, **kw)
    for f in ("x0", "mu0", "log_std0", "s"):
        assert torch.equal(getattr(new, f), getattr(old, f)), f
    assert torch.isfinite(new.s).all() and not torch.equal(new.s, torch.zeros_like(new.s))


def test_the_default_loop_runs_the_frozen_ddpm_chain(monkeypatch):
    """The loop (target-only, CSpD paper/parallel and exact/prefix) gives the same tokens and counters
    with the frozen chain swapped in for aligned_sample."""
    base = tiny_mar(0)
    t, d = _with_head(base, GaussianHead(0.0)), _with_head(base, GaussianHead(0.04))
    hc = HeadConfig(steps=K, cfg=2.0)

    def runs():
        return [ar_generate(t, LABELS, [0, 1], hc), cspd_generate(t, d, LABELS, [0, 1], hc, gamma=3),
                cspd_generate(t, d, LABELS, [0, 1], hc, gamma=3, mode="exact", verify="prefix", final_std=0.05)]

    new = runs()
    monkeypatch.setattr(generate, "aligned_sample", _old_aligned_sample)
    old = runs()
    for a, b in zip(new, old):
        assert torch.equal(a.tokens, b.tokens) and a.counters == b.counters


# ----------------------------------------------------------------------------------- DDIM's chain
class AnalyticHead(torch.nn.Module):
    """A smooth head with a t- and z-dependent epsilon and a v in (-1, 1) (which DDIM must ignore)."""

    def __init__(self, w: float = 0.7, shift: float = 0.0):
        super().__init__()
        self.w, self.shift = w, shift

    def forward(self, x, t, z):
        eps = torch.tanh(self.w * x + z[:, : x.shape[1]] + self.shift) * (1 + t / 1000)
        return eps, torch.tanh(x + z[:, 1: x.shape[1] + 1] + self.shift)


@pytest.mark.parametrize("eta,clip", [(0.0, None), (0.6, None), (1.0, None), (0.6, 0.5)])
def test_one_ddim_step_is_eq_12(eta, clip):
    """mean sqrt(ab') x0_hat + sqrt(1 - ab' - sigma^2) eps_hat, log var 2 log sigma with sigma = eta
    sqrt((1 - ab') / (1 - ab)) sqrt(1 - ab / ab'), from an independent schedule in numpy; eps_hat
    from the clipped x0_hat when clipping; at k = 0 the mean is x0_hat, as DDPM's."""
    head = AnalyticHead()
    z, _, x, _ = _inputs(5)
    sched = Schedule.respaced(K, sampler="ddim", eta=eta)
    ab, keep = _independent_schedule(K)
    for k in (K - 1, 3, 1):
        mu, log_var = step_gaussian(head, x, k, sched, z, clip_x0=clip)
        e = head(x, int(keep[k]), z)[0].numpy()
        xn, a, a_prev = x.numpy(), ab[k], ab[k - 1]
        x0 = (xn - np.sqrt(1 - a) * e) / np.sqrt(a)
        if clip is not None:
            x0 = np.clip(x0, -clip, clip)
            e = (xn - np.sqrt(a) * x0) / np.sqrt(1 - a)
        sigma = eta * np.sqrt((1 - a_prev) / (1 - a)) * np.sqrt(1 - a / a_prev)
        want = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev - sigma ** 2) * e
        np.testing.assert_allclose(mu.numpy(), want, rtol=1e-10, atol=1e-12)
        if eta == 0:
            assert torch.isinf(log_var).all() and (log_var < 0).all()
        else:
            np.testing.assert_allclose(log_var.numpy(), np.full_like(want, 2 * np.log(sigma)), rtol=1e-12)
    mu0, _ = step_gaussian(head, x, 0, sched, z, clip_x0=clip)
    x0 = (x - math.sqrt(1 - ab[0]) * head(x, int(keep[0]), z)[0]) / math.sqrt(ab[0])
    torch.testing.assert_close(mu0, x0 if clip is None else x0.clamp(-clip, clip), rtol=1e-12, atol=0)


def test_ddim_final_step_is_the_ddpm_final_step():
    """From the same x^(1): the ddim and ddpm Gaussians of step 0 are the same numbers (bit for bit)."""
    head = tiny_mar(1).head
    z, zu, x, _ = _inputs(7)
    a = step_gaussian(head, x, 0, Schedule.respaced(K), z, zu, 2.0)
    b = step_gaussian(head, x, 0, Schedule.respaced(K, sampler="ddim", eta=0.4), z, zu, 2.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("tau,clip", [(1.0, None), (0.8, 3.0)])
def test_ddim_eta_1_is_ddpm_with_the_fixed_small_variance(tau, clip):
    """eta = 1: sigma_k^2 = beta_tilde_k and eq. 12's mean = the DDPM posterior mean, so the aligned
    chain equals DDPM with fixed_v = -1 (log var = lmin), S included (its k = 0 uses that fixed_v)."""
    head = AnalyticHead()
    z, zu, noise, eps = _inputs(11)
    kw = dict(z_u=zu, cfg=1.5, tau=tau, clip_x0=clip, fixed_v=-1.0, final_noise=True)
    a = aligned_sample(head, z, noise, eps, Schedule.respaced(K, sampler="ddim", eta=1.0), **kw)
    b = aligned_sample(head, z, noise, eps, Schedule.respaced(K), **kw)
    for f in ("x0", "mu0", "log_std0", "s"):
        torch.testing.assert_close(getattr(a, f), getattr(b, f), rtol=1e-10, atol=1e-12)
    c = aligned_sample(head, z, noise, eps, Schedule.respaced(K), **{**kw, "fixed_v": None})  # learned v: not DDIM
    assert not torch.allclose(c.x0, a.x0, rtol=1e-6)


def test_ddim_eta_0_is_deterministic_given_the_initial_noise():
    """eta = 0: the token is a function of x^(K) only (eps_k, k >= 1, unused; eps_0 only as final
    noise); DDPM and eta > 0 do use the per-step noise."""
    head = AnalyticHead()
    z, zu, noise, eps = _inputs(13)
    other = eps.clone()
    other[1:] = torch.randn(K - 1, *eps.shape[1:], generator=torch.Generator().manual_seed(99), dtype=eps.dtype)
    ddim = Schedule.respaced(K, sampler="ddim")
    a = aligned_sample(head, z, noise, eps, ddim, z_u=zu, cfg=2.0)
    b = aligned_sample(head, z, noise, other, ddim, z_u=zu, cfg=2.0)
    assert torch.equal(a.x0, b.x0) and torch.equal(a.log_std0, b.log_std0) and torch.equal(a.s, torch.zeros_like(a.s))
    c = aligned_sample(head, z, noise * 1.1, eps, ddim, z_u=zu, cfg=2.0)
    assert not torch.allclose(a.x0, c.x0)
    for sched in (Schedule.respaced(K), Schedule.respaced(K, sampler="ddim", eta=0.3)):
        assert not torch.allclose(aligned_sample(head, z, noise, eps, sched).x0,
                                  aligned_sample(head, z, noise, other, sched).x0)


@pytest.mark.parametrize("eta", [0.0, 0.3, 1.0])
def test_ddim_S_is_a_schedule_constant_so_log_sigma_is_0(eta):
    """Two different heads (learned variances v differ): S_q - S_p = 0 exactly under ddim, S =
    sum_{k>=1} C/2 log sigma_k^2 (independent schedule; 0 at eta = 0); under ddpm S_q != S_p."""
    z, zu, noise, eps = _inputs(17)
    hp, hq = AnalyticHead(0.7, 0.0), AnalyticHead(0.5, 0.3)
    ddim = Schedule.respaced(K, sampler="ddim", eta=eta)
    p = aligned_sample(hp, z, noise, eps, ddim, z_u=zu, cfg=2.0, tau=0.9)
    q = aligned_sample(hq, z, noise, eps, ddim, z_u=zu, cfg=2.0, tau=0.9)
    assert torch.equal(q.s - p.s, torch.zeros_like(p.s))
    ab, _ = _independent_schedule(K)
    want = 0.0 if eta == 0 else sum(C * np.log(eta * np.sqrt((1 - ab[k - 1]) / (1 - ab[k])) * np.sqrt(1 - ab[k] / ab[k - 1]))
                                    for k in range(1, K))
    np.testing.assert_allclose(p.s.numpy(), np.full(p.s.shape, want), rtol=1e-12, atol=0)
    ddpm = Schedule.respaced(K)
    assert (aligned_sample(hq, z, noise, eps, ddpm).s - aligned_sample(hp, z, noise, eps, ddpm).s).abs().min() > 1e-3


# ---------------------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("mode,eta", [("paper", 0.0), ("paper", 0.5), ("exact", 0.0)])
def test_identical_models_accept_all_under_ddim(mode, eta):
    """log Sigma = 0 and equal final Gaussians: a model verifying itself keeps every token and
    reproduces target-only DDIM sampling; DDIM's tokens differ from DDPM's."""
    t = tiny_mar()
    hc = HeadConfig(steps=K, cfg=2.0, sampler="ddim", eta=eta)
    with batch_invariant():
        ar = ar_generate(t, LABELS, [0, 1], hc, final_noise=mode == "exact")
        sp = cspd_generate(t, t, LABELS, [0, 1], hc, gamma=3, mode=mode, verify="prefix", prefill=0.1)
    assert torch.equal(sp.tokens, ar.tokens)
    assert all(sp.acceptance_rate(b) == 1.0 for b in range(2))
    ddpm = ar_generate(t, LABELS, [0, 1], HeadConfig(steps=K, cfg=2.0), final_noise=mode == "exact")
    assert not torch.allclose(ddpm.tokens, ar.tokens)


@pytest.mark.parametrize("eta", [0.0, 0.5])
def test_exact_prefix_mode_with_ddim_keeps_the_target_distribution(eta):
    """CSpD (exact, prefix) with a shifted draft against target-only DDIM sampling, both with final
    std s: KS at three positions and on each sample's token sum; the negative control (the draft's
    own samples, what an accept-everything rule outputs) fails the same checks."""
    base = tiny_mar(0)
    t, d = _with_head(base, GaussianHead(0.0)), _with_head(base, GaussianHead(0.3))
    hc, s, n = HeadConfig(steps=K, sampler="ddim", eta=eta), 0.3, 200
    labels = torch.zeros(n, dtype=torch.long)
    ar = ar_generate(t, labels, range(n), hc, final_noise=True, final_std=s).tokens
    sp = cspd_generate(t, d, labels, range(10_000, 10_000 + n), hc, gamma=3, mode="exact", verify="prefix",
                       prefill=0.1, final_std=s)
    draft_only = ar_generate(d, labels, range(20_000, 20_000 + n), hc, final_noise=True, final_std=s).tokens

    def pvalues(x):
        return [stats.ks_2samp(ar[:, j, 0].numpy(), x[:, j, 0].numpy()).pvalue for j in (1, 4, 8)] + [
            stats.ks_2samp(ar.sum((1, 2)).numpy(), x.sum((1, 2)).numpy()).pvalue]

    assert min(pvalues(sp.tokens)) > 1e-3, pvalues(sp.tokens)
    assert pvalues(draft_only)[-1] < 1e-6, pvalues(draft_only)  # the check has power against the draft
    rate = sum(c["accepted"] for c in sp.counters) / sum(c["verified"] for c in sp.counters)
    assert 0.1 < rate < 0.9, rate


# --------------------------------------------------------------------------- the method's overrides
def test_method_overrides_the_target_head_for_cspd_and_its_baseline():
    target_head = HeadConfig(steps=K, cfg=2.0)
    m = build_method("cspd", family="continuous", sampler="ddim", eta=0.25, head_steps=5)
    for x in (m, m.baseline()):
        assert x.head_config(target_head) == dataclasses.replace(target_head, sampler="ddim", eta=0.25, steps=5)
    assert m.describe()["sampler"] == "ddim" and m.baseline().describe() == {
        "method": "ar", "sampler": "ddim", "eta": 0.25, "head_steps": 5}
    plain = build_method("cspd", family="continuous")
    assert plain.head_config(target_head) is target_head
    assert not {"sampler", "eta", "head_steps"} & (set(plain.describe()) | set(plain.baseline().describe()))
    ddim_target = HeadConfig(steps=K, sampler="ddim", eta=0.5)  # ddpm without eta: eta 0, not the target's 0.5
    assert ContinuousMethod("ar", sampler="ddpm").head_config(ddim_target) == HeadConfig(steps=K)
    assert ContinuousMethod("ar", head_steps=4).head_config(ddim_target) == dataclasses.replace(ddim_target, steps=4)
    assert build_method("ar", family="continuous", sampler="ddim").describe() == {"method": "ar", "sampler": "ddim"}
    assert build_method("ar", sampler=None, eta=None, head_steps=None).params == {}  # discrete: records unchanged


@pytest.mark.parametrize("call, message", [
    (lambda: Schedule.respaced(K, sampler="dpm"), "unknown sampler 'dpm'; valid: ddpm, ddim"),
    (lambda: Schedule.respaced(K, sampler="ddim", eta=1.5), r"eta \(DDIM's noise scale\) must be a number in \[0, 1\]"),
    (lambda: Schedule.respaced(K, sampler="ddim", eta=-0.1), r"must be a number in \[0, 1\], got -0.1"),
    (lambda: Schedule.respaced(K, eta=0.5), "eta=0.5 is DDIM's noise scale: it needs sampler=ddim"),
    (lambda: HeadConfig(sampler="euler"), "unknown sampler 'euler'"),
    (lambda: HeadConfig(eta=0.2), "it needs sampler=ddim"),
    (lambda: build_method("cspd", family="continuous", sampler="ddpm", eta=0.3), "it needs sampler=ddim"),
    (lambda: build_method("cspd", family="continuous", sampler="plms"), "unknown sampler 'plms'; valid: ddpm, ddim, null"),
    (lambda: build_method("cspd", family="continuous", eta=2.0), "cspd eta must be a finite number >= 0 and <= 1"),
    (lambda: build_method("cspd", family="continuous", head_steps=1), "cspd head_steps must be an integer >= 2"),
    (lambda: build_method("ar", sampler="ddim"), "ar sampler applies to continuous targets only"),
    (lambda: ContinuousMethod("cspd", eta=0.5).head_config(HeadConfig(steps=K)), "it needs sampler=ddim"),  # a ddpm target
    (lambda: ContinuousMethod("cspd", sampler="ddim").head_config(FlowConfig(num_steps=3, cfg=1.0)),
     r"method.sampler=ddim: a flow target \(FlowConfig, xAR's Euler-Maruyama sampler\) has no diffusion head"),
])
def test_bad_values_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as e:
        call()
    assert "\n" not in str(e.value)


def test_the_config_check_refuses_before_any_model_loads(compose):
    from coolsd.job.config_schema import check_config
    from coolsd.util.errors import ConfigError

    for overrides, message in (
            (("target=xar_h", "method=cspd", "method.sampler=ddim"), "method.sampler=ddim: a flow target"),
            (("target=xar_h", "method=ar", "method.eta=0.5"), "method.eta=0.5: a flow target"),
            (("target=toy", "method=ar", "method.sampler=ddim"),
             "method.sampler='ddim' is invalid: it applies to continuous targets only"),
            (("target=toy_continuous", "method=cspd", "method.sampler=ddpm", "method.eta=0.5"), "it needs sampler=ddim"),
            (("target=toy_continuous", "method=cspd", "method.sampler=pndm"), "method.sampler='pndm' is invalid: valid")):
        with pytest.raises(ConfigError, match=message) as e:
            check_config(compose(*overrides))
        assert "\n" not in str(e.value)


def test_run_py_cspd_with_ddim_on_the_toy_continuous_world(compose, toy_continuous_assets, tmp_path):
    """``run.py target=toy_continuous method=cspd method.sampler=ddim method.head_steps=5``: records
    carry the sampler for CSpD and its AR baseline; the target drafting for itself (exact, prefix)
    accepts everything and reproduces the baseline's images, so the baseline ran DDIM too."""
    from PIL import Image

    from coolsd.cli.runner import run
    from factories import toy_continuous_overrides

    out = tmp_path / "run"
    s = run(compose("target=toy_continuous", "method=cspd", *toy_continuous_overrides(toy_continuous_assets),
                    "dataset.n_prompts=2", "method.gamma=4", "method.sampler=ddim", "method.head_steps=5", "draft=self",
                    "method.mode=exact", "method.verify=prefix", "deterministic.batch_invariant=true", f"+out_dir={out}"))
    recs = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["method"] for r in recs) == ["ar", "ar", "cspd", "cspd"]
    for r in recs:
        assert r["params"]["sampler"] == "ddim" and r["params"]["head_steps"] == 5 and "eta" not in r["params"]
    assert s["results"]["cspd"]["acceptance_rate"]["mean"] == 1.0
    for r in recs:
        if r["method"] == "cspd":
            ar = next(x for x in recs if x["method"] == "ar" and x["prompt_index"] == r["prompt_index"])
            a, b = (np.asarray(Image.open(out / x["image"])) for x in (ar, r))
            assert np.array_equal(a, b)
    assert "sampler" not in json.loads((out / "run.json").read_text())["settings"]["head"]  # the target's: ddpm
