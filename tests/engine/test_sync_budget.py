"""The generation loop's sync budget (docs/gpu.md): in eager mode at most two host reads of a
tensor value a round (each is a device sync on CUDA: the loop's own status read, plus at most one
an adapter needs), and no tensor made from Python data in any round (each is a host-to-device
copy on CUDA), for every registered discrete method on the LlamaGen classes (the toy world: its
target and EAGLE-1 drafter) and on Lumina-mGPT's target and drafter. Counted on the CPU by
``coolsd.engine.host_reads`` as what the extra rounds of a longer run add (a run's set-up and end, the
prefill checks, per-batch tables and final records, cost the same at any length). The compiled
path's one read a round: tests/engine/test_compiled.py."""
import pytest
import torch

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.host_reads import count_host_reads
from coolsd.engine.methods import build_method
from coolsd.engine.methods.registry import method_names

EAGER_BUDGET = 2  # host reads a round


def _marginal(run, n_tokens: int, budget: int = EAGER_BUDGET):
    """Runs ``run(n)`` for n = ``n_tokens`` and n_tokens // 2 and checks the reads and lifts the extra
    rounds add (a run's set-up and end cost the same at both lengths): at most ``budget`` reads
    and no lift a round."""
    counts = []
    for n in (n_tokens // 2, n_tokens):
        with torch.no_grad(), count_host_reads() as reads:
            res = run(n)
        counts.append((max(len(r) for r in res.round_lengths), reads))
    (r0, a), (r1, b) = counts
    where = sorted({w for _, w in b.where})
    assert r1 - r0 >= 5, "too few extra rounds to tell a per-round cost from set-up"
    assert b.count - a.count <= budget * (r1 - r0), f"{b.count - a.count} reads in {r1 - r0} rounds: {where}"
    assert b.lifted <= a.lifted, f"{b.lifted - a.lifted} tensors made from Python data in {r1 - r0} rounds: {where}"


@pytest.fixture(scope="module")
def toy():
    from coolsd.cli.runner import compose
    from coolsd.worlds import load_world

    cfg = compose("target=toy", "dataset.n_prompts=2")
    world = load_world(cfg)
    return world, world.encode([s.caption for s in world.prompts(cfg)])


# PJD's schedule follows its acceptances, read on the host every forward (coolsd.engine.rows.pjd_generate):
# outside the budget by design, as docs/methods.md section 8.2 says
CASES = ([(n, "chain", {}) for n in method_names("discrete") if not n.startswith("_") and n != "pjd"]
         + [("eagle", "mc_sim_7b_63", {}), ("mc_sjd", "chain", {"coupling": "gumbel"})])


@pytest.mark.parametrize("name,tree,params", CASES, ids=[f"{n}-{t}" + "".join(f"-{v}" for v in p.values())
                                                         for n, t, p in CASES])
def test_eager_rounds_on_the_toy_world_stay_within_the_sync_budget(toy, name, tree, params):
    world, cond = toy
    t = world.target
    m = world.build_method(name, params, tree, 4 if tree == "chain" else None)
    _marginal(lambda n: speculative_generate(
        t, n, PerSampleRNG([1, 2]), rule=m.rule, drafter=build_drafter(
            m, world.drafter() if m.drafter == "model" else None, world.sampling, t.vocab_size, grid_width=8),
        tree=m.tree, sampling=world.sampling, cond=cond, batch_size=2), 48)


@pytest.mark.parametrize("name,kw", [("ar", {}), ("eagle", {"tree": "chain", "draft_length": 4}),
                                     ("eagle", {"tree": "mc_sim_7b_63"}), ("coolsd", {"draft_length": 4}),
                                     ("sjd", {})], ids=["ar", "eagle-chain", "eagle-tree", "coolsd", "sjd"])
def test_eager_rounds_on_lumina_stay_within_the_sync_budget(name, kw):
    from coolsd.models.eagle.lumina import LuminaEagleDrafter
    from factories import make_lm
    from test_lumina_eagle import N, PROMPTS, make_head, target

    model = make_lm().float()
    m = build_method(name, **kw)
    head = make_head(model).float()

    def run(n):
        t = target(model, prefill_features="all")
        d = LuminaEagleDrafter.for_target(head, t) if m.drafter == "model" else None
        return speculative_generate(t, n, PerSampleRNG([0, 1]), rule=m.rule, tree=m.tree, cond=PROMPTS, batch_size=2,
                                    drafter=build_drafter(m, d, SamplingConfig(), t.vocab_size, grid_width=4),
                                    sampling=SamplingConfig())

    _marginal(run, N)


def test_the_counter_sees_reads_and_lifts():
    """A negative control: the conversions and data-dependent shapes the budget forbids are counted."""
    x = torch.arange(6)
    with count_host_reads() as reads:
        bool(x.any()), int(x[0]), x.tolist(), x[[1, 2]], torch.tensor([1, 2]), float(x.sum())
        x[:, None][0] = 3  # a 0-dim scalar: passed by value, not a copy
        torch.nonzero(x > 2), x[x > 2]  # output shapes that depend on values: the host waits
    assert reads.count == 6 and reads.lifted == 2
