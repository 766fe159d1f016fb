"""The continuous generation loop (coolsd.engine.continuous.generate) on tiny random-weight MAR models:
identical draft and target accept everything and reproduce target-only sampling bit for bit
(prefix verification at any gamma; parallel verification at gamma = 1, where the target sees
what the draft saw); a batch equals its samples alone; the exact prefix mode keeps the
target's token distribution (two-sample checks at n = 100 catch gross bias only; the per-token
rules' exactness is tested at n = 20,000 in tests/engine/test_cspd.py); counters add up; bad settings
are errors."""
import copy

import pytest
import torch
from scipy import stats

from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.continuous.diffusion import cosine_alphas_bar
from coolsd.engine.continuous.generate import HeadConfig, ar_generate, cspd_generate
from coolsd.models.mar import MAR, MARConfig

TINY = MARConfig(seq_len=9, token_dim=4, encoder_dim=16, encoder_depth=1, encoder_heads=2, decoder_dim=16,
                 decoder_depth=1, decoder_heads=2, buffer_size=2, n_classes=3, head_width=16, head_depth=1)
HC = HeadConfig(steps=8)
AB = cosine_alphas_bar()  # alpha_bar of the original timesteps the head is called with


def tiny_mar(seed=0, **kw):
    torch.manual_seed(seed)
    m = MAR(MARConfig(**{**TINY.__dict__, **kw})).double().eval()
    for p in m.parameters():  # upstream zero-inits the head's output: randomise everything
        torch.nn.init.normal_(p, std=0.3)
    return m


LABELS = torch.tensor([1, 2])


@pytest.mark.parametrize("mode,verify,gamma,hc", [
    ("exact", "prefix", 3, HC), ("paper", "prefix", 3, HC), ("paper", "parallel", 1, HC),
    ("exact", "prefix", 4, HeadConfig(steps=8, cfg=2.0, cfg_schedule="linear")),
    ("paper", "parallel", 1, HeadConfig(steps=8, order="raster", cfg=3.0)),
])
def test_identical_models_accept_all_and_match_target_only_bitwise(mode, verify, gamma, hc):
    t = tiny_mar()
    with batch_invariant():  # rows of different batch shapes round alike (coolsd.engine.batch_invariant)
        ar = ar_generate(t, LABELS, [0, 1], hc, final_noise=mode == "exact")
        sp = cspd_generate(t, t, LABELS, [0, 1], hc, gamma=gamma, mode=mode, verify=verify, prefill=0.1)
    assert torch.equal(sp.tokens, ar.tokens)
    plain = cspd_generate(t, t, LABELS, [0, 1], hc, gamma=gamma, mode=mode, verify=verify, prefill=0.1)
    torch.testing.assert_close(plain.tokens, ar.tokens, rtol=1e-12, atol=0)  # default kernels: rounding only
    for b, c in enumerate(sp.counters):
        assert sp.acceptance_rate(b) == 1.0 and c["fallbacks"] == 0 and c["resample_rounds"] == 0
        assert c["verified"] == c["drafted"] == c["draft_forwards"]
        if verify == "prefix":  # 1 pre-filled, then rounds of gamma drafts + the bonus while there is room
            n, rounds, drafted = 1, 0, 0
            while n < 9:
                g = min(gamma, 9 - n)
                n, rounds, drafted = n + g + (n + g < 9), rounds + 1, drafted + g
            assert (c["drafted"], c["target_forwards"]) == (drafted, 1 + rounds)


def test_parallel_verification_is_not_exact_for_identical_models_past_gamma_1():
    """Mode A's target sees the verified tokens only (continuous_sd.md 2.7 d): with gamma > 1 its
    condition differs from the draft's, so even a model verifying itself rejects some tokens."""
    t = tiny_mar()
    sp = cspd_generate(t, t, LABELS, [0, 1], HC, gamma=4, mode="paper", verify="parallel", prefill=0.0)
    assert all(c["verified"] == 9 and c["target_forwards"] == 3 for c in sp.counters)  # ceil(9 / 4) rounds
    assert min(sp.acceptance_rate(b) for b in range(2)) < 1.0


@pytest.mark.parametrize("verify", ["prefix", "parallel"])
def test_a_batch_equals_its_samples_alone(verify):
    """Per-sample noise, orders and generators: a batch equals its samples alone, bit for bit under
    ``batch_invariant`` (accept / reject decisions would otherwise depend on GEMM rounding)."""
    t, d = tiny_mar(0), tiny_mar(1)
    with batch_invariant():
        both = cspd_generate(t, d, LABELS, [5, 6], HC, gamma=3, mode="exact", verify=verify)
        for b, seed in enumerate([5, 6]):
            one = cspd_generate(t, d, LABELS[b:b + 1], [seed], HC, gamma=3, mode="exact", verify=verify)
            assert torch.equal(one.tokens[0], both.tokens[b])
            assert one.counters[0] == both.counters[b]


