"""Every tensor a method's drafter, rule or tree holds lives on the target's device: each
registered discrete method is built for a target on another device (``meta``: no memory, no
kernels), moved and begun the way the loop does it (``Tree.on``, ``Rule.on``, the drafter's
``begin`` under ``torch.device``); any tensor left on the CPU fails. (On a GPU such a tensor is an indexing error or a host-to-device copy every round.)"""
import dataclasses

import pytest
import torch

from coolsd.engine.decoding.trees import make_tree
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.methods import build_method
from coolsd.engine.methods.registry import method_names
from coolsd.engine.model_protocol import StepOut

V, B, DEV = 32, 2, torch.device("meta")


class _MetaModel:
    """The draft model's side of the protocol; its own state is the model's (on its device)."""

    vocab_size = V
    device = DEV

    def begin(self, cond, batch_size, context=None):
        return None


def _tensors(obj, path="", depth=0, seen=None):
    """(path, tensor) for every tensor reachable from ``obj`` through attributes, containers and
    dataclass fields (a few levels deep; modules' parameters are their own business)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4 or isinstance(obj, torch.nn.Module):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]", depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", depth + 1, seen)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from _tensors(v, f"{path}.{k}", depth + 1, seen)


def _on_cpu(obj) -> list[str]:
    return [f"{p} {tuple(t.shape)}" for p, t in _tensors(obj) if t.device.type == "cpu"]


def _neighbours() -> torch.Tensor:
    cb = torch.randn(V, 4, generator=torch.Generator().manual_seed(0))
    return torch.cdist(cb, cb).argsort(-1)[:, 1:]  # built where the codebook is, as worlds build them


@pytest.mark.parametrize("name", [n for n in method_names("discrete") if not n.startswith("_")])
def test_drafter_rule_and_tree_of_every_method_follow_the_target_device(name):
    method = build_method(name, tree="chain", draft_length=4, neighbours=_neighbours(), vocab_size=V)
    drafter = build_drafter(method, _MetaModel(), SamplingConfig(), V, grid_width=4)
    tree, rule = method.tree.on(DEV), None if method.rule is None else method.rule.on(DEV)  # as the loop does
    with torch.device(DEV):
        first = torch.zeros(B, dtype=torch.long)
        if drafter is not None and hasattr(drafter, "begin"):  # a row-parallel schedule (zipar) has no state to begin
            drafter.begin(None, B, first, StepOut(logits=torch.zeros(B, 1, V), hidden=None))
    left = [f"drafter{p}" for p in _on_cpu(drafter)] + [f"rule{p}" for p in _on_cpu(rule)]
    left += [f"tree{p}" for p in _on_cpu(tree)]
    assert not left, f"{name}: tensors left on the CPU: {left}"


def test_the_check_sees_a_tensor_left_on_the_cpu():
    """The walker finds nested CPU tensors (a negative control for the test above)."""
    tree = make_tree("chain", 4).on(DEV)

    class Holder:
        def __init__(self):
            self.table = {"follow": [torch.zeros(3)]}
            self.ok = torch.zeros(3, device=DEV)

    assert _on_cpu(Holder()) == [".table['follow'][0] (3,)"]
    assert _on_cpu(tree) == []
