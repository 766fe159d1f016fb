"""Training pieces of the toy continuous world (continuous_sd.md 4.1): raw-pixel patch tokens and
the MAR-style diffusion loss of a ``ContinuousAR`` (epsilon MSE plus the variational bound for the
learned-range variance, with the mean's gradient stopped in that term, as improved DDPM's hybrid
loss), on the full T-step cosine schedule with a random timestep per token.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from coolsd.continuous.diffusion import cosine_alphas_bar

PATCH_SCALE = 2.0  # tokens = (pixels / 127.5 - 1) * PATCH_SCALE: about unit variance for the toy scenes


def patchify(images: np.ndarray, p: int = 4) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float32 (B, (H/p)(W/p), p*p*3) tokens, raster order, scaled."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float() / 127.5 - 1.0
    B, H, W, _ = x.shape
    x = x.reshape(B, H // p, p, W // p, p, 3).permute(0, 1, 3, 2, 4, 5).reshape(B, (H // p) * (W // p), p * p * 3)
    return x * PATCH_SCALE


def unpatchify(tokens: torch.Tensor, H: int, W: int, p: int = 4) -> np.ndarray:
    """Inverse of ``patchify``: tokens -> uint8 (B, H, W, 3) (clamped)."""
    B = tokens.shape[0]
    x = (tokens / PATCH_SCALE).reshape(B, H // p, W // p, p, p, 3).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, 3)
    return ((x + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()


def diffusion_loss(head, x0: torch.Tensor, z: torch.Tensor, gen: torch.Generator, T: int = 1000, vlb_weight: float = 1.0):
    """Mean over tokens of |eps_hat - eps|^2 / C + vlb_weight * KL(true posterior || predicted
    Gaussian with the mean's gradient stopped) / C; at t = 0 the KL is replaced by the Gaussian
    negative log-likelihood of x0. Returns (loss, {"mse", "vlb"})."""
    ab_all = cosine_alphas_bar(T).to(x0.dtype)
    M, C = x0.shape
    t = torch.randint(0, T, (M,), generator=gen)
    eps = torch.randn(M, C, generator=gen, dtype=x0.dtype)
    ab = ab_all[t].unsqueeze(1)
    ab_prev = torch.where(t > 0, ab_all[(t - 1).clamp(min=0)], torch.ones_like(t, dtype=x0.dtype)).unsqueeze(1)
    xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
    eps_hat, v = head(xt, t, z)
    mse = ((eps_hat - eps) ** 2).mean(1)
    beta = 1 - ab / ab_prev
    beta_tilde = beta * (1 - ab_prev) / (1 - ab)
    lmin = torch.log(torch.where(t.unsqueeze(1) > 0, beta_tilde, beta_tilde.new_full((), float(
        (1 - ab_all[1] / ab_all[0]) * (1 - ab_all[0]) / (1 - ab_all[1])))).clamp(min=1e-20))
    f = (v.clamp(-1, 1) + 1) / 2
    log_var = f * torch.log(beta) + (1 - f) * lmin
    c1 = beta * ab_prev.sqrt() / (1 - ab)
    c2 = (1 - ab_prev) * (1 - beta).sqrt() / (1 - ab)
    mean_pred = c1 * (xt - (1 - ab).sqrt() * eps_hat.detach()) / ab.sqrt() + c2 * xt
    mean_true = c1 * x0 + c2 * xt
    kl = 0.5 * (log_var - lmin + torch.exp(lmin - log_var) + (mean_true - mean_pred) ** 2 / torch.exp(log_var) - 1)
    nll = 0.5 * ((x0 - mean_pred) ** 2 / torch.exp(log_var) + log_var + math.log(2 * math.pi))
    vlb = torch.where(t.unsqueeze(1) > 0, kl, nll).mean(1)
    return (mse + vlb_weight * vlb).mean(), {"mse": float(mse.mean()), "vlb": float(vlb.mean())}


def ar_loss(model, tokens: torch.Tensor, labels: torch.Tensor, gen: torch.Generator, label_drop: float = 0.1):
    """Teacher-forced loss of a ``ContinuousAR`` on (B, N, C) tokens: conditions from the causal
    backbone (labels dropped to the null class w.p. ``label_drop`` for CFG), the head's diffusion
    loss on every token."""
    drop = torch.rand(labels.shape, generator=gen) < label_drop
    z = model.conditions(tokens, torch.where(drop, torch.full_like(labels, model.null_class), labels))
    B, N, C = tokens.shape
    return diffusion_loss(model.head, tokens.reshape(B * N, C), z[:, :N].reshape(B * N, -1), gen)
