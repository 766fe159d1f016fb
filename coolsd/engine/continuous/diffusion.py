"""The diffusion head's per-step Gaussians with trajectory alignment (continuous_sd.md 2.1-2.3):
a respaced cosine schedule, the posterior Gaussian of one step from an (epsilon, v) head output
(epsilon prediction, learned-range variance with a fixed-variance switch, CFG on epsilon, the
conditional branch's variance), and the aligned sampler returning what verification needs.

Invariants: draft and target use the SAME initial noise and the SAME per-step noise at a given
position (``noise``, ``eps``), so every intermediate log density reduces to the variance term
``S = sum_{k>=1} sum_d 1/2 log var_k`` (continuous_sd.md 2.3); k = 0 is the final step, whose
Gaussian (mu_0, log std_0) is returned, and whose noise is only added with ``final_noise``
(the exact mode; MAR outputs mu_0). All arithmetic in the input dtype (fp32 / fp64).

Two samplers on the same respaced cosine alpha_bar (``Schedule.respaced(K, sampler=, eta=)``;
docs/methods.md#51-ddim-head-sampler):
* ``ddpm`` (default, MAR's): the posterior Gaussian of ``step_gaussian`` at every step;
* ``ddim`` (Song et al. 2021, eq. 12): step k >= 1 is
  ``x^(k) = sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev - sigma_k^2) eps_hat + tau sigma_k eps_k`` with the
  SCHEDULE-ONLY ``sigma_k = eta sqrt((1 - ab_prev) / (1 - ab)) sqrt(1 - ab / ab_prev)``: the head's
  learned-range variance v is ignored by these steps; ``tau`` scales the injected noise as it
  scales DDPM's (MAR's temperature). eta = 1 is DDPM with the fixed small variance beta_tilde.
  Densities: eta > 0: each step k >= 1 is N(mean, tau^2 sigma_k^2 I) with the same sigma_k for draft
  and target, so S = sum_{k>=1} C/2 log sigma_k^2 is one schedule constant and log Sigma = S_q - S_p
  = 0 exactly (as xAR's SDE, ``flow``). eta = 0: the steps k >= 1 are deterministic, with no
  density (the trajectory ratio p(Y)/q(Y) is undefined); under trajectory alignment both chains
  are deterministic functions of the shared initial noise, so the only density verification needs
  is the final step's: S = 0 (no term), log Sigma = 0. The final step k = 0 (sigma_0 = 0 for every
  eta, ab_prev = 1) is eq. 12's x0 = x0_hat(x^(1)), which is also DDPM's posterior mean at k = 0
  (c1 = 1, c2 = 0): the ddim final step IS the ddpm one, Gaussian N(x0_hat, (tau sigma_0)^2) with
  DDPM's final std (learned-range v at k = 0, lmin_0 clipped at step 1's value), or N(x0_hat, s^2)
  with ``final_std``. This is what the paper's DDIM runs must have used: its code reads the final
  Gaussian off ``p_mean_variance`` (continuous_sd.md 2.7, step 4), which does not depend on the
  sampler, and DDIM's own final step (sigma_0 = 0) offers no other std. So every combination of
  sampler, eta, mode and final_std has a density: the paper mode tests x0 = mu_0 against these
  Gaussians exactly as with DDPM, and the exact mode (x0 = mu_0 + s eps_0) stays exact given the
  shared noise (continuous_sd.md 2.9).
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


SAMPLERS = ("ddpm", "ddim")


def check_sampler(sampler: str, eta: float) -> None:
    """The head sampler and DDIM's eta (the module docstring), each error one line naming the value."""
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; valid: {', '.join(SAMPLERS)}")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1:
        raise ValueError(f"eta (DDIM's noise scale) must be a number in [0, 1], got {eta!r}")
    if sampler == "ddpm" and eta != 0:
        raise ValueError(f"eta={eta!r} is DDIM's noise scale: it needs sampler=ddim (sampler=ddpm takes eta=0)")


