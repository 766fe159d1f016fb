"""Multi-token steps of diffusion-head models (``HeadConfig.num_iter``, ``maskgit_steps``): upstream's
MaskGIT-cosine schedule of MAR's ``sample_tokens`` and Harmon's ``Harmon.sample`` (simulated here with
upstream's mask arithmetic), identical draft and target reproducing target-only sampling bit for bit, a
batch equal to its samples alone, and the exact prefix mode lossless over steps of several tokens:
teacher-forced residuals, computed without the loop, are N(0, 1); parallel mode's are not."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.continuous.diffusion import Schedule, aligned_sample, cosine_alphas_bar
from coolsd.engine.continuous.generate import (HeadConfig, ar_generate, cspd_generate, generation_order,
                                               maskgit_steps, position_noise)
from coolsd.models.mar import MAR, MARConfig

TINY = MARConfig(seq_len=16, token_dim=4, encoder_dim=16, encoder_depth=1, encoder_heads=2, decoder_dim=16,
                 decoder_depth=1, decoder_heads=2, buffer_size=2, n_classes=3, head_width=16, head_depth=1)
AB = cosine_alphas_bar()
LABELS = torch.tensor([1, 2])


def tiny_mar(seed=0):
    torch.manual_seed(seed)
    m = MAR(TINY).double().eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def upstream_schedule(L: int, num_iter: int):
    """Tokens predicted and the linear CFG's known count of each iteration, by upstream's arithmetic on
    masks (mar.py sample_tokens; harmon.py:243-270): mask_len = floor(L cos(pi/2 (s+1)/num_iter)),
    clamped to [1, masked - 1]; the first mask_len of the order stay masked; the last step takes all."""
    order = torch.randperm(L, generator=torch.Generator().manual_seed(L + num_iter))
    mask = torch.ones(L, dtype=torch.bool)
    counts, known = [], []
    for step in range(num_iter):
        mask_ratio = np.cos(math.pi / 2.0 * (step + 1) / num_iter)
        mask_len = max(1, min(int(mask.sum()) - 1, int(np.floor(L * mask_ratio))))
        mask_next = torch.zeros(L, dtype=torch.bool)
        mask_next[order[:mask_len]] = True
        to_pred = mask.clone() if step >= num_iter - 1 else mask ^ mask_next
        counts.append(int(to_pred.sum()))
        known.append(L - mask_len)
        mask = mask & ~to_pred
    assert not mask.any()
    return counts, known


@pytest.mark.parametrize("L,num_iter", [(16, 5), (16, 64), (256, 64), (256, 256), (1024, 64), (9, 3)])
def test_steps_are_upstreams_cosine_schedule(L, num_iter):
    counts, known = upstream_schedule(L, num_iter)
    bounds, ours = maskgit_steps(L, num_iter)
    assert np.diff(bounds).tolist() == [c for c in counts if c]  # steps revealing nothing are dropped
    assert ours == [k for c, k in zip(counts, known) if c]
    assert bounds[0] == 0 and bounds[-1] == L


def test_the_schedule_matches_the_research_notes_counts():
    """harmon_upstream.md 2.1: at num_iter 64 the last step takes 6 tokens at L = 256 and 25 at L = 1024;
    num_iter None is one token a step with known = s + 1 (the loop's long-standing MAR schedule)."""
    assert np.diff(maskgit_steps(256, 64)[0])[-1] == 6 and np.diff(maskgit_steps(1024, 64)[0])[-1] == 25
    assert maskgit_steps(256, 256)[0] == list(range(257))  # MAR's num_iter = 256: one token a step
    assert maskgit_steps(5, None) == ([0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5])


HC = HeadConfig(steps=4, num_iter=5, cfg=2.0, cfg_schedule="linear")  # steps of 1, 3, 3, 5, 4 tokens


@pytest.mark.parametrize("mode,verify,gamma", [("exact", "prefix", 2), ("paper", "prefix", 3), ("paper", "parallel", 1)])
def test_identical_models_accept_all_and_match_target_only_bitwise(mode, verify, gamma):
    t = tiny_mar()
    with batch_invariant():
        ar = ar_generate(t, LABELS, [0, 1], HC, final_noise=mode == "exact")
        sp = cspd_generate(t, t, LABELS, [0, 1], HC, gamma=gamma, mode=mode, verify=verify, prefill=0.0)
    assert torch.equal(sp.tokens, ar.tokens)
    assert all(c["target_forwards"] == 5 for c in ar.counters)  # one call a step, not a token
    for b, c in enumerate(sp.counters):
        assert sp.acceptance_rate(b) == 1.0 and c["verified"] == c["drafted"]
    if verify == "prefix" and gamma == 2:  # rounds: steps 0-1 + bonus 2, then 3-4: 9 + 0 drafted tokens ...
        assert [c["drafted"] for c in sp.counters] == [1 + 3 + 5 + 4] * 2  # steps 0, 1 then 3, 4 drafted
        assert [c["target_forwards"] for c in sp.counters] == [2, 2]


@pytest.mark.parametrize("verify", ["prefix", "parallel"])
def test_a_batch_equals_its_samples_alone(verify):
    t, d = tiny_mar(0), tiny_mar(1)
    with batch_invariant():
        both = cspd_generate(t, d, LABELS, [5, 6], HC, gamma=2, mode="exact", verify=verify)
        for b, seed in enumerate([5, 6]):
            one = cspd_generate(t, d, LABELS[b:b + 1], [seed], HC, gamma=2, mode="exact", verify=verify)
            assert torch.equal(one.tokens[0], both.tokens[b]) and one.counters[0] == both.counters[b]


class LinearContext(torch.nn.Module):
    """A diffusion-head model whose token means depend strongly on the known tokens (a tiny random MAR's
    barely do, which would hide a wrong context): z_j = b_j + sum_i known_i W_ji x_i, and ``head`` the ideal
    epsilon-predictor for data N(z_j + shift, S^2 I) (as tests/engine/test_cspd_generate.py's GaussianHead)."""

    def __init__(self, shift: float, seed: int = 0, S: float = 0.5, L: int = 16, C: int = 4):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = MARConfig(**{**TINY.__dict__, "seq_len": L, "token_dim": C})
        self.W = torch.nn.Parameter(torch.randn(L, L, C, C, generator=g, dtype=torch.float64) * 0.25)
        self.b = torch.nn.Parameter(torch.randn(L, C, generator=g, dtype=torch.float64) * 0.5)
        self.shift, self.S = shift, S

    def conditions(self, tokens, known, labels):
        return self.b + torch.einsum("jicd,bid->bjc", self.W, tokens * known.unsqueeze(-1))

    def head(self, x, t, z):
        ab = float(AB[t])
        m = z + self.shift
        return (1 - ab) ** 0.5 * (x - ab ** 0.5 * m) / (ab * self.S ** 2 + 1 - ab), torch.zeros_like(x)


def residuals(target, tokens, seeds, hc, final_std):
    """(x - mu_p) / s of every token, mu_p the target's final mean given the output's own earlier steps and
    the position's aligned noise, recomputed here step by step (not by the loop)."""
    bounds, _ = maskgit_steps(TINY.seq_len, hc.num_iter)
    sched = Schedule.respaced(hc.steps)
    out = []
    for b, seed in enumerate(seeds):
        order = generation_order(seed, TINY.seq_len, hc.order)
        x = tokens[b:b + 1]
        for s in range(len(bounds) - 1):
            known = torch.zeros(1, TINY.seq_len, dtype=torch.bool)
            known[0, order[:bounds[s]]] = True
            z = target.conditions(x, known, torch.zeros(1, dtype=torch.long))[0]
            for j in order[bounds[s]:bounds[s + 1]].tolist():
                noise, eps = position_noise(seed, j, sched.K, TINY.token_dim)
                h = aligned_sample(target.head, z[j:j + 1], noise[None], eps[:, None], sched, final_std=final_std)
                out.append(((x[0, j] - h.mu0[0]) / final_std).numpy())
    return np.concatenate(out)


@pytest.mark.parametrize("verify,gamma,lossless", [("prefix", 2, True), ("prefix", 5, True), ("parallel", 2, False)])
def test_exact_prefix_mode_is_lossless_over_multi_token_steps(verify, gamma, lossless):
    t, d = LinearContext(0.0), LinearContext(0.04)
    hc, s, n = HeadConfig(steps=4, num_iter=5), 0.05, 60
    seeds = list(range(100, 100 + n))
    with torch.no_grad():
        res = cspd_generate(t, d, torch.zeros(n, dtype=torch.long), seeds, hc, gamma=gamma, mode="exact", verify=verify,
                            prefill=0.0, final_std=s)
        r = residuals(t, res.tokens, seeds, hc, s)
    rate = sum(c["accepted"] for c in res.counters) / sum(c["verified"] for c in res.counters)
    assert 0.1 < rate < 0.9, rate  # both the accepted and the resampled path
    ks = stats.kstest(r, "norm").pvalue
    chi = stats.chi2.sf((r ** 2).sum(), r.size)
    if lossless:
        assert ks > 1e-3 and 1e-3 < chi < 1 - 1e-3 and abs(r.mean()) < 4 / math.sqrt(r.size), (ks, chi, r.mean())
    else:  # parallel mode: the target sees none of the round's drafts: residuals off N(0, 1)
        assert min(ks, chi) < 1e-6, (ks, chi)


def test_num_iter_is_checked():
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="num_iter"):
            HeadConfig(num_iter=bad)
