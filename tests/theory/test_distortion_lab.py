"""Per-token distortion (docs/methods.md#10-exact-per-token-distortion, docs/distortion.md) in the theory lab: the production
loop's step_tv / step_kl against the independent oracle (coolsd.theory.exact), the exact
expected distortion against the exact sequence distortion it bounds, and the ``toward_one``
schedule (docs/methods.md#2-relaxation-schedules)."""
import math

import numpy as np
import pytest
import torch

from coolsd.engine.decoding.schedules import omega_schedule
from coolsd.engine.methods import build_method
from coolsd.theory import TabularAR, exact_stats, sample_stats
from coolsd.theory.lab import _method, _oracle
from coolsd.theory.sweep import lab_pairs

TOL = 1e-9

# every method exact_stats covers, each schedule of coolsd, both LANTERN resamplings
RELAXED = [
    ("uniform_rsd", {"delta": 2.0}),
    ("coolsd", {"delta": 2.0, "schedule": "exp"}),
    ("coolsd", {"delta": 1.5, "schedule": "exp_geomean"}),
    ("coolsd", {"delta": 3.0, "schedule": "linear"}),
    ("coolsd", {"delta": 2.5, "schedule": "toward_one"}),
    ("lantern", {"delta": 0.2, "k": 2}),
    ("lantern_pp", {"lam": 2.0, "k": 2}),
    ("lantern_pp", {"lam": 3.0, "k": 1, "resample": "gstar"}),
    ("budget", {"price": 2.0}),
    ("budget", {"price": 0.5, "cost": "tv"}),
]
# omega < 1 at every depth: pi = p mathematically (docs/distortion.md (2)), reported up to rounding
# (and a TV price above 1: every node chooses omega = 1, docs/methods.md#21-relaxation-by-budget)
STRICTER = [("coolsd", {"delta": 0.6, "schedule": "toward_one", "nu": 0.3}), ("budget", {"price": 1.5, "cost": "tv"})]
LOSSLESS = [("eagle", {}), ("coolsd", {"delta": 1.0, "schedule": "toward_one"}),
            ("budget", {"price": None})]  # a = p: exactly 0
CASES = RELAXED + STRICTER + LOSSLESS
BOUNDED = RELAXED + STRICTER


