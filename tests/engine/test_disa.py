"""DiSA (coolsd.engine.continuous.annealing; docs/methods.md#52-disa) against the upstream code's
own schedules and sampler (tests/fixtures/upstream/disa.safetensors, made by
tools/make_upstream_fixtures.py --disa from Qinyu-Allen-Zhao/DiSA), and in the continuous loop: each
token runs its AR iteration's chain (counted head calls), draft and target anneal alike so an
identical draft is accepted everywhere and CSpD reproduces DiSA alone bit for bit, DiSA alone through
run.py with its own baseline (the target's steps), and bad settings refused in one line."""
import pytest
import torch

from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.continuous.annealing import CLIP_TIMESTEP, STRATEGIES, annealed_steps
from coolsd.engine.continuous.diffusion import Schedule
from coolsd.engine.continuous.generate import HeadConfig, ar_generate, cspd_generate, maskgit_iterations
from test_cspd_generate import LABELS, tiny_mar

DISA = HeadConfig(steps=8, anneal="linear", lower_steps=3)


@pytest.mark.parametrize("mode,verify,gamma,hc", [
    ("exact", "prefix", 3, DISA), ("paper", "prefix", 4, DISA),
    ("exact", "prefix", 2, HeadConfig(steps=6, anneal="two-stage", lower_steps=2, cfg=2.0, num_iter=5)),
    ("paper", "parallel", 1, HeadConfig(steps=7, anneal="cosine", lower_steps=4, cfg=3.0, cfg_schedule="linear")),
])
def test_cspd_with_an_identical_annealed_draft_reproduces_disa_alone(mode, verify, gamma, hc):
    """Draft and target run each position's chain with the schedule of its AR iteration (and its
    noise drawn for that many steps): a verification query spanning several iterations groups its
    tokens by chain; a wrong grouping or noise length breaks the equality."""
    t = tiny_mar()
    with batch_invariant():
        alone = ar_generate(t, LABELS, [0, 1], hc, final_noise=mode == "exact")
        sp = cspd_generate(t, t, LABELS, [0, 1], hc, gamma=gamma, mode=mode, verify=verify, prefill=0.1)
    assert torch.equal(sp.tokens, alone.tokens)
    assert all(sp.acceptance_rate(b) == 1.0 for b in range(2))
    plain = ar_generate(t, LABELS, [0, 1], HeadConfig(**{**hc.__dict__, "anneal": None, "lower_steps": None}),
                        final_noise=mode == "exact")
    assert not torch.equal(plain.tokens, alone.tokens)  # the annealing changes what is sampled


@pytest.mark.parametrize("hc", [DISA, HeadConfig(steps=30, anneal="linear", lower_steps=2, num_iter=4)])
def test_each_token_runs_the_chain_of_its_iteration(hc):
    """Head calls counted per row: every token of step s runs K_eff(s) head evaluations, K_eff the
    length of the clipped respacing of its iteration's nominal steps (30 nominal: 29 after the clip)."""
    t = tiny_mar()
    calls = []
    net = t.diffloss.net
    real = net.forward

    def counted(x, tt, c):
        calls.append(len(x))
        return real(x, tt, c)

    net.forward = counted
    ar_generate(t, LABELS[:1], [3], hc)
    L = t.config.seq_len
    bounds, _, iters = maskgit_iterations(L, hc.num_iter)
    nominal = annealed_steps(hc.anneal, hc.steps, hc.lower_steps, hc.num_iter or L)
    want = sum((bounds[s + 1] - bounds[s]) * Schedule.respaced(nominal[i], clip_timestep=CLIP_TIMESTEP).K
               for s, i in enumerate(iters))
    assert sum(calls) == want
    if hc.steps == 30:
        assert Schedule.respaced(30, clip_timestep=CLIP_TIMESTEP).K == 29 and nominal == [30, 20, 11, 2]


