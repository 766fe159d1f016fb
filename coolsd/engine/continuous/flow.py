"""The flow-matching sampler of xAR-style models as per-step Gaussians (continuous_sd.md 1.7, 2.3;
docs/methods.md#5-continuous-speculative-decoding): the time grid, the per-cell CFG weight, CFG on
the velocity and the Euler-Maruyama transition of upstream's ``sampler.py`` (OliverRensu/xAR at
121e9c9, lines 98-218), and the trajectory-aligned chain of one speculation unit that CSpD verifies.

Invariants:
* step i = 0 .. N-2 from (t_i, dt_i < 0) is x_{i+1} ~ N(mean_i, std_i^2 I) with
  ``mean = x + dt (x + (2 - t) v)`` and the SCHEDULE-ONLY ``std_i = sqrt(2 t_i |dt_i|)``; the last
  step (t = 0.04 -> 0) is deterministic, ``x_N = mean``;
* draft and target given the same initial state and step noises (``aligned_flow``) have the same
  ``std_i``, so every intermediate log density is -1/2 (|eps|^2 + C log 2 pi std_i^2) for both and
  the variance term is ``S = sum_i C/2 log std_i^2``, one constant of the schedule: log Sigma = 0.0
  exactly in floats (continuous_sd.md 2.3, "Sigma = 1 by construction");
* the final step has no density, so both models get the same final std ``s`` (``final_std``; default
  ``DEFAULT_FINAL_STD`` = sqrt(2 * 0.04 * 0.04), the Euler-Maruyama std formula at the last step):
  the token's Gaussian is N(mean_{N-1}, s^2 I) (exact mode draws x0 = mean + s eps_0, the paper mode
  keeps x0 = mean, as upstream).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from coolsd.engine.continuous.annealing import check_annealing

T_LAST = 0.04  # the SDE runs from t = 1 to 0.04, then one deterministic step to 0 (sampler.py:116-117)
DEFAULT_FINAL_STD = math.sqrt(2 * T_LAST * T_LAST)  # 0.0566: sqrt(2 t |dt|) at t = |dt| = 0.04


def time_grid(num_steps: int) -> torch.Tensor:
    """(num_steps + 1,) fp64: ``linspace(1, 0.04, num_steps)`` then 0 (sampler.py:116-117). Step i goes
    from grid[i] to grid[i + 1]; steps 0 .. num_steps - 2 are stochastic, the last deterministic."""
    if num_steps < 2:
        raise ValueError(f"flow sampler: num_steps {num_steps} < 2 (upstream needs >= 3, see coolsd.models.xar)")
    return torch.cat([torch.linspace(1., T_LAST, num_steps, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])


def cfg_schedule(cfg: float, cell: int, n_cells: int) -> float:
    """Guidance weight of cell ``cell``: ``(cfg - 1) * cell / (n_cells - 1) + 1`` (xar.py:470), linear
    from 1 (cell 0, unguided) to cfg (the last cell); cfg itself for a single cell."""
    return float(cfg) if n_cells == 1 else (cfg - 1) * cell / (n_cells - 1.) + 1


def guide(v_cond: torch.Tensor, v_null: torch.Tensor, w) -> torch.Tensor:
    """CFG on the velocity: ``v_null + w (v_cond - v_null)`` if w > 1 (strictly, sampler.py:159), else
    v_cond; ``w`` a float or a tensor broadcasting against the velocities (per-row weights)."""
    if not torch.is_tensor(w):
        return v_null + w * (v_cond - v_null) if w > 1. else v_cond
    return torch.where(w > 1., v_null + w * (v_cond - v_null), v_cond)


def transition(x: torch.Tensor, v: torch.Tensor, t: float, dt: float, last: bool) -> tuple[torch.Tensor, float]:
    """One sampler step from state x at time t by dt < 0 with the (guided) velocity v: the Gaussian
    N(mean, std^2 I) of the next state, ``mean = x + dt (x + (2 - t) v)``, ``std = sqrt(2 t |dt|)``,
    std 0 for the last step (sampler.py:137-163, 201-216). The drift is ``v - g^2 / 2 * score`` with
    g^2 = 2t and the linear path's score ``((t - 1) v - x) / t`` (sampler.py:15-43)."""
    mean = x + dt * (x + (2 - t) * v)
    return mean, 0. if last else math.sqrt(2 * t * abs(dt))


