"""The Chameleon VQGAN image tokenizer, decoding side (Meta's ``tokenizer/vqgan.ckpt`` +
``vqgan.yaml``, used by Lumina-mGPT through ``lumina_mgpt/model/chameleon_vae_ori/``:
``vqgan.py`` is taming-transformers' ``VQModel``, ``image_tokenizer.py`` its driver).

Architecture (models_sjd.md 2.4; ``vq_config`` of the Lumina / LANTERN configs): 8192 codes x
256 dims, taming ``VectorQuantizer2`` (legacy, NO L2 normalisation: a code's latent is its raw
codebook row), ``post_quant_conv`` 1x1 (256 -> z_channels 256), then taming's ``Decoder`` with
ch 128, ch_mult (1, 1, 2, 2, 4) (f = 16), 2 res blocks per level (+1 in the decoder),
``attn_resolutions`` empty (attention only in the middle block), GroupNorm(32, eps 1e-6),
swish, nearest x2 upsampling followed by a 3x3 conv.

``decode_codes(codes (B, h*w), h, w)``: codebook rows reshaped (B, h, w, C) -> (B, C, h, w)
(``VectorQuantizer2.get_codebook_entry``), ``post_quant_conv``, ``decoder``; upstream
(``ImageTokenizer._pil_from_chw_tensor``) then clamps to [-1, 1] and maps to [0, 255] uint8;
here the result is returned as floats in [0, 1] (``(clamp(x, -1, 1) + 1) / 2``), the project's
image convention; quantising to uint8 is left to whoever writes the PNG.

Checkpoint: ``torch.load(vqgan.ckpt)["state_dict"]`` (upstream ``VQModel.init_from_ckpt`` and
transformers' converter both index ``["state_dict"]``), taming key layout: ``encoder.*``,
``decoder.*``, ``quantize.embedding.weight``, ``quant_conv.*``, ``post_quant_conv.*``. Upstream
loads it with ``strict=False``, which would hide anything else in the file (e.g. the ``loss.*``
training modules of taming's ``VQLPIPSWithDiscriminator``: LPIPS + discriminator; whether the
released file holds them is unverified). ``load_state`` here is strict: every decoder-side key
must be present with the right shape, and the only keys allowed beyond them are the documented
ignored prefixes ``IGNORED_PREFIXES`` (the encoder side, ``encoder.`` / ``quant_conv.``, which
turns pixels into codes and is not needed to decode generated images, and ``loss.``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.models.blocks import AttnBlock, ResnetBlock, Upsample, group_norm
from coolsd.util.loading import reading, torch_load

VQGAN_SOURCE = (
    "Meta's Chameleon tokenizer files (tokenizer/vqgan.ckpt, from the facebookresearch/chameleon "
    "download; the same file, md5-identical, is at huggingface.co/GAIR/Anole-7b-v0.1/tokenizer/vqgan.ckpt)"
)
IGNORED_PREFIXES = ("encoder.", "quant_conv.", "loss.")


@dataclass(frozen=True)
class VQConfig:
    n_embed: int = 8192
    embed_dim: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    z_channels: int = 256
    out_ch: int = 3
    attn_resolutions: tuple[int, ...] = ()
    resolution: int = 512  # training resolution; only matters through attn_resolutions

    def __post_init__(self):
        for c in {self.ch * m for m in self.ch_mult}:
            if c % 32:
                raise ValueError(f"GroupNorm(32) needs channel counts divisible by 32, got {c}")

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


CHAMELEON_VQGAN = VQConfig()


def tiny_vq(**overrides) -> VQConfig:
    """A small config for CPU tests: 16 codes x 8 dims, f = 4."""
    base = dict(n_embed=16, embed_dim=8, ch=32, ch_mult=(1, 1, 2), num_res_blocks=1, z_channels=8, resolution=16)
    base.update(overrides)
    return VQConfig(**base)


# ---------------------------------------------------------------------------------------- modules
class Decoder(nn.Module):
    """taming ``Decoder`` (``give_pre_end=False``, ``tanh_out=False``); ``up[i]`` is level i
    (upstream builds it in reverse and prepends), run from the deepest level up."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        n = len(cfg.ch_mult)
        block_in = cfg.ch * cfg.ch_mult[-1]
        res = cfg.resolution // 2 ** (n - 1)
        self.conv_in = nn.Conv2d(cfg.z_channels, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        levels: list[nn.Module] = []
        for i in reversed(range(n)):
            level = nn.Module()
            level.block = nn.ModuleList()
            level.attn = nn.ModuleList()
            block_out = cfg.ch * cfg.ch_mult[i]
            for _ in range(cfg.num_res_blocks + 1):
                level.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if res in cfg.attn_resolutions:
                    level.attn.append(AttnBlock(block_in))
            if i != 0:
                level.upsample = Upsample(block_in)
                res *= 2
            levels.insert(0, level)
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for i in reversed(range(len(self.up))):
            level = self.up[i]
            for j, block in enumerate(level.block):
                h = block(h)
                if len(level.attn) > 0:
                    h = level.attn[j](h)
            if i != 0:
                h = level.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """taming ``VectorQuantizer2`` (legacy, no remap, no L2 norm): only the codebook matters for
    decoding."""

    def __init__(self, n_e: int, e_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(n_e, e_dim)

    def get_codebook_entry(self, indices: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """indices (B*h*w,) or (B, h*w) -> latents (B, C, h, w) from ``shape`` = (B, h, w, C)."""
        return self.embedding(indices.reshape(-1)).view(shape).permute(0, 3, 1, 2).contiguous()


class ChameleonVQ(nn.Module):
    """Decoding half of the Chameleon VQGAN with the checkpoint's key names
    (``quantize.embedding.weight``, ``post_quant_conv.*``, ``decoder.*``)."""

    def __init__(self, cfg: VQConfig = CHAMELEON_VQGAN):
        super().__init__()
        self.config = cfg
        self.quantize = VectorQuantizer(cfg.n_embed, cfg.embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = Decoder(cfg)

    @property
    def codebook(self) -> torch.Tensor:
        """(n_embed, embed_dim) raw codebook (LANTERN's latent neighbourhoods, docs/methods.md#3-lantern-and-lantern)."""
        return self.quantize.embedding.weight

    @torch.no_grad()
    def decode_codes(self, codes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """codes (B, h*w) row-major code indices -> images (B, 3, h*f, w*f) in [0, 1]."""
        B = codes.shape[0]
        if codes.shape[1:] != (h * w,):
            raise ValueError(f"expected codes of shape (B, {h * w}) for a {h}x{w} grid, got {tuple(codes.shape)}")
        codes = codes.to(self.codebook.device, torch.long)
        if bool(((codes < 0) | (codes >= self.config.n_embed)).any()):
            raise ValueError(f"codes must lie in [0, {self.config.n_embed})")
        z = self.quantize.get_codebook_entry(codes, (B, h, w, self.config.embed_dim))
        x = self.decoder(self.post_quant_conv(z))
        return ((x.clamp(-1.0, 1.0) + 1.0) / 2.0).float()

    # ------------------------------------------------------------------ checkpoint loading
    @torch.no_grad()
    def load_state(self, checkpoint: Mapping[str, Any]) -> None:
        """Strictly load ``{"state_dict": sd, ...}`` (the vqgan.ckpt form) or a bare state dict:
        a ValueError names every missing, unexpected (outside ``IGNORED_PREFIXES``) or
        mis-shaped key, and nothing is written unless all check out."""
        sd = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, Mapping) else None
        if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ValueError(
                "a VQGAN checkpoint must be a state dict of tensors, or a dict holding one under 'state_dict'"
            )
        own = self.state_dict(keep_vars=True)
        got = {k: v for k, v in sd.items() if not k.startswith(IGNORED_PREFIXES)}
        missing = sorted(set(own) - set(got))
        unexpected = sorted(set(got) - set(own))
        bad = [f"{k}: checkpoint {tuple(got[k].shape)}, model {tuple(own[k].shape)}"
               for k in sorted(set(own) & set(got)) if got[k].shape != own[k].shape]
        if missing or unexpected or bad:
            def part(title, items):
                if not items:
                    return ""
                return f"\n  {title} ({len(items)}): " + ", ".join(items[:12]) + (" ..." if len(items) > 12 else "")

            raise ValueError(
                f"checkpoint does not match the Chameleon VQGAN decoder ({self.config}):"
                + part("missing keys", missing) + part("unexpected keys", unexpected) + part("wrong shapes", bad)
            )
        for k, p in own.items():
            p.copy_(got[k])


def load_vqgan(
    path: str | Path, cfg: VQConfig = CHAMELEON_VQGAN, device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> ChameleonVQ:
    """Read ``vqgan.ckpt`` with ``torch.load(weights_only=True)`` and load it strictly."""

    what = "Chameleon's VQGAN checkpoint (vqgan.ckpt)"
    ckpt = torch_load(path, what, VQGAN_SOURCE)
    model = ChameleonVQ(cfg).to(dtype=dtype)  # load into the final dtype (no fp32 round trip)
    with reading(path, what, VQGAN_SOURCE):
        model.load_state(ckpt)
    return model.to(device=device).eval().requires_grad_(False)


def image_shape(h: int, w: int, cfg: VQConfig = CHAMELEON_VQGAN) -> tuple[int, int, int]:
    """(3, H, W) of a decoded h x w code grid."""
    f = cfg.downsample
    return (cfg.out_ch, h * f, w * f)


__all__ = [
    "CHAMELEON_VQGAN", "ChameleonVQ", "IGNORED_PREFIXES", "VQConfig", "VQGAN_SOURCE", "image_shape", "load_vqgan",
    "tiny_vq",
]

