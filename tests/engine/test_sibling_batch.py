"""``verify_tree`` walks every node's children at once (docs/methods.md#13-verification-at-one-tree-depth-d):
each node with children walks its residual chain over its children rank by rank, whether or not the
walk reaches it, the accepted path follows each node's accepted child from the root, and a rule
whose step is the base class's (``Rule.siblings_in_batch``) reads a node's outcome off all its
children after the chain. It must be the walk of the docs, depth by depth and sibling by sibling,
bit for bit: same paths, same emitted tokens, the same emitted distribution to the last bit, the
same choices. The walk of the docs is written out here (``sibling_walk``), and every rule goes
through ``verify_tree`` both as it is and as a copy whose class redefines ``step`` (the base
class's, called), which sends it down the one-by-one branch.

Inputs: small vocabularies with zeros in q (draft tokens q cannot draw and duplicate siblings are
skipped), per-sample depth caps and room, and every registered rule class."""
import pytest
import torch

from coolsd.engine.decoding.lantern import neighbours_from_codebook
from coolsd.engine.decoding.rules import BudgetRule, ExactRule, GroupRule, LanternRule, Rule, ScaledRule
from coolsd.engine.decoding.sampling import normalize, sample_inverse_cdf
from coolsd.engine.decoding.trees import make_tree
from coolsd.engine.decoding.verify import Verdict, verify_tree

