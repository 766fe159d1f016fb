"""The per-token exactness test on neural targets (benchmarks/exactness.py): the randomised PIT is
uniform exactly when draws come from the distribution it is taken under, the teacher-forced
rescoring equals what the loop scored each token with, and on the toy world the test passes a
lossless method and fails a relaxed one at the same n."""
from pathlib import Path

import pytest
import torch
from scipy import stats

from coolsd.engine.decoding.sampling import randomized_pit, sample_inverse_cdf
from coolsd.engine.signals import teacher_forced_probs
from coolsd.cli.runner import compose
from coolsd.worlds import load_world
from factories import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def _draws(n=20000, V=7, seed=0, tilt=0.0, lean=0.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    # tilt > 0: likelier tokens over-drawn; lean > 0: higher token ids over-drawn
    src = torch.softmax((1 + tilt) * torch.log(p) + lean * torch.arange(V) / V, -1)
    x = sample_inverse_cdf(src, torch.rand(n, generator=g, dtype=torch.float64))
    return p, x, torch.rand(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("order", ["rank", "id"])
def test_pit_of_exact_draws_is_uniform_and_of_tilted_draws_is_not(order):
    p, x, u = _draws()
    v = randomized_pit(p, x, u, order).numpy()
    assert 0 <= v.min() and v.max() <= 1 and stats.kstest(v, "uniform").pvalue > 1e-3
    p, x, u = _draws(**({"tilt": 0.1} if order == "rank" else {"lean": 0.5}))  # small biases, each seen in its own order
    assert stats.kstest(randomized_pit(p, x, u, order).numpy(), "uniform").pvalue < 1e-6


def test_pit_rank_order_puts_the_likeliest_token_first():
    p = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    u = torch.tensor([0.5])
    # rank order 1, 2, 0: token 1 covers [0, 0.6), token 2 [0.6, 0.9), token 0 [0.9, 1)
    for tok, want in ((1, 0.3), (2, 0.75), (0, 0.95)):
        assert randomized_pit(p, torch.tensor([tok]), u, "rank").item() == pytest.approx(want)
    assert randomized_pit(p, torch.tensor([1]), u, "id").item() == pytest.approx(0.1 + 0.3)
    with pytest.raises(ValueError, match="order"):
        randomized_pit(p, torch.tensor([1]), u, "desc")
    with pytest.raises(ValueError, match="must agree"):
        randomized_pit(p, torch.tensor([1, 2]), u)


def test_teacher_forced_rescoring_equals_the_loops_scores():
    """EAGLE-1 on the toy world (a ragged batch: samples accept different lengths): -log of the
    teacher-forced p at each emitted token equals the loop's token_nll (float32 forwards)."""
    cfg = compose("target=toy", "dataset.n_prompts=4")
    world = load_world(cfg)
    t = world.target
    method = world.build_method("eagle", {}, "chain", 4)
    res, cond = world.generate_tokens(method, world.prompts(cfg), [11, 12, 13, 14])
    with torch.no_grad():
        p = teacher_forced_probs(t, res.tokens, cond, world.sampling)
    assert p.shape == (4, t.n_image_tokens, t.vocab_size)
    nll = -torch.log(p.gather(-1, res.tokens.unsqueeze(-1)).squeeze(-1).double())
    assert len({tuple(r) for r in res.round_lengths}) > 1  # not every sample in step
    assert (nll - res.token_nll).abs().max() < 1e-4


def test_exactness_benchmark_passes_eagle_and_fails_a_relaxed_method(tmp_path):
    """64 prompts: AR's and EAGLE-1's tokens are drawn from the target's conditionals; UniformRSD at
    delta = 4 (about 0.2 TV per token) is caught; NLL shifts paired by prompt against AR."""
    bench = load_benchmark("exactness")
    rows = bench.main(["--prompts", "64", "--methods", "ar,eagle,uniform_rsd_4", "--out", str(tmp_path)])
    assert rows["eagle"]["exact"] and rows["eagle"]["tokens"] == 64 * 64
    assert rows["eagle"]["nll_minus_ar"]["n"] == 64 and rows["ar"]["nll_minus_ar"]["mean"] == 0.0  # paired by prompt
    assert rows["uniform_rsd_4"]["nll_minus_ar"]["lo"] > 0  # the relaxed method's NLL cost is resolved
    assert not rows["uniform_rsd_4"]["exact"] and rows["uniform_rsd_4"]["p_bonferroni"] < 1e-4
    assert all(r["as_expected"] for r in rows.values())
    assert (tmp_path / "pit.png").stat().st_size > 0 and "| eagle | yes |" in (tmp_path / "exactness.md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--methods", "eagle,nope", "--out", str(tmp_path)])
