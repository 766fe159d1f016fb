"""Parity of the SJD family's verification and drafting with the UPSTREAM samplers, on recorded fixtures.

``tests/fixtures/upstream/sampler_*.safetensors`` were made by ``tools/make_upstream_fixtures.py``
(``--sjd``, ``--scd``, ``--gsd``, ``--sjd-pac``, ``--pjd``) with the upstream samplers at the commits in
``MANIFEST.json``, on a synthetic target (float64), with every random draw recorded: the acceptance
uniforms (upstream's ``torch.rand``), the top-up ids (``torch.randint``) and the uniforms of every
``torch.multinomial`` draw (the generator replaces it, during the upstream run, by an inverse-CDF draw
from a recorded uniform: the same law; upstream's probabilities and control flow unchanged). No
upstream code runs here.

Each round of upstream is replayed into OUR code fed the same draws: the drafter (``JacobiDrafter`` /
``PACDrafter``) set to upstream's window, ``verify_tree`` with the method's rule, then the drafter's
``observe``; the tests assert the same window, the same accept / reject decisions, the same emitted
token from the same residual distribution (float64, ``tolerance`` of the fixture) and the same next
window, except where ours deliberately differs, which each test asserts in exactly that place:

* MC-SJD (junhyukso/SCD): a draft the coupling KEEPS goes to the next window with its OLD q
  upstream, with the p it is distributed as here (``JacobiDrafter``'s docstring, docs/sjd_pac.md).
* GSD (junhyukso/GSD): a draft among the 7 least likely tokens gets an empty rank window upstream
  (``[r - 7 : r + 7]`` with a negative start is an empty slice; ``.max()`` of it raises, and the
  ``except`` falls back to SJD's own-token ratio); ours clips the window to the vocabulary.
* SJD-PAC (KangJialiang/SJD-PAC): upstream takes the longest run of passing nodes over its leaf
  rows, not recursive rejection's first passing sibling; emits a uniformly random top-up token when
  every draft is accepted; tests duplicate siblings (q = 0) and subtracts their q; draws the siblings
  of the next window from the coupling's residual (reported as draws from p), and a draft the stale
  test rejects at a branching depth from the residual after all the old siblings there; ours is
  recursive rejection with draws from the distributions each node reports (docs/sjd_pac.md).

PJD (boyaliao/PJD): each forward's rows are replayed into ``pjd_verify_row`` (the function
``pjd_generate`` runs for every row); no deliberate difference at this level. The schedule around it
(windows, row starts) is the glue's, not upstream's code (tests/fixtures/upstream/README.md).

Uniform conventions: upstream accepts draft i when ``rs[i, d_i] < min(1, p(d_i) / q(d_i))``, our
``verify_tree`` when ``u_accept < f``: u_accept = rs[i, d_i]. Upstream's top-up ``randint`` id k is
our top-up uniform (k + 0.5) / V (``JacobiDrafter`` takes floor(u V)). A multinomial draw's recorded
uniform is our inverse-CDF uniform (u_emit, the drafter's u_next).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from coolsd.engine import drafting
from coolsd.engine.decoding.rules import ExactRule, GroupRule, acceptance_prob, take
from coolsd.engine.decoding.trees import make_tree, pac_tree
from coolsd.engine.decoding.verify import verify_tree
from coolsd.engine.drafting import JacobiDrafter, PACDrafter, RoundInfo
from coolsd.engine.rows import pjd_verify_row

FIXTURES = Path(__file__).parents[1] / "fixtures" / "upstream"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())


def load(name: str) -> SimpleNamespace:
    path = FIXTURES / f"{name}.safetensors"
    groups = {"in": {}, "out": {}}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
            prefix, rest = key.split(".", 1)
            groups[prefix][rest] = f.get_tensor(key)
    tol = float(meta["tolerance"])
    assert MANIFEST["files"][path.name]["tolerance_max_abs"] == tol, f"{path.name}: manifest and file disagree"
    return SimpleNamespace(inp=groups["in"], out=groups["out"], config=json.loads(meta["config"]), tol=tol)


class Replay:
    """A stand-in for the loop's rng: hands the drafter recorded uniforms, in the order it asks."""

    def __init__(self, *blocks: torch.Tensor):
        self.blocks = list(blocks)

    def uniform(self, *shape: int) -> torch.Tensor:
        u = self.blocks.pop(0)
        assert tuple(u.shape) == (1, *shape), (tuple(u.shape), shape)
        return u


