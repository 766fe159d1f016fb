"""One generic registry behind every extension point (methods, drafter kinds, targets, metrics,
evaluation protocols), in the manner of lm-evaluation-harness's ``api/registry.py``: an entry is
registered once under its name with the facts that describe it, and everything that asks about
an extension point reads its registry; nothing keeps its own list of the names.

A registry:

* records where each entry was registered (``Entry.origin``, ``file:line`` of the object's
  definition, or of the call that registered it), so that a clash names both places;
* refuses a name registered twice from two places (the same definition registered again, as when
  a module is imported a second time under another name, replaces itself silently);
* refuses an entry that is not of its ``base`` class (a class registry: a subclass; an instance
  registry: an instance), or, for a registry of callables, one that is not callable;
* lists (``names``, with facts to filter on) and describes (``describe``: origin, docstring's
  first line, facts) its entries, and refuses an unknown name with the closest registered one.

The registries themselves live beside what they hold (``coolsd.engine.methods.registry.METHODS``,
``coolsd.engine.drafting.DRAFTERS``, ``coolsd.worlds.base.TARGETS``, ``coolsd.metrics``'s); this
module knows none of them.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding coolsd/


@dataclass(frozen=True)
class Entry:
    """One registered extension: its name, the object (a class, a function or an instance), where
    it was registered and the facts it was registered with."""

    name: str
    obj: Any
    origin: str  # file:line (relative to the checkout where it lies inside it)
    facts: Mapping = field(default_factory=dict)

    @property
    def builtin(self) -> bool:
        """Registered from the package (not from outside it: ``--include``, a test)."""
        return self.origin.startswith("coolsd/")

    @property
    def doc(self) -> str:
        """The first line of the object's ``doc`` (an entry object that carries its builder's
        docstring, ``MethodInfo``) or docstring ('' if none)."""
        if isinstance(getattr(self.obj, "doc", None), str):
            d = self.obj.doc
        elif inspect.isclass(self.obj):
            d = self.obj.__dict__.get("__doc__")  # its own, not a base class's
        else:
            d = getattr(self.obj, "__doc__", None) if callable(self.obj) else None
        d = inspect.cleandoc(d) if d else ""
        return d.splitlines()[0] if d else ""


def _where(path: Optional[str], line: Optional[int]) -> str:
    if not path:
        return "<unknown>"
    p = Path(path)
    try:
        p = p.resolve().relative_to(_PACKAGE_ROOT)
    except ValueError:
        pass
    return f"{p}:{line}" if line else str(p)


def origin_of(obj: Any, depth: int = 2) -> str:
    """Where ``obj`` was defined (a class or function: its source file and first line), else where
    the registering call was made (``depth`` frames above this one)."""
    target = obj.fget if isinstance(obj, property) else obj
    if inspect.isclass(target) or inspect.isfunction(target) or inspect.ismethod(target):
        try:
            _, line = inspect.getsourcelines(target)
            return _where(inspect.getsourcefile(target), line)
        except (OSError, TypeError):
            pass
    frame = sys._getframe(depth)
    return _where(frame.f_code.co_filename, frame.f_lineno)


class Registry:
    """Name -> ``Entry`` for one kind of extension (the module docstring).

    ``kind``: the word the messages use ("method", "target", ...). ``base``: the class every entry
    must be (an instance of, or with ``classes=True`` a subclass of); None: any callable (with
    ``callables=True``) or any object. ``discover``: a package (dotted name) whose modules register
    their entries on import; every module of it is imported once, before the first lookup (the
    package's own providers; entries from outside the package register when their file is
    included, ``coolsd.engine.plugins``).
    """

    def __init__(self, kind: str, *, base: Optional[type] = None, classes: bool = False, callables: bool = False,
                 discover: Optional[str] = None):
        self.kind, self.base, self.classes, self.callables = kind, base, classes, callables
        self._discover, self._discovered = discover, discover is None
        self._entries: dict[str, Entry] = {}

    # -- registering -------------------------------------------------------------------------------
    def _check_type(self, name: str, obj: Any) -> None:
        if self.base is not None:
            ok = inspect.isclass(obj) and issubclass(obj, self.base) if self.classes else isinstance(obj, self.base)
            if not ok:
                what = f"a subclass of {self.base.__qualname__}" if self.classes else f"a {self.base.__qualname__}"
                raise TypeError(f"{self.kind} {name!r}: {obj!r} is not {what}")
        elif self.callables and not callable(obj):
            raise TypeError(f"{self.kind} {name!r}: {obj!r} is not callable")

    def add(self, name: str, obj: Any, *, origin: Optional[str] = None, **facts) -> Any:
        """Register ``obj`` under ``name`` with ``facts``; returns ``obj``. A name registered from
        another place is refused, naming both."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names are non-empty strings, got {name!r}")
        self._check_type(name, obj)
        origin = origin or origin_of(obj, depth=2)
        old = self._entries.get(name)
        if old is not None and old.origin != origin:
            raise ValueError(f"{self.kind} {name!r} is registered twice: at {old.origin} and at {origin}")
        self._entries[name] = Entry(name, obj, origin, MappingProxyType(dict(facts)))
        return obj

    def register(self, name: str, **facts) -> Callable[[Any], Any]:
        """Decorator form of ``add``: ``@REGISTRY.register("name", fact=...)``."""

        def deco(obj):
            return self.add(name, obj, origin=origin_of(obj, depth=2), **facts)

        return deco

    # -- reading -----------------------------------------------------------------------------------
    def _all(self) -> dict[str, Entry]:
        if not self._discovered:
            self._discovered = True
            package = importlib.import_module(self._discover)
            for m in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{self._discover}.{m.name}")
        return self._entries

    def __contains__(self, name) -> bool:
        return name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._all())

    def names(self, **facts) -> list[str]:
        """Every registered name, sorted; with ``facts``, those whose facts have these values (a
        callable value: a test of the fact's value)."""
        out = []
        for n, e in self._all().items():
            if all((v(e.facts.get(k)) if callable(v) else e.facts.get(k) == v) for k, v in facts.items()):
                out.append(n)
        return sorted(out)

    def unknown(self, name, valid: Optional[list] = None) -> str:
        """'unknown <kind> <name> (did you mean <closest>?); valid: a, b, c'."""
        valid = self.names() if valid is None else valid
        close = difflib.get_close_matches(str(name), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.kind} {name!r}{hint}; valid: {', '.join(valid)}"

    def entry(self, name: str) -> Entry:
        """The entry of ``name`` (a ValueError naming the closest registered name if none)."""
        entries = self._all()
        if name not in entries:
            raise ValueError(self.unknown(name))
        return entries[name]

    def get(self, name: str) -> Any:
        """The registered object of ``name``."""
        return self.entry(name).obj

    def items(self) -> list[tuple[str, Any]]:
        return [(n, self._all()[n].obj) for n in self.names()]

    def describe(self, name: str) -> dict:
        """Name, origin, the first line of its docstring and its facts: what a listing prints."""
        e = self.entry(name)
        return {"name": e.name, "origin": e.origin, "doc": e.doc, **dict(e.facts)}