def _ids(cases):
    return [f"{m}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for m, p in cases]


def _close(got: float, want: float) -> bool:
    return got == want or abs(got - want) < TOL  # == for two infinite KLs


@pytest.mark.parametrize("L", [2, 3])
@pytest.mark.parametrize("method,params", CASES, ids=_ids(CASES))
def test_loop_distortion_equals_oracle_at_every_token(lab_pair, method, params, L):
    """Each emitted token's step_tv / step_kl (production: coolsd.engine.decoding.distortion inside the
    loop) equals TV / KL of the oracle's pi = cont + emis at the token's prefix and the depth j
    it had in its round (1e-9); past max_depth = min(L, N - round start) it is a bonus token
    drawn from p, with 0. L = 3 on N = 4 also truncates rounds at the end. Lossless rules
    report exactly 0. Each token's ``token_nll_expected`` equals -sum pi log p with the oracle's pi."""
    P, Q = lab_pair
    oracle = _oracle(P, Q, method, L, _method(P, method, L, "chain", dict(params)))
    n_distorted = 0
    for seed in (3, 4):
        res = sample_stats(P, Q, method, L, 64, seed, **params)["result"]
        if (method, params) in LOSSLESS:
            assert float(res.step_tv.abs().max()) == 0.0 and float(res.step_kl.abs().max()) == 0.0
        for b in range(res.tokens.shape[0]):
            toks, t = [int(x) for x in res.tokens[b]], 0
            for n_new in res.round_lengths[b]:
                max_depth = min(L, P.N - t)
                for j in range(1, n_new + 1):
                    c = tuple(toks[:t])
                    want = oracle.distortion(c, j) if j <= max_depth else np.zeros(2)
                    got = (float(res.step_tv[b, t]), float(res.step_kl[b, t]))
                    assert _close(got[0], want[0]) and _close(got[1], want[1]), (seed, b, t, j, got, want)
                    # the expected NLL: -sum pi log p with the oracle's pi (p itself for a bonus draw)
                    p = P.probs(c)
                    pi = sum(oracle.step(c, j)) if j <= max_depth else p
                    want_nll = -float(np.sum(np.where(pi > 0, pi * np.log(np.where(p > 0, p, 1.0)), 0.0)))
                    assert _close(float(res.token_nll_expected[b, t]), want_nll), (seed, b, t, j)
                    assert int(res.token_depth[b, t]) == (j if j <= max_depth else 0)
                    n_distorted += bool(want[0] > 1e-3)
                    t += 1
            assert t == P.N
    assert (n_distorted > 0) == ((method, params) in RELAXED)  # the comparison is not vacuous


def test_sjd_reports_zero_distortion(lab_pair):
    """SJD verifies with the exact rule (one-hot random drafts included): exactly 0."""
    P, _ = lab_pair
    for seed in (3, 4):
        res = sample_stats(P, P, "sjd", 3, 64, seed)["result"]
        assert float(res.step_tv.abs().max()) == 0.0 and float(res.step_kl.abs().max()) == 0.0


def _bound_pairs():
    """(name, target, draft): the conftest pair (V=3, N=4, built as in conftest) and a sweep
    pair with a sharper target (V=4, N=3)."""
    P = TabularAR.random(3, 4, seed=0)
    yield "lab", P, TabularAR.mix(P, TabularAR.random(3, 4, seed=1), 0.5)
    for seed, P, Q in lab_pairs(4, 3, 0.4, [0]):
        yield f"sweep{seed}", P, Q


BOUND_CASES = [(name, P, Q, L) for name, P, Q in _bound_pairs() for L in (1, 3)]


@pytest.mark.parametrize("method,params", BOUNDED, ids=_ids(BOUNDED))
def test_expected_distortion_bounds_the_sequence_distortion(method, params):
    """E[sum_t TV(pi_t, p_t)] >= TV(Q_seq, P_seq) and E[sum_t KL(pi_t || p_t)] >= KL(Q_seq || P_seq).

    Write the method's run as positions t = 1..N with round state z_t (the depth at which t is
    verified, or "bonus"): given (x_<t, z_t), x_t ~ pi_t = pi(x_<t, z_t) (p for a bonus), and
    pi_t's target counterpart is p_t = p(.|x_<t).

    TV: let H_k run the method for positions 1..k, then the target for k+1..N (H_0 = P_seq,
    H_N = Q_seq). H_k and H_{k-1} share the law of (x_<k, z_k), differ only in drawing x_k from
    pi_k or p_k, then apply the same kernel (the target given x_<=k); marginalising z_k and
    that common kernel cannot increase TV (convexity over the round state), so
    TV(H_k, H_{k-1}) <= E[TV(pi_k, p_k)], and the triangle inequality along the sequence sums
    these: TV(Q_seq, P_seq) <= sum_k TV(H_k, H_{k-1}) <= E[sum_t TV(pi_t, p_t)].

    KL: the chain rule gives KL(Q_seq || P_seq) = sum_t E[KL(Q(.|x_<t) || p_t)], with
    Q(.|x_<t) = E[pi_t | x_<t] a mixture over the round state given the prefix; KL is convex in
    its first argument, so KL(E[pi_t | x_<t] || p_t) <= E[KL(pi_t || p_t) | x_<t].

    Equality: with N = 1 there is one position, one round and one state (depth 1): both sides
    are TV / KL of pi at the empty prefix. With N > 1 the state given the prefix is random (a
    token may be an accepted depth-2 draft or the correction of a depth-1 rejection) and the
    inequalities are strict here: checked on the lab pair, so a wrong side fails either way."""
    strict = []
    for name, P, Q, L in BOUND_CASES:
        e = exact_stats(P, Q, method, L, **params)
        assert e["expected_step_tv"] >= e["tv"] - 1e-12, (name, L, e["expected_step_tv"], e["tv"])
        assert e["expected_step_kl"] >= e["kl"] - 1e-12, (name, L, e["expected_step_kl"], e["kl"])
        strict.append((e["expected_step_tv"] - e["tv"], e["expected_step_kl"] - e["kl"]))
    if (method, params) in RELAXED:
        gap_tv, gap_kl = strict[1]  # the lab pair at L = 3
        assert gap_tv > 1e-3 and gap_kl > 1e-5, strict
    else:  # omega <= 1 at every depth: lossless, every term is 0
        assert max(max(abs(g) for g in s) for s in strict) < 1e-12


@pytest.mark.parametrize("method,params", BOUNDED, ids=_ids(BOUNDED))
@pytest.mark.parametrize("L", [1, 3])
def test_one_token_makes_the_bound_an_equality(method, params, L):
    """N = 1: one round, one position verified at depth 1 (L' = min(L, 1)), no bonus: the
    sequence distribution is pi itself, so expected and sequence TV / KL agree (1e-10)."""
    for seed in (0, 1):
        P = TabularAR.random(5, 1, seed=seed, concentration=0.5)
        Q = TabularAR.mix(P, TabularAR.random(5, 1, seed=seed + 50, concentration=0.5), 0.6)
        e = exact_stats(P, Q, method, L, **params)
        assert abs(e["expected_step_tv"] - e["tv"]) < 1e-10, (seed, e["expected_step_tv"], e["tv"])
        assert abs(e["expected_step_kl"] - e["kl"]) < 1e-10, (seed, e["expected_step_kl"], e["kl"])
        assert e["expected_rounds"] == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["ar", "eagle"])