# ------------------------------------------------------------------------------------ SJD, MC-SJD, GSD
def jacobi_round(fx, r: int, rule, coupling=None) -> dict:
    """Upstream's round ``r`` replayed into ours: the drafter set to upstream's window (its carried
    drafts and their q; its top-ups from upstream's randint ids), ``verify_tree`` with ``rule`` and
    upstream's acceptance uniforms, ``observe`` with upstream's target samples' uniforms (and, for
    ``coupling="maximal"``, its keep-test uniforms and residual draws). Returns upstream's and our
    results side by side."""
    i_, o_ = fx.inp, fx.out
    V, W = fx.config["V"], fx.config["W"]
    n = W - 1
    window, q, p, rs = i_["window"][r], i_["window_q"][r], o_["p"][r], i_["rs"][r]
    n_carry, fm = int(i_["n_carry"][r]), int(o_["first_misaligned"][r])
    per_slot = o_["resid_token"].dim() == 2  # MC-SJD: a residual draw at every rejected slot

    d = JacobiDrafter(V, W, token_range=(0, V), coupling=coupling)
    d.begin(None, 1, window[:1], None)
    d.carry_tokens[0, :n_carry] = window[1 : 1 + n_carry]
    d.carry_q = q[1:].unsqueeze(0).clone()
    d.carry_count = torch.tensor([n_carry])
    topup = i_["topup"][r]
    u_top = torch.where(topup >= 0, (topup.double() + 0.5) / V, torch.full_like(topup, 0.5, dtype=torch.float64))
    # the next iteration's sample at node k (k = 1..n) is upstream's target sample at slot k
    u_next = i_["u_target"][r, 1:].clone()
    blocks = [u_top, u_next]
    if coupling == "maximal":
        # node k couples the draft at slot k + 1: upstream's test of that slot (rs) and, where it moved
        # the draft, its residual draw; the last node has no draft to couple: a fresh target sample
        u_keep = torch.full((n,), 0.5, dtype=torch.float64)
        for i in range(2, W):
            u_keep[i - 2] = rs[i, window[i]]
            if o_["resid_token"][r, i] >= 0 and i > fm:
                u_next[i - 2] = i_["resid_u"][r, i]
        blocks.append(u_keep)
    tree = make_tree("chain", n)
    max_depth = torch.tensor([n])
    tokens, qq = d.propose(tree, Replay(torch.stack(blocks).unsqueeze(0)), max_depth)

    u_accept = torch.zeros(1, W, dtype=torch.float64)
    for i in range(1, W):
        u_accept[0, i] = rs[i, window[i]]
    if fm < W:  # upstream's residual draw at its first rejection is the emitted token's
        u_emit = i_["resid_u"][r, fm] if per_slot else i_["resid_u"][r]
        up_emit_probs = o_["resid_probs"][r, fm] if per_slot else o_["resid_probs"][r]
    else:  # all accepted: the bonus token is the target sample at the last slot
        u_emit, up_emit_probs = i_["u_target"][r, W - 1], p[W - 1]
    verdict = verify_tree(p.unsqueeze(0), qq, tokens, tree, rule, u_accept, u_emit.view(1), max_depth)
    d.observe(RoundInfo(tokens, verdict.path, verdict.n_accepted, verdict.emitted, p.unsqueeze(0), None))
    m = int(d.carry_count[0])
    return {
        "window": window, "q": q, "p": p, "fm": fm, "tokens": tokens[0], "qq": qq[0],
        "n_acc": int(verdict.n_accepted[0]), "path_tokens": tokens[0, verdict.path[0, : int(verdict.n_accepted[0])]],
        "emitted": int(verdict.emitted[0]), "emit_probs": verdict.emit_probs[0], "up_emit_probs": up_emit_probs,
        "up_next_tokens": o_["next_tokens"][r], "up_next_scores": o_["next_scores"][r],
        "carry_tokens": d.carry_tokens[0, :m], "carry_q": d.carry_q[0, :m], "carry_count": m,
    }


def assert_round_agrees(x: dict, tol: float, q_differs_at=()) -> None:
    """Our replay of one round against upstream's: the same window, decisions, emitted token and
    distribution, and next window (tokens; q except at the carried slots ``q_differs_at``)."""
    W, fm = x["window"].shape[0], x["fm"]
    assert torch.equal(x["tokens"], x["window"]), "the drafter's window is not upstream's"
    assert torch.equal(x["qq"][1:], x["q"][1:]), "the drafter's q are not upstream's"
    assert x["n_acc"] == fm - 1, f"accepted {x['n_acc']} drafts, upstream {fm - 1}"
    assert torch.equal(x["path_tokens"], x["window"][1:fm])
    assert x["emitted"] == int(x["up_next_tokens"][fm - 1]), "emitted token differs"
    err = (x["emit_probs"] - x["up_emit_probs"]).abs().max().item()
    assert err <= tol, f"the emitted token's distribution differs by {err:.3g}"
    assert x["carry_count"] == W - fm
    assert torch.equal(x["carry_tokens"], x["up_next_tokens"][fm:]), "the next window's drafts differ"
    for s in range(W - fm):
        same = torch.equal(x["carry_q"][s], x["up_next_scores"][fm + s])
        assert same != (s in q_differs_at), f"next window slot {s}: q {'differs' if not same else 'agrees'}"


def check_sjd(fx, rule) -> None:
    for r in range(fx.inp["window"].shape[0]):
        assert_round_agrees(jacobi_round(fx, r, rule), fx.tol)


def test_sjd_matches_upstream():
    """tyshiwo1/Accelerating-T2I-AR-with-SJD's SpeculativeSampler (docs/methods.md#4-sjd): every round's
    decisions, emitted token (from the same residual [p - q]_+), and next window (the target samples
    after the emitted token, q = p) are ours, given the same draws."""
    fx = load("sampler_sjd")
    fm = fx.out["first_misaligned"]
    W = fx.config["W"]
    # the fixture holds rejections at every slot and all-accepted rounds
    assert set(fm.tolist()) == set(range(1, W + 1))
    check_sjd(fx, ExactRule())


class _NoResidual(ExactRule):
    def residual(self, p_res, q, accepted):  # mutation: resample from p, not [p - q]_+
        return p_res


class _IgnoreQ(ExactRule):
    def accepted(self, p_res, q, depth):  # mutation: accept with probability p(x) (as if q were one-hot)
        return q * p_res


