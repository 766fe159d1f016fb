"""Per-token verification of CSpD, everything in log space and in the input's float dtype (use
fp32 or fp64, never autocast): continuous_sd.md 2.3 (paper-faithful ratio with the variance
term), 2.4 (acceptance-rejection resampling from the target's final Gaussian, capped, falling
back to a target sample) and 2.9 (the exact mode: final-step noise, no variance term, residual
by rejection or, with equal final stds, by a reflection-maximal coupling).

Shapes: tokens are (N, C) rows (one row per drafted position); ``log_std`` broadcasts to them.
Device: every draw and every result lands on the device of the tokens (``mu_p``, ``x0``, ``xi0``),
drawn with ``gen``, which must be a generator of that device (``torch.Generator(device=...)``;
torch refuses a CPU generator for CUDA draws). CPU and CUDA generators give different numbers.
The variance term is ``log_sigma = S_q - S_p`` with ``S_m = sum_{k>=1} sum_d 1/2 log var_{m,k,d}``
(Sigma = prod sigma_q / sigma_p over the non-final steps; continuous_sd.md 2.3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_2PI = math.log(2 * math.pi)


def log_normal(y: torch.Tensor, mu: torch.Tensor, log_std: torch.Tensor, lam: float = 1.0) -> torch.Tensor:
    """log N(y; mu, diag(exp(2 log_std))) summed over the last dim (continuous_sd.md 2.2); with
    ``lam`` != 1 the exponent uses std * lam while the normaliser keeps std (the official code's
    "inner temperature", 2.7 b)."""
    z = (y - mu) * torch.exp(-log_std) / lam
    return -0.5 * (z * z + 2 * log_std + LOG_2PI).sum(-1)


def log_residual_accept(d: torch.Tensor) -> torch.Tensor:
    """log alpha_s = log max(0, 1 - exp(d)): log(-expm1(d)) for d < 0, -inf otherwise."""
    out = torch.full_like(d, -math.inf)
    neg = d < 0
    out[neg] = torch.log(-torch.expm1(d[neg]))
    return out


@dataclass
class Verdict:
    tokens: torch.Tensor  # (N, C) output tokens: the draft where accepted, else the resample
    accepted: torch.Tensor  # (N,) bool: the draft token was accepted
    rounds: torch.Tensor  # (N,) long: resampling rounds used (0 where accepted)
    fallback: torch.Tensor  # (N,) bool: the cap was reached and a plain target sample was used

    @property
    def acceptance_rate(self) -> float:
        return float(self.accepted.float().mean())


def resample(mu_p, log_std_p, mu_q, log_std_q, log_sigma, gen: torch.Generator, max_rounds: int = 100):
    """Acceptance-rejection from p'(y) ~ max(0, Sigma p0(y) - q0(y)) with proposals from the
    target's final Gaussian: accept y w.p. alpha_s(y) = max(0, 1 - exp(l_q0(y) - log Sigma - l_p0(y)))
    (continuous_sd.md 2.4). After ``max_rounds`` the last proposal, a plain target sample, is
    kept (``fallback``). Returns (tokens, rounds, fallback)."""
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    N, C = mu_p.shape
    dev = mu_p.device
    out = torch.empty_like(mu_p)
    rounds = torch.zeros(N, dtype=torch.long, device=dev)
    todo = torch.ones(N, dtype=torch.bool, device=dev)
    fallback = torch.zeros(N, dtype=torch.bool, device=dev)
    log_sigma = torch.as_tensor(log_sigma, dtype=mu_p.dtype, device=dev).expand(N)
    for r in range(1, max_rounds + 1):
        idx = todo.nonzero().squeeze(1)
        if len(idx) == 0:
            break
        sp = log_std_p.expand_as(mu_p)[idx]
        y = mu_p[idx] + torch.exp(sp) * torch.randn(len(idx), C, generator=gen, dtype=mu_p.dtype, device=dev)
        d = log_normal(y, mu_q[idx], log_std_q.expand_as(mu_q)[idx]) - log_sigma[idx] - log_normal(y, mu_p[idx], sp)
        log_u = torch.log(torch.rand(len(idx), generator=gen, dtype=mu_p.dtype, device=dev))
        ok = log_u < log_residual_accept(d)
        last = r == max_rounds
        take = ok | last
        out[idx[take]] = y[take]
        rounds[idx] = r
        todo[idx[take]] = False
        if last:  # the cap: the last proposal, a plain target sample, stands in (counted)
            fallback[idx[~ok]] = True
    return out, rounds, fallback


def verify_paper(x0, mu_p, log_std_p, mu_q, log_std_q, s_p, s_q, gen: torch.Generator, max_rounds: int = 100,
                 inner_temperature: float = 1.0) -> Verdict:
    """The paper-faithful rule (continuous_sd.md 2.3-2.4, mode A): log r = log Sigma + l_p0(x0)
    - l_q0(x0) with log Sigma = S_q - S_p; accept if log U < min(0, log r); otherwise resample
    (with the true stds). ``inner_temperature`` lam widens the exponents of the acceptance test
    only, as the official code's lam = 42 (2.7 b): a lossy heuristic; 1 is the paper's formula."""
    log_sigma = s_q - s_p
    lam = inner_temperature
    log_r = log_sigma + log_normal(x0, mu_p, log_std_p, lam) - log_normal(x0, mu_q, log_std_q, lam)
    log_u = torch.log(torch.rand(x0.shape[0], generator=gen, dtype=x0.dtype, device=x0.device))
    accepted = log_u < torch.clamp(log_r, max=0.0)
    return _finish(x0, accepted, mu_p, log_std_p, mu_q, log_std_q, log_sigma, gen, max_rounds)


def verify_exact(x0, mu_p, log_std_p, mu_q, log_std_q, gen: torch.Generator, max_rounds: int = 100) -> Verdict:
    """The exact rule (continuous_sd.md 2.9): x0 ~ N(mu_q, s_q^2) drawn with final-step noise;
    log r = l_p0(x0) - l_q0(x0) (no variance term); the residual max(0, p0 - q0) by rejection.
    Given the shared noise of the earlier steps, the output is distributed as N(mu_p, s_p^2)."""
    zero = torch.zeros(x0.shape[0], dtype=x0.dtype, device=x0.device)
    return verify_paper(x0, mu_p, log_std_p, mu_q, log_std_q, zero, zero, gen, max_rounds)  # log Sigma = 0


def verify_reflection(xi0, mu_p, mu_q, s, gen: torch.Generator) -> Verdict:
    """Exact mode with equal final stds ``s``: the reflection-maximal coupling of N(mu_q, s^2 I)
    and N(mu_p, s^2 I) (continuous_sd.md 2.9). The draft is x = mu_q + s xi0; it is kept w.p.
    min(1, phi(xi0 + z) / phi(xi0)), z = (mu_q - mu_p) / s; otherwise the output is
    mu_p + s (xi0 - 2 (e . xi0) e), e = z / |z|. One shot; acceptance = 1 - TV."""
    z = (mu_q - mu_p) / s
    log_keep = -0.5 * ((xi0 + z) ** 2 - xi0 ** 2).sum(-1)
    log_u = torch.log(torch.rand(xi0.shape[0], generator=gen, dtype=xi0.dtype, device=xi0.device))
    accepted = log_u < torch.clamp(log_keep, max=0.0)
    norm = z.norm(dim=-1, keepdim=True)
    e = torch.where(norm > 0, z / norm.clamp(min=torch.finfo(z.dtype).tiny), torch.zeros_like(z))
    reflected = mu_p + s * (xi0 - 2 * (e * xi0).sum(-1, keepdim=True) * e)
    tokens = torch.where(accepted.unsqueeze(-1), mu_q + s * xi0, reflected)
    n = xi0.shape[0]
    return Verdict(tokens, accepted, torch.zeros(n, dtype=torch.long, device=xi0.device),
                   torch.zeros(n, dtype=torch.bool, device=xi0.device))


def _finish(x0, accepted, mu_p, log_std_p, mu_q, log_std_q, log_sigma, gen, max_rounds) -> Verdict:
    tokens = x0.clone()
    rounds = torch.zeros(x0.shape[0], dtype=torch.long, device=x0.device)
    fallback = torch.zeros(x0.shape[0], dtype=torch.bool, device=x0.device)
    rej = (~accepted).nonzero().squeeze(1)
    if len(rej):
        ls = torch.as_tensor(log_sigma, dtype=x0.dtype, device=x0.device).expand(x0.shape[0])[rej]
        y, r, fb = resample(mu_p[rej], log_std_p.expand_as(mu_p)[rej], mu_q[rej], log_std_q.expand_as(mu_q)[rej],
                            ls, gen, max_rounds)
        tokens[rej], rounds[rej], fallback[rej] = y, r, fb
    return Verdict(tokens, accepted, rounds, fallback)
