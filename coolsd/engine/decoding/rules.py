"""Acceptance rules: the per-sibling step of docs/methods.md#13-verification-at-one-tree-depth-d for every discrete method, and every
other fact the harness needs about a method's rule.

A rule maps (current residual target p_res, the sibling's conditional draft q_j, its token x_j,
its depth d) to the acceptance probability f_j(x_j) and the UNNORMALISED residual that replaces
p_res if x_j is rejected. The tree walk (``verify.py``) is shared by all rules.

Table of docs/methods.md#13-verification-at-one-tree-depth-d, with a_j the acceptance numerator:
  exact (eagle, sjd)     a_j = p_res                     residual [p_res - q_j]_+
  scaled (uniform_rsd,   a_j = omega_d * p_res           residual G* = [p_res - min(q_j, a_j)]_+
          coolsd)
  lantern(_pp)           a_j = p~ (neighbourhood sum)    residual LANTERN's own or G*
  group (gsd)            q f = q min(1, p(G)/q(G))       residual [p_res - q_j]_+ (GSD's) or G*
  budget                 a_j = omega* p_res, omega* per  residual G*
                         node from (p_res, q_j)

One rule object holds every fact about its method (docs/distortion.md, "Where the facts live"):
the sampling ``step`` and the exact distribution ``emitted`` of the token it emits at a chain
node derive from the same two per-token facts, ``accepted`` (q f at every token) and ``residual``
(what a rejection resamples from, when that does not depend on the rejected draft), whose
base-class defaults are the G* form of COOL-SD (``accepted = min(q, numerator)``, ``residual =
[p_res - accepted]_+``). ``coolsd.engine.decoding.distortion`` calls ``emitted`` / ``is_exact`` /
``emitted_depths`` / ``depth_independent`` / ``emitted_row_elements`` and knows no rule class, so
a subclass defined anywhere that only defines ``numerator`` verifies and reports its exact
distortion correctly. A subclass that changes the acceptance or the resampling overrides
``accepted`` / ``residual`` (x-independent forms: ``step`` and ``emitted`` follow), or ``step``
and ``emitted`` together (LANTERN's own resampling depends on x).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from coolsd.engine.compiled import compiling
from coolsd.engine.decoding import lantern as _lantern
from coolsd.engine.decoding.groups import group_masses
from coolsd.engine.decoding.sampling import _TINY, normalize


def acceptance_prob(a_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """f = min(1, a(x) / q(x)); 0 where q(x) <= 0 (such drafts are skipped anyway; their
    division, by zero, lands in the branch ``where`` discards)."""
    return torch.where(q_x > 0, torch.clamp(a_x / q_x, max=1.0), 0.0)


def gstar_residual(p_res: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Unnormalised TV-optimal resampling G* = [p_res - q * f]_+ with q*f = min(q, a)
    (COOL-SD Theorem 2). For a = omega*p_res with omega >= 1 this is [p_res - q]_+ (Prop. 1)."""
    return torch.clamp(p_res - torch.minimum(q, a), min=0.0)


