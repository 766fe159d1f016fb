"""The theory lab: exact and sampled statistics of every method on tabular AR models."""
from __future__ import annotations

import numpy as np
import torch

from coolsd.engine.decoding.lantern import CodebookNeighbours, neighbours_from_codebook
from coolsd.engine.decoding.rng import SharedRNG
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.methods import build_method, method_info
from coolsd.theory.exact import ChainOracle, kl_divergence
from coolsd.theory.stats import total_variation
from coolsd.theory.tabular import TabularAR


def has_exact_stats(method: str) -> bool:
    """Whether ``exact_stats`` computes ``method`` (plain AR, or a method the independent
    ``ChainOracle`` implements); the others are sampled (``sample_stats``)."""
    return method == "ar" or method in ChainOracle.METHODS


def _check_pair(target: TabularAR, draft: TabularAR):
    if not isinstance(target, TabularAR) or not isinstance(draft, TabularAR):
        raise TypeError("target and draft must be TabularAR models")
    if (target.V, target.N) != (draft.V, draft.N):
        raise ValueError(
            f"target (V={target.V}, N={target.N}) and draft (V={draft.V}, N={draft.N}) must share vocabulary and length"
        )


def _method(target, method, draft_length, tree, params):
    if method_info(method).jacobi and "window" not in params:
        params = {**params, "window": int(draft_length) + 1}
    nb = CodebookNeighbours(target.codebook)  # LANTERN's neighbourhoods, sorted only if a rule reads them
    return build_method(method, tree=tree, draft_length=draft_length, neighbours=nb, vocab_size=target.V, **params)


def _oracle(target: TabularAR, draft: TabularAR, method: str, draft_length: int, m) -> ChainOracle:
    """The independent oracle of the built method ``m``: it takes only data from ``m`` (the omega
    schedule; the neighbour table is rebuilt from the codebook). ``ar`` drafts nothing: exact_stats
    answers it directly."""
    if not has_exact_stats(method):
        raise ValueError(
            f"exact_stats supports ar, {', '.join(ChainOracle.METHODS)}; for {method!r} (a method that carries "
            "drafts between rounds is not a function of the prefix alone) use sample_stats"
        )
    omega = getattr(m.rule, "omega", getattr(m.rule, "omegas", None))  # a schedule, or a budgeted node's candidates
    nb = None if getattr(m.rule, "nb_k1", None) is None else neighbours_from_codebook(target.codebook)
    return ChainOracle(target, draft, method, m.params, omega, nb, int(draft_length))


def exact_stats(target: TabularAR, draft: TabularAR, method: str, draft_length: int, **params) -> dict:
    """Exact statistics of chain drafting of ``draft_length`` tokens per round: TV and KL
    (``kl`` = KL(method || target), inf off the target's support) to the target's sequence
    distribution, accepted length N / E[rounds], and the expected summed per-token distortion
    ``expected_step_tv`` = E[sum_t TV(pi_t, p_t)], ``expected_step_kl`` = E[sum_t KL(pi_t || p_t)]
    (what the loop's per-image sums of step_tv / step_kl estimate; they bound tv / kl,
    docs/distortion.md)."""
    _check_pair(target, draft)
    m = _method(target, method, draft_length, "chain", params)  # validates everything first
    p_target = target.sequence_distribution()
    if method == "ar":
        return {"tv": 0.0, "kl": 0.0, "expected_step_tv": 0.0, "expected_step_kl": 0.0, "accepted_length": 1.0,
                "expected_rounds": float(target.N), "distribution": p_target, "target_distribution": p_target,
                "params": m.describe()}
    oracle = _oracle(target, draft, method, draft_length, m)
    dist, rounds = oracle.solve()
    step_tv, step_kl = oracle.expected_distortion()
    return {
        "tv": total_variation(dist, p_target),
        "kl": kl_divergence(dist, p_target),
        "expected_step_tv": step_tv,
        "expected_step_kl": step_kl,
        "accepted_length": target.N / rounds,
        "expected_rounds": rounds,
        "distribution": dist,
        "target_distribution": p_target,
        "params": m.describe(),
    }


def sample_stats(
    target: TabularAR, draft: TabularAR, method: str, draft_length: int, n: int, seed: int,
    tree="chain", sampling: SamplingConfig | None = None, grid_width: int | None = None, **params,
) -> dict:
    """Run the production loop (``speculative_generate`` with the production drafters and
    verification) n times from the empty prefix; empirical sequence distribution and
    accepted length N / mean(rounds); ``result``: the loop's ``GenerationResult`` (per-token
    step_tv / step_kl, round lengths). ``sampling``: the loop's warpers (default none); the
    distribution a lossless method must then match is ``target.warped(sampling)``'s
    (``tv_to_target`` is measured against it). ``grid_width``: lay the N tokens out on a grid
    that wide (SJD's spatial inits)."""
    _check_pair(target, draft)
    m = _method(target, method, draft_length, tree, params)
    sampling = sampling or SamplingConfig()
    drafter = build_drafter(m, draft, sampling, target.V, grid_width=grid_width)
    res = speculative_generate(
        target, target.N, SharedRNG(n, seed), rule=m.rule, drafter=drafter, tree=m.tree,
        sampling=sampling, batch_size=n, bos_token=target.bos_token,
    )
    idx = torch.zeros(n, dtype=torch.long)
    for t in range(target.N):
        idx = idx * target.V + res.tokens[:, t]
    counts = np.bincount(idx.numpy(), minlength=target.V**target.N).astype(np.float64)
    rounds = np.array([len(r) for r in res.round_lengths], dtype=np.float64)
    return {
        "counts": counts,
        "distribution": counts / n,
        "accepted_length": target.N / rounds.mean(),
        "mean_rounds": float(rounds.mean()),
        "rounds_std": float(rounds.std(ddof=1)) if n > 1 else 0.0,
        "tv_to_target": total_variation(counts / n, target.warped(sampling).sequence_distribution()),
        "n": n,
        "tokens": res.tokens,
        "result": res,
        "params": m.describe(),
    }
