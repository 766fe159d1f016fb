"""Fetch the Hugging Face hub files a target, its drafter and the metrics need into the local hub
cache, where runs read them (``hf://org/repo/path`` values, ``coolsd.util.hub``):

    python -m coolsd.cli.download target=llamagen_xl [draft=self] [metrics=clip_score,fid] [protocol=sjd] [--dry-run]

(The command is ``coolsd.cli.download``: every module of the package sits in a layer's folder, and
command lines are the apps layer's.) ``target=`` and any other Hydra override compose the job
config exactly as ``python run.py`` would; the files are the target world's own ``needs(cfg)``
(the list the up-front check of a run reads, not a second list), and ``metrics=`` adds the
inputs of ``python -m coolsd.cli.evaluate --metrics ...`` under ``protocol=`` (lantern, sjd).
A hub folder is fetched with its ``Need.fetch`` patterns only (one weight format), a file alone.

``--dry-run`` prints each file with its size where the hub API says (offline, ``HF_HUB_OFFLINE``,
or no network: sizes unknown, not an error) and downloads nothing. Inputs that are not hub ids
(a local path, or a file whose only source is not the hub: MAR's checkpoints, Inception's
weights, COCO) are listed with their source and left alone. The cache is ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``; downloading needs the network, and is refused while ``HF_HUB_OFFLINE`` is set.
"""
from __future__ import annotations

import argparse
import sys
from argparse import Namespace
from typing import Optional

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from coolsd.cli.evaluate import fill_defaults, input_flags, input_needs
from coolsd.cli.runner import compose, one_line_errors
from coolsd.metrics.protocols import check_protocol
from coolsd.metrics.registry import evaluate_metrics
from coolsd.util import hub
from coolsd.util.errors import ConfigError, InputError
from coolsd.worlds import world_class
from coolsd.worlds.files import Need


def split_args(argv) -> tuple[list[str], list[str], str, bool]:
    """(Hydra overrides, metrics, protocol, dry run) of the command line."""
    ap = argparse.ArgumentParser(prog="python -m coolsd.cli.download", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the files and their sizes; download nothing")
    ap.add_argument("overrides", nargs="*", help="target=<name> and Hydra overrides; metrics=a,b; protocol=lantern|sjd")
    a = ap.parse_args(argv)
    overrides, metrics, protocol = [], [], "lantern"
    for o in a.overrides:
        key, _, value = o.partition("=")
        if key == "metrics":
            metrics = [m.strip() for m in value.split(",") if m.strip()]
        elif key == "protocol":
            protocol = value
        else:
            overrides.append(o)
    valid = evaluate_metrics()
    unknown = sorted(set(metrics) - set(valid))
    if unknown:
        raise ConfigError(f"metrics: unknown metric(s) {unknown}; valid: {', '.join(valid)}")
    if not metrics and not any(o.startswith("target=") for o in overrides):
        raise ConfigError("nothing to fetch: give target=<name> (and draft=..., Hydra overrides) and/or metrics=a,b")
    return overrides, metrics, check_protocol(protocol), a.dry_run


def needs(overrides: list[str], metrics: list[str], protocol: str = "lantern") -> list[Need]:
    """The ``Need`` of every input of the composed target and drafter (``World.needs``) and of the metrics."""
    out: list[Need] = []
    if any(o.startswith("target=") for o in overrides):
        try:
            cfg = compose(*overrides)
        except (HydraException, OmegaConfBaseException) as e:  # an unknown config or key: Hydra's first line
            raise ConfigError(f"{' '.join(overrides)}: {str(e).strip().splitlines()[0]}") from None
        out += world_class(cfg.target.name).needs(cfg)
    if metrics:
        a = Namespace(run=None, protocol=protocol, **{f[2:].replace("-", "_"): None for f in input_flags()})
        fill_defaults(a)
        out += [n for n in input_needs(a, metrics) if n.key.startswith("--")]
    return out


class Item:
    """One hub input of the plan: its ``Need``, hub file, whether it is one file, and (a folder)
    the patterns it is fetched with; ``files``: {path in the repo: bytes or None}, or None (unknown)."""

    def __init__(self, need: Need, listing: Optional[dict]):
        self.need, self.ref = need, need.hub_file()
        self.file = hub.is_file(self.ref, need.folder, listing)
        self.patterns = [] if self.file else hub.folder_patterns(self.ref, need.fetch or need.contains, listing)
        if listing is None:
            self.files = None
        elif self.file:
            self.files = {self.ref.path: listing[self.ref.path]} if self.ref.path in listing else {}
        else:
            self.files = hub.selected(listing, self.patterns)

    def describe(self) -> list[str]:
        head = f"{self.need.name} ({self.need.key}): {self.ref}"
        if self.files is None:
            spec = self.need.fetch or self.need.contains
            what = self.ref.path if self.file else ", ".join(" or ".join(e) if isinstance(e, tuple) else e for e in spec)
            why = "offline (HF_HUB_OFFLINE)" if hub.offline() else "hub not reachable"
            return [f"{head}  [{what}; sizes unknown: {why}]"]
        if not self.files:
            return [f"{head}  [not found in the repo: {self.ref.path if self.file else ', '.join(self.patterns)}]"]
        sizes = [b for b in self.files.values() if b is not None]
        total = _size(sum(sizes)) if len(sizes) == len(self.files) else "size unknown"
        return [f"{head}  [{len(self.files)} file{'s' * (len(self.files) != 1)}, {total}]",
                *(f"    {f}  {_size(b)}" for f, b in sorted(self.files.items()))]


def _size(b: Optional[int]) -> str:
    if b is None:
        return "size unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if b < 1000 or unit == "GB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1000
    return f"{b:.2f} GB"


def plan(all_needs: list[Need]) -> tuple[list[Item], list[Need]]:
    """(the hub inputs, each once; the inputs that are not hub ids)."""
    items, others, seen, listings = [], [], set(), {}
    for n in all_needs:
        if not hub.is_hub(n.path):
            others.append(n)
            continue
        ref = n.hub_file()  # a malformed id: ValueError, reported by main as one line
        if str(ref) in seen:
            continue
        seen.add(str(ref))
        key = (ref.repo, ref.revision)
        if key not in listings:
            listings[key] = hub.listing(ref)
        items.append(Item(n, listings[key]))
    return items, others


def main(argv=None) -> int:
    overrides, metrics, protocol, dry_run = split_args(sys.argv[1:] if argv is None else argv)
    try:
        items, others = plan(needs(overrides, metrics, protocol))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(f"Hugging Face cache: {hub.cache_dir()}")
    for item in items:
        print("\n".join(item.describe()))
    for n in others:
        where = f"set to {n.path}" if n.path not in (None, "", "null") else "not set"
        print(f"{n.name} ({n.key}): {where}; not fetched from the hub -- {n.source}")
    if dry_run or not items:
        return 0
    if hub.offline():
        raise InputError(f"HF_HUB_OFFLINE is set: unset it to download (or --dry-run to list the files); "
                         f"cache {hub.cache_dir()}")
    for item in items:
        print(f"fetching {item.ref} ...", flush=True)
        try:
            path = hub.fetch(item.ref, item.file, item.patterns)
        except Exception as e:  # the network, a gated repo, a wrong name: what the hub said, in one line
            raise InputError(f"{item.need.name}: could not fetch {item.ref}: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
        print(f"  -> {path}")
    return 0


if __name__ == "__main__":
    with one_line_errors():
        raise SystemExit(main())
