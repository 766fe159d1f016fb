"""MAR's KL-16 VAE (LTH14/mar ``models/vae.py::AutoencoderKL``, an LDM KL autoencoder): MAR's
continuous token grid <-> pixels.

The module tree reproduces upstream's parameter names so ``kl16.ckpt`` (``{"model": sd}``, read by
upstream ``AutoencoderKL.init_from_ckpt``) loads with ``strict=True``:
``encoder.{conv_in, down.{i}.block.{j}, down.{i}.attn.{j}, down.{i}.downsample.conv,
mid.{block_1, attn_1, block_2}, norm_out, conv_out}``, ``quant_conv``, ``post_quant_conv`` and
``decoder.{conv_in, mid.*, up.{i}.block.{j}, up.{i}.upsample.conv, norm_out, conv_out}``, where
``decoder.up[i]`` is level i (``up[0]`` = full resolution; upstream ``self.up.insert(0, up)``).

Invariants (upstream behaviour):
* ``Encoder``: attention after every res block of a level whose resolution (counted from
  ``config.resolution``, not from the input) is in ``attn_resolutions`` = (16,), i.e. the last level
  at 256 px; ``Decoder``: ``attn_resolutions=()``, so attention only in ``mid``. No time embedding
  (``temb_ch=0``: no ``temb_proj``), dropout 0, ``nin_shortcut`` (1x1) when the width changes.
* stride 2**(len(ch_mult)-1) = 16: a 256x256 image gives a (16, 16, 16) latent;
  ``DiagonalGaussianDistribution``: (mean, logvar) = chunk(quant_conv(h), 2), logvar clamped to
  [-30, 20], sample = mean + exp(logvar / 2) * eps.
* MAR tokens are ``posterior.sample() * 0.2325`` (``engine_mar.train_one_epoch``), patchified
  row-major with patch size 1 (``MAR.patchify``); images are ``vae.decode(tokens / 0.2325)`` saved
  as ``round(clip((x + 1) / 2 * 255, 0, 255))`` (``engine_mar.evaluate``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.models.blocks import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm, res_level, run_res_level
from coolsd.util.loading import check_state_dict, read_torch_checkpoint

SCALE = 0.2325  # MAR's latent scale (engine_mar.py: "normalize the std of latent to be 1")
KL16_SOURCE = ("MAR's kl16.ckpt: `python util/download.py` in github.com/LTH14/mar writes "
               "pretrained_models/vae/kl16.ckpt (Dropbox link in that script), or the "
               "Hugging Face repo jadechoghari/mar")


@dataclass(frozen=True)
class KLVAEConfig:
    """Upstream builds ``AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4))`` and leaves every
    other Encoder/Decoder argument at its default; ``z_channels`` is ``embed_dim`` there."""
    embed_dim: int = 16
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    in_channels: int = 3
    out_ch: int = 3
    resolution: int = 256
    attn_resolutions: tuple[int, ...] = (16,)  # Encoder only (Decoder's default is ())

    def __post_init__(self):
        if self.z_channels != self.embed_dim:  # quant_conv maps 2*z_channels -> 2*embed_dim
            raise ValueError(f"z_channels ({self.z_channels}) must equal embed_dim ({self.embed_dim})")
        if self.ch % 32:  # GroupNorm(32) on every width ch * m
            raise ValueError(f"ch ({self.ch}) must be a multiple of 32 (GroupNorm with 32 groups)")

    @property
    def stride(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


def _mid(c: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(c, c), AttnBlock(c), ResnetBlock(c, c)
    return mid


def _run_mid(mid: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h)))


class Encoder(nn.Module):
    """Upstream ``Encoder`` (double_z=True: conv_out gives 2 * z_channels moments)."""

    def __init__(self, cfg: KLVAEConfig):
        super().__init__()
        n, res = len(cfg.ch_mult), cfg.resolution
        c = cfg.ch
        self.conv_in = nn.Conv2d(cfg.in_channels, c, 3, padding=1)
        self.down = nn.ModuleList()
        for i, m in enumerate(cfg.ch_mult):
            level = res_level(c, cfg.ch * m, cfg.num_res_blocks, attn=res in cfg.attn_resolutions, key="block")
            c = cfg.ch * m
            if i != n - 1:
                level.downsample, res = Downsample(c), res // 2
            self.down.append(level)
        self.mid = _mid(c)
        self.norm_out, self.conv_out = group_norm(c), nn.Conv2d(c, 2 * cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.down:
            h = run_res_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        return self.conv_out(F.silu(self.norm_out(_run_mid(self.mid, h))))


class Decoder(nn.Module):
    """Upstream ``Decoder`` (attn_resolutions=(), give_pre_end=False); num_res_blocks + 1 per level."""

    def __init__(self, cfg: KLVAEConfig):
        super().__init__()
        c = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, c, 3, padding=1)
        self.mid = _mid(c)
        levels = []
        for i in reversed(range(len(cfg.ch_mult))):  # built lowest resolution first
            level = res_level(c, cfg.ch * cfg.ch_mult[i], cfg.num_res_blocks + 1, attn=False, key="block")
            c = cfg.ch * cfg.ch_mult[i]
            if i != 0:
                level.upsample = Upsample(c)
            levels.insert(0, level)  # stored by level index: up[0] is the full resolution
        self.up = nn.ModuleList(levels)
        self.norm_out, self.conv_out = group_norm(c), nn.Conv2d(c, cfg.out_ch, 3, padding=1)

    def forward(self, z):
        h = _run_mid(self.mid, self.conv_in(z))
        for level in reversed(self.up):
            h = run_res_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class KLVAE(nn.Module):
    """Upstream ``AutoencoderKL`` with use_variational=True."""

    def __init__(self, config: KLVAEConfig = KLVAEConfig()):
        super().__init__()
        self.config = config
        self.encoder, self.decoder = Encoder(config), Decoder(config)
        self.quant_conv = nn.Conv2d(2 * config.z_channels, 2 * config.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.z_channels, 1)

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, 3, H, W) in [-1, 1] -> (mean, logvar), each (B, embed_dim, H/stride, W/stride)."""
        mean, logvar = self.quant_conv(self.encoder(images)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, embed_dim, h, w) unscaled latents -> (B, 3, h*stride, w*stride) in about [-1, 1]."""
        return self.decoder(self.post_quant_conv(latents))


def tokens_from_latents(lat: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C), token i*w + j = lat[:, :, i, j] (``MAR.patchify``, p=1)."""
    return lat.flatten(2).transpose(1, 2)


