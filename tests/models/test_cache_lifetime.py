"""KV-cache lifetime and memory (coolsd.models.kv_cache and its owners): a new cache is allocated
only after the old one is released (peak: one cache, not two); a reused cache keeps every
tensor's address across images (``reset`` zeroes in place, ``commit`` adds in place); owners size
their caches to the sequence's known maximum, so a decode never grows them; ``_grow``, the
fallback, keeps the values in one new buffer and releases the old one."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.models.eagle.model import EagleDrafter, EagleHead
from coolsd.models.eagle.lumina import LuminaEagleDrafter, LuminaEagleHead
from coolsd.engine.drafting import SamplingConfig
from coolsd.engine.loop import speculative_generate
from coolsd.models.kv_cache import KVCache
from coolsd.models.llamagen import LlamaGenTarget
from coolsd.models.lumina import ImageVocab, LuminaTarget, LuminaTokens
from coolsd.engine.model_protocol import StepOut
from factories import VMAP, engine_cond, engine_model, make_lm

HL = WL = 4  # Lumina: 16 image tokens, a newline after each of the first 3 rows
N = HL * WL
TOKENS = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)
PROMPTS = [[0, 30, 31, 32, 26], [0, 40, 41, 42, 43, 44, 45, 46, 47, 26], [0, 50, 51, 26]]


def lumina(model, **kw) -> LuminaTarget:
    kw.setdefault("cfg_scale", 3.0)
    return LuminaTarget(model, ImageVocab(VMAP), h_latent=HL, w_latent=WL, tokens=TOKENS, **kw)


# ------------------------------------------------------------------------------ owners
def _llamagen():
    target = LlamaGenTarget(engine_model(0), cfg_scale=2.0)
    return target, lambda B: target.begin(engine_cond([3, 5, 8][:B]), B)


def _lumina():
    target = lumina(make_lm())
    return target, lambda B: target.begin(PROMPTS[:B], B)


def _eagle():
    model = engine_model(0)
    drafter = EagleDrafter(EagleHead.from_target(model, seed=3), model.output.weight, 2.0)
    H, V = model.config.dim, model.config.vocab_size

    def begin(B):  # guided features of the prefill's last slot: the cache is made in begin
        hidden = torch.randn(B, 1, 2, H, dtype=torch.float64)
        drafter.begin(None, B, StepOut(logits=torch.zeros(B, 1, V), hidden=hidden))

    return drafter, begin


def _eagle_lumina():
    model = make_lm()
    t = lumina(model, prefill_features="all")
    drafter = LuminaEagleDrafter.for_target(LuminaEagleHead.from_target(model, seed=3).eval(), t)

    context = {B: t.begin(PROMPTS[:B], B) for B in (2, 3)}  # the target's prefill, made beforehand

    def begin(B):
        drafter.begin(PROMPTS[:B], B, context=context[B])

    return drafter, begin


OWNERS = {"llamagen": _llamagen, "lumina": _lumina, "eagle": _eagle, "eagle_lumina": _eagle_lumina}


@pytest.mark.parametrize("owner", list(OWNERS))
def test_a_new_cache_is_allocated_after_the_old_one_is_released(owner, monkeypatch):
    """Batch 2 then batch 3: the batch-2 cache (and its layer-0 key buffer) is already garbage when
    the batch-3 cache's constructor runs, so at most one cache is alive at any time."""
    obj, begin = OWNERS[owner]()
    begin(2)
    old_cache, old_k0 = weakref.ref(obj.cache), weakref.ref(obj.cache.k[0])
    seen = []
    init = KVCache.__init__

    def spy(self, *args, **kw):
        gc.collect()
        seen.append((old_cache() is None, old_k0() is None))
        init(self, *args, **kw)

    monkeypatch.setattr(KVCache, "__init__", spy)
    begin(3)
    assert seen, "batch 3 must allocate a new cache"
    assert seen[0] == (True, True), f"the old cache was alive while the new one was allocated: {seen[0]}"
    assert obj.cache.batch_size == 6  # guided: [cond; uncond] rows


@pytest.mark.parametrize("owner", ["llamagen", "lumina", "eagle", "eagle_lumina"])
def test_a_reused_cache_keeps_every_address(owner, monkeypatch):
    """Two images of the same batch: the same cache object, and k[0], v[0], ``length`` and
    ``hidden_slots`` at the same addresses after the second ``begin`` (its prefill commits too)."""
    obj, begin = OWNERS[owner]()
    begin(2)
    cache = obj.cache

    def ptrs():
        return [cache.k[0].data_ptr(), cache.v[0].data_ptr(), cache.length.data_ptr(), cache.hidden_slots.data_ptr()]

    before = ptrs()
    monkeypatch.setattr(KVCache, "__init__", lambda *a, **k: pytest.fail("a matching cache is reused"))
    begin(2)
    assert obj.cache is cache
    assert ptrs() == before


