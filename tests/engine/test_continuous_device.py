"""The continuous loop (coolsd.engine.continuous.generate, .cspd, .diffusion) draws on the model's device:
every ``torch.Generator`` it makes names the device of the model's parameters, and every draw
(initial and per-step noise, verification uniforms, resample proposals) passes that generator
and that device, so a CUDA model gets CUDA generators and CUDA draws (no CPU generator handed a
CUDA tensor, no per-round CPU draw copied over). No draw uses torch's global RNG (a sample stays
a function of its seed and label). The CPU tests record the calls; the CUDA test runs the loop on
a GPU where one exists (CPU and CUDA samples differ: torch's CPU and CUDA generators differ)."""
import copy

import pytest
import torch

from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.continuous import cspd
from coolsd.engine.continuous.generate import HeadConfig, _seed, ar_generate, cspd_generate, position_noise

from test_cspd_generate import HC, GaussianHead, tiny_mar  # the tiny MAR pair and its ideal head

DRAWS = ("randn", "rand", "randint", "randperm", "multinomial", "normal", "randn_like", "rand_like", "bernoulli")


def _pair(shift=0.004):
    base = tiny_mar(0)
    t, d = copy.deepcopy(base), copy.deepcopy(base)
    t.diffloss.net, d.diffloss.net = GaussianHead(0.0), GaussianHead(shift)
    return t, d


class DrawLog:
    """Records the device argument of every ``torch.Generator(...)`` and, for every random draw,
    (name, the generator's device or None, the requested device or None)."""

    def __init__(self, monkeypatch):
        self.generators, self.draws = [], []
        real = torch.Generator

        def generator(device=None):
            self.generators.append(device)
            return real() if device is None else real(device=device)

        monkeypatch.setattr(torch, "Generator", generator)
        for name in DRAWS:
            monkeypatch.setattr(torch, name, self._wrap(name, getattr(torch, name)))

    def _wrap(self, name, fn):
        def draw(*args, **kw):
            g = kw.get("generator")
            self.draws.append((name, None if g is None else g.device, kw.get("device")))
            return fn(*args, **kw)
        return draw

    def check(self, device):
        device = torch.device(device)
        assert self.generators and self.draws
        assert all(d is not None and torch.device(d) == device for d in self.generators), self.generators
        for name, g, want in self.draws:
            assert g is not None, f"torch.{name} drew from the global RNG"
            assert want is not None and torch.device(want) == g == device, (name, g, want)


@pytest.mark.parametrize("mode,verify", [("exact", "prefix"), ("paper", "parallel"), ("exact", "parallel"),
                                         ("paper", "prefix")])
def test_every_generator_and_draw_of_cspd_follows_the_models_device(monkeypatch, mode, verify):
    t, d = _pair()
    log = DrawLog(monkeypatch)
    out = cspd_generate(t, d, torch.tensor([0, 1, 2]), [3, 4, 5], HC, gamma=3, mode=mode, verify=verify, max_rounds=2)
    log.check(next(t.parameters()).device)
    assert out.tokens.device == next(t.parameters()).device
    c = out.counters
    assert 0 < sum(x["accepted"] for x in c) < sum(x["verified"] for x in c)  # both paths ran
    assert sum(x["resample_rounds"] for x in c) > 0


def test_every_generator_and_draw_of_target_only_sampling_follows_the_models_device(monkeypatch):
    t = tiny_mar(0)
    log = DrawLog(monkeypatch)
    ar_generate(t, torch.tensor([1, 2]), [0, 1], HeadConfig(steps=8, cfg=2.0), final_noise=True)
    log.check("cpu")


def test_the_per_token_rules_draw_on_their_inputs_device(monkeypatch):
    """verify_paper / verify_exact / verify_reflection / resample draw with the device of their
    tensors (the caller's generator must live there) and return tensors on it."""
    log = DrawLog(monkeypatch)
    g = torch.Generator(device="cpu").manual_seed(0)
    n, C = 64, 3
    mu_q, mu_p = torch.zeros(n, C, dtype=torch.float64), torch.full((n, C), 0.3, dtype=torch.float64)
    ls = torch.full((n, C), -1.0, dtype=torch.float64)
    x0 = mu_q + torch.exp(ls) * torch.randn(n, C, generator=g, dtype=torch.float64, device="cpu")
    for v in (cspd.verify_exact(x0, mu_p, ls, mu_q, ls, g, max_rounds=2),
              cspd.verify_paper(x0, mu_p, ls, mu_q, ls, torch.zeros(n, dtype=torch.float64),
                                torch.full((n,), 0.5, dtype=torch.float64), g, 2),
              cspd.verify_reflection(x0, mu_p, mu_q, 0.3, g)):
        assert {t.device for t in (v.tokens, v.accepted, v.rounds, v.fallback)} == {x0.device}
        assert 0 < v.acceptance_rate < 1
    y, r, fb = cspd.resample(mu_p, ls, mu_q, ls, 0.0, g, max_rounds=3)  # a float log Sigma too
    assert {y.device, r.device, fb.device} == {x0.device} and r.min() >= 1
    log.check("cpu")


def test_position_noise_follows_the_requested_device_and_is_unchanged_on_the_cpu():
    """The CPU default is the generator of before (samples on the CPU are unchanged)."""
    x, eps = position_noise(7, 3, 5, 4, torch.float64, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(_seed(7, 3))
    assert torch.equal(x, torch.randn(4, generator=g, dtype=torch.float64))
    assert torch.equal(eps, torch.randn(5, 4, generator=g, dtype=torch.float64))
    assert torch.equal(position_noise(7, 3, 5, 4, torch.float64)[0], x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("verify", ["prefix", "parallel"])
def test_the_loop_runs_on_cuda_with_cuda_generators_and_a_batch_equals_its_samples_alone(monkeypatch, verify):
    t, d = (m.cuda() for m in _pair(0.004))
    log = DrawLog(monkeypatch)
    labels = torch.tensor([0, 1, 2])
    with batch_invariant():
        both = cspd_generate(t, d, labels, [3, 4, 5], HC, gamma=3, mode="exact", verify=verify)
        again = cspd_generate(t, d, labels, [3, 4, 5], HC, gamma=3, mode="exact", verify=verify)
        alone = [cspd_generate(t, d, labels[b:b + 1], [s], HC, gamma=3, mode="exact", verify=verify)
                 for b, s in enumerate([3, 4, 5])]
    log.check(next(t.parameters()).device)
    assert both.tokens.is_cuda and torch.equal(both.tokens, again.tokens) and both.counters == again.counters
    for b, one in enumerate(alone):
        assert torch.equal(one.tokens[0], both.tokens[b]) and one.counters[0] == both.counters[b]
    ar = ar_generate(t, labels, [3, 4, 5], HC, final_noise=True)
    assert ar.tokens.is_cuda and torch.isfinite(ar.tokens).all()