@pytest.mark.parametrize("mutant", [_NoResidual(), _IgnoreQ()], ids=["no_residual", "ignore_q"])
def test_sjd_parity_catches_a_mutated_rule(mutant):
    with pytest.raises(AssertionError):
        check_sjd(load("sampler_sjd"), mutant)


def kept_slots(x: dict) -> list[int]:
    """Carried slots (of the next window) whose draft upstream's coupling KEPT: slot s holds upstream's
    sample index k = fm + s, its coupling of the draft at slot k + 1 (none for k = W - 1)."""
    W, fm = x["window"].shape[0], x["fm"]
    return [k - fm for k in range(fm, W - 1) if x["resid_token"][k + 1] < 0 and
            int(x["up_next_tokens"][k]) == int(x["window"][k + 1])]


def check_mc_sjd(fx) -> list[tuple[int, int]]:
    """Every round of upstream's MC sampler against ours (``coupling="maximal"``); returns the
    (round, slot) pairs where the q differs (upstream's kept drafts)."""
    differs = []
    for r in range(fx.inp["window"].shape[0]):
        x = jacobi_round(fx, r, ExactRule(), coupling="maximal")
        x["resid_token"] = fx.out["resid_token"][r]
        kept = kept_slots(x)
        fm = x["fm"]
        for s in kept:  # upstream reports the kept draft's OLD q, ours the p it is distributed as
            assert torch.equal(x["up_next_scores"][fm + s], x["q"][fm + s + 1])
            assert torch.equal(x["carry_q"][s], x["p"][fm + s])
        visible = [s for s in kept if not torch.equal(x["q"][fm + s + 1], x["p"][fm + s])]
        assert_round_agrees(x, fx.tol, q_differs_at=visible)
        differs += [(r, s) for s in visible]
    return differs


def test_mc_sjd_matches_upstream_but_for_kept_drafts_q():
    """junhyukso/SCD's MC sampler (``jacobi_iteration_lumina_mgpt_SCDMC.py``: the SJD test at every
    slot, no break after the first rejection): the decisions, the emitted token, and the next window's
    drafts (kept, or drawn from Norm([p - q]_+), or a fresh sample at the last slot) are ours token for
    token. The next window's q agree everywhere except at the drafts the coupling KEPT: upstream reports
    their old q, ours the stale p they were tested against. The coupled draft (kept with probability
    min(1, p / q), else drawn from Norm([p - q]_+)) is distributed as min(q, p) + [p - q]_+ = p
    (docs/sjd_pac.md, "AC is MC-SJD's maximal coupling"); a kept one is distributed as
    min(q, p) / beta, not as q, so the next verification's proposal must be p: with upstream's q the
    lab's chi-square test fails (tests/engine/test_parallel_decoders.py
    ``test_upstream_bookkeeping_of_kept_drafts_fails``). Each round is replayed from upstream's own
    window (its q included), so the difference is asserted where it arises, in the next window."""
    differs = check_mc_sjd(load("sampler_mc_sjd"))
    assert len(differs) >= 3, differs  # the fixture shows the difference


def _moves_from_p(d, q, p, qd, pd, u_keep, u_next):  # mutation: a moved draft drawn from p, not [p - q]_+
    keep = u_keep * qd < pd
    return torch.where(keep, d, drafting.sample_inverse_cdf(p, u_next))


def _keeps_by_q_over_p(d, q, p, qd, pd, u_keep, u_next):  # mutation: keep with min(1, q(d) / p(d))
    return _REAL_COUPLING(d, q, p, pd, qd, u_keep, u_next)


_REAL_COUPLING = drafting._maximal_coupling


@pytest.mark.parametrize("mutant", [_moves_from_p, _keeps_by_q_over_p], ids=["no_residual", "inverted_ratio"])
def test_mc_sjd_parity_catches_a_mutated_coupling(monkeypatch, mutant):
    monkeypatch.setattr(drafting, "_maximal_coupling", mutant)
    with pytest.raises(AssertionError):
        check_mc_sjd(load("sampler_mc_sjd"))


