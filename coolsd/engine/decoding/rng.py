"""Sources of uniforms for decoding: counter-based streams computed on the target's device.

Every uniform is a pure function of (key, element index): element ``k`` of a stream with key
``s`` (a seed, 0 <= s < 2^64) comes from Philox4x32-10 (Salmon et al., SC'11, "Parallel random
numbers: as easy as 1, 2, 3"; the generator torch's CUDA RNG also uses) applied to the counter
(k // 2, 0, 0, 0) under the key (s mod 2^32, s div 2^32): its four 32-bit output words give the
uniforms of elements 2j and 2j+1, 53 bits each, ``((x0 >> 5) * 2^26 + (x1 >> 6)) * 2^-53`` (so
uniforms lie on the float64 grid of [0, 1), like ``torch.rand``'s). Philox is computed in int64
torch ops: a 32 x 32-bit product is one int64 multiply whose low 64 bits are kept (two's-complement
wrap-around, what CPU and CUDA integer multiplies do), its words read with a shift and masks; each
device's first use checks that against Random123's known answer and, where it fails, splits every
product into two 32 x 16-bit ones that never overflow. So the uniforms are bit-identical on every
device and CPU (tests/engine/test_rng.py checks Random123's known-answer vectors and an independent
pure-Python Philox, both ways).

A stream is consumed in order: ``uniform(*shape)`` returns the next ``prod(shape)`` elements.
What a call returns depends only on the key and how many elements earlier calls took, never on
the device, the batch it shares or when elements were computed. Elements are computed ahead in
blocks (a pool on the device, refilled by one vectorised Philox pass over every stream), so a
round's draws are slices of a device tensor: no host work, no host-to-device copy, no sync.

``PerSampleRNG`` gives each sample its own stream keyed by its seed, so a sample's tokens do not
depend on which other samples share its batch or in which order prompts run (every sample of a
batch consumes the same counts: the loop draws fixed shapes per round). ``SharedRNG`` draws a
whole batch from one stream (row b of a call = its b-th block of elements): the theory lab,
where samples are i.i.d. replicates.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

MASK32 = 0xFFFFFFFF
# Philox4x32 constants (Random123 philox.h): multipliers and Weyl key increments
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10


def _mulhilo_wrapping(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * m (a an int64 tensor of values < 2^32, m <
    2^32) from one int64 multiply that wraps modulo 2^64: the arithmetic shift's sign bits above
    bit 31 are masked off."""
    prod = a * m
    return (prod >> 32) & MASK32, prod & MASK32


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * m, a an int64 tensor of values < 2^32:
    m = mh * 2^16 + ml, so a * m = (a * mh) * 2^16 + a * ml with both products < 2^48 (no int64
    overflow anywhere): lo = (a*ml + (a*mh mod 2^16) * 2^16) mod 2^32, hi = (a*mh + a*ml div 2^16) div 2^16."""
    lo_part = a * (m & 0xFFFF)
    hi_part = a * (m >> 16)
    lo = (lo_part + ((hi_part & 0xFFFF) << 16)) & MASK32
    hi = (hi_part + (lo_part >> 16)) >> 16
    return hi, lo


def philox4x32(counter: Sequence[torch.Tensor], key: Sequence[torch.Tensor], rounds: int = PHILOX_ROUNDS,
               wrapping: Optional[bool] = None):
    """Philox4x32-``rounds`` (Random123's philox4x32_R): four int64 tensors (or ints) of 32-bit
    counter words and two of key words (broadcastable) -> the four 32-bit output words (int64
    tensors). ``wrapping``: products by one wrapping multiply (None: where the device's check passed)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    if wrapping is None:
        wrapping = _wraps(k0.device if torch.is_tensor(k0) else torch.device("cpu"))
    mulhilo = _mulhilo_wrapping if wrapping else _mulhilo
    for r in range(rounds):
        if r:  # the key schedule bumps before every round after the first
            k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
        hi0, lo0 = mulhilo(c0, PHILOX_M[0])
        hi1, lo1 = mulhilo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


# Random123 kat_vectors, philox4x32 10: counter and key of all ones (every product wraps)
_KAT = ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD))
_WRAPS: dict = {}


