"""Method registry: every fact about a method in one entry (lm-evaluation-harness style
``@register_method(..., higher_is_better=...)``): its builder, the families it runs in, its
parameters with their types and valid values (``Param``; checked once, by ``check_params``, before
any model loads), whether it is lossless, and which drafter runs it (a kind of
``coolsd.engine.drafting.DRAFTERS``: ``model``, ``jacobi``, ``pac`` or ``none``). Everything else that
asks about methods (the config check, the drafter factory, the lab, the reports, the benchmarks)
reads this registry (``METHODS``, a ``coolsd.util.registry.Registry``); nothing keeps its own list
of method names.

Families: a ``discrete`` builder (token targets, ``coolsd.engine.loop``) returns (acceptance rule,
tree or None: the configured tree), wrapped into a ``Method``; a ``continuous`` builder (diffusion-
head targets, ``coolsd.engine.continuous.generate``) returns its own method object. A world of another
family refuses a method, listing the methods it runs. Every method names its baseline
(``baseline()``: the target alone, sampled as the method samples), which the job runs beside it.

Builders take their parameters as keyword arguments; the same names are ``method.<name>`` in a job
config and the keywords of ``coolsd.theory.exact_stats(..., **params)``. The ``Param``s are the one
place a parameter's default, type, range and doc live: a job config's ``method`` node is generated
from them (``config_node``, stored in Hydra's ConfigStore as ``method/<name>`` by
``coolsd.job.config_schema.register_schemas``), so a method has no yaml of its own. A method defined
outside the package registers the same way (docs/add_method.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

import torch

from coolsd.engine.decoding.rules import Rule
from coolsd.engine.decoding.trees import EMPTY_TREE, Tree, make_tree
from coolsd.engine import rows  # noqa: F401  (registers the row-parallel drafter kinds)
from coolsd.engine.drafting import DRAFTERS
from coolsd.util.registry import Registry, origin_of


@dataclass
class BuildContext:
    """What a builder may need beyond its own parameters."""

    tree: Tree  # the drafted tree (chain for the theory lab)
    neighbours: Optional[torch.Tensor] = None  # (V, V-1) LANTERN neighbourhoods
    vocab_size: Optional[int] = None
    family: str = "discrete"


FAMILIES = ("discrete", "continuous")


@dataclass(frozen=True)
class Param:
    """One method parameter: its default and what values are valid. ``kind``: ``int``, ``float``
    (any finite real; ints accepted), ``str`` or ``bool``; ``low`` / ``high`` bounds (``low_open`` /
    ``high_open``: strict); ``choices``: the valid values; ``nullable``: None allowed (and then
    means what the builder says); ``families``: the families the parameter applies to (None: all
    of the method's); in another family it must keep its default and is left out of the resolved
    parameters (``check_method``), so records there do not change."""

    default: Any
    kind: type = float
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Optional[tuple] = None
    nullable: bool = False
    families: Optional[tuple] = None
    doc: str = ""

    def problem(self, value) -> Optional[str]:
        """Why ``value`` is invalid, as "must be ..." / "valid: ..." (None: it is valid)."""
        if value is None and self.nullable:
            return None
        if self.choices is not None:
            return None if value in self.choices else "valid: " + ", ".join(
                "null" if c is None else str(c) for c in self.choices + ((None,) if self.nullable else ()))
        if value is None:
            return f"must be {self._what()} (not null)"
        if self.kind is bool:
            return None if isinstance(value, bool) else "must be true or false"
        if self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, self.kind)
        if ok and self.low is not None:
            ok = value > self.low if self.low_open else value >= self.low
        if ok and self.high is not None:
            ok = value < self.high if self.high_open else value <= self.high
        return None if ok else f"must be {self._what()}"

    def _what(self) -> str:
        what = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(self.kind, str(self.kind))
        lo = "" if self.low is None else f" {'>' if self.low_open else '>='} {self.low!r}"
        hi = "" if self.high is None else f" {'<' if self.high_open else '<='} {self.high!r}"
        return what + lo + (" and" if lo and hi else "") + hi + (" or null" if self.nullable else "")


@dataclass(frozen=True)
class MethodInfo:
    """Every fact about a registered method."""

    name: str
    builder: Callable
    families: tuple[str, ...]
    params: dict  # name -> Param
    lossless: Union[bool, Callable[[dict], bool]]  # or a function of the resolved parameters
    drafter: Optional[str]  # the drafter kind (discrete methods)
    checks: tuple = ()  # functions of the resolved parameters that raise ValueError (cross-parameter rules)
    doc: str = ""
    # functions (params, cfg, world_cls) raising ValueError for a job setting the method cannot run
    # with (``coolsd.job.config_schema.check_config`` calls them, before the parameters' own check)
    config_checks: tuple = ()

    @property
    def jacobi(self) -> bool:
        """Drafts from the target itself, a window of its own earlier samples (SJD's family): its
        ``window`` follows the draft length where a caller sets only that (a fact of its drafter
        kind, ``coolsd.engine.drafting.DRAFTERS``)."""
        return self._drafter_fact("jacobi")

    @property
    def row_parallel(self) -> bool:
        """Decodes several image rows a forward (ZipAR, PJD: ``coolsd.engine.rows``): runs only on targets
        whose forward sees by position (``World.row_parallel``), eagerly (a fact of its drafter kind)."""
        return self._drafter_fact("row_parallel")

    def _drafter_fact(self, fact: str) -> bool:
        return self.drafter is not None and bool(DRAFTERS.entry(self.drafter).facts.get(fact))

    def is_lossless(self, params: Optional[dict] = None) -> bool:
        """Whether the method samples the target's distribution exactly with these parameters."""
        if callable(self.lossless):
            return bool(self.lossless({**self.defaults(), **(params or {})}))
        return bool(self.lossless)

    def defaults(self) -> dict:
        return {k: p.default for k, p in self.params.items()}

    @property
    def builtin(self) -> bool:
        """Defined in the package (not registered from outside it: ``coolsd.engine.plugins``, a test)."""
        return self.builder.__module__.startswith("coolsd.")


@dataclass
class Method:
    """A discrete method: what ``coolsd.engine.loop.speculative_generate`` runs."""

    name: str
    rule: Optional[Rule]
    drafter: str  # the drafter kind: "model" (a tree drafted by a model), "jacobi", "pac" (SJD's family) or "none"
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


# name -> MethodInfo (``coolsd.util.registry``: origin, duplicates refused, listing); facts: families,
# drafter kind, lossless (a bool or a function of the parameters)
METHODS = Registry("method", base=MethodInfo)


def register_method(name: str, families: Sequence[str] = ("discrete",), *, lossless: Union[bool, Callable] = False,
                    drafter: Optional[str] = "model", params: Optional[dict] = None, checks: Sequence[Callable] = (),
                    config_checks: Sequence[Callable] = ()):
    """Register a method's builder with its facts (the module docstring). ``params``: name ->
    ``Param`` (or a plain default: any value of its type), in the builder's keyword order (the
    order of its config node); ``checks``: functions of the resolved parameters raising ValueError
    for combinations no single ``Param`` can refuse; ``config_checks``: functions ``(params, cfg,
    world_cls)`` raising ValueError (its message the config check's one line) for a job setting
    the method cannot run with (batch-invariance, compilation, the target's grid). ``drafter``: the
    drafter kind for discrete methods (None: continuous only)."""
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"method {name!r}: unknown famil(ies) {sorted(unknown)}; valid: {', '.join(FAMILIES)}")

    def deco(fn):
        spec = {k: v if isinstance(v, Param) else Param(v, kind=type(v) if v is not None else object, nullable=v is None)
                for k, v in (params or {}).items()}
        kind = drafter if "discrete" in families else None
        info = MethodInfo(name, fn, tuple(families), spec, lossless, kind, tuple(checks), (fn.__doc__ or "").strip(),
                          tuple(config_checks))
        METHODS.add(name, info, origin=origin_of(fn), families=tuple(families), drafter=kind, lossless=lossless)
        return fn

    return deco


def method_names(family: Optional[str] = None) -> list[str]:
    """Every registered method, or those of one family."""
    return METHODS.names() if family is None else METHODS.names(families=lambda f: family in f)


def method_info(name: str) -> MethodInfo:
    """The registry entry of ``name`` (a ValueError listing the valid names if there is none)."""
    return METHODS.get(name)


def method_families(name: str) -> tuple[str, ...]:
    return method_info(name).families


def method_params(name: str) -> dict:
    """The declared parameters of a method and their defaults."""
    return method_info(name).defaults()


def config_node(name: str) -> dict:
    """The job config's ``method`` node of ``method=<name>``: its name, then every parameter at its
    default, in the ``Param``s' order (``register_schemas`` stores it as ``method/<name>``)."""
    return {"name": name, **method_params(name)}


def check_method(name: str, family: str, params) -> dict:
    """The method's name and family, and its parameters' names and values (``check_params``), with
    nothing built: the check before any model loads. Returns the resolved parameters, less those
    that apply to other families only (``Param.families``; set in this family: a ``ParamError``)."""
    info = method_info(name)
    if family not in info.families:
        raise ValueError(f"method={name} does not run on {family} targets (it runs on {', '.join(info.families)} "
                         f"ones); methods for {family} targets: "
                         f"{', '.join(n for n in method_names(family) if not n.startswith('_'))}")
    resolved = check_params(name, params)
    for k, p in info.params.items():
        if p.families is not None and family not in p.families:
            if resolved[k] != p.default:
                raise ParamError(name, k, resolved[k], f"applies to {' and '.join(p.families)} targets only")
            del resolved[k]
    return resolved


class ParamError(ValueError):
    """A method parameter's value is invalid: ``method``, ``name``, ``value`` and ``why`` ("must
    be ..." or "valid: ..."), for callers that word the error their own way (the config check)."""

    def __init__(self, method: str, name: str, value, why: str):
        self.method, self.name, self.value, self.why = method, name, value, why
        if why.startswith("valid:"):
            super().__init__(f"unknown {name} {value!r}; {why} (method {method})")
        else:
            super().__init__(f"{method} {name} {why}, got {value!r}")


def check_params(name: str, params) -> dict:
    """Every parameter of method ``name`` checked against its ``Param`` and the method's
    cross-parameter checks: the one place method parameters are validated (a ``ParamError``
    naming the parameter, its value and what is valid). Returns the resolved parameters
    (defaults filled in)."""
    info = method_info(name)
    unknown = sorted(set(params) - set(info.params))
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; its parameters: {sorted(info.params)}")
    resolved = {**info.defaults(), **params}
    for k, v in resolved.items():
        why = info.params[k].problem(v)
        if why is not None:
            raise ParamError(name, k, v, why)
    for check in info.checks:
        check(resolved)
    return resolved


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
    """Validate parameters (``check_method``) and build a method of ``family`` (a ``Method`` for
    discrete targets). Errors name the bad value and the valid ones."""
    info = method_info(name)
    resolved = check_method(name, family, params)
    if draft_length is not None:
        if isinstance(draft_length, bool) or int(draft_length) != draft_length or draft_length < 1:
            raise ValueError(f"draft length must be an integer >= 1, got {draft_length!r}")
    tree_error = None
    try:
        t = tree if isinstance(tree, Tree) else make_tree(tree, draft_length)
    except ValueError as e:  # fatal only for methods that draft with the configured tree
        t, tree_error = EMPTY_TREE, e
    ctx = BuildContext(tree=t, neighbours=neighbours, vocab_size=vocab_size, family=family)
    built = info.builder(ctx, **resolved)
    if family != "discrete":  # a family's own method object (continuous methods)
        return built
    rule, t2 = built
    if t2 is None and tree_error is not None:
        raise tree_error
    return Method(name, rule, info.drafter, t2 if t2 is not None else t, resolved)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)
