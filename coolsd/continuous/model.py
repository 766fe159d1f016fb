"""A small causal AR model over continuous tokens with a MAR-style diffusion head (the toy
continuous target and draft; continuous_sd.md 4.1).

* ``AdaLNHead``: MAR's ``SimpleMLPAdaLN`` shape: input projection, sinusoidal step embedding
  and condition projection summed into c, residual blocks of LayerNorm -> adaLN modulation
  (shift, scale, gate from SiLU(c)) -> MLP, a modulated final layer giving 2C channels:
  epsilon and v (the learned-range variance interpolant).
* ``ContinuousAR``: a class embedding as the first position, then token projections with learned
  positions, a causal transformer; the output at position i conditions token i. The forward
  always runs on the full padded length, so a position's condition is bit-identical whatever the
  number of tokens given (the speculative loop relies on this).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ContinuousConfig:
    token_dim: int = 16
    seq_len: int = 16
    dim: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_classes: int = 10
    head_width: int = 64
    head_blocks: int = 2


def step_embedding(t, n: int, dim: int, dtype) -> torch.Tensor:
    """(n, dim) sinusoidal embedding of timestep t, an int or (n,) (MAR's TimestepEmbedder input)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    ang = torch.as_tensor(t, dtype=torch.float64).reshape(-1, 1) * freqs
    return torch.cat([torch.cos(ang), torch.sin(ang)], -1).to(dtype).expand(n, dim)


class AdaLNBlock(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.norm = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(w, 3 * w))

    def forward(self, x, c):
        shift, scale, gate = self.ada(c).chunk(3, dim=-1)
        return x + gate * self.mlp(self.norm(x) * (1 + scale) + shift)


class AdaLNHead(nn.Module):
    def __init__(self, cfg: ContinuousConfig):
        super().__init__()
        w, C = cfg.head_width, cfg.token_dim
        self.width = w
        self.input_proj = nn.Linear(C, w)
        self.time_embed = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.cond_embed = nn.Linear(cfg.dim, w)
        self.blocks = nn.ModuleList(AdaLNBlock(w) for _ in range(cfg.head_blocks))
        self.final_norm = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(w, 2 * w))
        self.out = nn.Linear(w, 2 * C)

    def forward(self, x: torch.Tensor, t, z: torch.Tensor):
        """x (N, C), original timestep t (an int, or (N,) for training), condition z (N, dim) ->
        (epsilon (N, C), v (N, C))."""
        c = self.time_embed(step_embedding(t, x.shape[0], self.width, x.dtype)) + self.cond_embed(z)
        h = self.input_proj(x)
        for b in self.blocks:
            h = b(h, c)
        shift, scale = self.final_ada(c).chunk(2, dim=-1)
        eps, v = self.out(self.final_norm(h) * (1 + scale) + shift).chunk(2, dim=-1)
        return eps, v


class ContinuousAR(nn.Module):
    def __init__(self, cfg: ContinuousConfig):
        super().__init__()
        self.config = cfg
        self.class_embed = nn.Embedding(cfg.n_classes + 1, cfg.dim)  # the last class is "no label" (CFG)
        self.token_proj = nn.Linear(cfg.token_dim, cfg.dim)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len + 1, cfg.dim))
        layer = nn.TransformerEncoderLayer(cfg.dim, cfg.n_head, 4 * cfg.dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, cfg.n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = AdaLNHead(cfg)
        nn.init.normal_(self.pos, std=0.02)

    @property
    def null_class(self) -> int:
        return self.config.n_classes

    def conditions(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens (B, n, C) with n <= seq_len, labels (B,) -> z (B, seq_len + 1, dim); z[:, i]
        conditions token i and depends on tokens < i only (causal; padded to full length)."""
        cfg = self.config
        B, n, _ = tokens.shape
        full = torch.zeros(B, cfg.seq_len, cfg.token_dim, dtype=tokens.dtype, device=tokens.device)
        full[:, :n] = tokens
        h = torch.cat([self.class_embed(labels).unsqueeze(1), self.token_proj(full)], 1) + self.pos
        mask = torch.ones(cfg.seq_len + 1, cfg.seq_len + 1, dtype=torch.bool, device=h.device).triu(1)
        return self.norm(self.blocks(h, mask=mask))