def test_lossless_methods_have_zero_expected_distortion(lab_pair, method):
    P, Q = lab_pair
    e = exact_stats(P, Q, method, 3)
    for key in ("tv", "kl", "expected_step_tv", "expected_step_kl"):
        assert abs(e[key]) < 1e-12, (key, e[key])


@pytest.mark.parametrize("method,params", [("coolsd", {"delta": 2.0}), ("lantern_pp", {"lam": 2.0, "k": 2})])
def test_sampled_distortion_sums_estimate_the_expectation(lab_pair, method, params):
    """The loop's per-image sum of step_tv (and step_kl) is an unbiased estimate of
    expected_step_tv (expected_step_kl): sample mean within 5 standard errors. This also pins
    the oracle's reach probabilities, which the bound tests alone would not (a larger
    expectation still bounds)."""
    P, Q = lab_pair
    L, n = 3, 4000
    e = exact_stats(P, Q, method, L, **params)
    res = sample_stats(P, Q, method, L, n, seed=21, **params)["result"]
    tv_sums, kl_sums = res.step_tv.sum(1), res.step_kl.sum(1)
    for sums, want in ((tv_sums, e["expected_step_tv"]), (kl_sums, e["expected_step_kl"])):
        mean, se = float(sums.mean()), float(sums.std()) / math.sqrt(n)
        assert abs(mean - want) < 5 * se, (mean, want, se)
    # the bound is loose by more than the noise: the sums do not estimate the sequence TV itself
    assert e["expected_step_tv"] > e["tv"] + 5 * float(tv_sums.std()) / math.sqrt(n)


@pytest.mark.parametrize("delta", [0.3, 0.9, 1.0, 1.1, 2.0, 5.0])
@pytest.mark.parametrize("nu", [0.0, 0.7, 3.0, 50.0])
def test_toward_one_schedule_values_and_side_of_one(delta, nu):
    """omega_d = 1 + (delta - 1) exp(-nu (d - 1)), d = 1..L: starts at delta, moves
    monotonically toward 1 and stays on delta's side of it (never crosses 1)."""
    L = 6
    w = omega_schedule("toward_one", delta, L, nu=nu)
    want = [1 + (delta - 1) * math.exp(-nu * (d - 1)) for d in range(1, L + 1)]
    assert w.dtype == torch.float64 and w.tolist() == pytest.approx(want, rel=0, abs=1e-15)
    assert float(w[0]) == pytest.approx(delta, rel=0, abs=1e-15)
    steps = (w[1:] - w[:-1]) * (1 if delta < 1 else -1)
    assert bool((steps >= 0).all())  # toward 1
    side = (w - 1) * math.copysign(1, delta - 1)
    assert bool((side >= 0).all()) if delta != 1 else w.tolist() == [1.0] * L


def test_toward_one_is_a_coolsd_schedule():
    m = build_method("coolsd", draft_length=3, delta=2.0, schedule="toward_one", nu=1.0)
    assert m.rule.omega.tolist() == pytest.approx([2.0, 1 + math.exp(-1), 1 + math.exp(-2)])
    with pytest.raises(ValueError, match="unknown schedule 'cosine'.*toward_one"):
        build_method("coolsd", draft_length=3, schedule="cosine")
    with pytest.raises(ValueError, match="nu must be a finite number >= 0"):
        build_method("coolsd", draft_length=3, schedule="toward_one", nu=-1.0)


def test_toward_one_at_delta_one_is_eagle(lab_pair):
    """delta = 1 gives omega = 1 at every depth: EAGLE's tokens for the same seed, and exactly
    lossless in the lab; delta > 1 relaxes only less than uniform_rsd at the same delta
    (omega_d <= delta), a trade it shows as a shorter accepted length."""
    P, Q = lab_pair
    ref = sample_stats(P, Q, "eagle", 3, 256, seed=5)["tokens"]
    assert torch.equal(sample_stats(P, Q, "coolsd", 3, 256, seed=5, delta=1.0, schedule="toward_one")["tokens"], ref)
    assert exact_stats(P, Q, "coolsd", 3, delta=1.0, schedule="toward_one")["tv"] < 1e-12
    toward = exact_stats(P, Q, "coolsd", 3, delta=2.0, schedule="toward_one")
    uniform = exact_stats(P, Q, "uniform_rsd", 3, delta=2.0)
    assert toward["accepted_length"] < uniform["accepted_length"]
