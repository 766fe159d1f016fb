"""Training losses of MAR-style models (continuous_sd.md 1.2, 1.5, 4.1): the diffusion head's
loss (epsilon MSE plus the variational bound for the learned-range variance, with the mean's
gradient stopped in that term, as improved DDPM's hybrid loss, on the full T-step cosine
schedule with a random timestep per token) and MAR's masked-token loss around it.
"""
from __future__ import annotations

import math

import torch

from coolsd.engine.continuous.diffusion import cosine_alphas_bar
from coolsd.models.mar import MAR, NULL_LABEL


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
    return (mse + vlb_weight * vlb).mean(), {"mse": float(mse.detach().mean()), "vlb": float(vlb.detach().mean())}


def mar_loss(model: MAR, tokens, labels, gen: torch.Generator, label_drop: float = 0.1, batch_mul: int = 2):
    """MAR's training loss (models/mar.py ``forward``): a random order per sample, the first
    n_b positions of it known with n_b uniform in [0, L - 1] (generation sees every count, one
    token per step), ``diffusion_loss`` on the unknown tokens, each
    repeated ``batch_mul`` times with its own timestep; labels dropped w.p. ``label_drop``."""
    B, L, C = tokens.shape
    rank = torch.argsort(torch.rand(B, L, generator=gen), 1)  # rank of each position in a random order
    known = rank < torch.randint(0, L, (B, 1), generator=gen)
    drop = (torch.rand(B, generator=gen) < label_drop).reshape(B, *[1] * (labels.dim() - 1))  # labels (B,) or (B, k)
    z = model.conditions(tokens, known, torch.where(drop, torch.full_like(labels, NULL_LABEL), labels))
    x0, zs = tokens[~known].repeat(batch_mul, 1), z[~known].repeat(batch_mul, 1)
    return diffusion_loss(model.head, x0, zs, gen)
