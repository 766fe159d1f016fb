"""``python run.py --list methods|targets|drafters|trees|metrics|protocols``: what can be chosen,
printed from the registries themselves (``coolsd.util.registry``), entries from ``--include`` files
included: each method with its families, drafter kind, whether it is lossless, and every parameter
with its default, type and valid values; each target with its family and where it is defined; each
drafter kind with its facts; each named tree with its size; each metric with who computes it, its
direction, the inputs it reads and the prompt sets it scores; each evaluation protocol with what it
fixes. Nothing here keeps a list of names."""
from __future__ import annotations

import sys
from typing import Optional

from coolsd.engine import plugins
from coolsd.engine.decoding.trees import TREE_NAMES, make_tree
from coolsd.engine.drafting import DRAFTERS
from coolsd.engine.methods import METHODS, method_info
from coolsd.metrics.registry import METRICS, PROTOCOLS, InputSpec
from coolsd.util.errors import ConfigError
from coolsd.worlds import TARGETS

KINDS = ("methods", "targets", "drafters", "trees", "metrics", "protocols")


def _methods() -> list[str]:
    lines = []
    for name in METHODS.names():
        if name.startswith("_"):
            continue  # internal entries (tests' negative controls)
        info, entry = method_info(name), METHODS.entry(name)
        lossless = info.lossless if isinstance(info.lossless, bool) else "depends on its parameters"
        kind = f", drafter {info.drafter}" if info.drafter else ""
        lines.append(f"{name}  ({'/'.join(info.families)}{kind}; lossless: {lossless}; {entry.origin})")
        if entry.doc:
            lines.append(f"    {entry.doc}")
        for key, p in info.params.items():
            what = p.problem(object())  # "must be ..." / "valid: ...": the valid values in words
            what = what.removeprefix("must be ") if what else "any value"
            doc = f"  {p.doc}" if p.doc else ""
            lines.append(f"    method.{key}={_value(p.default)}   ({what}){doc}")
    return lines


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _targets() -> list[str]:
    lines = []
    for name in TARGETS.names():
        e = TARGETS.entry(name)
        lines.append(f"{name}  ({e.facts.get('family')}; {e.obj.__name__}, {e.origin})")
        if e.doc:
            lines.append(f"    {e.doc}")
        if e.obj.prompt_rules():
            lines.append(f"    prompts: {e.obj.prompt_rules()}")
    return lines


def _drafters() -> list[str]:
    lines = []
    for name in DRAFTERS.names():
        e = DRAFTERS.entry(name)
        facts = [k for k, v in e.facts.items() if v]
        lines.append(f"{name}  ({', '.join(facts) + '; ' if facts else ''}{e.origin})")
    return lines


def _trees() -> list[str]:
    lines = []
    for name in TREE_NAMES:
        if name == "chain":
            lines.append("chain  (tree.draft_length tokens in a row; the default)")
            continue
        t = make_tree(name)
        lines.append(f"{name}  ({t.n_nodes} drafted nodes, depth {t.max_depth})")
    return lines


def _metrics() -> list[str]:
    lines = []
    for name in METRICS.names():
        m, e = METRICS.get(name), METRICS.entry(name)
        better = "higher" if m.higher_is_better else "lower"
        stands = f"; stands in for {m.stands_for}, is not it" if m.stands_for else ""
        lines.append(f"{name}  (computed by {m.computed_by}; {better} is better{stands}; {e.origin})")
        if m.doc:
            lines.append(f"    {m.doc}")
        if m.computed_by == "evaluate":
            flags = [i.flag if isinstance(i, InputSpec) else f"{i} (per protocol)" for i in m.inputs]
            lines.append(f"    python -m coolsd.cli.evaluate RUN --metrics {name}   (inputs: {', '.join(flags) or 'none'}; "
                         f"prompt sets: {', '.join(m.prompt_sets)})")
    return lines


def _protocols() -> list[str]:
    lines = []
    for name in PROTOCOLS.names():
        p, e = PROTOCOLS.get(name), PROTOCOLS.entry(name)
        lines.append(f"{name}  (prompt sets: {', '.join(p.prompt_sets)}; {e.origin})")
        lines.append(f"    {p.doc}")
        lines += [f"    {k}: {v}" for k, v in p.description.items()]
        lines += [f"    {flag}: {s.name} [${s.env}]" for flag, s in p.inputs.items()]
    return lines


def listing(kind: str) -> str:
    """The listing of ``kind`` (one of ``KINDS``), a ConfigError naming the valid kinds else."""
    fn = {"methods": _methods, "targets": _targets, "drafters": _drafters, "trees": _trees, "metrics": _metrics,
          "protocols": _protocols}.get(kind)
    if fn is None:
        raise ConfigError(f"--list {kind}: valid: {', '.join(KINDS)}")
    return "\n".join(fn())


def list_from_argv(argv: list[str]) -> Optional[int]:
    """``--list KIND`` / ``--list=KIND`` in ``argv``: print the listing and return the exit status
    (0, or 2 with one line for an unknown kind); None when there is no ``--list``."""
    for i, a in enumerate(argv):
        if a == "--list" or a.startswith("--list="):
            kind = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                plugins.load()  # the --include files (already in COOLSD_INCLUDE) register first
                print(listing(kind))
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            return 0
    return None
