"""LlamaGen's image tokenizer (FoundationVision/LlamaGen ``tokenizer/tokenizer_image/vq_model.py``,
``VQ_16``): the t2i target's token grid <-> pixels.

The module tree reproduces the upstream parameter names, so ``vq_ds16_t2i.pt`` (``{"model": sd}``)
loads with ``strict=True``: encoder and decoder (``conv_in``, ``conv_blocks.{i}.res.{j}``,
``conv_blocks.{i}.attn.{j}``, ``conv_blocks.{i}.downsample|upsample.conv``, ``mid.{0,1,2}``,
``norm_out``, ``conv_out``), ``quant_conv``, ``post_quant_conv``, ``quantize.embedding`` and
the ``quantize.codebook_used`` buffer (65,536 entries, training bookkeeping, kept so that
strict loading accounts for every key).

Invariants (upstream behaviour):
* the codebook is L2-normalised at lookup (``codebook_l2_norm=True``), latents too at encoding;
* tokens are the latent grid flattened row-major: ``decode_code(tokens, shape=[B, 8, g, g])``;
* GroupNorm(32, eps=1e-6), swish, nearest x2 upsampling + conv, stride-2 conv downsampling after
  a (0, 1, 0, 1) zero pad; single-head spatial self-attention at the lowest resolution;
* decoder output is in [-1, 1]; pixels are ``clamp(127.5 x + 128, 0, 255)`` as
  ``sample_t2i_ddp.py`` writes them (``decode_uint8``), [0, 1] floats via ``(x + 1) / 2``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.models.blocks import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm, res_level, run_res_level
from coolsd.util.loading import check_state_dict, read_torch_checkpoint, unwrap_checkpoint  # noqa: F401 (re-exported)

VQ_SOURCE = "https://huggingface.co/peizesun/llamagen_t2i (file vq_ds16_t2i.pt)"


@dataclass(frozen=True)
class VQConfig:
    codebook_size: int = 16384
    codebook_dim: int = 8
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    z_channels: int = 256
    num_res_blocks: int = 2
    usage_buffer: int = 65536  # length of quantize.codebook_used (upstream constant)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


VQ_16 = VQConfig()


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        ch, mult, n = cfg.ch, cfg.ch_mult, len(cfg.ch_mult)
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        c = ch
        for i in range(n):  # attention only at the last (lowest-resolution) level
            level = res_level(c, ch * mult[i], cfg.num_res_blocks, attn=i == n - 1, key="res")
            c = ch * mult[i]
            if i != n - 1:
                level.downsample = Downsample(c)
            self.conv_blocks.append(level)
        self.mid = nn.ModuleList([ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)])
        self.norm_out, self.conv_out = group_norm(c), nn.Conv2d(c, cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.conv_blocks:
            h = run_res_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        ch, mult, n = cfg.ch, cfg.ch_mult, len(cfg.ch_mult)
        c = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c, 3, padding=1)
        self.mid = nn.ModuleList([ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)])
        self.conv_blocks = nn.ModuleList()
        for i in reversed(range(n)):  # conv_blocks[0] is the lowest resolution (with attention)
            level = res_level(c, ch * mult[i], cfg.num_res_blocks + 1, attn=i == n - 1, key="res")
            c = ch * mult[i]
            if i != 0:
                level.upsample = Upsample(c)
            self.conv_blocks.append(level)
        self.norm_out, self.conv_out = group_norm(c), nn.Conv2d(c, 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for level in self.conv_blocks:
            h = run_res_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Quantizer(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_dim)
        self.register_buffer("codebook_used", torch.zeros(cfg.usage_buffer))

    def codebook(self) -> torch.Tensor:
        return F.normalize(self.embedding.weight, p=2, dim=-1)


class LlamaGenVQ(nn.Module):
    def __init__(self, cfg: VQConfig = VQ_16):
        super().__init__()
        self.config = cfg
        self.encoder, self.decoder = Encoder(cfg), Decoder(cfg)
        self.quantize = Quantizer(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_dim, cfg.z_channels, 1)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, (H/16) (W/16)) token ids, row-major."""
        z = F.normalize(self.quant_conv(self.encoder(images)), p=2, dim=1)  # (B, d, h, w)
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        e = self.quantize.codebook()
        dist = (flat**2).sum(1, keepdim=True) + (e**2).sum(1) - 2 * flat @ e.T
        return dist.argmin(1).reshape(b, h * w)

    @torch.no_grad()
    def decode_code(self, tokens: torch.Tensor, grid: int | None = None) -> torch.Tensor:
        """(B, g*g) token ids -> decoder output (B, 3, 16g, 16g) in about [-1, 1]."""
        b, n = tokens.shape
        g = grid or round(n**0.5)
        if g * g != n:
            raise ValueError(f"{n} tokens do not form a square grid")
        zq = self.quantize.codebook()[tokens.reshape(-1)].reshape(b, g, g, -1).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(zq.to(self.post_quant_conv.weight.dtype)))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, g*g) -> images (B, 3, H, W) in [0, 1] (the ImageTarget protocol)."""
        return ((self.decode_code(tokens) + 1) / 2).clamp(0, 1)

    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """(B, g*g) -> uint8 (B, H, W, 3), upstream's ``clamp(127.5 x + 128, 0, 255)``."""
        x = (127.5 * self.decode_code(tokens) + 128.0).clamp(0, 255)
        return x.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def load_llamagen_vq(path, cfg: VQConfig = VQ_16, device="cpu") -> LlamaGenVQ:
    """Strictly load ``vq_ds16_t2i.pt`` (fp32, eval mode)."""
    state = read_torch_checkpoint(path, "LlamaGen VQ tokenizer (vq_ds16_t2i.pt)", VQ_SOURCE)
    model = LlamaGenVQ(cfg)
    check_state_dict(model, state, path, VQ_SOURCE)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval().requires_grad_(False)