def test_reset_empties_in_place():
    cache = KVCache(2, 2, 2, 4, 16, torch.float32)
    ptrs = (cache.length.data_ptr(), cache.hidden_slots.data_ptr())
    cache.prepare(torch.ones(3, 3, dtype=torch.bool).tril(), 3)
    cache.advance(3)
    cache.commit(None, torch.tensor([3, 2]), hide=torch.tensor([[True, False, True], [False, True, False]]))
    assert cache.length.tolist() == [3, 2] and bool(cache.hidden_slots.any())
    assert (cache.length.data_ptr(), cache.hidden_slots.data_ptr()) == ptrs  # commit adds in place
    cache.reset()
    assert cache.length.tolist() == [0, 0] and not bool(cache.hidden_slots.any())
    assert cache.n_pending == 0 and cache._max_committed == 0 and cache._same_length
    assert (cache.length.data_ptr(), cache.hidden_slots.data_ptr()) == ptrs


# ------------------------------------------------------------------------------ sized to the maximum
def test_lumina_decodes_full_images_without_growing(monkeypatch):
    """A target reused for a longer prompt (the first image's cache fits, the second's does not)
    decodes both images without ``_grow``, and its tokens equal a fresh target's."""
    grown = []
    grow = KVCache._grow
    monkeypatch.setattr(KVCache, "_grow", lambda self, needed: (grown.append(needed), grow(self, needed)))
    model, greedy = make_lm(), SamplingConfig(temperature=0.0)
    short, long = [PROMPTS[0], PROMPTS[2]], [[0] + list(range(27, 60)) * 2 + [26]] * 2  # 5 and 68 ids
    target = lumina(model, cache_headroom=8)
    runs = [speculative_generate(target, N, PerSampleRNG([0, 1]), cond=c, batch_size=2, sampling=greedy)
            for c in (short, long)]
    assert grown == []
    fresh = speculative_generate(lumina(model, cache_headroom=8), N, PerSampleRNG([0, 1]), cond=long, batch_size=2,
                                 sampling=greedy)
    assert torch.equal(runs[1].tokens, fresh.tokens)


def test_eager_eagle_drafter_with_a_text_prefix_never_grows(monkeypatch):
    """The eager drafter's cache holds its text prefix and every image token from the start
    (LANTERN's LlamaGen T2I drafter: 119 prefix slots beside the image)."""
    grown = []
    grow = KVCache._grow
    monkeypatch.setattr(KVCache, "_grow", lambda self, needed: (grown.append(needed), grow(self, needed)))
    model = engine_model(0)
    drafter = EagleDrafter(EagleHead.from_target(model, seed=3), model.output.weight, 1.0, text_prefix=True)
    H, V, n = model.config.dim, model.config.vocab_size, model.config.block_size
    T = 130  # prefix slots beyond the default block_size + 64
    g = torch.Generator().manual_seed(0)
    drafter.begin(None, 1, StepOut(logits=torch.zeros(1, T, V), hidden=torch.randn(1, T, H, generator=g,
                                                                                  dtype=torch.float64)))
    tokens = torch.randint(0, V, (1, n), generator=g)
    drafter.forward(tokens, torch.arange(n).unsqueeze(0), torch.ones(n, n, dtype=torch.bool).tril(),
                    torch.randn(1, n, H, generator=g, dtype=torch.float64))
    drafter.commit(None, torch.tensor([n]))
    assert grown == [] and int(drafter.cache.length[0]) == T - 1 + n


# ------------------------------------------------------------------------------ _grow, the fallback
def test_grow_keeps_values_in_one_new_buffer_and_releases_the_old():
    """The fallback growth: every layer's keys and values keep their values in the new buffer, the
    views ``k[i]`` / ``v[i]`` are views of it, hidden slots are kept, and the old buffer is garbage
    afterwards (while growing, old and new are both alive: one buffer holds every layer)."""
    L, B, Hh, D = 3, 2, 2, 4
    cache = KVCache(L, B, Hh, D, 64, torch.float32)
    g = torch.Generator().manual_seed(0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    cache.hidden_slots[:, :5] = torch.tensor([[True, False, True, False, False], [False] * 4 + [True]])
    k_vals, v_vals = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    hidden = cache.hidden_slots.clone()
    old = weakref.ref(cache.kv)
    cache._grow(100)
    gc.collect()
    assert old() is None, "the old buffer outlived the growth"
    assert cache.max_len == 128 and cache.kv.shape == (2 * L, B, Hh, 128, D)
    base = cache.kv.untyped_storage().data_ptr()
    for new, was in zip((*cache.k, *cache.v), (*k_vals, *v_vals)):
        assert new.shape == (B, Hh, 128, D) and new.untyped_storage().data_ptr() == base
        assert torch.equal(new[:, :, :64], was) and not bool(new[:, :, 64:].any())
    assert cache.hidden_slots.shape == (B, 128)
    assert torch.equal(cache.hidden_slots[:, :64], hidden) and not bool(cache.hidden_slots[:, 64:].any())