def emitted_mixture(p: torch.Tensor, accepted: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """pi = accepted + beta Norm(residual), beta = 1 - sum accepted (clamped at 0), along the last
    dim: the emitted distribution at a chain node of a rule whose residual does not depend on the
    rejected draft (formulas (2) and (4) of docs/distortion.md); ``Norm`` falls back to p where
    the residual has no mass, as ``verify_tree`` does."""
    beta = (1 - accepted.sum(-1, keepdim=True)).clamp(min=0)
    return accepted + beta * normalize(residual, p)


def take(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.gather(-1, x.unsqueeze(-1)).squeeze(-1)


def depth_runs(depths: tuple) -> list:
    """(slice, depth) for each run of equal values in ``depths`` (host ints)."""
    runs, start = [], 0
    for i in range(1, len(depths) + 1):
        if i == len(depths) or depths[i] != depths[start]:
            runs.append((slice(start, i), depths[start]))
            start = i
    return runs


class Rule:
    """Base: subclasses define the acceptance numerator a_j(.) over the whole vocabulary; every
    other fact defaults to the G* form derived from it (module docstring).

    Facts the exact distortion (``coolsd.engine.decoding.distortion``) reads, with their defaults:

    * ``emitted(p, q, depth)``: pi, the distribution of the token emitted at a chain node;
      ``emitted_mixture`` of ``accepted`` and ``residual``;
    * ``is_exact(depth)``: whether pi = p exactly there (reported as p, no rounding residue); False;
    * ``emitted_depths(p, q)``: pi at every depth of a chain in one vectorised pass, or None
      (depth by depth through ``emitted``); None;
    * ``depth_independent``: whether ``emitted`` ignores its depth and its rows cost enough that
      a chain's depths go as one batch of rows, of which eager code computes only the emitted
      ones; False;
    * ``emitted_row_elements(V)``: the elements of ``emitted``'s largest temporary per row, which
      bounds its chunks of rows, or None (never chunked); None.
    """

    name = "rule"
    depth_independent = False

    def numerator(self, p_res: torch.Tensor, depth: int) -> torch.Tensor:
        """a_j (..., V): the acceptance numerator at every token, f(x) = min(1, a(x) / q(x))."""
        raise NotImplementedError

    def accepted(self, p_res, q, depth):
        """q(y) f(y) at every token (..., V), the mass of drafting y and accepting it: min(q, a)
        (= q min(1, a / q) where q > 0, and 0 where q = 0). Needs only p_res and q, not the draft."""
        return torch.minimum(q, self.numerator(p_res, depth))

    def residual(self, p_res, q, accepted):
        """The unnormalised distribution a rejection resamples from, given ``accepted`` (this
        rule's ``accepted(p_res, q, depth)``), where it does not depend on the rejected draft:
        G* = [p_res - q f]_+ (COOL-SD Theorem 2; ``gstar_residual``)."""
        return torch.clamp(p_res - accepted, min=0.0)

    def step(self, p_res, q, x, depth, choice: Optional[torch.Tensor] = None):
        """(f(x), residual) of the sibling x (B,) drawn from q: f from ``accepted`` at x (min(q, a)
        / q = min(1, a / q) exactly), the residual from ``residual``. ``choice``: the node's own
        relaxation as ``choose`` gave it (rules that choose), passed on to ``accepted``."""
        acc = self.accepted(p_res, q, depth) if choice is None else self.accepted(p_res, q, depth, choice)
        return acceptance_prob(take(acc, x), take(q, x)), self.residual(p_res, q, acc)

    def is_exact(self, depth: int) -> bool:
        """Whether the rule emits p itself at a chain node of ``depth`` (lossless there)."""
        return False

    # ``verify_tree`` walks the residual chains of every node with children at once: rows (N, B, V)
    # whose n-th block of B rows verifies children at depth ``depths[n]`` (host ints). A rule that
    # reads its depth is called once per run of equal depths (``depth_runs``), one that does not
    # (``reads_depth`` False) once for all rows, each call on rows (N' * B, V) as ``step`` and
    # ``accepted`` are documented; ``ScaledRule`` overrides ``accepted_rows`` with every row's
    # omega_d in one pass.
    @property
    def reads_depth(self) -> bool:
        """Whether ``accepted`` or ``step`` read their ``depth``: True unless a class says otherwise
        of its own definitions."""
        return True

    def accepted_rows(self, p_res, q, depths: tuple, choice: Optional[torch.Tensor] = None):
        """``accepted`` over rows (N, B, V) at depths ``depths`` (N host ints); ``choice`` (N, B)."""
        if choice is None:
            return self._by_depth(lambda d, p, qq: (self.accepted(p, qq, d),), depths, p_res, q)[0]
        return self._by_depth(lambda d, p, qq, c: (self.accepted(p, qq, d, c),), depths, p_res, q, choice)[0]

    def step_rows(self, p_res, q, x, depths: tuple, choice: Optional[torch.Tensor] = None):
        """``step`` over rows (N, B, V) at depths ``depths``, x (N, B): (f (N, B), residual (N, B, V))."""
        if choice is None:
            return self._by_depth(lambda d, p, qq, xx: self.step(p, qq, xx, d), depths, p_res, q, x)
        return self._by_depth(lambda d, p, qq, xx, c: self.step(p, qq, xx, d, c), depths, p_res, q, x, choice)

    def _by_depth(self, fn, depths: tuple, *rows: torch.Tensor) -> tuple:
        """``fn(depth, *rows)`` on each run of equal depths (every row at once where the rule does
        not read its depth), each of ``rows`` (N, B, ...) handed over as (n * B, ...) (a view of a
        contiguous run); its outputs, each (n * B, ...), back as (N, B, ...)."""
        B = rows[0].shape[1]
        runs = depth_runs(depths) if self.reads_depth else [(slice(None), depths[0])]
        parts = [[o.view(-1, B, *o.shape[1:]) for o in fn(d, *(t[s].reshape(-1, *t.shape[2:]) for t in rows))]
                 for s, d in runs]
        return tuple(o[0] if len(parts) == 1 else torch.cat(o) for o in zip(*parts))

    @property
    def siblings_in_batch(self) -> bool:
        """Whether ``verify_tree`` may decide a node's children after walking their residual chain:
        true where ``step`` is this class's, i.e. f(x) and the residual come from ``accepted`` and
        ``residual``, which do not depend on the draft (the chain is then the same whichever child
        is accepted). A rule with its own ``step`` advances each node's chain only past a verified
        child that it rejects (``verify_tree``'s second branch)."""
        return type(self).step is Rule.step

    def emitted(self, p: torch.Tensor, q: torch.Tensor, depth: int) -> torch.Tensor:
        """pi (..., V): the distribution of the token the rule emits at a chain node of ``depth``,
        marginalised over the draft x ~ q (p, q the target's and the drafter's distributions):
        q f + (1 - sum q f) Norm(residual), formula (2) / (4) of docs/distortion.md. Exact only
        when ``residual`` does not depend on x; a rule whose residual does overrides this.
        ``distortion.emitted_distribution`` calls it where ``is_exact(depth)`` is False."""
        accepted = self.accepted(p, q, depth)
        return emitted_mixture(p, accepted, self.residual(p, q, accepted))

    def emitted_depths(self, p: torch.Tensor, q: torch.Tensor,
                       choices: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """pi (..., D, V) at every depth 1..D of a chain at once, p and q (..., D, V) holding depth
        d's node in column d - 1, where the rule has a form vectorised over depths; None: none
        (``distortion.chain_distortion`` goes depth by depth through ``emitted``). ``choices``
        (..., D): the nodes' own relaxations as verification chose them (rules that choose)."""
        return None

    # Rules whose relaxation is a per-node choice from the node's (p_res, q) made before its
    # acceptance draw (``BudgetRule``) say so in ``chooses`` and give it by ``choose``. The
    # verification walk chooses once per node and hands the choice to ``step``, and, on a chain,
    # to the signals (``Verdict.choices`` -> ``emitted_depths``): the emitted distribution is then
    # computed at the relaxation the round sampled with, and the choice's work is paid once.
    chooses = False

    def choose(self, p_res: torch.Tensor, q: torch.Tensor) -> Optional[torch.Tensor]:
        """The per-node choice (...,) from rows of (p_res, q) (..., V) where ``chooses``."""
        return None

    def emitted_row_elements(self, V: int) -> Optional[int]:
        """Elements of the largest temporary ``emitted`` holds per row of a (rows, V) call, or None
        (a few (rows, V) tensors: never chunked). ``distortion.emitted_distribution`` then goes
        through the rows in chunks of at most ``distortion.LANTERN_CHUNK_ELEMENTS`` such elements,
        so every step of ``emitted`` must be per row."""
        return None

    def _inherits(self, owner: type, *names: str) -> bool:
        """Whether this rule's class keeps ``owner``'s definitions of ``names``: a subclass that
        redefines one (its own numerator, say) voids the facts ``owner`` derives from them (its
        ``is_exact``, its vectorised form), and gets the base class's general ones instead."""
        return all(getattr(type(self), n) is getattr(owner, n) for n in names)

    def describe(self) -> dict:
        return {"rule": self.name}

    def on(self, device) -> "Rule":
        """This rule with every tensor it holds on ``device`` (a copy made once per device; the
        loop verifies with the target's): tables built where their inputs were (a codebook's
        neighbourhoods, a schedule) never meet the target's tensors on another device."""
        device = torch.device(device)
        state = {k: v for k, v in vars(self).items() if k != "_on_device"}
        if all(v.device == device for v in state.values() if isinstance(v, torch.Tensor)):
            return self
        copies = self.__dict__.setdefault("_on_device", {})
        if device not in copies:
            moved = object.__new__(type(self))
            moved.__dict__.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()})
            copies[device] = moved
        return copies[device]


class ExactRule(Rule):
    """Lossless speculative sampling (EAGLE-1 recursive rejection; SJD's window test)."""

    name = "exact"

    def numerator(self, p_res, depth):
        return p_res

    def is_exact(self, depth):  # a = p: pi = p at every depth (formula (2) would leave rounding residue)
        return self._inherits(ExactRule, "numerator", "accepted", "residual")

    @property
    def reads_depth(self):
        return not self._inherits(ExactRule, "numerator", "accepted", "step")


class ScaledRule(Rule):
    """a_j = omega_d * p_res: UniformRSD (omega constant) and COOL-SD (annealed omega)."""

    name = "scaled"

    def __init__(self, omega: torch.Tensor):
        self.omega = omega.double()
        self.weights = [float(w) for w in self.omega]  # host floats: no tensor read per step (traceable)

    def weight(self, depth: int) -> float:
        return self.weights[self._at(depth)]

    def _at(self, depth: int) -> int:
        # depths past the schedule (never reached by a tree of depth L) reuse the last weight
        return min(depth, len(self.weights)) - 1

    def numerator(self, p_res, depth):
        return self.weight(depth) * p_res

    def is_exact(self, depth):  # omega_d = 1: a = p
        return self.weight(depth) == 1.0 and self._inherits(ScaledRule, "numerator", "accepted", "residual")

    def accepted_rows(self, p_res, q, depths, choice=None):
        """min(q, omega_d p_res) with each row's omega_d, in one pass (the same product, to the last
        bit, as ``numerator`` takes with omega_d a host float: both round omega_d to p_res's dtype)."""
        if not self._inherits(ScaledRule, "numerator", "accepted", "weight"):
            return super().accepted_rows(p_res, q, depths, choice)
        at = [self._at(d) for d in depths]
        if len(set(at)) == 1:
            return self.accepted(p_res, q, depths[0])
        # the rows' weights from the held tensor (views stacked: one kernel, nothing lifted from host data)
        w = torch.stack([self.omega[i] for i in at]).to(p_res.dtype).view(-1, *(1,) * (p_res.dim() - 1))
        return torch.minimum(q, w * p_res)

    def emitted_depths(self, p, q, choices=None):
        """Cheap rows: every depth at once, omega_d broadcast over the batch (formula (2) with
        a = omega_d p), and p itself at the depths where omega_d = 1."""
        if not self._inherits(ScaledRule, "numerator", "accepted"):
            return None  # a subclass's own numerator: depth by depth through ``emitted``
        depth = p.shape[-2]
        omega = [self.weight(j) for j in range(1, depth + 1)]
        w = torch.tensor(omega, dtype=p.dtype, device=p.device).view(depth, 1)
        accepted = torch.minimum(q, w * p)
        pi = emitted_mixture(p, accepted, self.residual(p, q, accepted))
        if 1.0 in omega:  # a = p at that depth: exactly p (formula (2) would leave rounding residue)
            pi = torch.where(w == 1.0, p, pi)
        return pi

    def describe(self):
        return {"rule": self.name, "omega": [round(float(w), 6) for w in self.omega]}


class LanternRule(Rule):
    """LANTERN (absolute budget ``delta``) / LANTERN++ (relative budget ``lam``), docs/methods.md#3-lantern-and-lantern."""

    name = "lantern"
    # the exact distortion (docs/distortion.md (3)): a = p~ whatever the depth, O(V k) a row, so
    # a chain's depths go as one batch of rows and eager code computes only the emitted ones
    depth_independent = True

    def __init__(self, neighbours: torch.Tensor, k: int, *, lam=None, delta=None, resample="lantern"):
        self.nb_k = neighbours[:, :k]
        self.nb_k1 = neighbours[:, : k + 1]  # LANTERN zeroes k+1 neighbours (reference code)
        # who has each token among its k+1 neighbours (the exact distortion's scatter as a gather, compiled)
        self.rev_k1 = _lantern.reverse_neighbours(self.nb_k1) if k + 1 <= _lantern.UNROLL_MAX else None
        self.lam, self.delta, self.resample = lam, delta, resample

    def numerator(self, p_res, depth):
        return _lantern.aggregate(p_res, self.nb_k, None, lam=self.lam, delta=self.delta)[0]

    def step(self, p_res, q, x, depth):
        if self.resample == "gstar":
            return super().step(p_res, q, x, depth)
        p_tilde_x, relaxed = _lantern.aggregate(p_res, self.nb_k, x, lam=self.lam, delta=self.delta)
        f = acceptance_prob(p_tilde_x, take(q, x))
        # LlamaGen static-tree path: if relaxation was used at x, zero q on x's first k+1
        # neighbours (not renormalised), then [p_res - q]_+.
        zero = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, self.nb_k1[x], True)
        q_mod = torch.where(zero & relaxed.unsqueeze(-1), torch.zeros_like(q), q)
        return f, torch.clamp(p_res - q_mod, min=0.0)

    @property
    def reads_depth(self):
        return not self._inherits(LanternRule, "numerator", "accepted", "step")

    @property
    def siblings_in_batch(self) -> bool:
        """With G* resampling LANTERN's step is the base class's (``Rule.siblings_in_batch``)."""
        return self.resample == "gstar" and type(self).step is LanternRule.step

    def residual(self, p_res, q, accepted):
        if self.resample != "gstar":
            raise NotImplementedError("LANTERN's own residual depends on the rejected draft (step, emitted)")
        return super().residual(p_res, q, accepted)

    def emitted_row_elements(self, V):
        """V (k + 1): the neighbour gathers of ``lantern.neighbour_sum`` / ``reverse_sum`` and the
        first block and continued prefixes of ``lantern.aggregate_all`` are (rows, V, k + 1)."""
        return V * self.nb_k1.shape[1]

    def emitted(self, p, q, depth):
        """pi (N, V): with ``resample=gstar`` formula (2), a = p~ over the vocabulary as
        ``numerator`` computes it but cheaper (``lantern.aggregate_all``); with LANTERN's own
        resampling formula (3) of docs/distortion.md (``_emitted_own``). Every step is per row."""
        if self.resample == "gstar":
            accepted = torch.minimum(q, _lantern.aggregate_all(p, self.nb_k, lam=self.lam, delta=self.delta)[0])
            return emitted_mixture(p, accepted, self.residual(p, q, accepted))
        return self._emitted_own(p, q)

    def _emitted_own(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Formula (3) of docs/distortion.md, vectorised over rows and every draft x at once.

        pi(y) gets c(x) Delta_x(y) from every relaxed x with y in N(x); neighbourhoods are not
        symmetric, so that sum is a scatter over (x, j) -> y = nb_k1[x, j]. Since Delta_x(y) =
        min(p, q)(y) for y in N(x) does not depend on x, it factors: sum_x c(x) Delta_x(y) =
        min(p, q)(y) * sum_{x relaxed, y in N(x)} c(x), so only the (N, V) weights c are scattered
        (``lantern.reverse_sum``: an index_add with the flat (V (k+1),) index in eager code, a gather
        through the reverse neighbour table in compiled code). Eager code (k + 1 <= lantern.UNROLL_MAX)
        goes to ``_emitted_own_token_major``, the same formula, for any number of rows: a row's
        value may not depend on which rows share its call (coolsd.engine.batch_invariant), and the two
        paths differ in the last bits."""
        nb1 = self.nb_k1
        if _lantern.token_major(p, nb1, 1):  # eager: every row count alike (a row's value must not depend on N)
            return self._emitted_own_token_major(p.t().contiguous(), q.t().contiguous()).t().contiguous()
        N, V = p.shape
        p_tilde, relaxed = _lantern.aggregate_all(p, self.nb_k, lam=self.lam, delta=self.delta)
        f = acceptance_prob(p_tilde, q)  # f(x) at every x, as step evaluates it at the draft
        w = q * (1 - f)  # probability of drafting x and rejecting it
        r0 = torch.clamp(p - q, min=0.0)
        m = torch.minimum(p, q)  # Delta_x on N(x)
        everyone = nb1.shape[1] == V - 1  # N(x) = every token but x (LANTERN's k = 1000 on a small vocabulary)
        if everyone:  # the sums over N(x) are the total less x's own term: O(V), not O(V^2)
            gain = m.sum(-1, keepdim=True) - m
        else:
            gain = _lantern.neighbour_sum(m, nb1)  # (N, V): sum_{y in N(x)} min(p, q)(y)
        s = r0.sum(-1, keepdim=True) + torch.where(relaxed, gain, torch.zeros_like(gain))  # (N, V): mass of r_x
        ok = s > _TINY
        c = torch.where(ok, w / torch.where(ok, s, torch.ones_like(s)), torch.zeros_like(s))  # weight of Norm(r_x)
        pi = q * f + c.sum(-1, keepdim=True) * r0 + (w * ~ok).sum(-1, keepdim=True) * p  # massless r_x: p
        cr = torch.where(relaxed, c, torch.zeros_like(c))
        if everyone:
            into = cr.sum(-1, keepdim=True) - cr  # sum over x != y
        else:
            into = _lantern.reverse_sum(cr, nb1, self.rev_k1)  # (N, V): sum_{x relaxed, y in N(x)} c(x)
        return pi + m * into

    def _emitted_own_token_major(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``_emitted_own`` on the transposes: p, q (V, N) -> pi (V, N), formula (3) of
        docs/distortion.md with the same elementwise steps (bit for bit); the sums over N(x) and the
        reverse scatter add in another order (equal up to float rounding). Each column's value does not
        depend on the other columns (``lantern.vocab_sum``). Token-major, every neighbour read
        is a copy of whole rows (``lantern.aggregate_token_major``, ``neighbour_sum_token_major``,
        ``reverse_sum_token_major``, no (N, V, k) tensor), and the steps run in place on a few (V, N)
        buffers: fresh large tensors are fresh pages from the OS, whose faults measured as much as the
        arithmetic on the toy world. Masks are float 0/1 (a boolean ``where`` / ``masked_fill`` on
        (512, 80) measured 25x the time of a product with a float mask on the CPU): x * mask for
        where(mask, x, 0), equal for the finite x here, and a safe divisor d + (1 - mask), equal to d
        where the mask is 1. Needs k + 1 <= lantern.UNROLL_MAX neighbours."""
        nb1, vocab_sum = self.nb_k1, _lantern.vocab_sum
        f, relaxed = _lantern.aggregate_token_major(p, self.nb_k, lam=self.lam, delta=self.delta)  # f <- p~
        relaxed = relaxed.to(p.dtype)  # float masks from here on (see the docstring)
        drafted = torch.gt(q, 0, out=torch.empty_like(q))  # acceptance_prob, in place:
        f.div_(q + (1 - drafted)).clamp_(max=1.0).mul_(drafted)  # min(1, p~ / q) where q > 0 (q + 0 = q), else 0
        w = f.neg().add_(1.0).mul_(q)  # q (1 - f): probability of drafting x and rejecting it
        r0 = torch.sub(p, q).clamp_(min=0.0)
        m = torch.minimum(p, q)  # Delta_x on N(x)
        s = _lantern.neighbour_sum_token_major(m, nb1).mul_(relaxed)  # sum_{y in N(x)} min(p, q)(y) if relaxed(x)
        s.add_(vocab_sum(r0))  # mass of r_x at every x
        ok = torch.gt(s, _TINY, out=torch.empty_like(s))
        notok = 1 - ok
        c = torch.div(w, s.add_(notok), out=s).mul_(ok)  # weight of Norm(r_x): w / s, 0 where r_x has no mass
        massless = vocab_sum(w.mul_(notok))  # weight of the fallback to p
        pi = f.mul_(q).add_(r0.mul_(vocab_sum(c))).add_(p * massless)  # q f + (sum c) r0 + ... p
        into = _lantern.reverse_sum_token_major(c.mul_(relaxed), nb1)  # sum_{x relaxed, y in N(x)} c(x)
        return pi.add_(m.mul_(into))


class GroupRule(Rule):
    """GSD (``coolsd.engine.decoding.groups``): a draft x is accepted with probability
    min(1, p(G_x) / q(G_x)), its group's masses. The accepted mass at y is then
    q(y) f(y) = min(q(y), a(y)) with a = q p(G) / q(G), which depends on q: ``accepted`` gives it
    at every token. Resampling after a rejection: ``resample="sjd"`` GSD's own, SJD's
    [p_res - q]_+; ``"gstar"`` COOL-SD's G* = [p_res - min(q, a)]_+ (Theorem 2), so the two
    relaxation families can be compared at equal resampling. Both residuals do not depend on the
    rejected x, so the base class's ``step`` (f(x) = q f / q at x) and ``emitted`` (the closed
    form (4) of docs/distortion.md) hold as they are."""

    name = "group"

    def __init__(self, size: int, p_thr: Optional[float], resample: str = "sjd"):
        self.size, self.p_thr, self.resample = int(size), p_thr, resample

    def accepted(self, p_res: torch.Tensor, q: torch.Tensor, depth=None) -> torch.Tensor:
        """q(y) f(y) at every token (..., V), at any depth."""
        pg, qg = group_masses(p_res, q, self.size, self.p_thr)
        return torch.where(qg > 0, q.to(p_res.dtype) * torch.clamp(pg / torch.where(qg > 0, qg, 1.0), max=1.0), 0.0)

    def residual(self, p_res: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
        return torch.clamp(p_res - (accepted if self.resample == "gstar" else q.to(p_res.dtype)), min=0.0)

    @property
    def reads_depth(self):
        return not self._inherits(GroupRule, "accepted", "step")

    def describe(self):
        return {"rule": self.name, "size": self.size, "p_thr": self.p_thr, "resample": self.resample}


# the relaxations a budgeted node chooses among: omega = 1 (exact) first, then log-spaced up to 64
BUDGET_OMEGAS = torch.cat([torch.ones(1, dtype=torch.float64, device="cpu"),
                           torch.logspace(0.05, 1.8, 35, dtype=torch.float64, device="cpu")])
PRICE_RANGE = (1e-4, 1e6)  # where a tuned price stays
# eager CPU code chooses for at most this many (rows x candidates x V) elements at a time, in
# buffers reused from call to call (``BudgetRule._workspace``): 8 MiB each in float32
CHOOSE_CHUNK_ELEMENTS = 1 << 21
# eager code on an accelerator chooses for at most this many at a time (512 MiB a float32
# temporary): a tree's nodes are chosen for all at once (``verify_tree``), (nodes x batch) rows
DEVICE_CHOOSE_CHUNK_ELEMENTS = 1 << 27


def _on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


class BudgetRule(Rule):
    """Relaxation by price (docs/methods.md#21-relaxation-by-budget): at every node the G* relaxation
    a = omega p_res with the omega among ``omegas`` (1 first, ascending) that maximises

        alpha(omega) - price * cost(pi(omega), p_res),

    alpha(omega) = sum_y min(q, omega p_res)(y) the node's acceptance probability, pi(omega) the
    distribution it emits (formula (2) of docs/distortion.md) and ``cost`` its KL(pi || p) or its
    TV. The choice reads only the node's p_res and q, before the acceptance draw, so ``accepted``
    is still a function of (p_res, q) and the exact distortion follows from it as for every rule.
    Ties go to the smallest omega: with ``price`` None (infinite) the rule is exact (lossless).

    With ``cost="tv"`` the choice is all or nothing: for omega >= 1, TV(pi(omega), p) =
    alpha(omega) - alpha(1) exactly (docs/methods.md#21-relaxation-by-budget), so the objective is
    alpha(1) + (1 - price) TV(omega): omega = 1 for price >= 1 (a tie at 1 goes to the smallest),
    the largest omega for price < 1.

    ``tv_per_image``: the price is tuned over a run's images to meet this budget of summed step TV
    per image (``observe``: after each batch, log price += ``rate`` times the batch's mean of
    (tv - budget) / budget); 0 is the exact rule. The current price lives in ``state``, a dict the device copies of the rule share
    (``Rule.on`` copies attributes by reference), so an update reaches every copy."""

    name = "budget"

    def __init__(self, price: Optional[float], cost: str = "kl", omegas: Optional[torch.Tensor] = None,
                 tv_per_image: Optional[float] = None, rate: float = 0.2):
        if cost not in ("kl", "tv"):
            raise ValueError(f"budget cost must be 'kl' or 'tv', got {cost!r}")
        if tv_per_image is not None and (tv_per_image < 0 or (tv_per_image > 0 and price is None)):
            raise ValueError("a budget tv_per_image >= 0 needs a starting price (a number)")
        self.price0 = None if price is None or tv_per_image == 0 else float(price)
        self.cost = cost
        self.omegas = (BUDGET_OMEGAS if omegas is None else omegas).double()
        if self.omegas[0] != 1 or (self.omegas.diff() <= 0).any():
            raise ValueError("budget omegas must start at 1 and ascend: the choice's closed forms rest on "
                             "omega >= 1 (docs/methods.md#21-relaxation-by-budget)")
        self.tv_per_image, self.rate = tv_per_image, float(rate)
        self.state = {"price": self.price0}

    @property
    def price(self) -> Optional[float]:
        return self.state["price"]

    @property
    def adaptive(self) -> bool:
        """Whether ``observe`` tunes the price (a positive ``tv_per_image``)."""
        return bool(self.tv_per_image)

    def observe(self, tvs) -> None:
        """One controller step after a batch generated at the current price: ``tvs`` its images'
        summed step TV. The step is the batch's mean, so a batch of b images moves the price as far
        as one image would, whatever b."""
        if not self.adaptive or not len(tvs):
            return
        if any(tv is None or not math.isfinite(tv) for tv in tvs):
            raise ValueError("budget tv_per_image needs each image's summed step TV: a chain (tree=chain) "
                             "with the per-token signals recorded")
        excess = sum(float(tv) - self.tv_per_image for tv in tvs) / (len(tvs) * self.tv_per_image)
        self.state["price"] = min(max(self.state["price"] * math.exp(self.rate * excess), PRICE_RANGE[0]),
                                  PRICE_RANGE[1])

    @property
    def chooses(self) -> bool:
        """Whether nodes choose their relaxation (a price is set; ``Rule.chooses``)."""
        return self.price is not None

    def choose(self, p_res: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The index into ``omegas`` each row (...,) chooses at the current price: the first
        maximum of alpha - price * cost over the candidates, in closed form where cost = TV
        (omega = 1 for price >= 1, else the largest: the class docstring's identity) and by a
        vectorised pass over the candidates where cost = KL.

        The KL pass rests on omega >= 1 (every candidate): then the G* residual is [p - q]_+
        whatever omega (COOL-SD Prop. 1), and pi(omega) / p = min(t, omega) + beta(omega) s / Z
        on p's support, with t = q / p, s = [1 - t]_+, Z = sum [p - q]_+ and beta = 1 - alpha
        (formula (2) of docs/distortion.md; where Z has no mass the residual falls back to p, as
        ``normalize`` does, and pi / p = min(t, omega) + beta). So alpha and KL(pi || p) =
        sum p u log u are a handful of passes over (..., K, V) with one log, instead of forming
        pi and its normalised residual per candidate."""
        if self.cost == "tv":
            k = 0 if self.price >= 1 else self.omegas.numel() - 1
            return torch.full(p_res.shape[:-1], k, dtype=torch.long, device=p_res.device)
        shape, V = p_res.shape[:-1], p_res.shape[-1]
        p_res, q = p_res.reshape(-1, V), q.to(p_res.dtype).reshape(-1, V)
        pos = p_res > 0
        t = torch.where(pos, q / torch.where(pos, p_res, 1.0), 0.0)
        s = torch.where(pos, torch.clamp(1 - t, min=0.0), 0.0)
        z = (p_res * s).sum(-1, keepdim=True)
        ok = z > _TINY
        norm = torch.where(ok, s / torch.where(ok, z, 1.0), pos.to(p_res.dtype))  # Norm(residual) / p
        if compiling():
            return self._choose_kl(p_res, t, norm).view(shape)
        K, host = self.omegas.numel(), _on_host(p_res)
        n = min(p_res.shape[0], max(1, (CHOOSE_CHUNK_ELEMENTS if host else DEVICE_CHOOSE_CHUNK_ELEMENTS) // (K * V)))
        bufs = self._workspace(n, K, V, p_res.dtype) if host else None  # an accelerator's allocator reuses
        parts = [self._choose_kl(p_res[i : i + n], t[i : i + n], norm[i : i + n], bufs)
                 for i in range(0, p_res.shape[0], n)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(shape)

    def _workspace(self, n: int, K: int, V: int, dtype) -> tuple:
        """Two (>= n, K, V) CPU buffers kept on the rule and reused call to call (grown when a
        call needs more rows, at most ``CHOOSE_CHUNK_ELEMENTS`` each): temporaries of that size
        freshly allocated are new pages from the OS at every call, which cost more than the
        arithmetic (measured on the toy world, V = 512, K = 36, 64 rows: 8.5 to 11 ms allocated
        per call, 2.6 to 2.9 ms reused)."""
        work = self.__dict__.get("_work")
        if work is None or work[0].shape[0] < n or work[0].shape[1:] != (K, V) or work[0].dtype != dtype:
            self._work = work = tuple(torch.empty(n, K, V, dtype=dtype, device="cpu") for _ in range(2))
        return work

    def _choose_kl(self, p_res, t, norm, bufs: Optional[tuple] = None) -> torch.Tensor:
        """``choose`` at cost KL for rows (n, V) of p, t = q / p and Norm(residual) / p: in place in
        ``bufs``, two (>= n, K, V) buffers (eager CPU), or written as plain expressions (None:
        what ``torch.compile`` fuses into one pass, and the GPU's allocator reuses).

        u - 1 = pi / p - 1 = (min(t, omega) - 1) + beta Norm / p and KL = sum p u log u, with
        log u = log1p(u - 1): the same value to rounding, and half log's time on the CPU
        (measured: 1.0 against 1.6 to 2.7 ms for 1.2M float32 entries); u - 1 is clamped above
        -1 by the dtype's eps, so u = 0 (no mass) contributes 0."""
        w = self.omegas.to(device=p_res.device, dtype=p_res.dtype).view(-1, 1)
        p_k, norm_k = p_res.unsqueeze(-2), norm.unsqueeze(-2)
        floor = torch.finfo(p_res.dtype).eps - 1
        if bufs is None:
            m = torch.minimum(t.unsqueeze(-2), w)  # min(q, omega p) / p  (n, K, V)
            alpha = (m * p_k).sum(-1)
            um1 = torch.addcmul(m - 1, torch.clamp(1 - alpha, min=0.0).unsqueeze(-1), norm_k)
            kl = (torch.log1p(um1.clamp(min=floor)) * (um1 + 1) * p_k).sum(-1)
        else:
            m, work = (b[: p_res.shape[0]] for b in bufs)
            torch.minimum(t.unsqueeze(-2), w, out=m)
            alpha = torch.mul(m, p_k, out=work).sum(-1)
            um1 = m.sub_(1).addcmul_(torch.clamp(1 - alpha, min=0.0).unsqueeze(-1), norm_k)
            kl = torch.clamp(um1, min=floor, out=work).log1p_().mul_(um1.add_(1)).mul_(p_k).sum(-1)
        return torch.argmax(alpha - self.price * kl, dim=-1)  # the first maximum: the smallest omega

    def accepted(self, p_res, q, depth, choice: Optional[torch.Tensor] = None):
        """min(q, omega p_res) at the node's omega: ``choice`` (indices into ``omegas``, as
        ``choose`` gave them) where the caller holds it, else chosen here."""
        if self.price is None:
            return torch.minimum(q.to(p_res.dtype), p_res)
        k = self.choose(p_res, q) if choice is None else choice
        omega = self.omegas.to(device=p_res.device, dtype=p_res.dtype)[k].unsqueeze(-1)
        return torch.minimum(q.to(p_res.dtype), omega * p_res)

    def emitted_depths(self, p, q, choices: Optional[torch.Tensor] = None):
        """pi at every depth from the choices verification made (``Verdict.choices``), or None
        without them (depth by depth through ``emitted``, which chooses)."""
        if choices is None or not self._inherits(BudgetRule, "accepted", "residual"):
            return None
        accepted = self.accepted(p, q, None, choices)
        return emitted_mixture(p, accepted, self.residual(p, q, accepted))

    def is_exact(self, depth):
        return self.price is None and self._inherits(BudgetRule, "accepted", "residual")

    @property
    def reads_depth(self):
        return not self._inherits(BudgetRule, "accepted", "step")

    def describe(self):
        """The rule as configured (the starting price): what a run's identity binds; the price each
        image was generated at is its record's ``budget_price``."""
        return {"rule": self.name, "price": self.price0, "cost": self.cost,
                **({"tv_per_image": self.tv_per_image, "rate": self.rate} if self.tv_per_image is not None else {}),
                "omegas": [float(self.omegas[0]), float(self.omegas[-1]), int(self.omegas.numel())]}
