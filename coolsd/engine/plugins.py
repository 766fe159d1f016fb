"""Methods (and drafters) defined outside the package, lm-evaluation-harness ``--include_path``
style: ``python run.py --include PATH method=<yours>`` (or ``COOLSD_INCLUDE=PATH``, several joined
by ``os.pathsep``). PATH is a Python file or a folder of them; each is imported once (its
``@register_method`` / ``@register_drafter`` / ``@register_metric`` calls and world subclasses
register what it defines; a method's config node is generated from its parameters, so
``method=<name>`` composes), and the folder's ``conf/`` (for a file, the ``conf/`` beside it), where
there is one, joins Hydra's config search path (a target's ``target/<name>.yaml``, presets). The Hydra plugin
(``hydra_plugins.coolsd_experiments``) loads them on every Hydra start, in the launching process
and in every job process (the variable is inherited), before any config is checked. In Python
(the lab, a notebook) ``load([PATH])`` or a plain import does the same. docs/add_method.md.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from coolsd.util.errors import ConfigError

ENV = "COOLSD_INCLUDE"
_LOADED: dict = {}  # resolved file -> module


class PluginError(ConfigError):
    """A file named by ``--include`` / ``COOLSD_INCLUDE`` raised while being imported."""


def plugin_failure(e: Exception, path: Path) -> str:
    """'<file>:<line> raised <Exception>: <message>' (the deepest line of ``path`` in the traceback;
    the message's whitespace collapsed and cut)."""
    import traceback

    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    where = f"{path}:{lines[-1]}" if lines else str(path)
    why = " ".join(str(e).split())
    return f"{where} raised {type(e).__name__}" + (f": {why[:200]}" if why else "")


def include_paths() -> list[Path]:
    """The paths ``COOLSD_INCLUDE`` names (empty entries ignored)."""
    return [Path(p).expanduser() for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]


def _files(path: Path) -> list[Path]:
    if not path.exists():
        raise ConfigError(f"{ENV} / --include: {path} does not exist; name a Python file or a folder of them")
    if path.is_file():
        if path.suffix != ".py":
            raise ConfigError(f"{ENV} / --include: {path} is not a Python file (.py) or a folder")
        return [path]
    return sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))


def conf_dir(path: Path) -> Optional[Path]:
    """The config folder a path brings: ``conf/`` inside a folder, or beside a file (None: none)."""
    d = (path if path.is_dir() else path.parent) / "conf"
    return d if d.is_dir() else None


def load(paths: Optional[Sequence] = None) -> list[Path]:
    """Import every Python file of ``paths`` (default: ``COOLSD_INCLUDE``'s) once; returns the
    config folders they bring. A file that raises while importing is a ``PluginError`` naming the
    file, the line and the exception (one line; its traceback chained)."""
    paths = include_paths() if paths is None else [Path(p).expanduser() for p in paths]
    confs = []
    for path in paths:
        for f in _files(path):
            key = f.resolve()
            if key not in _LOADED:
                name = f"coolsd_include_{f.stem}_{hashlib.sha1(str(key).encode()).hexdigest()[:8]}"
                spec = importlib.util.spec_from_file_location(name, key)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                _LOADED[key] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException as e:
                    del _LOADED[key], sys.modules[name]
                    if isinstance(e, Exception):  # the plugin's own error: one line (its traceback is chained)
                        raise PluginError(f"{ENV} / --include: {plugin_failure(e, key)}; fix it, or run with "
                                          "COOLSD_VERBOSE=1 for its traceback") from e
                    raise
        c = conf_dir(path)
        if c is not None:
            confs.append(c.resolve())
    return confs


def include_from_argv(argv: list[str]) -> list[str]:
    """``argv`` without its ``--include PATH`` / ``--include=PATH`` options, whose paths are added
    to ``COOLSD_INCLUDE`` (so Hydra's plugin and every job process load them)."""
    rest, extra = [], []
    it = iter(argv)
    for a in it:
        if a == "--include":
            p = next(it, None)
            if p is None:
                raise SystemExit("error: --include needs a path (a Python file or a folder of them)")
            extra.append(p)
        elif a.startswith("--include="):
            extra.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    for p in extra:
        if not Path(p).expanduser().exists():
            raise SystemExit(f"error: --include {p}: no such file or folder; name a Python file or a folder of them")
    if extra:
        have = [p for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]
        os.environ[ENV] = os.pathsep.join(have + [str(Path(p).expanduser().resolve()) for p in extra])
    return rest