def _wraps(device: torch.device) -> bool:
    """Whether int64 multiplies wrap modulo 2^64 on ``device`` (its first use: one known-answer
    Philox and one host read, then cached)."""
    key = (device.type, device.index)
    if key not in _WRAPS:
        if device.type == "meta":
            return True
        ctr, k, want = _KAT
        out = philox4x32([torch.tensor([c], device=device) for c in ctr], [torch.tensor([x], device=device) for x in k],
                         wrapping=True)
        _WRAPS[key] = torch.cat(out).tolist() == list(want)
    return _WRAPS[key]


def _to_unit(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """53-bit uniforms in [0, 1) from two 32-bit words (exact in float64)."""
    return ((hi >> 5) * (1 << 26) + (lo >> 6)).to(torch.float64) * 2.0 ** -53


def stream_uniforms(keys: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """(S, count) float64: elements [start, start + count) of the streams keyed by ``keys`` (S,)
    int64 (values in [0, 2^63): seeds), computed on ``keys``' device."""
    if count <= 0:
        return torch.zeros(keys.shape[0], 0, dtype=torch.float64, device=keys.device)
    first, last = start // 2, (start + count - 1) // 2  # counter blocks holding the elements
    j = torch.arange(first, last + 1, device=keys.device).unsqueeze(0)
    u = _blocks(keys, lambda rows, cols: (j[:, cols] & MASK32, j[:, cols] >> 32, 0, 0), j.shape[1])
    off = start - 2 * first
    return u[:, off: off + count]


def indexed_uniforms(keys: torch.Tensor, index: torch.Tensor, count: int, tag: int = 1) -> torch.Tensor:
    """(R, count) float64: uniform ``v`` of row ``r`` is a pure function of (keys[r], index[r], v):
    word pair ``v mod 2`` of Philox on the counter (v // 2, index[r], tag, 0) under the key keys[r]
    (``keys`` (R,) in [0, 2^63), ``index`` (R,) in [0, 2^32), ``count`` <= 2^33). Random access by
    index (an image position, say), where a stream is consumed in order; ``tag`` >= 1 keeps these
    counters apart from every stream's (whose third word is 0)."""
    n = (count + 1) // 2
    v = torch.arange(n, device=keys.device).unsqueeze(0)
    idx = index.reshape(-1, 1)
    return _blocks(keys, lambda rows, cols: (v[:, cols], idx[rows], tag, 0), n)[:, :count]


_CHUNK = 1 << 14  # Philox blocks per CPU tile (measured: 2x faster than one pass over 2^20)


def _blocks(keys: torch.Tensor, counter, n_blocks: int) -> torch.Tensor:
    """(S, 2 * n_blocks) float64: the uniforms of Philox blocks 0..n_blocks-1 of row s under the key
    keys[s], block c at the counter ``counter(rows, cols)`` (four words: tensors broadcastable to
    (rows, cols), or ints). On the CPU in tiles of about _CHUNK blocks (rows x columns: one long
    stream is tiled too), whose ~200 elementwise passes stay in cache."""
    S = keys.shape[0]
    out = torch.empty(S, 2 * n_blocks, dtype=torch.float64, device=keys.device)
    cpu = keys.device.type == "cpu"
    cols_per = max(1, min(n_blocks, _CHUNK)) if cpu else max(n_blocks, 1)
    rows_per = max(1, _CHUNK // cols_per) if cpu else max(S, 1)
    for c in range(0, n_blocks, cols_per):
        cols = slice(c, min(n_blocks, c + cols_per))
        for r in range(0, S, rows_per):
            rows = slice(r, r + rows_per)
            k = keys[rows].unsqueeze(1)
            x0, x1, x2, x3 = philox4x32(counter(rows, cols), (k & MASK32, k >> 32))
            u = torch.stack([_to_unit(x0, x1), _to_unit(x2, x3)], -1)  # (rows, cols, 2)
            out[rows, 2 * cols.start: 2 * cols.stop] = u.expand(k.shape[0], cols.stop - cols.start, 2).flatten(1)
    return out


class _Streams:
    """Consumes S counter-based streams in order, computed ahead in pooled blocks on one device."""

    pool_elements = 1 << 21  # the pool holds at most this many uniforms in all (16 MiB of float64) ...
    min_block = 256  # ... and at least this many per stream (more when one call asks for more)

    def __init__(self, keys: Sequence[int], device=None):
        device = torch.device("cpu") if device is None else torch.device(device)  # ``to`` moves them
        keys = [int(k) for k in keys]
        if any(k < 0 or k >= 1 << 63 for k in keys):
            raise ValueError("RNG seeds must lie in [0, 2^63)")
        self.keys = torch.tensor(keys, dtype=torch.long, device=device)
        self.pos = 0  # elements consumed per stream (host-known: every stream consumes alike)
        self.base = 0  # stream index of the pool's first column
        self.pool = torch.zeros(len(keys), 0, dtype=torch.float64, device=device)

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def to(self, device) -> None:
        self.keys, self.pool = self.keys.to(device), self.pool.to(device)

    def take(self, n: int) -> torch.Tensor:
        """(S, n): the next n elements of every stream (a view of the pool when it holds them)."""
        end = self.base + self.pool.shape[1]
        if self.pos + n > end:
            S = self.keys.shape[0]
            block = max(n, self.min_block, min(self.pool_elements // max(S, 1), 2 * self.pool.shape[1]))
            self.base, self.pool = self.pos, stream_uniforms(self.keys, self.pos, block)
        i = self.pos - self.base
        self.pos += n
        return self.pool[:, i: i + n]


class _CounterRNG:
    """Draws from counter-based streams on ``device`` (``on`` moves them; a stream's values never
    depend on it)."""

    def __init__(self, keys, dtype, device):
        self.streams = _Streams(keys, device)
        self.dtype = dtype

    def on(self, device):
        self.streams.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return self.streams.device

    def keys(self) -> torch.Tensor:
        """(B,) int64 on the device: one fresh key per row (its next uniform's 53 bits, so row b's
        key comes from row b's draws alone), for ``indexed_uniforms``' random-access draws."""
        return (self._take(self._rows, (1,), exact=True)[:, 0] * 2.0 ** 53).long()

    def indexed(self, keys: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
        """``indexed_uniforms(keys, index, count)`` on this RNG's device (random access: a pure
        function of its arguments, whatever was drawn before)."""
        return indexed_uniforms(keys.to(self.device), index.to(self.device), count)

    def _take(self, rows: int, shape: tuple[int, ...], exact: bool = False) -> torch.Tensor:
        u = self.streams.take(rows * math.prod(shape)).reshape(-1, *shape)
        return u if exact or self.dtype == torch.float64 else u.to(self.dtype)


class PerSampleRNG(_CounterRNG):
    """Sample b's uniforms come from its own stream keyed by ``seeds[b]``."""

    def __init__(self, seeds, dtype=torch.float64, device=None):
        super().__init__(seeds, dtype, device)
        self._rows = 1  # rows a stream gives each call

    def uniform(self, *shape: int) -> torch.Tensor:
        """(B, *shape) uniforms in [0, 1); row b from sample b's stream only."""
        return self._take(self._rows, shape)


class SharedRNG(_CounterRNG):
    """A batch of i.i.d. replicates from one stream keyed by ``seed``: row b of a call takes the
    call's b-th block of ``prod(shape)`` elements."""

    def __init__(self, batch: int, seed: int, dtype=torch.float64, device: Optional[torch.device] = None):
        super().__init__([seed], dtype, device)
        self.batch = self._rows = batch

    def uniform(self, *shape: int) -> torch.Tensor:
        return self._take(self._rows, shape)
