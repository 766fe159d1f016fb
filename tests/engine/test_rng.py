"""The counter-based uniforms (coolsd.engine.decoding.rng): Philox4x32-10 bit for bit, streams that are a
pure function of (key, element index), batch-invariant, on the caller's device, and uniform."""
import math

import numpy as np
import pytest
import torch
from scipy import stats

from coolsd.engine.decoding.rng import PerSampleRNG, SharedRNG, indexed_uniforms, philox4x32, stream_uniforms

# Random123 kat_vectors: philox4x32 10, counter (4 words), key (2 words) -> output (4 words)
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _philox_python(ctr, key, rounds=10):
    """Philox4x32 in Python integers (an independent reference: no tensor arithmetic)."""
    M = 0xFFFFFFFF
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & M, (k[1] + 0xBB67AE85) & M]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M, (p0 >> 32) ^ c[3] ^ k[1], p0 & M]
    return tuple(c)


@pytest.mark.parametrize("wrapping", [True, False], ids=["wrapping_multiply", "split_multiply"])
@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want, wrapping):
    out = philox4x32([torch.tensor([c]) for c in ctr], [torch.tensor([k]) for k in key], wrapping=wrapping)
    assert tuple(int(o) for o in out) == want
    assert _philox_python(ctr, key) == want


def test_the_cpu_passes_the_wrapping_check():
    from coolsd.engine.decoding.rng import _wraps

    assert _wraps(torch.device("cpu"))


@pytest.mark.parametrize("wrapping", [True, False], ids=["wrapping_multiply", "split_multiply"])
def test_philox_matches_the_python_reference_on_random_inputs(wrapping):
    r = np.random.default_rng(0)
    ctr = r.integers(0, 2**32, (4, 200))
    key = r.integers(0, 2**32, (2, 200))
    out = philox4x32([torch.from_numpy(c) for c in ctr], [torch.from_numpy(k) for k in key], wrapping=wrapping)
    for i in range(200):
        assert tuple(int(o[i]) for o in out) == _philox_python(ctr[:, i].tolist(), key[:, i].tolist())


def test_a_stream_is_a_function_of_key_and_index_only():
    """However calls split the stream (and the pool refills), element k is the same."""
    keys = [3, 2**62 + 11, 0]
    whole = stream_uniforms(torch.tensor(keys), 0, 3000)
    for sizes in ([1] * 7 + [2993], [5, 300, 2695], [257, 256, 2487], [3000]):
        rng = PerSampleRNG(keys)
        got = torch.cat([rng.uniform(n) for n in sizes], 1)
        assert torch.equal(got, whole)
    assert torch.equal(stream_uniforms(torch.tensor(keys), 1001, 7), whole[:, 1001:1008])
    shaped = PerSampleRNG(keys)
    assert torch.equal(shaped.uniform(4, 5).flatten(1), whole[:, :20])


def test_a_sample_stream_does_not_depend_on_its_batch():
    alone = PerSampleRNG([7])
    batch = PerSampleRNG([1, 7, 9, 7])
    for shape in [(5,), (1,), (3, 4), (2, 17)]:
        a, b = alone.uniform(*shape), batch.uniform(*shape)
        assert torch.equal(b[1], a[0]) and torch.equal(b[3], a[0])
        assert not torch.equal(b[0], b[1])


def test_uniforms_lie_in_the_unit_interval_on_the_53_bit_grid_and_are_uniform():
    u = stream_uniforms(torch.arange(8), 0, 50_000).flatten()
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u * 2.0**53, torch.floor(u * 2.0**53))
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    # neighbours in a stream and the same index in two streams are uncorrelated
    w = stream_uniforms(torch.tensor([5, 6]), 0, 100_000)
    se = 1 / math.sqrt(100_000)
    assert abs(float(torch.corrcoef(torch.stack([w[0, :-1], w[0, 1:]]))[0, 1])) < 5 * se
    assert abs(float(torch.corrcoef(w)[0, 1])) < 5 * se


def test_shared_rng_rows_are_consecutive_blocks_of_one_stream():
    rng = SharedRNG(3, seed=4)
    a = rng.uniform(2)
    b = rng.uniform(5)
    whole = stream_uniforms(torch.tensor([4]), 0, 21)[0]
    assert torch.equal(a.flatten(), whole[:6]) and torch.equal(b.flatten(), whole[6:21])


def test_uniforms_are_made_on_the_rng_device():
    rng = PerSampleRNG([1, 2]).on("meta")
    u = rng.uniform(3, 4)
    assert u.device.type == "meta" and u.shape == (2, 3, 4)
    assert SharedRNG(2, 0).on("meta").uniform(3).device.type == "meta"


def _unit(hi, lo):
    return ((hi >> 5) * (1 << 26) + (lo >> 6)) * 2.0 ** -53


def test_indexed_uniforms_are_philox_at_the_index_counter_bit_for_bit():
    """Row r, element v: word pair v mod 2 of Philox((v // 2, index[r], tag, 0), key[r]), checked
    against the Python Philox; long rows are tiled on the CPU, so 40,001 elements cross tiles."""
    keys, index = torch.tensor([3, 2**62 + 11, 3]), torch.tensor([0, 7, 2**32 - 1])
    u = indexed_uniforms(keys, index, 40_001)
    assert u.shape == (3, 40_001) and u.dtype == torch.float64
    for r in range(3):
        key = (int(keys[r]) & 0xFFFFFFFF, int(keys[r]) >> 32)
        for v in (0, 1, 2, 5, 32_767, 32_768, 40_000):
            x = _philox_python((v // 2, int(index[r]), 1, 0), key)
            assert float(u[r, v]) == (_unit(x[0], x[1]) if v % 2 == 0 else _unit(x[2], x[3]))
    # a pure function of (key, index, element): rows alone or in any order, fewer elements
    assert torch.equal(indexed_uniforms(keys[[2, 0]], index[[2, 0]], 100), u[[2, 0], :100])
    # apart from the streams (tag 0 is a stream's third word) and from other indices
    assert not torch.equal(u[0, :100], stream_uniforms(keys[:1], 0, 100)[0])
    assert not torch.equal(u[0, :100], u[2, :100])


def test_keys_are_fresh_per_row_and_follow_a_sample_alone():
    alone, batch = PerSampleRNG([7]), PerSampleRNG([1, 7])
    k1, k2 = alone.keys(), batch.keys()
    assert k2[1] == k1[0] and k2[0] != k2[1] and alone.keys()[0] != k1[0]
    assert 0 <= int(k1[0]) < 2**53
    shared = SharedRNG(3, seed=0).keys()
    assert len(set(shared.tolist())) == 3


def test_bad_seed_is_refused():
    with pytest.raises(ValueError, match="seeds"):
        PerSampleRNG([-1])