def schedule_log_var_sum(num_steps: int, token_dim: int) -> float:
    """S = sum over the stochastic steps and the token's dims of 1/2 log std_i^2: the same for every
    model run on this grid (the paper rule's variance term, whose difference log Sigma is 0)."""
    grid = time_grid(num_steps)
    return sum(0.5 * token_dim * math.log(2 * float(grid[i]) * abs(float(grid[i + 1] - grid[i])))
               for i in range(num_steps - 1))


@dataclass(frozen=True)
class FlowConfig:
    """The sampling settings draft, target and target-only runs of a flow model share.

    ``unit``: tokens per autoregressive step along the model's cell order (None: one whole cell, the
    released model's 4 steps of 64 tokens; 1: one token per step, the CSpD paper's table setting as
    docs/targets.md argues); it must divide the cell. ``num_steps``: SDE steps per unit (the same for
    draft and target, or the schedules' variances differ and Sigma != 1). ``cfg``: the weight of the
    last cell (``cfg_schedule``); a unit inside cell c uses cell c's weight."""

    num_steps: int = 50
    cfg: float = 1.0
    unit: int | None = None
    # DiSA on xAR (coolsd.engine.continuous.annealing): the SDE steps of cell c annealed linearly from
    # ``num_steps`` (the first cell) to ``lower_steps`` (the last), xAR_DiSA's only strategy; None: fixed
    anneal: str | None = None
    lower_steps: int | None = None
    # AR steps over the whole sequence in place of ``unit`` (unit = tokens / num_iter, a divisor of the
    # cell): how a run of the target alone is given as many forwards as another run (MAR's num_iter)
    num_iter: int | None = None

    def __post_init__(self):
        if isinstance(self.num_steps, bool) or int(self.num_steps) != self.num_steps or self.num_steps < 2:
            raise ValueError(f"num_steps (SDE steps per unit) must be an integer >= 2, got {self.num_steps!r}")
        if self.anneal is not None:
            if self.anneal != "linear":  # xAR_DiSA/models/xar.py: "We only implement linear transition here"
                raise ValueError(f"DiSA anneals a flow model's steps linearly only (as upstream), not {self.anneal!r}")
            check_annealing(self.anneal, self.num_steps, self.lower_steps)
        elif self.lower_steps is not None:
            raise ValueError(f"lower_steps={self.lower_steps!r} is DiSA's last-cell SDE steps: it needs anneal=linear")
        if not self.cfg >= 1.0:
            raise ValueError(f"cfg must be >= 1 (1 = no guidance), got {self.cfg}")
        if self.unit is not None and (isinstance(self.unit, bool) or int(self.unit) != self.unit or self.unit < 1):
            raise ValueError(f"unit (tokens per AR step) must be an integer >= 1 or null, got {self.unit!r}")
        if self.num_iter is not None:
            if isinstance(self.num_iter, bool) or int(self.num_iter) != self.num_iter or self.num_iter < 1:
                raise ValueError(f"num_iter (AR steps) must be an integer >= 1 or null, got {self.num_iter!r}")
            if self.unit is not None:
                raise ValueError(f"num_iter={self.num_iter} and unit={self.unit} both set a flow model's AR steps: "
                                 "give one")

    @staticmethod
    def num_iters(cell_len: int, n_cells: int) -> list[int]:
        """The AR step counts a flow model can take, ascending: tokens / u for each unit u dividing the
        cell (units never span cells)."""
        return [cell_len * n_cells // u for u in range(cell_len, 0, -1) if cell_len % u == 0]

    def unit_for(self, cell_len: int, n_cells: int) -> int:
        """Tokens per AR step; ``num_iter`` must be one of ``num_iters``."""
        if self.num_iter is not None:
            L, valid = cell_len * n_cells, self.num_iters(cell_len, n_cells)
            if self.num_iter not in valid:
                raise ValueError(f"num_iter {self.num_iter}: {L} tokens in AR steps of a whole divisor of the "
                                 f"{cell_len}-token cell need num_iter in {{{', '.join(map(str, valid))}}}")
            return L // self.num_iter
        u = cell_len if self.unit is None else int(self.unit)
        if cell_len % u:
            raise ValueError(f"unit {u} does not divide the model's cell of {cell_len} tokens; use a divisor "
                             f"(1, ..., {cell_len}) or null (one cell)")
        return u
