"""Building blocks shared by several model files. Parameter names are those of the upstream
checkpoints that use them, so every model built from them loads its files with ``strict=True``.

* ``RMSNorm`` (LlamaGen, Chameleon, EAGLE): statistics in at least fp32 (``compute_dtype``). With
  the weight in the input's dtype it is one fused ``F.rms_norm`` (one kernel on CUDA, which
  computes in fp32 for bf16 / fp16 and rounds once); upstream normalises in fp32, casts back, then
  scales (two roundings, four kernels). In fp32 / fp64 the two are the same arithmetic; in bf16 they
  differ by at most one bf16 ulp where they differ at all (a quarter of the entries, measured on
  random inputs), the fused one nearer the exact value. A weight in another dtype than the input
  (mixed precision) takes upstream's path;
* ``GatedMLP``: the Llama SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``; no biases),
  used by the EAGLE-1 head (LANTERN's drafters) and the Chameleon backbone (Lumina-mGPT).
* ``ResnetBlock``, ``AttnBlock``, ``Upsample``, ``group_norm``: the taming-transformers conv
  blocks of the VQ tokenizers (LlamaGen ``vq_model.py``, Chameleon's VQGAN): GroupNorm(32,
  eps 1e-6), swish, a 1x1 ``nin_shortcut`` when the width changes, single-head spatial
  self-attention with scale c^-1/2, nearest x2 upsampling then a 3x3 conv.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and RoPE run in fp32 as upstream, or in fp64 when the model is fp64."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:  # one fused kernel, statistics in at least fp32 (module docstring)
            return F.rms_norm(x, x.shape[-1:], weight=self.weight, eps=self.eps)
        # mixed precision: normalise in fp32, cast back, then scale (upstream's order)
        normed = F.rms_norm(x.to(compute_dtype(x.dtype)), x.shape[-1:], eps=self.eps)  # x * rsqrt(mean(x^2) + eps)
        return normed.to(x.dtype) * self.weight


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def group_norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """taming ``ResnetBlock`` without a time embedding."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1, self.conv1 = group_norm(c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = group_norm(c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.nin_shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    """taming ``AttnBlock``: single-head attention over the h*w positions, 1x1 conv projections."""

    def __init__(self, c: int):
        super().__init__()
        self.norm = group_norm(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        h = self.norm(x)
        q, k, v = (m(h).reshape(b, c, hh * ww).transpose(1, 2) for m in (self.q, self.k, self.v))
        w = torch.softmax(q @ k.transpose(1, 2) * c ** -0.5, dim=-1)  # (b, query, key)
        return x + self.proj_out((w @ v).transpose(1, 2).reshape(b, c, hh, ww))


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Downsample(nn.Module):
    """Stride-2 3x3 conv after a (0, 1, 0, 1) zero pad (taming / LDM ``Downsample``, with_conv)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


def res_level(c_in: int, c_out: int, n_blocks: int, attn: bool, key: str) -> nn.Module:
    """One resolution level of a taming/LDM encoder or decoder: ``n_blocks`` ResnetBlocks under
    ``key`` (LlamaGen: "res", LDM: "block"), each followed by an AttnBlock when ``attn``."""
    level = nn.Module()
    setattr(level, key, nn.ModuleList(ResnetBlock(c_in if j == 0 else c_out, c_out) for j in range(n_blocks)))
    level.attn = nn.ModuleList(AttnBlock(c_out) for _ in range(n_blocks if attn else 0))
    level.key = key
    return level


def run_res_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for j, block in enumerate(getattr(level, level.key)):
        h = block(h)
        if len(level.attn):
            h = level.attn[j](h)
    return h

