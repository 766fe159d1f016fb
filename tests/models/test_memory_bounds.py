"""Bounded memory of the decode and the LANTERN paths: images decoded a chunk at a time
(``World.decode_images``), LANTERN's neighbour tables built only for the methods that read them,
once per codebook, in row blocks, keeping only the columns read
(``lantern.neighbour_table`` / ``CodebookNeighbours``), and LANTERN's exact distortion in chunks of
rows (``distortion.emitted_distribution``)."""
from collections import OrderedDict

import numpy as np
import pytest
import torch

import coolsd.worlds.llamagen
import coolsd.worlds.lumina
import coolsd.worlds.toy
from coolsd.engine.decoding import distortion
from coolsd.engine.decoding import lantern
from coolsd.engine.decoding.rules import LanternRule
from coolsd.worlds import load_world

WORLDS = ("toy", "llamagen_xl", "lumina_mgpt")


def _cfg(compose, world_overrides, name):
    return compose(*world_overrides(name), "quality_signals=false", "dataset.n_prompts=5")


@pytest.fixture(scope="module")
def worlds(request):
    """name -> the loaded world on tiny files (the toy world: its shipped weights), loaded once."""
    compose, overrides = request.getfixturevalue("compose"), request.getfixturevalue("world_overrides")
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_world(_cfg(compose, overrides, name))
        return cache[name]

    return get


def _vq(world):
    """The module whose ``decoder`` turns a world's latents into pixels."""
    return world.target.decoder if world.name == "lumina_mgpt" else world.vq


def _random_tokens(world, n, seed=0):
    V, T = world.target.vocab_size, world.target.n_image_tokens
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def _decoder_batches(world):
    """The batch sizes the VQ decoder network is called with (a forward pre-hook), and its handle."""
    sizes = []
    handle = _vq(world).decoder.register_forward_pre_hook(lambda m, args: sizes.append(int(args[0].shape[0])))
    return sizes, handle


# ------------------------------------------------------------------------------ 1. chunked decode
@pytest.mark.parametrize("name", WORLDS)
def test_decode_images_goes_in_chunks_with_the_whole_batchs_pixels(name, worlds):
    world = worlds(name)
    tokens = _random_tokens(world, 6)
    whole = world.decode_uint8(tokens)  # the whole batch at once
    sizes, handle = _decoder_batches(world)
    try:
        chunked = world.decode_images(tokens)
    finally:
        handle.remove()
    assert world.decode_chunk == 4 and sizes == [4, 2]
    # the decoders are per image (convolutions, GroupNorm, attention within an image): bit for bit
    # on the CPU for these decoders
    assert chunked.dtype == np.uint8 and np.array_equal(chunked, whole)


@pytest.mark.parametrize("name", ("toy", "llamagen_xl"))
def test_generate_never_decodes_more_than_a_chunk(name, worlds, compose, world_overrides):
    world = worlds(name)
    method = world.build_method("ar", {})
    prompts = type(world).prompts(_cfg(compose, world_overrides, name))
    seeds = list(range(len(prompts)))
    assert len(seeds) == 5
    sizes, handle = _decoder_batches(world)
    try:
        samples = world.generate(method, prompts, seeds)
    finally:
        handle.remove()
    assert sizes == [4, 1]  # decode_chunk = 4
    res, _ = world.generate_tokens(method, prompts, seeds)  # the same tokens (the same seeds)
    assert np.array_equal(np.stack([s.image for s in samples]), world.decode_uint8(res.tokens))


# ----------------------------------------------------------------------- 2. LANTERN's neighbours
def _reference_neighbours(codebook, k=None):
    """The whole-matrix table: float64 ``cdist`` over every pair, stable sort (ties by index)."""
    cb = codebook.double()
    V = cb.shape[0]
    k = V - 1 if k is None else min(int(k), V - 1)
    dist = torch.cdist(cb, cb)
    dist.fill_diagonal_(float("inf"))
    return torch.sort(dist, dim=1, stable=True).indices[:, :k].contiguous()


