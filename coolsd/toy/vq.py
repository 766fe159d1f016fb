"""A tiny LlamaGen-style VQ image tokenizer for the toy world (32x32 RGB -> 8x8 = 64 tokens).

Follows LlamaGen's ``VQ_16`` (``tokenizer/tokenizer_image/vq_model.py``) at toy scale: a conv
encoder, ``quant_conv`` to a low-dimensional (8) latent, an L2-normalised codebook (latents and
entries are both normalised before the nearest-neighbour lookup, and ``codebook`` returns the
normalised entries), ``post_quant_conv`` and a conv decoder. Tokens are the latent grid
flattened row-major, like ``decode_code(tokens, shape=[B, dim, g, g])``.

Deliberate toy-scale departures, chosen by measurement on 2 shared CPU cores:
* the x4 down/up-sampling is space-to-depth / depth-to-space (pixel (un)shuffle) with every conv
  but the decoder's last at the 8x8 latent resolution (held-out MAE 0.024 vs 0.030 for a
  strided-conv / nearest-upsample-conv stack after the same ~130 s of training); one 3x3 conv at
  full resolution after the depth-to-space sharpens edges (0.021 vs 0.024);
* no GroupNorm in the ResBlocks (with it, MAE was ~25% higher at equal early steps);
* a radial penalty (log|u|)^2 on the quant_conv output before L2 normalisation. Everything after
  the normalisation is invariant to |u|, so Adam inflates it; the encoder's gradient then shrinks
  as 1/|u| and the latents freeze onto their codes, a collapse that loses shape colour (seen in
  1 of 6 seeds without it: MAE 0.044 vs 0.027-0.033 after 600 steps; with it all six seeds gave
  0.026-0.027).

Training (``train_vq``) uses L1 reconstruction + the VQ-VAE codebook and commitment losses with
a straight-through estimator, AdamW with warm-up and cosine decay, gradient clipping, and
deterministic dead-code restarts (codes unused over an interval are re-seeded at current encoder
outputs, drawn in proportion to their squared quantisation error).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.toy.scenes import IMAGE_SIZE, render_batch, sample_scenes
from coolsd.toy.weights import REBUILD, read_weights, save_weights

# Scenes for tokenizer training are drawn from sample_scenes(pool, TRAIN_SEED_BASE + seed);
# the held-out metrics use HELDOUT_SEED. Both are far from the small seeds used for evaluation.
TRAIN_SEED_BASE = 1_000_000
HELDOUT_SEED = 2_000_000
VQ_FORMAT = "coolsd.toy.vq"


@dataclass(frozen=True)
class VQConfig:
    # architecture
    codebook_size: int = 512
    codebook_dim: int = 8
    channels: int = 96           # conv width (all convs run at the 8x8 latent resolution)
    enc_blocks: int = 1          # ResBlocks in the encoder
    dec_blocks: int = 5          # ResBlocks in the decoder
    head_channels: int = 16      # width of the decoder's full-resolution output conv; 0: none
    z_channels: int = 64         # encoder output / post_quant_conv output width
    downsample: int = 4          # 32x32 image -> 8x8 token grid
    beta: float = 0.25           # commitment weight
    codebook_l2_norm: bool = True
    latent_norm_weight: float = 0.1  # radial penalty (log|u|)^2 on the latent before l2-norm
    # training (used by train_vq only)
    lr: float = 2e-3
    weight_decay: float = 1e-4
    warmup_steps: int = 50
    grad_clip: float = 1.0       # max global grad norm; 0 disables
    restart_every: int = 100     # dead-code restart interval (steps); 0 disables
    restart_until: float = 0.8   # no restarts in the last 20% of training
    train_pool: int = 16384      # pre-rendered training images

    def __post_init__(self):
        if self.downsample < 1 or IMAGE_SIZE % self.downsample:
            raise ValueError(f"downsample must divide the image size {IMAGE_SIZE}, got {self.downsample}")

    @property
    def grid(self) -> int:
        return IMAGE_SIZE // self.downsample

    @property
    def num_tokens(self) -> int:
        return self.grid ** 2

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "VQConfig":
        d = json.loads(s)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown VQConfig fields {sorted(unknown)}")
        return cls(**d)


class ResBlock(nn.Module):
    """x + conv(silu(conv(silu(x)))) (LlamaGen's ResnetBlock without its GroupNorms)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class Encoder(nn.Module):
    """Space-to-depth by ``downsample`` (4x4x3 = 48 channels per latent cell), conv_in, ResBlocks
    at the latent resolution, conv_out to z_channels."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.r = cfg.downsample
        self.conv_in = nn.Conv2d(3 * self.r**2, cfg.channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ResBlock(cfg.channels) for _ in range(cfg.enc_blocks)])
        self.conv_out = nn.Conv2d(cfg.channels, cfg.z_channels, 3, padding=1)

    def forward(self, x):
        return self.conv_out(F.silu(self.blocks(self.conv_in(F.pixel_unshuffle(x, self.r)))))


class Decoder(nn.Module):
    """conv_in from z_channels, ResBlocks at the latent resolution, conv_out and depth-to-space to
    ``head_channels`` maps at 32x32, then one full-resolution 3x3 conv to RGB (sharpens edges;
    head_channels=0 makes conv_out emit the 4x4x3 pixels of each cell directly)."""

    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.r = cfg.downsample
        self.conv_in = nn.Conv2d(cfg.z_channels, cfg.channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ResBlock(cfg.channels) for _ in range(cfg.dec_blocks)])
        hc = cfg.head_channels or 3
        self.conv_out = nn.Conv2d(cfg.channels, hc * self.r**2, 3, padding=1)
        self.head = nn.Conv2d(hc, 3, 3, padding=1) if cfg.head_channels else None

    def forward(self, z):
        h = F.pixel_shuffle(self.conv_out(F.silu(self.blocks(self.conv_in(z)))), self.r)
        return h if self.head is None else self.head(F.silu(h))


class ToyVQ(nn.Module):
    """Images (n,3,32,32) in [0,1] <-> tokens (n, 64) row-major over the 8x8 grid."""

    def __init__(self, cfg: VQConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or VQConfig()
        self.encoder = Encoder(cfg)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_dim, 1)
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_dim)
        with torch.no_grad():  # unit-norm init (the lookup normalises anyway when l2-normed)
            self.embedding.weight.copy_(F.normalize(torch.randn(cfg.codebook_size, cfg.codebook_dim), dim=1))
        self.post_quant_conv = nn.Conv2d(cfg.codebook_dim, cfg.z_channels, 1)
        self.decoder = Decoder(cfg)

    # ---- codebook ------------------------------------------------------------------------
    @property
    def codebook(self) -> torch.Tensor:
        """(K, dim) codebook vectors as used for lookup (L2-normalised when codebook_l2_norm)."""
        w = self.embedding.weight
        return F.normalize(w, dim=1) if self.cfg.codebook_l2_norm else w

    def _latent(self, x: torch.Tensor, raw: bool = False):
        """(n,3,H,W) in [0,1] -> (n, g, g, dim) pre-quantisation latent (normalised if l2);
        with raw=True also the quant_conv output before normalisation."""
        u = self.quant_conv(self.encoder(x * 2 - 1)).permute(0, 2, 3, 1)
        z = F.normalize(u, dim=-1) if self.cfg.codebook_l2_norm else u
        return (z, u) if raw else z

    def _nearest(self, z: torch.Tensor) -> torch.Tensor:
        """Indices of the nearest codebook entries for latents z (..., dim)."""
        e = self.codebook
        flat = z.reshape(-1, z.shape[-1])
        d = flat.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1)[None] - 2 * flat @ e.t()
        return d.argmin(1).reshape(z.shape[:-1])

    # ---- public API ----------------------------------------------------------------------
    @staticmethod
    def to_input(images) -> torch.Tensor:
        """uint8 (n,32,32,3) numpy/tensor or float (n,3,32,32) in [0,1] -> float (n,3,32,32)."""
        if isinstance(images, np.ndarray):
            images = torch.from_numpy(np.ascontiguousarray(images))
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"images must be a numpy array or tensor, got {type(images).__name__}")
        if images.dtype == torch.uint8:
            if images.ndim != 4 or images.shape[-1] != 3:
                raise ValueError(f"uint8 images must be (n,H,W,3), got {tuple(images.shape)}")
            return images.permute(0, 3, 1, 2).float().div(255.0)
        if not images.is_floating_point() or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"float images must be (n,3,H,W) in [0,1], got {images.dtype} {tuple(images.shape)}")
        return images.float()

    @torch.no_grad()
    def encode(self, images) -> torch.Tensor:
        """Tokens (n, 64) long, row-major over the latent grid."""
        x = self.to_input(images).to(self.embedding.weight.device)
        return self._nearest(self._latent(x)).flatten(1)

    def decode_latent(self, zq: torch.Tensor) -> torch.Tensor:
        """(n, g, g, dim) quantised latent -> raw decoder output (n,3,32,32), ~[-1,1]."""
        return self.decoder(self.post_quant_conv(zq.permute(0, 3, 1, 2).contiguous()))

    @torch.no_grad()
    def decode(self, tokens) -> torch.Tensor:
        """Tokens (n, 64) -> float images (n,3,32,32) in [0,1]."""
        tokens = torch.as_tensor(tokens, device=self.embedding.weight.device).long()
        g, K = self.cfg.grid, self.cfg.codebook_size
        if tokens.ndim != 2 or tokens.shape[1] != g * g:
            raise ValueError(f"tokens must be (n, {g * g}), got {tuple(tokens.shape)}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= K):
            raise ValueError(f"token ids must lie in [0, {K}), got [{int(tokens.min())}, {int(tokens.max())}]")
        zq = self.codebook[tokens].reshape(-1, g, g, self.cfg.codebook_dim)
        return (self.decode_latent(zq) * 0.5 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def decode_uint8(self, tokens) -> np.ndarray:
        """Tokens (n, 64) -> uint8 (n,32,32,3) numpy images."""
        x = self.decode(tokens)
        return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def forward(self, images) -> dict:
        """Training pass: recon (n,3,32,32) in [0,1] (unclamped), tokens, and losses."""
        x = self.to_input(images).to(self.embedding.weight.device)
        z, u = self._latent(x, raw=True)
        idx = self._nearest(z.detach())
        zq = self.codebook[idx]
        codebook_loss = F.mse_loss(zq, z.detach())
        commit_loss = self.cfg.beta * F.mse_loss(z, zq.detach())
        zq = z + (zq - z).detach()  # straight-through
        out = self.decode_latent(zq)
        recon_loss = F.l1_loss(out, x * 2 - 1)
        # With an l2-normalised latent, everything downstream is invariant to |u|, so nothing stops
        # Adam from inflating it; the gradient reaching the encoder then shrinks as 1/|u| and the
        # latents freeze onto their codes (seen as a collapse that loses shape colour). Pinning
        # log|u| near 0 is a purely radial penalty that leaves the normalised latent's direction alone.
        norm_loss = u.norm(dim=-1).clamp_min(1e-6).log().pow(2).mean() if self.cfg.codebook_l2_norm else u.new_zeros(())
        loss = recon_loss + codebook_loss + commit_loss + self.cfg.latent_norm_weight * norm_loss
        return {
            "recon": out * 0.5 + 0.5, "tokens": idx.flatten(1), "latent": z,
            "recon_loss": recon_loss, "codebook_loss": codebook_loss, "commit_loss": commit_loss,
            "norm_loss": norm_loss, "loss": loss,
        }


# ---- training ----------------------------------------------------------------------------
def _images(n: int, seed: int) -> torch.Tensor:
    return ToyVQ.to_input(render_batch(sample_scenes(n, seed)))


@torch.no_grad()
def evaluate_vq(model: ToyVQ, images=None, n: int = 1024, batch_size: int = 256) -> dict:
    """Held-out reconstruction and codebook metrics (default: n scenes from HELDOUT_SEED)."""
    x = _images(n, HELDOUT_SEED) if images is None else ToyVQ.to_input(images)
    was_training = model.training
    model.eval()
    toks, recs, agree = [], [], []
    for i in range(0, len(x), batch_size):
        t = model.encode(x[i:i + batch_size])
        toks.append(t)
        recs.append(model.decode(t).cpu())
        agree.append((model.encode(model.decode_uint8(t)) == t).cpu())  # re-encoding stability
    model.train(was_training)
    toks, rec = torch.cat(toks), torch.cat(recs)
    rec8 = (rec * 255).round() / 255  # what a uint8 consumer sees
    counts = torch.bincount(toks.flatten().cpu(), minlength=model.cfg.codebook_size).double()
    p = counts / counts.sum()
    ent = -(p[p > 0] * p[p > 0].log()).sum().item()
    return {
        "heldout_mae": (rec - x).abs().mean().item(),
        "heldout_mse": (rec - x).pow(2).mean().item(),
        "heldout_mae_uint8": (rec8 - x).abs().mean().item(),
        "heldout_max_pixel_err_p99": torch.quantile((rec - x).abs().amax(1).flatten(), 0.99).item(),
        "reencode_agreement": torch.cat(agree).double().mean().item(),
        "codebook_usage": (counts > 0).double().mean().item(),
        "perplexity": math.exp(ent),
        "heldout_images": len(x),
    }


def _restart_dead_codes(model: ToyVQ, counts: torch.Tensor, z: torch.Tensor, gen: torch.Generator) -> int:
    """Re-seed codes unused since the last restart at current encoder outputs, drawn with
    probability proportional to their squared quantisation error (k-means++ style: new codes go
    where the codebook fits worst, typically shape cells rather than the plentiful background)."""
    dead = (counts == 0).nonzero().flatten()
    if len(dead) == 0:
        return 0
    flat = z.detach().reshape(-1, z.shape[-1])
    with torch.no_grad():
        err = torch.cdist(flat, model.codebook.detach()).amin(1).pow(2) + 1e-12
    pick = torch.multinomial(err, len(dead), replacement=True, generator=gen)
    new = flat[pick] + 0.01 * torch.randn(len(dead), flat.shape[1], generator=gen)
    if model.cfg.codebook_l2_norm:
        new = F.normalize(new, dim=1)
    with torch.no_grad():
        model.embedding.weight[dead] = new
    return len(dead)


def train_vq(cfg: VQConfig | None = None, steps: int = 3000, batch_size: int = 16, seed: int = 0,
             log=print, log_every: int = 100, eval_images: int = 1024) -> tuple[ToyVQ, dict]:
    """Train a ToyVQ on ``cfg.train_pool`` scenes from ``TRAIN_SEED_BASE + seed``.

    Deterministic given (cfg, steps, batch_size, seed) and the torch thread count (CPU conv
    reductions may differ across thread counts). Returns the model in eval mode and metrics:
    held-out MAE/MSE on [0,1] (``evaluate_vq``), codebook usage and perplexity, training seconds,
    the dead-code restart log. Defaults (3000 steps of 16) take ~6-8 min on 2 CPU cores.
    """
    cfg = cfg or VQConfig()
    t0 = time.time()
    torch.manual_seed(seed)
    model = ToyVQ(cfg)
    data = _images(cfg.train_pool, TRAIN_SEED_BASE + seed)
    gen = torch.Generator().manual_seed(seed)
    codebook = [model.embedding.weight]
    others = [p for n, p in model.named_parameters() if not n.startswith("embedding.")]
    decay = [p for p in others if p.ndim > 1]
    no_decay = [p for p in others if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay + codebook, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.99),
    )

    def lr_at(step):
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        prog = (step - cfg.warmup_steps) / max(1, steps - cfg.warmup_steps)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog)))

    counts = torch.zeros(cfg.codebook_size, dtype=torch.long)
    restarted, hist = 0, []
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        idx = torch.randint(len(data), (batch_size,), generator=gen)
        out = model(data[idx])
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip) if cfg.grad_clip else torch.tensor(0.0)
        opt.step()
        counts += torch.bincount(out["tokens"].flatten(), minlength=cfg.codebook_size)
        if cfg.restart_every and (step + 1) % cfg.restart_every == 0:
            if step + 1 < cfg.restart_until * steps:
                n_dead = _restart_dead_codes(model, counts, out["latent"], gen)
                restarted += n_dead
            else:
                n_dead = int((counts == 0).sum())
            hist.append({"step": step + 1, "recon_l1": round(out["recon_loss"].item(), 5), "dead": n_dead})
            counts.zero_()
        if log and log_every and ((step + 1) % log_every == 0 or step == 0):
            log(f"vq step {step + 1}/{steps} loss {out['loss'].item():.4f} "
                f"l1 {out['recon_loss'].item():.4f} commit {out['commit_loss'].item():.4f} "
                f"|u|-pen {out['norm_loss'].item():.3f} gnorm {gnorm.item():.3f} lr {lr_at(step):.2e} {time.time() - t0:.0f}s")
    train_seconds = time.time() - t0
    model.eval()
    metrics = {
        "train_seconds": train_seconds, "steps": steps, "batch_size": batch_size, "seed": seed,
        "codes_restarted": restarted, "final_train_loss": out["loss"].item() if steps else float("nan"),
        "threads": torch.get_num_threads(), "restarts": hist, "config": asdict(cfg),
    }
    if eval_images:
        metrics.update(evaluate_vq(model, n=eval_images))
    if log:
        log("vq done: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, float)))
    return model, metrics


# ---- persistence -------------------------------------------------------------------------
def save_vq(model: ToyVQ, path) -> None:
    save_weights(path, model.state_dict(), VQ_FORMAT, model.cfg.to_json())


def load_vq(path, device="cpu") -> ToyVQ:
    sd, config = read_weights(path, VQ_FORMAT, "toy VQ weights")
    try:
        model = ToyVQ(VQConfig.from_json(config))
        model.load_state_dict(sd, strict=True)
    except Exception as e:  # bad config, shape/key mismatch
        why = " ".join(str(e).split())
        raise ValueError(f"toy VQ weights {path} do not match ToyVQ ({why}); {REBUILD}") from e
    return model.to(device).eval()