@dataclass(frozen=True)
class Schedule:
    """A respaced schedule of K steps (index k = 0 .. K-1, k = 0 final), continuous_sd.md 2.1, and
    the sampler that walks it (``ddpm`` or ``ddim`` with ``eta``; the module docstring)."""

    alphas_bar: torch.Tensor  # (K,) float64
    timesteps: torch.Tensor  # (K,) long: the original (training) timestep of each respaced step
    sampler: str = "ddpm"
    eta: float = 0.0

    def __post_init__(self):
        check_sampler(self.sampler, self.eta)

    @classmethod
    def respaced(cls, K: int, T: int = 1000, sampler: str = "ddpm", eta: float = 0.0,
                 clip_timestep: int | None = None) -> "Schedule":
        """K evenly spaced original timesteps as MAR's ``space_timesteps(T, str(K))`` takes them: a
        float index advanced by (T - 1) / (K - 1) K times, each rounded half to even (Python's
        ``round``). The accumulated float decides ties: for odd K the middle index is 499.5 give or
        take an ulp, so K = 21, 23, 27, ... take 499 where an exact linspace rounds to 500 (the
        DiSA fixture showed it; K = 100, 20 and every even K agree with linspace). ``clip_timestep``:
        each clipped at that value and duplicates merged (DiSA's respacing,
        ``coolsd.engine.continuous.annealing``: the chain starts there and may run fewer than K steps)."""
        check_sampler(sampler, eta)
        ab = cosine_alphas_bar(T)
        stride, cur, taken = (T - 1) / (K - 1), 0.0, []
        for _ in range(K):
            taken.append(round(cur))
            cur += stride
        keep = torch.tensor(taken, dtype=torch.long)
        if clip_timestep is not None:
            keep = torch.unique(keep.clamp(max=clip_timestep))  # sorted
        return cls(ab[keep], keep, sampler, float(eta))

    @property
    def K(self) -> int:
        return len(self.alphas_bar)

    @property
    def noiseless(self) -> bool:
        """The steps k >= 1 are deterministic (DDIM with eta = 0): no noise, no density, no S term."""
        return self.sampler == "ddim" and self.eta == 0

    def ddim(self, k: int) -> tuple[float, float, float]:
        """DDIM's step k (Song et al. 2021, eq. 12): (sqrt(ab_prev), sqrt(1 - ab_prev - sigma_k^2),
        sigma_k) with sigma_k = eta sqrt((1 - ab_prev) / (1 - ab)) sqrt(1 - ab / ab_prev)."""
        ab = float(self.alphas_bar[k])
        ab_prev = float(self.alphas_bar[k - 1]) if k > 0 else 1.0
        sigma = self.eta * math.sqrt((1 - ab_prev) / (1 - ab)) * math.sqrt(1 - ab / ab_prev)
        return math.sqrt(ab_prev), math.sqrt(max(1 - ab_prev - sigma * sigma, 0.0)), sigma

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
    conditional branch; ``fixed_v`` replaces v (the fixed-variance switch). With ``sched.sampler == "ddim"`` a step k >= 1
    is DDIM's (``Schedule.ddim``, v unused): mean sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev - sigma_k^2)
    eps_hat (eps_hat recomputed from the clipped x0_hat with ``clip_x0``, as improved DDPM's
    ddim_sample) and log var = log sigma_k^2 (-inf with eta = 0); its k = 0 is DDPM's (the module
    docstring)."""
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
    if sched.sampler == "ddim" and k > 0:  # eq. 12; at k = 0 it is x0_hat, DDPM's posterior mean below
        a_prev, direction, sigma = sched.ddim(k)
        e = eps if clip_x0 is None else (x - math.sqrt(c["ab"]) * x0_hat) / math.sqrt(1 - c["ab"])
        log_var = torch.full_like(x0_hat, 2 * math.log(sigma) if sigma > 0 else -math.inf)
        return a_prev * x0_hat + direction * e, log_var
    mu = c["c1"] * x0_hat + c["c2"] * x
    v = torch.full_like(v_c, float(fixed_v)) if fixed_v is not None else v_c.clamp(-1, 1)
    f = (v + 1) / 2
    return mu, f * c["lmax"] + (1 - f) * c["lmin"]


@dataclass
class HeadSample:
    x0: torch.Tensor  # (N, C) the token
    mu0: torch.Tensor  # (N, C) final-step mean
    log_std0: torch.Tensor  # (N, C) final-step log std (temperature included; or log final_std)
    s: torch.Tensor  # (N,) sum over steps k >= 1 and dims of 1/2 log var_k (no temperature); DDIM:
    #                  the schedule constant sum C/2 log sigma_k^2 (eta > 0), 0 (eta = 0: no density)


def aligned_sample(head: Head, z_c, noise, eps, sched: Schedule, *, z_u=None, cfg=1.0, tau: float = 1.0,
                   final_noise: bool = False, fixed_v=None, clip_x0=None, final_std=None) -> HeadSample:
    """Run the chain k = K-1 .. 0 from x^(K) = ``noise`` (N, C) with per-step noise ``eps``
    (K, N, C): x^(k) = mu_k + tau sigma_k eps_k for k >= 1; x0 = mu_0 (+ s_0 eps_0 with
    ``final_noise``, s_0 = tau sigma_0, or ``final_std``: the exact mode's smoothing s of
    continuous_sd.md 2.9, which convolves the target with N(0, s^2)). Two heads given the same
    noise and eps are trajectory-aligned. DDIM (``sched.sampler``): sigma_k of the schedule in place
    of sigma_k; with eta = 0 the steps k >= 1 add no noise and nothing to ``s`` (the module docstring)."""
    x, s = noise, torch.zeros(noise.shape[0], dtype=noise.dtype, device=noise.device)
    for k in range(sched.K - 1, 0, -1):
        mu, log_var = step_gaussian(head, x, k, sched, z_c, z_u, cfg, fixed_v, clip_x0)
        if sched.noiseless:  # DDIM, eta = 0: x^(k) = mu_k, a deterministic step without density
            x = mu
            continue
        s = s + 0.5 * log_var.sum(-1)
        x = mu + tau * torch.exp(0.5 * log_var) * eps[k]
    mu0, log_var0 = step_gaussian(head, x, 0, sched, z_c, z_u, cfg, fixed_v, clip_x0)
    log_std0 = 0.5 * log_var0 + math.log(tau) if final_std is None else torch.full_like(mu0, math.log(final_std))
    x0 = mu0 + torch.exp(log_std0) * eps[0] if final_noise else mu0
    return HeadSample(x0, mu0, log_std0, s)
