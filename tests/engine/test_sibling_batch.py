"""``verify_tree`` verifies a depth's siblings in one pass for every rule whose step is the base
class's (``Rule.siblings_in_batch``): the residual chain the siblings would walk if each were
rejected is computed first, and the depth's outcome read off all siblings at once
(docs/methods.md#13-verification-at-one-tree-depth-d). It must be the sibling-by-sibling walk bit
for bit: same paths, same emitted tokens, the same emitted distribution to the last bit. Each rule
is compared with a copy of itself whose class redefines ``step`` as the base class's, which sends
``verify_tree`` down the sibling-by-sibling walk.

Inputs: small vocabularies with zeros in q (draft tokens q cannot draw and duplicate siblings are
skipped), per-sample depth caps and room, and every registered rule class."""
import pytest
import torch

from coolsd.engine.decoding.lantern import neighbours_from_codebook
from coolsd.engine.decoding.rules import BudgetRule, ExactRule, GroupRule, LanternRule, Rule, ScaledRule
from coolsd.engine.decoding.trees import make_tree
from coolsd.engine.decoding.verify import verify_tree

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
}


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
    tree = make_tree(tree_name, draft_length=4) if tree_name == "chain" else make_tree(tree_name)
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


@pytest.mark.parametrize("tree_name", ["mc_sim_7b_63", "naive_extend_57", "chain"])
@pytest.mark.parametrize("name", list(RULES))
def test_a_depth_verified_in_one_pass_is_the_sibling_walk_bit_for_bit(name, tree_name):
    rule = RULES[name]()
    assert rule.siblings_in_batch and not _walked(rule).siblings_in_batch
    accepted = 0
    for seed in range(3):
        p, q, tokens, tree, u_accept, u_emit, max_depth, room = _round(tree_name, seed)
        one = verify_tree(p, q, tokens, tree, rule, u_accept, u_emit, max_depth, emit_allowed_after=room)
        walk = verify_tree(p, q, tokens, tree, _walked(rule), u_accept, u_emit, max_depth, emit_allowed_after=room)
        assert torch.equal(one.path, walk.path), (seed, one.path, walk.path)
        assert torch.equal(one.n_accepted, walk.n_accepted) and torch.equal(one.emitted, walk.emitted)
        assert torch.equal(one.emit_probs, walk.emit_probs)
        accepted += int(one.n_accepted.sum())
    assert accepted > 0  # the inputs reach past the first sibling


def test_a_rule_with_its_own_step_is_walked_sibling_by_sibling():
    assert not LanternRule(NB, 2, lam=2.0).siblings_in_batch  # its residual depends on the draft
    assert LanternRule(NB, 2, lam=2.0, resample="gstar").siblings_in_batch