@torch.no_grad()
def encode_tokens(vae: KLVAE, images: torch.Tensor, sample: bool = True,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Images in [-1, 1] -> MAR tokens (B, h*w, C): posterior sample (or mean) * SCALE."""
    mean, logvar = vae.encode(images)
    if sample:
        eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        mean = mean + torch.exp(0.5 * logvar) * eps
    return tokens_from_latents(mean * SCALE)


@torch.no_grad()
def decode_tokens(vae: KLVAE, tokens: torch.Tensor, h: int, w: int) -> np.ndarray:
    """MAR tokens (B, h*w, C) -> uint8 RGB (B, H, W, 3), as ``engine_mar.evaluate`` saves them."""
    b, n, c = tokens.shape
    if n != h * w:
        raise ValueError(f"{n} tokens do not form a {h}x{w} grid")
    lat = tokens.transpose(1, 2).reshape(b, c, h, w).to(vae.post_quant_conv.weight.dtype)
    x = (vae.decode(lat / SCALE).float() + 1) / 2
    x = torch.round(torch.clamp(x * 255, 0, 255))  # clip then round (np.round: half to even, as torch)
    return x.to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def load_kl16(path, config: KLVAEConfig = KLVAEConfig(), device="cpu") -> KLVAE:
    """Strictly load MAR's ``kl16.ckpt`` (``{"model": sd}``, or LDM's "state_dict"; or a
    .safetensors of the same state dict); fp32, eval."""

    state = read_torch_checkpoint(path, "KL-16 VAE checkpoint", KL16_SOURCE, keys=("model", "state_dict"))
    # Upstream loads with strict=False (it only prints missing/unexpected keys). Of what it would
    # ignore we drop only LDM's training loss (``loss.*``: LPIPS + discriminator, no module in MAR's
    # AutoencoderKL); kl16.ckpt itself (253.5 MiB = 66.46M fp32 values) should hold none.
    state = {k: v for k, v in state.items() if not k.startswith("loss.")}
    model = KLVAE(config)
    check_state_dict(model, state, os.fspath(path), KL16_SOURCE)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval().requires_grad_(False)
