"""Exact output distribution and expected rounds of chain speculative decoding on tabular
models: the test oracle. Written directly from docs/methods.md#13-verification-at-one-tree-depth-d and #3-lantern-and-lantern in numpy, sharing no
decoding code with the production engine (only the omega schedule formula and the neighbour
table, which are data).

Lab protocol: generation starts from the empty prefix; each round drafts
L' = min(L, N - |prefix|) tokens along a chain; a fully accepted round emits a bonus token only
if there is room.

Besides the sequence distribution, the oracle gives the expected per-token distortion summed
over the sequence, E[sum_t TV(pi_t, p_t)] and E[sum_t KL(pi_t || p_t)] (docs/methods.md#10-exact-per-token-distortion,
docs/distortion.md): the quantities whose per-image sums the production loop records.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np

from coolsd.theory.stats import total_variation


def _norm(v, fallback):
    s = v.sum()
    return v / s if s > 1e-12 else fallback


def _aggregate(p, nb, x, k, lam, delta):
    """LANTERN p~(x) and whether m* exists (docs/methods.md#3-lantern-and-lantern), by explicit loop."""
    budget = (lam - 1) * p[x] if lam is not None else delta
    c, c_star, relaxed = 0.0, 0.0, False
    for m in range(k):
        c += p[nb[x, m]]
        if c <= budget:
            c_star, relaxed = c, True
    return p[x] + c_star, relaxed


def kl_divergence(a: np.ndarray, b: np.ndarray) -> float:
    """KL(a || b) = sum_{a > 0} a log(a / b); inf if a has mass where b has none."""
    on = a > 0
    if np.any(b[on] <= 0):
        return float("inf")
    return float(np.sum(a[on] * np.log(a[on] / b[on])))


class ChainOracle:
    """Exact chain-drafting statistics by explicit enumeration, an implementation of each method's
    acceptance and residual of its own (independent of ``coolsd.engine.decoding.rules``), for the methods
    it implements, ``METHODS``."""

    METHODS = ("eagle", "uniform_rsd", "coolsd", "lantern", "lantern_pp", "budget")

    def __init__(self, target, draft, method: str, params: dict, omega, neighbours, L: int):
        self.P, self.Q = target, draft
        self.V, self.N, self.L = target.V, target.N, L
        self.method, self.params = method, params
        self.omega = None if omega is None else np.asarray(omega, dtype=np.float64)
        self.nb = None if neighbours is None else np.asarray(neighbours)

    @functools.lru_cache(maxsize=None)
    def step(self, c: tuple, d: int):
        """(continue weights q(x) f(x), emission mass sum_x q(x)(1-f(x)) Norm(r_x)) at chain
        prefix c and depth d."""
        p, q, V = self.P.probs(c), self.Q.probs(c), self.V
        m = self.method
        if m == "eagle":
            a = p.copy()
        elif m in ("uniform_rsd", "coolsd"):
            a = self.omega[d - 1] * p
        elif m == "budget":  # self.omega: the omegas a node chooses among
            a = self._budget_omega(p, q) * p
        elif m in ("lantern", "lantern_pp"):
            k = self.params["k"]
            lam = self.params.get("lam") if m == "lantern_pp" else None
            delta = self.params.get("delta") if m == "lantern" else None
            agg = [_aggregate(p, self.nb, x, k, lam, delta) for x in range(V)]
            a = np.array([t[0] for t in agg])
            relaxed = [t[1] for t in agg]
        else:
            raise ValueError(f"exact_stats does not support method {m!r}")
        f = np.where(q > 0, np.minimum(1.0, a / np.where(q > 0, q, 1.0)), 0.0)
        cont = q * f
        if m in ("lantern", "lantern_pp") and self.params.get("resample", "lantern") == "lantern":
            emis = np.zeros(V)
            for x in range(V):
                if q[x] * (1 - f[x]) <= 0:
                    continue
                qx = q.copy()
                if relaxed[x]:
                    qx[self.nb[x, : self.params["k"] + 1]] = 0.0
                emis += q[x] * (1 - f[x]) * _norm(np.maximum(p - qx, 0.0), p)
        else:
            beta = float((q * (1 - f)).sum())
            emis = beta * _norm(np.maximum(p - np.minimum(q, a), 0.0), p)
        return cont, emis

    def _budget_omega(self, p: np.ndarray, q: np.ndarray) -> float:
        """The budgeted node's relaxation (docs/methods.md#21-relaxation-by-budget), by explicit loop
        over the candidates: the first omega maximising alpha - price * cost, with pi formed and its
        KL or TV computed directly."""
        price = self.params.get("price")
        if price is None:
            return 1.0
        best, best_j = 1.0, -np.inf
        for w in self.omega:
            acc = np.minimum(q, w * p)
            alpha = float(acc.sum())
            pi = acc + max(0.0, 1.0 - alpha) * _norm(np.maximum(p - acc, 0.0), p)
            cost = kl_divergence(pi, p) if self.params.get("cost", "kl") == "kl" else total_variation(pi, p)
            j = alpha - price * cost
            if j > best_j:
                best, best_j = float(w), j
        return best

    @functools.lru_cache(maxsize=None)
    def distortion(self, c: tuple, d: int) -> np.ndarray:
        """[TV, KL] of the emitted token's distribution pi = cont + emis (docs/distortion.md (1))
        against p(.|c), at chain prefix c and depth d."""
        cont, emis = self.step(c, d)
        pi, p = cont + emis, self.P.probs(c)
        return np.array([total_variation(pi, p), kl_divergence(pi, p)])

    def round_distortion(self, s: tuple) -> np.ndarray:
        """[E TV, E KL] summed over the tokens of one round started at prefix s: sum over the
        chain nodes (c, d), d <= L', of P(the round reaches depth d at c) * distortion(c, d).
        The token at depth d is emitted from pi whether it is accepted or corrects a rejection;
        a bonus token is drawn from p and adds 0."""
        Lp = min(self.L, self.N - len(s))
        total, frontier = np.zeros(2), {s: 1.0}
        for d in range(1, Lp + 1):
            reached = {}
            for c, w in frontier.items():
                total = total + w * self.distortion(c, d)
                cont, _ = self.step(c, d)
                for x in np.flatnonzero(cont > 0):  # accepted at depth d: go on to depth d+1
                    reached[c + (int(x),)] = w * cont[x]
            frontier = reached
        return total

    @functools.lru_cache(maxsize=None)
    def round_outcomes(self, s: tuple):
        """[(prefix after the round, probability)] for one round started at prefix s."""
        Lp = min(self.L, self.N - len(s))
        out: dict[tuple, float] = {}

        def rec(c, d, w):
            if d > Lp:
                if len(c) < self.N:
                    for y, py in enumerate(self.P.probs(c)):
                        if py > 0:
                            out[c + (y,)] = out.get(c + (y,), 0.0) + w * py
                else:
                    out[c] = out.get(c, 0.0) + w
                return
            cont, emis = self.step(c, d)
            for x in range(self.V):
                if cont[x] > 0:
                    rec(c + (x,), d + 1, w * cont[x])
                if emis[x] > 0:
                    out[c + (x,)] = out.get(c + (x,), 0.0) + w * emis[x]

        rec(s, 1, 1.0)
        return out

    def _backward(self, terminal, reward):
        """A(()) for A(s) = reward(s) + sum_{s2} w(s -> s2) A(s2) over the round outcomes, and
        A(s) = terminal(s) on complete sequences: prefixes only grow, so longest first."""
        value: dict[tuple, object] = {}
        for n in range(self.N, -1, -1):
            for s in itertools.product(range(self.V), repeat=n):
                if n == self.N:
                    value[s] = terminal(s)
                    continue
                v = reward(s)
                for s2, w in self.round_outcomes(s).items():
                    v = v + w * value[s2]  # w > 0: an inf KL stays inf, never 0 * inf
                value[s] = v
        return value[()]

    def solve(self):
        """(distribution over length-N sequences in lexicographic order, expected rounds)."""
        V, N = self.V, self.N

        def one_hot(s):
            v = np.zeros(V**N)
            v[_index(s, V)] = 1.0
            return v

        dist = self._backward(one_hot, lambda s: np.zeros(V**N))
        rounds = self._backward(lambda s: 0.0, lambda s: 1.0)
        return dist, float(rounds)

    def expected_distortion(self) -> tuple[float, float]:
        """(E[sum_t TV(pi_t, p_t)], E[sum_t KL(pi_t || p_t)]) over the method's own rounds from
        the empty prefix: each round adds its round_distortion."""
        tv, kl = self._backward(lambda s: np.zeros(2), self.round_distortion)
        return float(tv), float(kl)


def _index(seq, V):
    i = 0
    for t in seq:
        i = i * V + int(t)
    return i