def test_bad_annealing_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown annealing strategy 'exp'; valid: linear, cosine, constant, two-stage"):
        HeadConfig(steps=8, anneal="exp", lower_steps=3)
    with pytest.raises(ValueError, match="lower=9 > upper=8"):
        HeadConfig(steps=8, anneal="linear", lower_steps=9)
    with pytest.raises(ValueError, match="lower_steps=3 is DiSA's last-iteration head steps: it needs an annealing"):
        HeadConfig(steps=8, lower_steps=3)
    with pytest.raises(ValueError, match="DiSA's annealing runs the ddpm head sampler, not 'ddim'"):
        HeadConfig(steps=8, anneal="linear", lower_steps=3, sampler="ddim")
    assert annealed_steps("linear", 8, 3, 1) == [8]  # one iteration (upstream divides by zero): the upper count
    assert set(STRATEGIES) == {"linear", "cosine", "constant", "two-stage"}


@pytest.mark.parametrize("target", ["toy_continuous", "mar_h", "harmon_1_5b", "xar_h"])
def test_disa_alone_and_with_cspd_run_through_run_py(target, compose, world_overrides, tmp_path):
    """``method=disa`` (its baseline: the target's own head steps) and ``method=cspd`` with DiSA's
    annealing (draft, target and the target-alone baseline annealed alike) on the tiny files of the
    diffusion-head targets and of xAR (its SDE steps annealed by cell)."""
    import json

    from coolsd.cli.runner import run

    n = ["dataset.n_prompts=2"]
    s = run(compose(*world_overrides(target), "method=disa", "method.head_steps=6", "method.lower_steps=2", *n,
                    f"+out_dir={tmp_path / 'disa'}"))
    recs = [json.loads(x) for x in (tmp_path / "disa" / "samples.jsonl").read_text().splitlines()]
    disa = [r for r in recs if r["method"] == "disa"]
    assert len(disa) == 2 and disa[0]["params"] == {"method": "disa", "head_steps": 6, "anneal": "linear",
                                                    "lower_steps": 2}
    assert [r["params"] for r in recs if r["method"] == "ar"][0] == {"method": "ar"}  # the target's own steps
    assert "speedup" in s["results"]["disa"]
    both = run(compose(*world_overrides(target), "method=cspd", "method.gamma=2", "method.head_steps=6",
                       "method.anneal=linear", "method.lower_steps=2", *n, f"+out_dir={tmp_path / 'both'}"))
    assert both["results"]["cspd"]["params"]["anneal"] == "linear"
    base = [json.loads(x) for x in (tmp_path / "both" / "samples.jsonl").read_text().splitlines()]
    assert {r["params"].get("anneal") for r in base if r["method"] == "ar"} == {"linear"}  # annealed alike


def test_a_flow_target_anneals_linearly_by_cell():
    """xAR_DiSA: num_steps = int((u - c) / u * (upper - lower) + lower) for cell c of u + 1 (its only
    strategy, linear): 50 -> 15 over xAR's 4 cells is [50, 38, 26, 15]; another strategy is refused."""
    from coolsd.engine.continuous.flow import FlowConfig

    assert annealed_steps("linear", 50, 15, 4) == [50, 38, 26, 15]
    with pytest.raises(ValueError, match="DiSA anneals a flow model's steps linearly only \\(as upstream\\), not 'cosine'"):
        FlowConfig(num_steps=50, anneal="cosine", lower_steps=15)
    with pytest.raises(ValueError, match="lower_steps=15 is DiSA's last-cell SDE steps: it needs anneal=linear"):
        FlowConfig(num_steps=50, lower_steps=15)