class GaussianHead(torch.nn.Module):
    """The ideal epsilon-predictor for data N(m(z), S^2 I): eps*(x) = sqrt(1 - ab) (x - sqrt(ab) m)
    / (ab S^2 + 1 - ab), with m(z) = tanh(z[:, :C]) + shift. Random untrained heads make MAR's
    unclipped chain explode (|mu_0| ~ 1e4), so no two models ever agree to the final std (~6e-3);
    this head keeps the chain on the data scale, with the AR dependence through z."""

    def __init__(self, shift: float, S: float = 0.5):
        super().__init__()
        self.shift, self.S = shift, S

    def forward(self, x, t, z):
        ab = float(AB[t])
        m = torch.tanh(z[:, : x.shape[1]]) + self.shift
        eps = (1 - ab) ** 0.5 * (x - ab ** 0.5 * m) / (ab * self.S ** 2 + 1 - ab)
        return eps, torch.zeros_like(x)


def _with_head(model, head):
    m = copy.deepcopy(model)
    m.diffloss.net = head
    return m


@pytest.mark.parametrize("shift,final_std", [(0.004, None), (0.04, 0.05)])
def test_exact_prefix_mode_keeps_the_target_distribution(shift, final_std):
    """Means ``shift`` apart per dim against final stds ~6e-3 (the head's), or against the
    smoothing s = final_std shared by target-only sampling: partial acceptance either way."""
    base = tiny_mar(0)
    t, d = _with_head(base, GaussianHead(0.0)), _with_head(base, GaussianHead(shift))
    n = 100
    ar = ar_generate(t, torch.zeros(n, dtype=torch.long), range(n), HC, final_noise=True, final_std=final_std).tokens
    sp = cspd_generate(t, d, torch.zeros(n, dtype=torch.long), range(10_000, 10_000 + n), HC, gamma=3, mode="exact",
                       verify="prefix", prefill=0.1, final_std=final_std)
    for pos in (1, 4, 8):
        assert stats.ks_2samp(ar[:, pos, 0].numpy(), sp.tokens[:, pos, 0].numpy()).pvalue > 1e-3
    rate = sum(c["accepted"] for c in sp.counters) / sum(c["verified"] for c in sp.counters)
    assert 0.1 < rate < 0.9, rate  # both paths exercised; per-token exactness: tests/engine/test_cspd.py
    for c in sp.counters:
        assert c["accepted"] <= c["verified"] <= c["drafted"] == c["draft_forwards"]


def test_inner_temperature_widens_the_paper_test_only():
    """lam = 42 (the official code) accepts where the paper's formula (lam = 1) rejects
    everything; the identical-model case is unaffected (log r = 0 for any lam)."""
    base = tiny_mar(0)
    t, d = _with_head(base, GaussianHead(0.0)), _with_head(base, GaussianHead(0.05))
    labels = torch.zeros(8, dtype=torch.long)
    rates = {lam: sum(c["accepted"] for c in cspd_generate(t, d, labels, range(8), HC, gamma=4,
                                                             inner_temperature=lam).counters)
             for lam in (1.0, 42.0)}
    assert rates[1.0] == 0 and rates[42.0] > 0, rates
    same = cspd_generate(t, t, labels[:2], [0, 1], HC, gamma=1, inner_temperature=42.0)
    assert all(c["accepted"] == c["verified"] for c in same.counters)


def test_bad_settings_are_errors():
    t = tiny_mar()
    for kw, msg in ((dict(mode="fast"), "unknown mode 'fast'; valid: exact, paper"),
                    (dict(verify="tree"), "unknown verify 'tree'; valid: parallel, prefix"),
                    (dict(gamma=0), "gamma must be an integer >= 1"),
                    (dict(prefill=1.5), "prefill must be a fraction"),
                    (dict(final_std=0.0), "final_std must be > 0"),
                    (dict(inner_temperature=-1.0), "inner_temperature must be > 0")):
        with pytest.raises(ValueError, match=msg):
            cspd_generate(t, t, LABELS, [0, 1], HC, **kw)
    with pytest.raises(ValueError, match="unknown order 'spiral'"):
        HeadConfig(order="spiral")
    with pytest.raises(ValueError, match="disagree on"):
        cspd_generate(t, tiny_mar(token_dim=3), LABELS, [0, 1], HC)