V, B = 7, 64
NB = neighbours_from_codebook(torch.randn(V, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
RULES = {
    "exact": lambda: ExactRule(),
    "scaled": lambda: ScaledRule(torch.tensor([3.0, 2.0, 1.5, 1.2, 1.0])),
    "scaled_below_one": lambda: ScaledRule(torch.tensor([0.6, 0.8])),
    "group_sjd": lambda: GroupRule(2, 0.05),
    "group_gstar": lambda: GroupRule(3, None, resample="gstar"),
    "budget_kl": lambda: BudgetRule(0.3),
    "budget_tv": lambda: BudgetRule(0.5, cost="tv"),
    "lantern_gstar": lambda: LanternRule(NB, 2, lam=2.0, resample="gstar"),
    "lantern_own": lambda: LanternRule(NB, 2, lam=2.0),
}


# a node with children beside a leaf sibling, walk nodes of several depths with the same number of
# children, a deep chain under a late sibling
UNEVEN = [[0], [1], [2], [0, 0], [2, 0], [2, 1], [2, 1, 0], [2, 1, 0, 0], [2, 1, 1], [0, 0, 0]]


def sibling_walk(p, q, tokens, tree, rule, u_accept, u_emit, max_depth, emit_allowed_after=None) -> Verdict:
    """docs/methods.md#13-verification-at-one-tree-depth-d as written: depth by depth below the
    accepted prefix, each sample's children of the accepted node in rank order through
    ``rule.step``, the residual advancing past each verified child that is rejected."""
    B, _, V = p.shape
    ar = torch.arange(B)
    node, p_res, D = torch.zeros(B, dtype=torch.long), p[:, 0], tree.max_depth
    searching = max_depth > 0
    chain = D > 0 and tree.max_children == 1
    choices = rule.choose(p[:, :D], q[:, 1 : D + 1]) if rule.chooses and chain else None
    path = []
    for d in range(1, D + 1):
        kids = tree.children[node]  # (B, max_children), -1 where absent
        p_node, open_ = p[ar, node], searching.clone()
        for r in range(tree.max_children):
            c = kids[:, r].clamp(min=0)
            x, qj = tokens[ar, c], q[ar, c]
            verified = (kids[:, r] >= 0) & (qj[ar, x] > 0)
            live = open_ & verified
            if not rule.chooses:
                f, residual = rule.step(p_res, qj, x, d)
            else:
                f, residual = rule.step(p_res, qj, x, d, choices[:, d - 1] if chain else rule.choose(p_res, qj))
            acc = live & (u_accept[ar, c] < f)
            p_res = torch.where((live ^ acc).unsqueeze(-1), normalize(residual, p_node), p_res)
            open_ = open_ ^ acc
            node = torch.where(acc, c, node)
        found = searching ^ open_
        p_res = torch.where(found.unsqueeze(-1), p[ar, node], p_res)
        path.append(torch.where(found, node, -1))
        searching = found & (max_depth > d)
    path = torch.stack(path, 1) if D else torch.empty(B, 0, dtype=torch.long)
    n_acc = (path >= 0).sum(1)
    emitted = sample_inverse_cdf(p_res, u_emit)
    if emit_allowed_after is not None:
        emitted = torch.where(n_acc < emit_allowed_after, emitted, -1)
    return Verdict(path, n_acc, emitted, p_res, choices)


def _walked(rule: Rule) -> Rule:
    """``rule`` with a class whose ``step`` is its own definition (the base class's, called): the
    sibling-by-sibling walk."""
    cls = type(rule)
    own = type("Walked" + cls.__name__, (cls,), {"step": lambda self, *a, **k: cls.step(self, *a, **k)})
    out = object.__new__(own)
    out.__dict__.update(rule.__dict__)
    return out


def _round(tree_name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    tree = make_tree(tree_name, draft_length=4) if tree_name == "chain" else \
        make_tree(UNEVEN) if tree_name == "uneven" else make_tree(tree_name)
    n1 = tree.n_nodes + 1
    p = torch.rand(B, n1, V, generator=g, dtype=torch.float64) ** 3
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(B, n1, V, generator=g, dtype=torch.float64) * (torch.rand(B, n1, V, generator=g) > 0.3)
    q[..., 0] += 1e-3  # every row has mass
    q = q / q.sum(-1, keepdim=True)
    tokens = torch.randint(0, V, (B, n1), generator=g)
    u_accept = torch.rand(B, n1, generator=g, dtype=torch.float64)
    u_emit = torch.rand(B, generator=g, dtype=torch.float64)
    max_depth = torch.randint(0, tree.max_depth + 1, (B,), generator=g)
    room = torch.randint(1, tree.max_depth + 2, (B,), generator=g)
    return p, q, tokens, tree, u_accept, u_emit, max_depth, room


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "naive_extend_57", "chain", "uneven"])
@pytest.mark.parametrize("name", list(RULES))
def test_every_node_walked_at_once_is_the_sibling_walk_bit_for_bit(name, tree_name):
    accepted = 0
    for seed in range(3):
        p, q, tokens, tree, u_accept, u_emit, max_depth, room = _round(tree_name, seed)
        ref = sibling_walk(p, q, tokens, tree, RULES[name](), u_accept, u_emit, max_depth, emit_allowed_after=room)
        rules = [RULES[name]()]
        if rules[0].siblings_in_batch:
            rules.append(_walked(RULES[name]()))
            assert not rules[1].siblings_in_batch
        for rule in rules:
            got = verify_tree(p, q, tokens, tree, rule, u_accept, u_emit, max_depth, emit_allowed_after=room)
            assert torch.equal(got.path, ref.path), (seed, got.path, ref.path)
            assert torch.equal(got.n_accepted, ref.n_accepted) and torch.equal(got.emitted, ref.emitted)
            assert torch.equal(got.emit_probs, ref.emit_probs)
            assert (got.choices is None) == (ref.choices is None)
            assert got.choices is None or torch.equal(got.choices, ref.choices)
        accepted += int(ref.n_accepted.sum())
    assert accepted > 0  # the inputs reach past the first sibling


def test_a_rule_with_its_own_step_is_walked_sibling_by_sibling():
    assert not LanternRule(NB, 2, lam=2.0).siblings_in_batch  # its residual depends on the draft
    assert LanternRule(NB, 2, lam=2.0, resample="gstar").siblings_in_batch


def test_rules_that_ignore_their_depth_verify_all_nodes_in_one_call(monkeypatch):
    """``Rule.reads_depth``: an exact rule is asked once for every node's rows; a subclass with
    its own numerator (which may read the depth) once per depth; ScaledRule's rows take each
    row's omega_d in one pass, bit for bit its per-depth products."""
    calls = []
    base = Rule.accepted

    def counted(self, p_res, q, depth):
        calls.append(depth)
        return base(self, p_res, q, depth)

    monkeypatch.setattr(Rule, "accepted", counted)

    class OwnNumerator(ExactRule):
        def numerator(self, p_res, depth):
            return p_res

    p, q, tokens, tree, u_accept, u_emit, max_depth, room = _round("mc_sim_7b_63", 0)
    exact = verify_tree(p, q, tokens, tree, ExactRule(), u_accept, u_emit, max_depth)
    assert len(calls) == tree.max_children  # one call a rank
    calls.clear()
    own = verify_tree(p, q, tokens, tree, OwnNumerator(), u_accept, u_emit, max_depth)
    runs = [(r, d) for r, c in enumerate(tree.walk_rank_counts) for d in _runs(tree.walk_depths[:c])]
    assert len(calls) == len(runs) > tree.max_children  # one call a run of equal depths, rank by rank
    assert torch.equal(own.emit_probs, exact.emit_probs) and torch.equal(own.path, exact.path)
    rule = ScaledRule(torch.tensor([3.0, 2.0, 1.5, 1.2, 1.0]))
    rows = p.transpose(0, 1)[tree.walk_nodes].float()
    qr = q.transpose(0, 1)[tree.walk_children[: rows.shape[0]]].float()
    one = rule.accepted_rows(rows, qr, tree.walk_depths)
    by_depth = torch.stack([rule.accepted(rows[e], qr[e], d) for e, d in enumerate(tree.walk_depths)])
    assert torch.equal(one, by_depth)


def _runs(depths):
    return [d for i, d in enumerate(depths) if i == 0 or depths[i - 1] != d]


class _OwnSchedule(ScaledRule):
    """A ScaledRule whose schedule is its own ``weight``: verified with it, not with ``omega``."""

    def weight(self, depth):
        return 1.0 + 0.5 * depth


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "chain"])
def test_a_scaled_rule_with_its_own_weight_is_verified_with_it(tree_name):
    for seed in range(3):
        p, q, tokens, tree, u_accept, u_emit, max_depth, room = _round(tree_name, seed)
        rule = _OwnSchedule(torch.ones(5))
        got = verify_tree(p, q, tokens, tree, rule, u_accept, u_emit, max_depth, emit_allowed_after=room)
        ref = sibling_walk(p, q, tokens, tree, rule, u_accept, u_emit, max_depth, emit_allowed_after=room)
        assert torch.equal(got.path, ref.path) and torch.equal(got.emit_probs, ref.emit_probs)
