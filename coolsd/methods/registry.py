"""Method registry: a method is a small builder that turns its Hydra parameters into an
acceptance rule and a drafter kind (lm-evaluation-harness style ``@register_method``).

Builders declare their parameters as keyword arguments with defaults; the same names appear
in ``conf/method/<name>.yaml`` and in ``coolsd.theory.exact_stats(..., **params)``.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from coolsd.decoding.rules import Rule
from coolsd.decoding.trees import EMPTY_TREE, Tree, make_tree


@dataclass
class BuildContext:
    """What a builder may need beyond its own parameters."""

    tree: Tree  # the drafted tree (chain for the theory lab)
    neighbours: Optional[torch.Tensor] = None  # (V, V-1) LANTERN neighbourhoods
    vocab_size: Optional[int] = None


@dataclass
class Method:
    name: str
    rule: Optional[Rule]
    drafter: str  # "model" (tree drafted by a model), "jacobi" (SJD) or "none" (plain AR)
    tree: Tree
    params: dict = field(default_factory=dict)  # resolved parameters, recorded with every run

    def describe(self) -> dict:
        d = {"method": self.name, "drafter": self.drafter, "tree": self.tree.name, **self.params}
        if self.rule is not None:
            d.update(self.rule.describe())
        return d


_REGISTRY: dict[str, Callable] = {}


def register_method(name: str):
    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} registered twice")
        _REGISTRY[name] = fn
        return fn

    return deco


def method_names() -> list[str]:
    return sorted(_REGISTRY)


def method_params(name: str) -> dict:
    """The declared parameters of a method and their defaults."""
    sig = inspect.signature(_get(name))
    return {k: v.default for k, v in list(sig.parameters.items())[1:]}


def _get(name: str) -> Callable:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; valid names: {', '.join(method_names())}")
    return _REGISTRY[name]


def build_method(
    name: str,
    *,
    tree: str | list | Tree | None = "chain",
    draft_length: Optional[int] = None,
    neighbours: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    **params,
) -> Method:
    """Validate parameters and build a method. Errors name the bad value and the valid ones."""
    fn = _get(name)
    declared = method_params(name)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise ValueError(
            f"method {name!r} has no parameter(s) {unknown}; its parameters: {sorted(declared)}"
        )
    if draft_length is not None:
        if isinstance(draft_length, bool) or int(draft_length) != draft_length or draft_length < 1:
            raise ValueError(f"draft length must be an integer >= 1, got {draft_length!r}")
    tree_error = None
    try:
        t = tree if isinstance(tree, Tree) else make_tree(tree, draft_length)
    except ValueError as e:  # fatal only for methods that draft with the configured tree
        t, tree_error = EMPTY_TREE, e
    resolved = {**declared, **params}
    ctx = BuildContext(tree=t, neighbours=neighbours, vocab_size=vocab_size)
    rule, drafter, t2 = fn(ctx, **resolved)
    if t2 is None and tree_error is not None:
        raise tree_error
    return Method(name, rule, drafter, t2 if t2 is not None else t, resolved)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def require_finite(name: str, value, *, low=None, low_inclusive=True, high=None) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    ok = math.isfinite(v)
    if ok and low is not None:
        ok = v >= low if low_inclusive else v > low
    if ok and high is not None:
        ok = v <= high
    if not ok:
        lo = "" if low is None else (f" >= {low}" if low_inclusive else f" > {low}")
        hi = "" if high is None else f" <= {high}"
        both = " and" if lo and hi else ""
        raise ValueError(f"{name} must be a finite number{lo}{both}{hi}, got {value!r}")
    return v