@pytest.fixture
def count_sorts(monkeypatch):
    """Every ``neighbours_from_codebook`` call (its codebook's size and k), from an empty cache;
    patched in the world modules too (where one imported the name, it is spied on there)."""
    calls = []
    real = lantern.neighbours_from_codebook

    def spy(codebook, k=None, **kw):
        calls.append((codebook.shape[0], k))
        return real(codebook, k, **kw)

    monkeypatch.setattr(lantern, "neighbours_from_codebook", spy)
    for module in (coolsd.worlds.llamagen, coolsd.worlds.lumina, coolsd.worlds.toy):
        monkeypatch.setattr(module, "neighbours_from_codebook", spy, raising=False)
    monkeypatch.setattr(lantern, "_TABLES", OrderedDict(), raising=False)
    return calls


@pytest.mark.parametrize("V,D,ties", [(300, 3, False), (257, 2, True), (40, 1, True)])
def test_blocked_neighbours_equal_the_whole_matrix_sort(V, D, ties):
    g = torch.Generator().manual_seed(V)
    cb = torch.randn(V, D, generator=g)
    if ties and D > 1:  # duplicated codes: exact distance ties, broken by index
        cb[V // 2 :] = cb[: V - V // 2].clone()
    elif ties:  # a 1-D codebook of a few integers: most distances tie
        cb = torch.randint(0, 5, (V, 1), generator=g).float()
    ref = _reference_neighbours(cb)
    for rows in (1, 7, 64, V, 10 * V):
        assert torch.equal(lantern.neighbours_from_codebook(cb, block_rows=rows), ref)
    assert torch.equal(lantern.neighbours_from_codebook(cb, 11, block_rows=13), ref[:, :11])
    assert torch.equal(lantern.neighbours_from_codebook(cb), ref)  # the default block


@pytest.mark.parametrize("name", WORLDS)
def test_methods_without_neighbourhoods_never_sort_the_codebook(name, worlds, compose, world_overrides,
                                                                count_sorts):
    world = load_world(_cfg(compose, world_overrides, name))  # loading sorts nothing either
    for method, params in (("ar", {}), ("coolsd", {}), ("uniform_rsd", {}), ("eagle", {}), ("sjd", {}),
                           ("gsd", {})):
        world.build_method(method, params, tree="mc_sim_7b_63")
    assert count_sorts == []


@pytest.mark.parametrize("name", WORLDS)
def test_lantern_methods_sort_each_codebook_once(name, worlds, count_sorts):
    world = worlds(name)
    if isinstance(world.__dict__.get("neighbours"), getattr(lantern, "CodebookNeighbours", ())):
        del world.__dict__["neighbours"]  # a fresh (unbuilt) table for this loaded world
    a = world.build_method("lantern_pp", {"k": 3}, tree="mc_sim_7b_63")
    b = world.build_method("lantern_pp", {"k": 3}, tree="mc_sim_7b_63")
    c = world.build_method("lantern", {}, tree="mc_sim_7b_63")  # k = 1000: within the kept columns
    V = world.codebook().shape[0]
    assert count_sorts == [(V, min(lantern.NEIGHBOURS_KEPT, V - 1))]
    ref = _reference_neighbours(world.codebook())
    for m, k in ((a, 3), (b, 3), (c, 1000)):
        assert torch.equal(m.rule.nb_k, ref[:, :k]) and torch.equal(m.rule.nb_k1, ref[:, : k + 1])
    # another world over the same codebook content shares the table
    assert torch.equal(lantern.CodebookNeighbours(world.codebook().clone())[:, :5], ref[:, :5])
    assert len(count_sorts) == 1


def test_the_kept_table_has_only_the_columns_read(count_sorts):
    V = 1500
    cb = torch.randn(V, 4, generator=torch.Generator().manual_seed(3))
    ref = _reference_neighbours(cb)
    nb = lantern.CodebookNeighbours(cb)
    assert nb.shape == (V, V - 1) and count_sorts == []  # nothing built yet
    rule = LanternRule(nb, 10, lam=2.0)
    assert count_sorts == [(V, lantern.NEIGHBOURS_KEPT)]  # 1024 of the 1499 columns
    assert torch.equal(rule.nb_k, ref[:, :10]) and torch.equal(rule.nb_k1, ref[:, :11])
    wide = LanternRule(nb, 1200, delta=0.1)  # wider than kept: rebuilt once, with the spare k + 1 column
    assert count_sorts[1:] == [(V, 1201)]
    assert torch.equal(wide.nb_k, ref[:, :1200]) and torch.equal(wide.nb_k1, ref[:, :1201])
    tokens = torch.tensor([0, 7, 1499])
    assert torch.equal(nb[tokens, :8], ref[tokens, :8]) and len(count_sorts) == 2
    assert torch.equal(lantern.CodebookNeighbours(cb.clone())[:, :1201], ref[:, :1201]) and len(count_sorts) == 2
    assert torch.equal(nb[tokens], ref[tokens])  # no column slice: every column
    assert count_sorts[2:] == [(V, V - 1)]


# --------------------------------------------------------------- 3. LANTERN's distortion in chunks
def _pq(N, V, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(N, V, generator=g, dtype=torch.float64), -1).to(dtype)
    q = torch.softmax(3 * torch.randn(N, V, generator=g, dtype=torch.float64), -1).to(dtype)
    p[0] = 1.0 / V  # ties and a flat row
    q[1] = 0.0
    q[1, 3] = 1.0  # a one-token draft
    return p, q


@pytest.mark.parametrize("k,rule_kw", [(3, {"lam": 2.0}), (3, {"delta": 0.1, "resample": "gstar"}),
                                        (40, {"delta": 0.1}), (40, {"lam": 2.0, "resample": "gstar"}),
                                        (63, {"delta": 0.5})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lantern_distortion_in_chunks_equals_the_whole_call(k, rule_kw, dtype, monkeypatch):
    V, N = 64, 37
    cb = torch.randn(V, 3, generator=torch.Generator().manual_seed(k))
    rule = LanternRule(lantern.neighbours_from_codebook(cb), k, **rule_kw)
    p, q = _pq(N, V, k, dtype)
    whole = distortion.emitted_distribution(rule, p, q, 1)  # the default budget: one chunk here
    width = rule.nb_k1.shape[1]
    budget = 5 * V * width  # 5 rows a chunk: 8 chunks
    monkeypatch.setattr(distortion, "LANTERN_CHUNK_ELEMENTS", budget, raising=False)
    rows, gathered = [], []
    real_emitted, real_at = getattr(distortion, "_emitted", None), lantern.at_neighbours

    def spy_emitted(rule, p, q, depth):
        rows.append(p.shape[0])
        return real_emitted(rule, p, q, depth)

    def spy_at(v, nb):
        out = real_at(v, nb)
        gathered.append(out.numel())
        return out

    monkeypatch.setattr(distortion, "_emitted", spy_emitted, raising=False)
    monkeypatch.setattr(lantern, "at_neighbours", spy_at)
    chunked = distortion.emitted_distribution(rule, p, q, 1)
    assert rows == [5] * 7 + [2]
    assert all(r * V * width <= budget for r in rows) and all(n <= budget for n in gathered)
    assert torch.equal(chunked, whole)  # every step is per row: bit for bit
    # through the chain signals as the loop calls them (every depth a row)
    B, depth = 5, 4
    P, Q = _pq(B * (depth + 1), V, k + 1, dtype)
    P, Q = P.view(B, depth + 1, V), Q.view(B, depth + 1, V)
    need = torch.rand(B, depth, generator=torch.Generator().manual_seed(1)) < 0.7
    logp = torch.log(P.clamp(min=1e-30))
    monkeypatch.setattr(distortion, "LANTERN_CHUNK_ELEMENTS", V * width, raising=False)  # one row a chunk
    small = distortion.chain_distortion(rule, P, Q, depth, need, logp)
    monkeypatch.setattr(distortion, "LANTERN_CHUNK_ELEMENTS", 1 << 40, raising=False)
    big = distortion.chain_distortion(rule, P, Q, depth, need, logp)
    for a, b in zip(small, big):
        assert torch.equal(a, b)


def test_lantern_chunk_rows_at_llamagen_sizes():
    """LANTERN's k = 1000 on LlamaGen's 16384 codes: 4 rows (262 M entries) a chunk at 2^26 elements."""
    nb = (torch.arange(16384).unsqueeze(1) + torch.arange(1, 1025)) % 16384  # a table's shape (in-degree k + 1)
    assert distortion.lantern_chunk_rows(LanternRule(nb, 1000, delta=0.1), 16384) == 4
    assert distortion.lantern_chunk_rows(LanternRule(nb, 10, lam=2.0), 16384) == 372