def test_cspd_on_xar_with_an_identical_annealed_draft_reproduces_disa_alone(world_overrides, compose):
    """xAR's chains annealed by cell: a verification query spanning cells groups its units by chain
    length; an identical draft accepts everything and reproduces the annealed target alone."""
    from coolsd.engine.continuous.flow import FlowConfig
    from coolsd.worlds import load_world

    world = load_world(compose(*world_overrides("xar_h"), "method=ar", "dataset.n_prompts=1"))
    t = world.target
    fc = FlowConfig(num_steps=6, cfg=2.0, unit=4, anneal="linear", lower_steps=2)
    labels = torch.tensor([1, 2])
    with batch_invariant():
        alone = ar_generate(t, labels, [0, 1], fc, final_noise=True, final_std=0.05)
        sp = cspd_generate(t, t, labels, [0, 1], fc, gamma=3, mode="exact", verify="prefix", prefill=0.1, final_std=0.05)
    assert torch.equal(sp.tokens, alone.tokens) and all(sp.acceptance_rate(b) == 1.0 for b in range(2))
    fixed = ar_generate(t, labels, [0, 1], FlowConfig(num_steps=6, cfg=2.0, unit=4), final_noise=True, final_std=0.05)
    assert not torch.equal(fixed.tokens, alone.tokens)


# ---- parity with the upstream code (tests/fixtures/upstream/disa.safetensors) -------------------
def test_the_schedules_are_upstreams():
    """Every strategy's nominal steps per iteration, and every nominal count's clipped timesteps, as
    upstream's DiffLoss.sample and create_diffusion compute them."""
    from test_upstream_parity import load_fixture

    fx = load_fixture("disa")
    for upper, lower, n in fx.config["schedules"]:
        for strategy in fx.config["strategies"]:
            want = fx.out[f"steps_{strategy}_{upper}_{lower}_{n}"].tolist()
            assert annealed_steps(strategy, upper, lower, n) == want, (strategy, upper, lower, n)
    for k in range(3, 51):
        assert Schedule.respaced(k, clip_timestep=CLIP_TIMESTEP).timesteps.tolist() == fx.out[f"timesteps_{k}"].tolist(), k


@pytest.mark.parametrize("step", [0, 3, 6])
@pytest.mark.parametrize("cfg", [1, 3])
def test_the_annealed_chain_is_upstreams(step, cfg):
    """Upstream's DiffLoss.sample(z, temperature 0.9, cfg, step, ar_num_iter 7) with DiSA's sampler
    (8 -> 3 linear), its draws replayed: the chain of iteration ``step`` (its timesteps, its noise,
    the learned-range variance, CFG on epsilon with the conditional half's variance) is ours."""
    from coolsd.engine.continuous.diffusion import aligned_sample
    from coolsd.models.mar import SimpleMLPAdaLN
    from test_upstream_parity import assert_close, load_fixture

    fx = load_fixture("disa")
    c = fx.config
    net = SimpleMLPAdaLN(c["in_channels"], c["model_channels"], c["z_channels"], c["num_res_blocks"]).eval()
    net.load_state_dict(fx.w, strict=True)
    sched = Schedule.respaced(annealed_steps(c["strategy"], c["upper"], c["lower"], c["ar_num_iter"])[step],
                              clip_timestep=c["clip_timesteps"])
    assert sched.K == int(fx.out[f"n_steps_s{step}"]) and sched.timesteps.tolist() == fx.out[f"ts_s{step}"].tolist()[::-1]
    B = len(fx.inp["z"])
    if cfg == 1:
        draws = list(fx.inp[f"draws_s{step}_cfg1"])
    else:  # the first draw for B rows (both halves share it); each step's for 2B rows, the first half used
        draws = [fx.inp[f"draw{i}_s{step}_cfg3"][:B] for i in range(sched.K + 1)]
    eps = torch.stack([draws[sched.K - k] for k in range(sched.K)])  # step k uses upstream's draw K - k
    with torch.no_grad():
        h = aligned_sample(lambda x, t, z: net(x, t, z), fx.inp["z"], draws[0], eps, sched,
                           z_u=None if cfg == 1 else fx.inp["z_uncond"], cfg=float(cfg), tau=c["temperature"])
    assert_close(h.x0, fx.out[f"sample_s{step}_cfg{cfg}"][:B], fx.tol, f"DiSA chain, iteration {step}, cfg {cfg}")
