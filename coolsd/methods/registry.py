"""Method registry: a method is a small builder that turns its Hydra parameters into what the
generation loop of its family runs (lm-evaluation-harness style ``@register_method``).

Families: ``discrete`` methods (token targets, ``coolsd.generate``) return (acceptance rule,
drafter kind, tree or None), wrapped into a ``Method``; ``continuous`` methods (diffusion-head
targets, ``coolsd.continuous.generate``) return their own method object. A method declares the
families it runs in; a world of another family refuses it, listing the methods it runs. Every
method names its baseline (``baseline()``: the target alone, sampled as the method samples),
which the job runs beside it for the speed-up.

Builders declare their parameters as keyword arguments with defaults; the same names appear
in ``conf/method/<name>.yaml`` and in ``coolsd.theory.exact_stats(..., **params)``.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Optional

import torch

from coolsd.decoding.rules import Rule
from coolsd.decoding.trees import EMPTY_TREE, Tree, make_tree


@dataclass
class BuildContext:
    """What a builder may need beyond its own parameters."""

    tree: Tree  # the drafted tree (chain for the theory lab)
    neighbours: Optional[torch.Tensor] = None  # (V, V-1) LANTERN neighbourhoods
    vocab_size: Optional[int] = None
    family: str = "discrete"


FAMILIES = ("discrete", "continuous")


@dataclass
class Method:
    """A discrete method: what ``coolsd.generate.speculative_generate`` runs."""

    name: str
    rule: Optional[Rule]
    drafter: str  # "model" (tree drafted by a model), "jacobi" (SJD) or "none" (plain AR)
    tree: Tree
    params: dict = field(default_factory=dict)  # resolved parameters, recorded with every run
    family: ClassVar[str] = "discrete"

    def describe(self) -> dict:
        d = {"method": self.name, "drafter": self.drafter, "tree": self.tree.name, **self.params}
        if self.rule is not None:
            d.update(self.rule.describe())
        return d

    def baseline(self) -> "Method":
        """Plain AR on the same target with the same warpers (the speed-up reference)."""
        return build_method("ar")


_REGISTRY: dict[str, Callable] = {}
_FAMILIES: dict[str, tuple[str, ...]] = {}


def register_method(name: str, families: tuple[str, ...] = ("discrete",)):
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"method {name!r}: unknown famil(ies) {sorted(unknown)}; valid: {', '.join(FAMILIES)}")

    def deco(fn):
        if name in _REGISTRY:
            raise ValueError(f"method {name!r} registered twice")
        _REGISTRY[name] = fn
        _FAMILIES[name] = tuple(families)
        return fn

    return deco


def method_names(family: Optional[str] = None) -> list[str]:
    """Every registered method, or those of one family."""
    return sorted(n for n in _REGISTRY if family is None or family in _FAMILIES[n])


def method_families(name: str) -> tuple[str, ...]:
    _get(name)
    return _FAMILIES[name]


def method_params(name: str) -> dict:
    """The declared parameters of a method and their defaults."""
    sig = inspect.signature(_get(name))
    return {k: v.default for k, v in list(sig.parameters.items())[1:]}


def _get(name: str) -> Callable:
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; valid names: {', '.join(method_names())}")
    return _REGISTRY[name]


def check_method(name: str, family: str, params) -> dict:
    """The method's name, family and parameter names (no values, nothing built: a check before
    any model loads). Returns the declared parameters and their defaults."""
    _get(name)
    if family not in _FAMILIES[name]:
        raise ValueError(f"method={name} does not run on {family} targets (it runs on {', '.join(_FAMILIES[name])} "
                         f"ones); methods for {family} targets: "
                         f"{', '.join(n for n in method_names(family) if not n.startswith('_'))}")
    declared = method_params(name)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; its parameters: {sorted(declared)}")
    return declared


def build_method(
    name: str,
    *,
    family: str = "discrete",
    tree: str | list | Tree | None = "chain",
    draft_length: Optional[int] = None,
    neighbours: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    **params,
):
    """Validate parameters and build a method of ``family`` (a ``Method`` for discrete targets).
    Errors name the bad value and the valid ones."""
    fn = _get(name)
    declared = check_method(name, family, params)
    if draft_length is not None:
        if isinstance(draft_length, bool) or int(draft_length) != draft_length or draft_length < 1:
            raise ValueError(f"draft length must be an integer >= 1, got {draft_length!r}")
    tree_error = None
    try:
        t = tree if isinstance(tree, Tree) else make_tree(tree, draft_length)
    except ValueError as e:  # fatal only for methods that draft with the configured tree
        t, tree_error = EMPTY_TREE, e
    resolved = {**declared, **params}
    ctx = BuildContext(tree=t, neighbours=neighbours, vocab_size=vocab_size, family=family)
    built = fn(ctx, **resolved)
    if not isinstance(built, tuple):  # a family's own method object (continuous methods)
        return built
    rule, drafter, t2 = built
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
