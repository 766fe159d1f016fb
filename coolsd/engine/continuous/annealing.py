"""DiSA, diffusion step annealing (Zhao et al., arXiv 2505.20297; docs/methods.md#52-disa): the
diffusion head of a MAR-style model takes many steps for the first AR iterations and few for the
last, as later tokens are better constrained by the tokens already generated. Qinyu-Allen-Zhao/DiSA
(commit 283fa59), ``MAR_DiSA/models/diffloss.py`` ``DiffLoss.sample`` and
``MAR_DiSA/diffusion/__init__.py``:

* iteration ``step`` of ``num_iter`` runs ``lower + i`` nominal head steps, i an index into the
  ``upper - lower + 1`` respaced diffusions, with u = num_iter - 1 and n = upper - lower:
  ``linear``: i = int((u - step) / u * n); ``cosine``: i = int((cos(pi step / u) + 1) / 2 * n);
  ``constant``: i = 0 (always ``lower``); ``two-stage``: i = n for step < u / 2, else 0;
  int() truncates (the values are >= 0), the arithmetic in Python floats as upstream;
* the respaced diffusion of k nominal steps runs MAR's evenly spaced original timesteps
  (``space_timesteps``) clipped at ``CLIP_TIMESTEP`` = 950 (``min(t, 950)``), duplicates merged:
  every chain starts from N(0, I) at t = 950, not 999, and k >= 22 runs fewer than k steps (50
  nominal: 48). Sampler, variance, temperature and CFG are MAR's, unchanged.

The step count depends on the AR iteration only (not on how many tokens are known), and every token
of an iteration, in both CFG halves, runs the same chain.
"""
from __future__ import annotations

import math

STRATEGIES = ("linear", "cosine", "constant", "two-stage")
CLIP_TIMESTEP = 950


def check_annealing(strategy, upper, lower) -> None:
    """One line per bad value: the strategy, and lower <= upper, both integers >= 2."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown annealing strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    for name, v in (("upper (head steps of the first iteration)", upper), ("lower (of the last)", lower)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ValueError(f"DiSA's {name} must be an integer >= 2, got {v!r}")
    if lower > upper:
        raise ValueError(f"DiSA anneals from upper to lower head steps: lower={lower} > upper={upper}")


def annealed_steps(strategy: str, upper: int, lower: int, num_iter: int) -> list[int]:
    """The nominal head steps of each AR iteration 0 .. num_iter - 1 (the module docstring). One
    iteration (num_iter = 1, where upstream divides by zero) runs ``upper``."""
    check_annealing(strategy, upper, lower)
    n, u = upper - lower, num_iter - 1
    if u == 0:
        return [upper]
    out = []
    for step in range(num_iter):
        if strategy == "linear":
            i = int((u - step) / u * n)
        elif strategy == "cosine":
            i = int((math.cos(math.pi * step / u) + 1) / 2 * n)
        elif strategy == "constant":
            i = 0
        else:  # two-stage
            i = n if step < u / 2 else 0
        out.append(lower + i)
    return out
