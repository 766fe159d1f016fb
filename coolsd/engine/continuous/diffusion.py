"""The diffusion head's per-step Gaussians with trajectory alignment (continuous_sd.md 2.1-2.3):
a respaced cosine schedule, the posterior Gaussian of one step from an (epsilon, v) head output
(epsilon prediction, learned-range variance with a fixed-variance switch, CFG on epsilon, the
conditional branch's variance), and the aligned sampler returning what verification needs.

Invariants: draft and target use the SAME initial noise and the SAME per-step noise at a given
position (``noise``, ``eps``), so every intermediate log density reduces to the variance term
``S = sum_{k>=1} sum_d 1/2 log var_k`` (continuous_sd.md 2.3); k = 0 is the final step, whose
Gaussian (mu_0, log std_0) is returned, and whose noise is only added with ``final_noise``
(the exact mode; MAR outputs mu_0). All arithmetic in the input dtype (fp32 / fp64).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


def cosine_alphas_bar(T: int = 1000, s: float = 0.008) -> torch.Tensor:
    """alpha_bar_t, t = 0..T-1, of the cosine schedule (improved DDPM / MAR's ``cosine``), betas
    clipped at 0.999 as upstream."""
    f = lambda t: math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
    betas = torch.tensor([min(1 - f(t + 1) / f(t), 0.999) for t in range(T)], dtype=torch.float64)
    return torch.cumprod(1 - betas, 0)


@dataclass(frozen=True)
class Schedule:
    """A respaced schedule of K steps (index k = 0 .. K-1, k = 0 final), continuous_sd.md 2.1."""

    alphas_bar: torch.Tensor  # (K,) float64
    timesteps: torch.Tensor  # (K,) long: the original (training) timestep of each respaced step

    @classmethod
    def respaced(cls, K: int, T: int = 1000) -> "Schedule":
        ab = cosine_alphas_bar(T)
        keep = torch.linspace(0, T - 1, K).round().long()  # evenly spaced original timesteps
        return cls(ab[keep], keep)

    @property
    def K(self) -> int:
        return len(self.alphas_bar)

    def coefficients(self, k: int) -> dict:
        ab = float(self.alphas_bar[k])
        ab_prev = float(self.alphas_bar[k - 1]) if k > 0 else 1.0
        beta = 1 - ab / ab_prev
        beta_tilde = beta * (1 - ab_prev) / (1 - ab)
        if k == 0:  # beta_tilde_0 = 0: MAR clips the log variance at step 1's value
            b1 = 1 - float(self.alphas_bar[1]) / float(self.alphas_bar[0])
            lmin = math.log(b1 * (1 - float(self.alphas_bar[0])) / (1 - float(self.alphas_bar[1])))
        else:
            lmin = math.log(beta_tilde)
        return {"ab": ab, "ab_prev": ab_prev, "beta": beta, "lmin": lmin, "lmax": math.log(beta),
                "c1": beta * math.sqrt(ab_prev) / (1 - ab), "c2": (1 - ab_prev) * math.sqrt(1 - beta) / (1 - ab)}


# head(x (N, C), t, z) -> (eps (N, C), v (N, C) in about [-1, 1]); t: the ORIGINAL training
# timestep of the step (MAR maps respaced steps back to it), z: condition (N, D)
Head = Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def step_gaussian(head: Head, x, k: int, sched: Schedule, z_c, z_u=None, cfg=1.0, fixed_v=None, clip_x0=None):
    """(mu, log_var) of step k from state x (continuous_sd.md 2.2): guided epsilon
    eps_u + w (eps_c - eps_u) when ``z_u`` is given (w: a float or an (N, 1) tensor of per-row
    scales; only the conditional branch without ``z_u``), x0_hat (unclipped as MAR; ``clip_x0``
    = c clamps it to [-c, c], improved DDPM's clip_denoised for a head whose epsilon error the
    1/sqrt(alpha_bar) of the noisiest steps would blow up), the
    posterior mean, log var = f lmax + (1 - f) lmin with f = (clamp(v_c, -1, 1) + 1) / 2 from the
    conditional branch; ``fixed_v`` replaces v (the fixed-variance switch)."""
    c = sched.coefficients(k)
    t = int(sched.timesteps[k])
    if z_u is None:
        eps, v_c = head(x, t, z_c)
    else:  # both branches in one call (MAR's forward_with_cfg), the same state x
        e, v = head(torch.cat([x, x]), t, torch.cat([z_c, z_u]))
        eps_c, eps_u = e.chunk(2)
        eps, v_c = eps_u + cfg * (eps_c - eps_u), v[: x.shape[0]]
    x0_hat = (x - math.sqrt(1 - c["ab"]) * eps) / math.sqrt(c["ab"])
    if clip_x0 is not None:
        x0_hat = x0_hat.clamp(-clip_x0, clip_x0)
    mu = c["c1"] * x0_hat + c["c2"] * x
    v = torch.full_like(v_c, float(fixed_v)) if fixed_v is not None else v_c.clamp(-1, 1)
    f = (v + 1) / 2
    return mu, f * c["lmax"] + (1 - f) * c["lmin"]


@dataclass
class HeadSample:
    x0: torch.Tensor  # (N, C) the token
    mu0: torch.Tensor  # (N, C) final-step mean
    log_std0: torch.Tensor  # (N, C) final-step log std (temperature included; or log final_std)
    s: torch.Tensor  # (N,) sum over steps k >= 1 and dims of 1/2 log var_k (no temperature)


def aligned_sample(head: Head, z_c, noise, eps, sched: Schedule, *, z_u=None, cfg=1.0, tau: float = 1.0,
                   final_noise: bool = False, fixed_v=None, clip_x0=None, final_std=None) -> HeadSample:
    """Run the chain k = K-1 .. 0 from x^(K) = ``noise`` (N, C) with per-step noise ``eps``
    (K, N, C): x^(k) = mu_k + tau sigma_k eps_k for k >= 1; x0 = mu_0 (+ s_0 eps_0 with
    ``final_noise``, s_0 = tau sigma_0, or ``final_std``: the exact mode's smoothing s of
    continuous_sd.md 2.9, which convolves the target with N(0, s^2)). Two heads given the same
    noise and eps are trajectory-aligned."""
    x, s = noise, torch.zeros(noise.shape[0], dtype=noise.dtype, device=noise.device)
    for k in range(sched.K - 1, 0, -1):
        mu, log_var = step_gaussian(head, x, k, sched, z_c, z_u, cfg, fixed_v, clip_x0)
        s = s + 0.5 * log_var.sum(-1)
        x = mu + tau * torch.exp(0.5 * log_var) * eps[k]
    mu0, log_var0 = step_gaussian(head, x, 0, sched, z_c, z_u, cfg, fixed_v, clip_x0)
    log_std0 = 0.5 * log_var0 + math.log(tau) if final_std is None else torch.full_like(mu0, math.log(final_std))
    x0 = mu0 + torch.exp(log_std0) * eps[0] if final_noise else mu0
    return HeadSample(x0, mu0, log_std0, s)
