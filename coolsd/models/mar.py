"""MAR (Li et al. 2024, github.com/LTH14/mar ``models/mar.py``, ``models/diffloss.py``) in one
file: the masked encoder-decoder ViT that turns the known tokens into one condition vector z per
position, and the DiffLoss head ``SimpleMLPAdaLN`` that turns (noisy token, timestep, z) into
(epsilon, v). Parameter names are upstream's, so ``checkpoint-last.pth`` ("model_ema") loads with
``strict=True`` (``load_mar``). The continuous speculative loop (``coolsd.engine.continuous.generate``)
uses only ``conditions`` and ``head``; the toy continuous world uses the same classes, tiny.

Invariants (continuous_sd.md 1.2-1.5):
* ``conditions(tokens, known, labels)[b, j]`` depends on the tokens at the known positions of
  row b only (the values at unknown positions are never read), bidirectionally. Upstream drops
  unknown tokens before the encoder (MAE); here they are excluded as attention keys, which gives
  the same outputs and lets rows of one batch know different numbers of tokens.
* The class embedding fills the ``buffer_size`` leading positions; ``NULL_LABEL`` (-1) selects
  ``fake_latent``, the unconditional embedding of classifier-free guidance.
* The head embeds the ORIGINAL training timestep (256 sinusoidal frequencies, then an MLP);
  its output's first half is epsilon, the second v (learned-range variance).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.engine.model_protocol import NULL_LABEL  # noqa: F401  (-1: the unconditional branch, MAR's ``fake_latent``)
from coolsd.util.loading import check_state_dict, read_torch_checkpoint


@dataclass(frozen=True)
class MARConfig:
    seq_len: int = 256  # (img_size / vae_stride / patch_size)^2
    token_dim: int = 16  # vae_embed_dim * patch_size^2
    encoder_dim: int = 1024
    encoder_depth: int = 16
    encoder_heads: int = 16
    decoder_dim: int = 1024
    decoder_depth: int = 16
    decoder_heads: int = 16
    mlp_ratio: float = 4.0
    buffer_size: int = 64
    n_classes: int = 1000
    head_width: int = 1024  # diffloss_w
    head_depth: int = 3  # diffloss_d

    @property
    def side(self) -> int:
        return math.isqrt(self.seq_len)


# The released checkpoints (continuous_sd.md 1.2): encoder = decoder size; DiffLoss depth x width
MAR_CONFIGS = {
    "mar_base": MARConfig(encoder_dim=768, encoder_depth=12, encoder_heads=12, decoder_dim=768, decoder_depth=12,
                          decoder_heads=12, head_width=1024, head_depth=6),
    "mar_large": MARConfig(head_width=1280, head_depth=8),
    "mar_huge": MARConfig(encoder_dim=1280, encoder_depth=20, encoder_heads=16, decoder_dim=1280, decoder_depth=20,
                          decoder_heads=16, head_width=1536, head_depth=12),
}


class Attention(nn.Module):
    """timm ``Attention``: fused ``qkv`` (with bias), scale head_dim^-1/2, ``proj``."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, key_ok=None):
        B, T, D = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if key_ok is None else key_ok[:, None, None, :]  # (B, 1, 1, T): True = may be attended
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """timm ``Block`` (pre-norm, LayerNorm eps 1e-6, exact GELU, no layer scale)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x, key_ok=None):
        x = x + self.attn(self.norm1(x), key_ok)
        return x + self.mlp(self.norm2(x))


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int, n_freq: int = 256):
        super().__init__()
        self.n_freq = n_freq
        self.mlp = nn.Sequential(nn.Linear(n_freq, width), nn.SiLU(), nn.Linear(width, width))
        self._freq: dict = {}  # (t, dtype, device) -> (1, n_freq): the weight-free sinusoid, cached

    def forward(self, t, n: int, dtype):
        """(n, width) embeddings of timestep t (an int, or (n,) in training)."""
        device = self.mlp[0].weight.device
        if isinstance(t, int):
            key = (t, dtype, device)
            if key not in self._freq:
                self._freq[key] = self._sinusoid(t, dtype, device)
            return self.mlp(self._freq[key]).expand(n, -1)
        return self.mlp(self._sinusoid(t, dtype, device)).expand(n, -1)

    def _sinusoid(self, t, dtype, device):
        half = self.n_freq // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        ang = torch.as_tensor(t, dtype=torch.float32).reshape(-1, 1) * freqs  # upstream: fp32 frequencies
        return torch.cat([torch.cos(ang), torch.sin(ang)], -1).to(dtype=dtype, device=device)


class ResBlock(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(w, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 3 * w))

    def forward(self, x, y):
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class FinalLayer(nn.Module):
    def __init__(self, w: int, out: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(w, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 2 * w))

    def forward(self, x, y):
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class SimpleMLPAdaLN(nn.Module):
    """MAR's DiffLoss network: ``head(x (N, C), t, z (N, D)) -> (epsilon (N, C), v (N, C))``
    with t the original training timestep (an int, or (N,) in training)."""

    def __init__(self, token_dim: int, width: int, z_dim: int, depth: int):
        super().__init__()
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(z_dim, width)
        self.input_proj = nn.Linear(token_dim, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * token_dim)
        for b in self.res_blocks:  # upstream's zero init of the modulations and the output
            nn.init.zeros_(b.adaLN_modulation[-1].weight), nn.init.zeros_(b.adaLN_modulation[-1].bias)
        for m in (self.final_layer.adaLN_modulation[-1], self.final_layer.linear):
            nn.init.zeros_(m.weight), nn.init.zeros_(m.bias)

    def forward(self, x, t, z):
        y = self.time_embed(t, x.shape[0], x.dtype) + self.cond_embed(z)
        h = self.input_proj(x)
        for b in self.res_blocks:
            h = b(h, y)
        return self.final_layer(h, y).chunk(2, dim=-1)


class DiffLoss(nn.Module):
    """Holds ``net`` (upstream's key prefix ``diffloss.net.``); the diffusion itself lives in
    ``coolsd.engine.continuous.diffusion`` and ``coolsd.models.mar_loss``."""

    def __init__(self, cfg: MARConfig):
        super().__init__()
        self.net = SimpleMLPAdaLN(cfg.token_dim, cfg.head_width, cfg.decoder_dim, cfg.head_depth)


class MAR(nn.Module):
    def __init__(self, cfg: MARConfig):
        super().__init__()
        self.config = cfg
        E, Dd, L = cfg.encoder_dim, cfg.decoder_dim, cfg.seq_len + cfg.buffer_size
        self.class_emb = nn.Embedding(cfg.n_classes, E)
        self.fake_latent = nn.Parameter(torch.zeros(1, E))
        self.z_proj = nn.Linear(cfg.token_dim, E)
        self.z_proj_ln = nn.LayerNorm(E, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L, E))
        self.encoder_blocks = nn.ModuleList(Block(E, cfg.encoder_heads, cfg.mlp_ratio) for _ in range(cfg.encoder_depth))
        self.encoder_norm = nn.LayerNorm(E, eps=1e-6)
        self.decoder_embed = nn.Linear(E, Dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, Dd))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L, Dd))
        self.decoder_blocks = nn.ModuleList(Block(Dd, cfg.decoder_heads, cfg.mlp_ratio) for _ in range(cfg.decoder_depth))
        self.decoder_norm = nn.LayerNorm(Dd, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, cfg.seq_len, Dd))
        self.diffloss = DiffLoss(cfg)
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)

    @property
    def head(self) -> SimpleMLPAdaLN:
        return self.diffloss.net

    def class_embedding(self, labels: torch.Tensor) -> torch.Tensor:
        """(B,) class indices, ``NULL_LABEL`` for the unconditional branch -> (B, encoder_dim)."""
        null = (labels == NULL_LABEL).unsqueeze(-1)
        return torch.where(null, self.fake_latent, self.class_emb(labels.clamp(min=0)))

    def conditions(self, tokens: torch.Tensor, known: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """tokens (B, L, C), known (B, L) bool, labels (B,) -> z (B, L, decoder_dim): the condition
        of every position given the known tokens (MAR's ``forward_mae_encoder`` + ``_decoder``)."""
        cfg = self.config
        B, nb = tokens.shape[0], cfg.buffer_size
        x = self.z_proj(torch.where(known.unsqueeze(-1), tokens, torch.zeros_like(tokens)))
        x = torch.cat([self.class_embedding(labels).unsqueeze(1).expand(B, nb, -1).to(x.dtype), x], 1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
        key_ok = torch.cat([known.new_ones(B, nb), known], 1)
        for blk in self.encoder_blocks:
            x = blk(x, key_ok)
        x = self.decoder_embed(self.encoder_norm(x))
        x = torch.where(key_ok.unsqueeze(-1), x, self.mask_token.to(x.dtype))  # unknown positions: the mask token
        x = x + self.decoder_pos_embed_learned
        for blk in self.decoder_blocks:
            x = blk(x)
        return self.decoder_norm(x)[:, nb:] + self.diffusion_pos_embed_learned


MAR_SOURCE = ("MAR's checkpoint-last.pth (github.com/LTH14/mar README / util/download.py: "
              "pretrained_models/mar/mar_{base,large,huge}/; Hugging Face jadechoghari/mar)")


def load_mar(path, cfg: MARConfig, dtype=torch.float32, device="cpu", model_cls=None) -> MAR:
    """Strict, safe loading of a MAR checkpoint for the architecture ``cfg``: ``.safetensors``, or
    ``checkpoint-last.pth`` via ``torch.load(weights_only=True)`` taking "model_ema" (upstream's
    evaluation weights), else "model"; upstream pickles its argparse ``args`` beside the weights,
    so Namespace (and nothing else) is allowed."""
    import argparse


    state = read_torch_checkpoint(path, "MAR checkpoint", MAR_SOURCE, keys=("model_ema", "model"),
                                  allow=(argparse.Namespace,))
    with torch.device("meta"):
        model = (model_cls or MAR)(cfg)
    check_state_dict(model, state, os.fspath(path), MAR_SOURCE)
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
