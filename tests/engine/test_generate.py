"""The generation loop on a tiny random LlamaGen (the class real targets load): greedy
speculative equals greedy AR for every method, seeds fix tokens, a batch equals single runs."""
import pytest
import torch

from coolsd.engine.decoding.lantern import neighbours_from_codebook
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.methods import build_method
from coolsd.engine.batch_invariant import batch_invariant
from coolsd.models.llamagen import LlamaGenTarget, tiny
from factories import engine_cond as cond, engine_model

CFG = tiny()
T, N, V = CFG.cls_token_num, CFG.block_size, CFG.vocab_size
NEIGHBOURS = neighbours_from_codebook(torch.randn(V, 4, generator=torch.Generator().manual_seed(9)))
METHODS = [
    ("ar", {}),
    ("eagle", {}),
    ("uniform_rsd", {"delta": 2.0}),
    ("coolsd", {"delta": 2.0}),
    ("coolsd", {"delta": 1.5, "schedule": "linear"}),
    ("lantern", {"delta": 0.3, "k": 5}),
    ("lantern_pp", {"lam": 3.0, "k": 5}),
    ("lantern_pp", {"lam": 3.0, "k": 5, "resample": "gstar"}),
    ("sjd", {"window": 4}),
]
IDS = [f"{m}-{'-'.join(f'{k}{v}' for k, v in p.items())}" for m, p in METHODS]


TARGET_MODEL = engine_model(0)
DRAFT_MODEL = engine_model(1, dim=32, n_layer=1)


def generate(method, params, valid, seeds, sampling, tree="mc_sim_7b_63", rows=None):
    """rows: run only these batch rows of cond(valid) (same caption tensors as in the batch)."""
    c = cond(valid)
    if rows is not None:
        c = {k: v[rows] for k, v in c.items()}
    m = build_method(method, tree=tree, neighbours=NEIGHBOURS, **params)
    target = LlamaGenTarget(TARGET_MODEL, cfg_scale=3.0)
    drafter = build_drafter(m, LlamaGenTarget(DRAFT_MODEL, cfg_scale=3.0), sampling, V)
    return speculative_generate(
        target, N, PerSampleRNG(seeds), rule=m.rule, drafter=drafter, tree=m.tree,
        sampling=sampling, cond=c, batch_size=len(seeds),
    )


@pytest.mark.parametrize("method,params", METHODS, ids=IDS)
def test_greedy_speculative_equals_greedy_ar(method, params):
    greedy = SamplingConfig(temperature=0.0)
    ar = generate("ar", {}, [3, T], [0, 1], greedy)
    spec = generate(method, params, [3, T], [0, 1], greedy)
    assert torch.equal(spec.tokens, ar.tokens)
    assert all(sum(r) == N - 1 for r in spec.round_lengths)  # first token comes from prefill


@pytest.mark.parametrize("method,params", METHODS, ids=IDS)
def test_batch_of_four_equals_four_single_runs(method, params):
    """Per-sample seeds and KV commits: a batch equals its samples alone, bit for bit under
    ``batch_invariant`` (without it, a GEMM's blocking rounds a batch differently on some CPUs)."""
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    valid, seeds = [2, T, 5, 1], [10, 11, 12, 13]
    with batch_invariant():
        batch = generate(method, params, valid, seeds, sampling)
        for b in range(4):
            single = generate(method, params, valid, [seeds[b]], sampling, rows=[b])
            assert torch.equal(batch.tokens[b], single.tokens[0]), b
            assert batch.round_lengths[b] == single.round_lengths[0]


def test_same_seed_same_tokens_and_seed_matters():
    sampling = SamplingConfig(temperature=1.0)
    a = generate("coolsd", {"delta": 2.0}, [4, 6], [7, 8], sampling)
    b = generate("coolsd", {"delta": 2.0}, [4, 6], [7, 8], sampling)
    c = generate("coolsd", {"delta": 2.0}, [4, 6], [9, 10], sampling)
    assert torch.equal(a.tokens, b.tokens) and a.round_lengths == b.round_lengths
    assert not torch.equal(a.tokens, c.tokens)


def test_self_drafting_accepts_whole_tree_paths():
    """Drafter = target: with sampling, every drafted path is accepted (p = q), so each round
    emits depth + 1 tokens until the sequence end."""
    sampling = SamplingConfig(temperature=1.0)
    m = build_method("eagle", tree="chain", draft_length=3)
    res = speculative_generate(
        LlamaGenTarget(TARGET_MODEL, cfg_scale=3.0), N, PerSampleRNG([3]), rule=m.rule,
        drafter=build_drafter(m, LlamaGenTarget(TARGET_MODEL, cfg_scale=3.0), sampling, V), tree=m.tree,
        sampling=sampling, cond=cond([T]), batch_size=1,
    )
    assert res.round_lengths[0][:-1] == [4] * (len(res.round_lengths[0]) - 1)
    assert res.target_forwards[0] == 1 + len(res.round_lengths[0])


def test_latency_is_bracketed_by_device_syncs():
    """docs/methods.md#6-evaluation-protocol: the clock starts and stops only after a device sync."""
    from coolsd.engine.timing import device_sync

    calls = []
    m = build_method("eagle", tree="chain", draft_length=2)
    speculative_generate(LlamaGenTarget(TARGET_MODEL, cfg_scale=3.0), 4, PerSampleRNG([0]), rule=m.rule,
                         drafter=build_drafter(m, LlamaGenTarget(DRAFT_MODEL, cfg_scale=3.0), SamplingConfig(), V),
                         tree=m.tree, cond=cond([3]), batch_size=1, sync=lambda: calls.append(len(calls)))
    assert calls == [0, 1]
    assert device_sync("cpu")() is None
    if torch.cuda.is_available():
        device_sync("cuda")()


def test_tree_on_another_device_keeps_its_host_views():
    """The loop moves the tree to the target's device (``Tree.on``): index tensors there, the
    host views (levels, children, parents, depth) the same, one copy per device."""
    from coolsd.engine.decoding.trees import HOST_VIEWS, make_tree

    tree = make_tree("mc_sim_7b_63")
    assert tree.on("cpu") is tree
    moved = tree.on("meta")
    assert moved is tree.on("meta")
    assert moved.children.device.type == "meta" and moved.ancestors.device.type == "meta"
    for view in HOST_VIEWS:
        assert getattr(moved, view) == getattr(tree, view)
    assert moved.n_nodes == tree.n_nodes and moved.paths == tree.paths