class UpstreamGroupWindow(GroupRule):
    """GroupRule as junhyukso/GSD's sampler runs it: for a draft of ascending rank r < size // 2 its
    slice ``logit_sort[r - 7 : r + 7]`` starts below 0 and is empty, ``.max()`` of it raises, and the
    ``except`` tests the draft with SJD's own-token ratio min(1, p(x) / q(x))."""

    def step(self, p_res, q, x, depth):
        f, residual = super().step(p_res, q, x, depth)
        rank = (p_res < take(p_res, x).unsqueeze(-1)).sum(-1)  # ascending, as upstream's logits.sort()
        return torch.where(rank < self.size // 2, acceptance_prob(take(p_res, x), take(q, x)), f), residual


def low_rank_tested(fx, r: int, size: int = 14) -> bool:
    """Whether upstream tested, in round r, a draft of ascending rank < size // 2."""
    window, p, fm = fx.inp["window"][r], fx.out["p"][r], int(fx.out["first_misaligned"][r])
    W = window.shape[0]
    return any(int((p[i - 1] < p[i - 1, window[i]]).sum()) < size // 2 for i in range(1, min(fm, W - 1) + 1))


def low_rank_acceptance(fx) -> list[tuple[float, float]]:
    """(ours, upstream's) acceptance probability of every tested draft of ascending rank < 7."""
    out, ours, up = [], GroupRule(14, 0.15, "sjd"), UpstreamGroupWindow(14, 0.15, "sjd")
    for r in range(fx.inp["window"].shape[0]):
        window, q, p = fx.inp["window"][r], fx.inp["window_q"][r], fx.out["p"][r]
        fm, W = int(fx.out["first_misaligned"][r]), window.shape[0]
        for i in range(1, min(fm, W - 1) + 1):
            if int((p[i - 1] < p[i - 1, window[i]]).sum()) < 7:
                args = (p[i - 1 : i], q[i : i + 1], window[i : i + 1], i)
                out.append((float(ours.step(*args)[0]), float(up.step(*args)[0])))
    return out


def gsd_disagreeing_rounds(fx, rule) -> list[int]:
    bad = []
    for r in range(fx.inp["window"].shape[0]):
        try:
            assert_round_agrees(jacobi_round(fx, r, rule), fx.tol)
        except AssertionError:
            bad.append(r)
    return bad


def test_gsd_matches_upstream():
    """junhyukso/GSD's grouped acceptance (``coolsd.engine.decoding.groups``): a draft is accepted with
    probability min(1, p(G) / q(G)) over its group G, the tokens within 7 ranks of it in the target's
    ascending order with |p(y) - p(x)| < 0.15 (upstream's embedding-distance filter is disabled in the
    fixture: all distances 0; ours does not have it), and a rejection resamples from [p - q]_+.
    Every round agrees with ``GroupRule(14, 0.15, "sjd")`` where upstream tests no draft among the 7
    least likely tokens, and every round agrees with upstream's window for those
    (``UpstreamGroupWindow``); there the two windows give different acceptance probabilities. Ours
    clips the window to the vocabulary: upstream's empty slice is an indexing accident (a negative
    slice start), and in upstream's own setting (8192 logits, image top-k 2000) the 7 least likely
    tokens have p = 0, so both reject them."""
    fx = load("sampler_gsd")
    n = fx.inp["window"].shape[0]
    assert gsd_disagreeing_rounds(fx, UpstreamGroupWindow(14, 0.15, "sjd")) == []
    ours = gsd_disagreeing_rounds(fx, GroupRule(14, 0.15, "sjd"))
    low = [r for r in range(n) if low_rank_tested(fx, r)]
    assert set(ours) <= set(low), (ours, low)
    # the fixture tests drafts among the 7 least likely tokens, where the two windows give other
    # acceptance probabilities (its uniforms happen to decide those tests alike)
    f = low_rank_acceptance(fx)
    assert low and any(abs(a - b) > 1e-3 for a, b in f), f


@pytest.mark.parametrize("mutant", [ExactRule(), GroupRule(12, 0.15, "sjd"), GroupRule(14, None, "sjd"),
                                    GroupRule(14, 0.15, "gstar")], ids=["sjd_rule", "size_12", "no_p_thr", "gstar"])
def test_gsd_parity_catches_a_mutated_rule(mutant):
    """SJD's own-token test, a window of 12 ranks, no probability filter, COOL-SD's G* residual: each
    disagrees with upstream on some round where the group rule alone decides."""
    fx = load("sampler_gsd")
    low = {r for r in range(fx.inp["window"].shape[0]) if low_rank_tested(fx, r)}
    assert set(gsd_disagreeing_rounds(fx, mutant)) - low


# ------------------------------------------------------------------------------------ SJD-PAC
class PacRound(SimpleNamespace):
    """One round of upstream's SJD-PAC sampler in OUR node order (``pac_tree``)."""


def pac_round(fx, r: int) -> PacRound:
    """Upstream's round r mapped onto our tree: node tokens, the target's p at every node, each node's
    q as upstream tests it (the depth's draft_prob; for rank k >= 1 with the tokens of ranks < k zeroed
    and renormalised), each node's acceptance uniform (upstream's torch.rand of the first leaf row
    through it: ``node_group_heads``), and upstream's accepted path in our node indices."""
    c, i_, o_ = fx.config, fx.inp, fx.out
    M, K, D, V = c["M"], c["K"], c["D"], c["V"]
    tree = pac_tree(M, K, D)
    index = {(): 0, **{p: j + 1 for j, p in enumerate(tree.paths)}}
    ours = torch.tensor([index[tuple(p)] for p in c["paths"]])  # upstream node -> our node
    n1 = tree.n_nodes + 1
    tokens = torch.empty(n1, dtype=torch.long)
    tokens[ours] = i_["nodes"][r]
    p = torch.empty(n1, V, dtype=torch.float64)
    p[ours] = i_["node_p"][r]
    q_in, retrieve, rnd = i_["q_in"][r], i_["retrieve"], i_["rnd"][r]
    q = torch.zeros(n1, V, dtype=torch.float64)
    u = torch.zeros(n1, dtype=torch.float64)
    for j in range(1, n1):
        e, k, parent = int(tree.depth[j]), int(tree.rank[j]), int(tree.parent[j])
        base = q_in[e].clone()
        if k:
            earlier = [s for s in tree.children_list[parent] if int(tree.rank[s]) < k]
            base[tokens[earlier]] = 0.0
            base = base / base.sum()
        q[j] = base
    for a in range(1, retrieve.shape[1]):  # upstream node at column a of the leaf rows
        for up in set(retrieve[:, a].tolist()) - {-1}:
            head = int(torch.nonzero(retrieve[:, a] == up)[0, 0])
            u[ours[up]] = rnd[head, a - 1]
    acc_len, acc_row = int(o_["acc_len"][r]), int(o_["acc_row"][r])
    up_path = ours[retrieve[acc_row, 1 : acc_len + 1]]
    return PacRound(tree=tree, ours=ours, tokens=tokens, p=p, q=q, u=u, acc_len=acc_len, acc_row=acc_row,
                    up_path=up_path, M=M, K=K, D=D, V=V, n=M - 1)


def in_order_walk(x: PacRound, skip_zero_q: bool) -> tuple[list[int], list[int]]:
    """Recursive rejection over siblings, depth by depth, with upstream's per-node test (a node
    passes when p_k(x) > u q_k(x), p_k = Norm([p_{k-1} - q_{k-1}]_+) over its earlier siblings, as
    upstream's ``seq_curr_b`` loop residualises p): the path of the first passing sibling at each
    depth, and the nodes tested. ``skip_zero_q``: a sibling with q_k(x) = 0 (a duplicate of an earlier
    sibling's token) is skipped, as ``verify_tree`` does; upstream tests it (it never passes: the
    residual is 0 at a rejected token) and subtracts its q_k from the residual all the same."""
    path, tested, node = [], [], 0
    while True:
        p_res, nxt = x.p[node], None
        for child in x.tree.children_list[node]:
            t = x.tokens[child]
            if skip_zero_q and x.q[child, t] <= 0:
                continue
            tested.append(child)
            if p_res[t] > x.u[child] * x.q[child, t]:
                nxt = child
                break
            r = (p_res - x.q[child]).clamp(min=0)
            p_res = r / r.sum()
        if nxt is None:
            return path, tested
        path.append(nxt)
        node = nxt


def pac_verify(x: PacRound, fx, r: int, rule=None):
    u_emit = fx.inp["mult_u"][r, 0, 0].view(1)  # the emitted token: upstream's first draw from its row 0
    return verify_tree(x.p.unsqueeze(0), x.q.unsqueeze(0), x.tokens.unsqueeze(0), x.tree, rule or ExactRule(),
                       x.u.unsqueeze(0), u_emit, torch.tensor([x.n]))


def check_pac_verification(fx, rule=None) -> dict:
    """Every round's verification against upstream's; returns the rounds where upstream's
    longest-row choice is not recursive rejection's, where it tested a sibling with q = 0, and where
    it accepted every draft."""
    c = fx.config
    found = {"longest": [], "zero_q": [], "bonus": []}
    for r in range(fx.inp["nodes"].shape[0]):
        x = pac_round(fx, r)
        v = pac_verify(x, fx, r, rule)
        n_acc = int(v.n_accepted[0])
        ours_path = v.path[0, :n_acc].tolist()
        walk, _ = in_order_walk(x, skip_zero_q=True)
        assert ours_path == walk, f"round {r}: verify_tree's path is not recursive rejection's"
        up_walk, up_tested = in_order_walk(x, skip_zero_q=False)
        if up_walk != x.up_path.tolist():
            # upstream's path skips an earlier sibling that passed its test, for the longest run
            found["longest"].append(r)
            d = next(k for k, (a, b) in enumerate(zip(up_walk + [-1], x.up_path.tolist())) if a != b)
            assert d < len(up_walk) and int(x.tree.rank[up_walk[d]]) < int(x.tree.rank[x.up_path[d]])
            assert len(x.up_path) > len(up_walk)
            continue
        if any(x.q[j, x.tokens[j]] <= 0 for j in up_tested):
            found["zero_q"].append(r)  # upstream's residual differs from ours after such a sibling
            continue
        assert n_acc == x.acc_len
        emitted, resid0 = int(v.emitted[0]), fx.out["resid"][r, 0]
        if x.acc_len == x.n:  # every draft accepted: upstream's row 0 is its uniform top-up row
            found["bonus"].append(r)
            pad = torch.zeros(c["V"], dtype=torch.float64)
            pad[c["img_start"] :] = 1.0 / (c["V"] - c["img_start"])
            assert torch.equal(resid0, pad), "upstream's bonus token is not a top-up"
            assert torch.equal(v.emit_probs[0], x.p[ours_path[-1]])  # ours: the target's p after the last draft
            continue
        assert emitted == int(fx.out["sampled"][r, 0, 0]), f"round {r}: emitted token differs"
        err = (v.emit_probs[0] - resid0 / resid0.sum()).abs().max().item()
        assert err <= fx.tol, f"round {r}: the emitted token's distribution differs by {err:.3g}"
    return found


def test_sjd_pac_verification_matches_upstream():
    """KangJialiang/SJD-PAC's ``SJDPACSpeculativeSampler`` tests every node of its tree (node token =
    candidate[rank, depth], a sibling's q = the depth's proposal with earlier siblings' tokens zeroed and
    renormalised, its p the residual after them): where its accepted path is the one recursive
    rejection takes (the first passing sibling at each depth), ``verify_tree`` with ``ExactRule`` on
    ``pac_tree`` accepts the same drafts and emits the same token from the same residual.

    Upstream differs in three places the fixture shows. (1) It takes the LONGEST run of passing nodes
    over all leaf rows (``accepted_lengths.max()``), so it may skip an earlier sibling that passed for
    a later sibling whose test assumed the earlier one was rejected (its p is the residual after it):
    recursive rejection stops at the first passing sibling, which is what makes a tree's
    verification exact (docs/methods.md#13-verification-at-one-tree-depth-d); upstream's token at that
    depth then depends on the tests deeper down, which moves mass from the earlier sibling's token to
    the later one's. (2) When every draft is
    accepted, upstream emits a uniformly random image token (its top-up row): the target's
    distribution after the last draft is not among the columns it reads (``advanced_prob[:, :L - 1]``);
    ours emits from it. (3) A sibling whose token duplicates an earlier sibling's (q = 0 there: the
    first window's independent random siblings, or a kept draft drawn again from the residual) is
    skipped by ours (it cannot have been drawn from its q); upstream tests it (it never passes) and
    still subtracts its q from the residual the later siblings and the emitted token see."""
    fx = load("sampler_sjd_pac")
    found = check_pac_verification(fx)
    n = fx.inp["nodes"].shape[0]
    assert found["longest"] and found["bonus"] and found["zero_q"], found
    assert n - sum(len(v) for v in found.values()) >= n // 2, found  # the other rounds: the same


def test_sjd_pac_verification_parity_catches_a_mutated_rule():
    with pytest.raises(AssertionError):
        check_pac_verification(load("sampler_sjd_pac"), _NoResidual())


def pac_node(x: PacRound, path) -> int:
    return {p: j + 1 for j, p in enumerate(x.tree.paths)}[tuple(path)]


def pac_drafter_round(fx, r: int, x: PacRound) -> dict:
    """Upstream's round r (a round after the first: its tree holds candidate[rank, depth] at every
    node) replayed into ``PACDrafter``: its state set to upstream's candidates and their q, ``propose``
    (which must lay out upstream's tree), ``verify_tree``, ``observe`` with upstream's draws: the keep
    test of the draft at old depth c + 1 is upstream's rnd of that node, the draw that replaces it
    upstream's first multinomial draw of the next window's column c - acc_len, our siblings take the
    uniforms of upstream's siblings."""
    c, i_ = fx.config, fx.inp
    M, K, D, V, n, S = x.M, x.K, x.D, x.V, x.n, x.D - 1
    m, mult_u = x.acc_len, i_["mult_u"][r]
    d = PACDrafter(V, M, K, D, token_range=(c["img_start"], V))
    d.begin(None, 1, x.tokens[:1], None)
    chain = [pac_node(x, (0,) * e) for e in range(1, n + 1)]
    d.carry_tokens = x.tokens[chain].unsqueeze(0).clone()
    d.carry_q = i_["q_in"][r, 1:].unsqueeze(0).clone()
    d.carry_count = torch.tensor([n])
    d.sib_q = torch.zeros(1, S, K - 1, V, dtype=torch.float64)
    for s in range(S):
        for k in range(1, K):
            j = pac_node(x, (0,) * s + (k,))
            d.sib[0, s, k - 1], d.sib_q[0, s, k - 1] = x.tokens[j], x.q[j]
    # the keep tests and replacement draws of old depths e = 2..n (index e - 2), the fresh draw past it
    u_keep = torch.ones(n, dtype=torch.float64)
    u_next = torch.full((n,), 0.5, dtype=torch.float64)
    kept = {}
    for col in range(m + 1, n):  # old column col = old depth col + 1, next window's column col - m
        row = x.acc_row if col < D else 0  # upstream's target_rows
        node = int(i_["retrieve"][row, col + 1])
        if node >= 0:
            j = int(x.ours[node])
            u_keep[col - 1] = x.u[j]
            parent = int(x.tree.parent[j])
            kept[col - m] = bool(x.p[parent, x.tokens[j]] > x.u[j] * x.q[j, x.tokens[j]])
        else:
            kept[col - m] = False  # a padded node: upstream's rnd is inf there (never kept)
        u_next[col - 1] = mult_u[col - m, 0]
    u_next[n - 1] = mult_u[n - m, 0]
    u_sib = torch.zeros(S, K - 1, dtype=torch.float64)
    for s in range(S):
        jj = s + 1  # the next window's column of depth s + 1
        if jj < n - m:
            u_sib[s] = mult_u[jj, : K - 1] if kept[jj] else mult_u[jj, 1:K]
    u3 = torch.stack([torch.full((n,), 0.5, dtype=torch.float64), u_next, u_keep]).unsqueeze(0)
    tokens, q = d.propose(x.tree, Replay(u3, u_sib.unsqueeze(0)), torch.tensor([n]))
    v = verify_tree(x.p.unsqueeze(0), q, tokens, x.tree, ExactRule(), x.u.unsqueeze(0), mult_u[0, 0].view(1),
                    torch.tensor([n]))
    d.observe(RoundInfo(tokens, v.path, v.n_accepted, v.emitted, x.p.unsqueeze(0), None))
    return {"tokens": tokens[0], "q": q[0], "n_acc": int(v.n_accepted[0]), "carry": d.carry_tokens[0],
            "carry_q": d.carry_q[0], "carry_count": int(d.carry_count[0]), "sib": d.sib[0], "kept": kept}


def check_pac_drafting(fx) -> dict:
    """Every round after a sample's first whose verification agrees with upstream's, replayed into
    ``PACDrafter``; returns where the next windows differ by design."""
    c, o_ = fx.config, fx.out
    skip = check_pac_verification(fx)
    found = {"rounds": 0, "coupled_agree": 0, "fresh": 0, "fresh_differ": 0, "all_sibling_moves": 0,
             "all_sibling_moves_differ": 0, "siblings": 0, "siblings_differ": 0}
    pad = torch.zeros(c["V"], dtype=torch.float64)
    pad[c["img_start"] :] = 1.0 / (c["V"] - c["img_start"])
    for r in range(fx.inp["nodes"].shape[0]):
        if r % c["rounds"] == 0 or any(r in v for v in skip.values()):
            continue
        found["rounds"] += 1
        x = pac_round(fx, r)
        y = pac_drafter_round(fx, r, x)
        assert torch.equal(y["tokens"][0], x.tokens[0]) and torch.equal(y["tokens"], x.tokens), \
            f"round {r}: PACDrafter's tree is not upstream's"
        assert torch.equal(y["q"][1:], x.q[1:]), f"round {r}: PACDrafter's q are not upstream's"
        assert y["n_acc"] == x.acc_len
        m, n, sampled, res_p = x.acc_len, x.n, o_["sampled"][r], o_["res_p"][r]
        res_len = n - m
        # ours carries one more draft: the target's sample after the window's last draft (upstream
        # drops that distribution and tops the slot up, uniform q)
        assert y["carry_count"] == res_len
        assert torch.equal(res_p[res_len], pad)
        for j in range(1, res_len):  # the next window's depth j: upstream's column j, our carry slot j - 1
            assert torch.equal(y["carry_q"][j - 1], res_p[j]), f"round {r}, depth {j}: q differs"
            col = m + j  # the old draft at depth col + 1, tested against the p of the node before it
            same_token = int(y["carry"][j - 1]) == int(sampled[0, j])
            if col == x.D - 1 and int(fx.inp["retrieve"][x.acc_row, x.D]) < 0:
                # upstream has no draft there on its row: a fresh draw from p; ours couples the chain's
                found["fresh"] += 1
                found["fresh_differ"] += int(not same_token)
            elif col <= x.D - 2 and not y["kept"][j]:
                # a moved draft at a branching depth: upstream draws it from the residual after ALL K
                # siblings of the old tree there (res_rows = last_siblings), ours from [p - q_0]_+
                node = int(x.ours[int(fx.inp["retrieve"][x.acc_row, col + 1])])
                parent = int(x.tree.parent[node])
                p_res, rest = x.p[parent], None
                for sib in x.tree.children_list[parent]:
                    rest = (p_res - x.q[sib]).clamp(min=0)
                    p_res = rest / rest.sum()
                err = (o_["resid"][r, j] - rest).abs().max().item()
                assert err <= fx.tol, f"round {r}, depth {j}: upstream's draw is not from the all-sibling residual"
                found["all_sibling_moves"] += 1
                found["all_sibling_moves_differ"] += int(not same_token)
            else:
                assert same_token, f"round {r}, depth {j}: candidate 0 differs"
                found["coupled_agree"] += 1
            if j <= x.D - 1:  # siblings: upstream's are further draws from the residual row
                resid = o_["resid"][r, j]
                up_sib = sampled[1:, j]
                assert (resid[up_sib] > 0).all()
                found["siblings"] += 1
                found["siblings_differ"] += int(not torch.equal(up_sib, y["sib"][j - 1]))
    return found


def test_sjd_pac_drafting_matches_upstream_but_for_siblings():
    """SJD-PAC's next window (``PACDrafter``) against upstream's, round after round: ``propose`` lays
    out upstream's tree (node token = candidate[rank, depth]); the q each next candidate 0 reports
    (the stale p at the node on the rank-0 continuation of the accepted path, or on the rank-0 chain
    past the tree) is ours everywhere, and candidate 0 itself (upstream's "adaptive continuation": the
    old draft kept by the stale test, else a draw from Norm([p - q]_+), MC-SJD's maximal coupling) is
    ours token for token, except in the places below.

    Differences by design. (1) The siblings: upstream's are further draws from the coupling's
    residual (``torch.multinomial(res_p, K)``) that it reports as draws from p without replacement;
    ours are drawn from p without candidate 0, so all K candidates are draws without replacement from
    p and each reports its exact conditional (docs/sjd_pac.md, "PD is lossless with the right
    bookkeeping"); with the same uniforms the tokens differ. (2) A draft the stale test rejects at a
    BRANCHING depth is replaced upstream by a draw from the residual after all K siblings there
    (``res_rows = last_siblings``), not after candidate 0 alone: that draw is then not distributed as
    the p it reports (min(q_0, p) + beta Norm(r_K) != p unless r_K is proportional to [p - q_0]_+;
    e.g. V = 2, p = (1/2, 1/2), q_0 = (1, 0), sibling 1 = token 1 with q_1 = (0, 1): r_2 = 0 but for
    upstream's 1e-20 at token 0, so the new draft is token 0 always, reported as p); ours is MC-SJD's
    maximal coupling, distributed as p. (3) Right after a sibling subtree's leaf
    upstream's row has no draft, so it draws from p afresh; ours couples the chain's draft there (both
    distributed as the p they report). (4) Ours also carries the target's sample after the window's
    last draft, as SJD does; upstream drops that distribution and tops the slot up."""
    found = check_pac_drafting(load("sampler_sjd_pac"))
    assert found["rounds"] >= 8 and found["coupled_agree"] >= 10, found
    assert found["siblings_differ"] >= 1 and found["all_sibling_moves_differ"] >= 1 and found["fresh"] >= 1, found


@pytest.mark.parametrize("mutant", [_moves_from_p, _keeps_by_q_over_p], ids=["no_residual", "inverted_ratio"])
def test_sjd_pac_drafting_parity_catches_a_mutated_coupling(monkeypatch, mutant):
    monkeypatch.setattr(drafting, "_maximal_coupling", mutant)
    with pytest.raises(AssertionError):
        check_pac_drafting(load("sampler_sjd_pac"))


# ------------------------------------------------------------------------------------ PJD
def pjd_forwards(fx, rule=None, top_rows="first", keep_above=0.5):
    """Replays every forward of ``sampler_pjd`` into ``pjd_verify_row``, one active row at a time
    (the top row first), with upstream's draws; yields (forward, row index, what upstream did, ours)."""
    V = fx.config["V"]
    rule = rule or ExactRule()
    for f in range(fx.inp["window"].shape[0]):
        rows = fx.inp["rows"][f]
        s = 0
        for k in range(int((rows >= 0).sum())):
            v, keep = int(fx.inp["v"][f, k]), int(fx.inp["keep"][f, k])
            e = s + v
            window = fx.inp["window"][f, s:e]
            p = torch.softmax(fx.inp["logits"][f, s:e], -1)
            torch.testing.assert_close(p, fx.out["p"][f, s:e], atol=fx.tol, rtol=0)
            # carried drafts with the q upstream tests them with; top-ups (upstream's randint ids) one-hot here
            drafts = [(int(window[j]), fx.inp["window_q"][f, s + j] if j <= keep else None) for j in range(1, v)]
            u_accept = torch.stack([fx.inp["rs"][f, s + j, window[j]] for j in range(1, v)]) if v > 1 else torch.zeros(0)
            resid_u = fx.inp["resid_u"][f, s:e]
            top = k == 0 if top_rows == "first" else True
            ours = pjd_verify_row(p, drafts, u_accept, float(resid_u.max()), fx.inp["u_target"][f, s:e], top,
                                  keep_above, rule)
            m = int(fx.out["matched"][f, k])
            theirs = SimpleNamespace(committed=fx.out["next_tokens"][f, s : s + m].tolist(),
                                     drafts=fx.out["next_tokens"][f, s + m : e].tolist(),
                                     q=fx.out["next_scores"][f, s + m : e], keep=keep, window=window,
                                     resid_slot=int(resid_u.argmax()) if float(resid_u.max()) >= 0 else None,
                                     resid_probs=fx.out["resid_probs"][f, s:e])
            yield f, int(rows[k]), theirs, ours
            s = e
    assert V == fx.out["p"].shape[-1]


def check_pjd(fx, **kw) -> dict:
    seen = {"top_resampled": 0, "lower_rejected": 0, "kept_by_half_rule": 0, "carried": 0}
    carried = {}  # (case, row) -> our next drafts, to compare with the next forward's carried drafts
    for f, r, theirs, ours in pjd_forwards(fx, **kw):
        case = int(fx.inp["case"][f])
        assert ours.committed == theirs.committed, (f, r, ours.committed, theirs.committed)
        assert [t for t, _ in ours.drafts] == theirs.drafts, (f, r, ours.drafts, theirs.drafts)
        for (t, q), q_up in zip(ours.drafts, theirs.q):
            qv = q if q is not None else torch.nn.functional.one_hot(torch.tensor(t), q_up.shape[0]).double()
            torch.testing.assert_close(qv, q_up, atol=fx.tol, rtol=0)
        if theirs.resid_slot is not None:  # the top row's correction: the same residual distribution
            assert ours.residual is not None, (f, r)
            torch.testing.assert_close(ours.residual, theirs.resid_probs[theirs.resid_slot], atol=fx.tol, rtol=0)
            seen["top_resampled"] += 1
        else:
            assert ours.residual is None, (f, r)
        prev = carried.get((case, r))
        if prev is not None and theirs.keep:  # the next forward tests the drafts we carried, with their q
            assert [t for t, _ in prev[: theirs.keep]] == theirs.window[1 : 1 + theirs.keep].tolist(), (f, r)
            seen["carried"] += 1
        if r != int(fx.inp["rows"][f, 0]) and len(theirs.committed) < len(theirs.window) - 1:
            seen["lower_rejected"] += 1
        n_acc = len(theirs.committed)
        for j, (t, q) in enumerate(ours.drafts[1:], n_acc + 2):  # drafts after the first rejected slot
            if j < len(theirs.window) and t == int(theirs.window[j]) and q is not None:
                seen["kept_by_half_rule"] += 1
        carried[(case, r)] = ours.drafts
    return seen


def test_pjd_matches_upstream():
    """boyaliao/PJD's SpeculativeSampler over every active row of a forward, and prefix_matching's
    split (docs/methods.md section 8.2): per row, the committed tokens (the top row's accepted drafts
    and its correction from [p - q]_+ or its bonus; a lower row's accepted drafts only), the next
    forward's drafts and their q (the 1/2 rule's kept drafts with their old q), the residual, given
    the same draws, on every forward of 8 images of a 4 x 8 grid."""
    fx = load("sampler_pjd")
    seen = check_pjd(fx)
    # the fixture holds what the rules are about: corrections, lower-row rejections, kept drafts
    assert seen["top_resampled"] >= 20 and seen["lower_rejected"] >= 20, seen
    assert seen["kept_by_half_rule"] >= 3 and seen["carried"] >= 50, seen


@pytest.mark.parametrize("mutant", [{"rule": _NoResidual()}, {"rule": _IgnoreQ()}, {"keep_above": None},
                                    {"top_rows": "all"}],
                         ids=["no_residual", "ignore_q", "no_half_rule", "lower_rows_as_top"])
def test_pjd_parity_catches_a_mutation(mutant):
    with pytest.raises(AssertionError):
        check_pjd(load("sampler_pjd"), **mutant)
