"""The loop's per-token quality signals against an independent computation from a
tabular target's exact conditionals: ``token_nll`` = -log p(x_t | prefix) before truncation,
``token_off_support`` = x_t outside the warped (top-k) support, ``token_depth`` = the round depth
the token was verified at (0 for a bonus token drawn from p)."""
import numpy as np
import pytest

from coolsd.engine.decoding.rng import SharedRNG
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.theory.lab import _method

L, BATCH = 2, 96


def _run(P, Q, method, params, sampling):
    m = _method(P, method, L, "chain", dict(params))
    return speculative_generate(P, P.N, SharedRNG(BATCH, 5), rule=m.rule, drafter=build_drafter(m, Q, sampling, P.V),
                                tree=m.tree, sampling=sampling, batch_size=BATCH, bos_token=P.bos_token)


@pytest.mark.parametrize("method, params", [("lantern", {"delta": 0.5, "k": 1}), ("eagle", {}), ("coolsd", {"delta": 3.0}),
                                            ("ar", {})])
def test_token_signals_equal_independent_computation(lab_pair, method, params):
    P, Q = lab_pair
    top_k = 2
    res = _run(P, Q, method, params, SamplingConfig(top_k=top_k))
    n_off = 0
    for b in range(BATCH):
        toks, t = res.tokens[b].tolist(), 0
        for n_new in res.round_lengths[b]:
            max_depth = 0 if method == "ar" else min(L, P.N - t)
            for j in range(1, n_new + 1):
                p = P.probs(toks[:t])
                x = toks[t]
                kept = np.argsort(-p, kind="stable")[:top_k]
                assert abs(float(res.token_nll[b, t]) + np.log(p[x])) < 1e-9, (b, t)
                off = x not in kept
                assert float(res.token_off_support[b, t]) == float(off), (b, t, p, x)
                assert float(res.token_depth[b, t]) == (j if j <= max_depth else 0), (b, t, j)
                n_off += off
                t += 1
        assert t == P.N
    if method == "lantern":  # LANTERN's delta budget accepts drafts the truncation removed
        assert n_off > 0
    else:  # lossless rules and omega * p never emit off the warped support
        assert n_off == 0


def test_signals_are_nan_when_not_asked_for(lab_pair):
    P, Q = lab_pair
    m = _method(P, "coolsd", L, "chain", {"delta": 2.0})
    res = speculative_generate(P, P.N, SharedRNG(4, 0), rule=m.rule, drafter=build_drafter(m, Q, SamplingConfig(), P.V),
                               tree=m.tree, batch_size=4, bos_token=P.bos_token, distortion=False)
    for x in (res.step_tv, res.token_nll, res.token_off_support, res.token_depth):
        assert bool(x.isnan().all())


def test_lossless_target_nll_is_unbiased(lab_pair):
    """The per-token NLL of a lossless method's output averages to the target's entropy rate, as AR's
    does (the loop attributes each token to the right parent node): 20,000 sequences, 4 standard errors."""
    P, Q = lab_pair
    d = P.sequence_distribution()
    h = -(d[d > 0] * np.log(d[d > 0])).sum() / P.N
    for method in ("ar", "eagle"):
        m = _method(P, method, L, "chain", {})
        n = 20000
        res = speculative_generate(P, P.N, SharedRNG(n, 9), rule=m.rule, drafter=build_drafter(m, Q, SamplingConfig(), P.V),
                                   tree=m.tree, batch_size=n, bos_token=P.bos_token)
        nll = res.token_nll.mean(1).numpy()
        assert abs(nll.mean() - h) < 4 * nll.std() / np.sqrt(n), (method, nll.mean(), h)
