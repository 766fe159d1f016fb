"""Metrics and evaluation protocols as registered entries (``coolsd.util.registry``), each with
every fact about it in one place, in the manner of lm-evaluation-harness's
``register_metric(..., higher_is_better=, aggregation=)``.

A metric (``MetricInfo``) says who computes it (``computed_by``: ``evaluate`` from a finished run's
images and captions, ``world`` a toy world's own quality numbers, ``loop`` the loop's exact
per-token signals), whether higher is better, how a table heads and formats it, the domain of its
confidence interval, whether the comparison page plots it against speed (``pareto``), the field's
metric it stands in for (``stands_for``: ``toy_clip`` for ``clip_score``; a toy metric is never that
metric), and, for ``evaluate``, the inputs it reads (``InputSpec``: a flag, its environment variable
and where the file comes from; or the name of a flag the protocol defines), the prompt sets it can
score and its builder (``build(ctx)`` -> a ``Scorer``).

A protocol (``Protocol``) is one paper family's way of computing the shared metrics (the FID
recipe, the CLIP variant and its weights, the prompts), with its inputs and a description of each
metric it fixes; every number ``evaluate`` writes names its protocol.

Everything that asks about a metric or a protocol (evaluate, download, the run's summary, the
printed columns, the reports, the page and its plots, W&B) reads these registries; nothing keeps a
list of their names (``tests/metrics/test_metric_registry.py`` scans for such lists). The package's
own entries register when their module is imported (every module of ``coolsd.metrics`` is imported
on the first lookup); one from outside the package registers when its file is included
(``--include PATH``, docs/add_metric.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from coolsd.util.registry import Registry, origin_of
from coolsd.util.stats import DOMAINS, REAL, mean_ci

COMPUTED_BY = ("evaluate", "world", "loop")


@dataclass(frozen=True)
class InputSpec:
    """One input file or folder an ``evaluate`` metric reads, set by ``flag`` (``--clip``) or its
    environment variable ``env``; ``name``: what an error calls it; ``source``: where the right
    file comes from; ``folder`` / ``contains``: a folder holding these names (a tuple entry: any one
    of them); ``fetch``: the glob patterns a hub folder is downloaded with; ``hub``: its default
    hub id (``hf://org/repo[/file]``: read from the local hub cache, never downloaded at run time);
    ``optional``: not set means a documented default (``--ir-python``: this interpreter); ``default``:
    the value where neither the flag nor the variable is set, and there is no ``hub`` id (a local
    default path, as the torch hub cache of the Inception weights)."""

    flag: str
    help: str
    name: str
    source: str
    env: Optional[str] = None
    folder: bool = False
    contains: tuple = ()
    fetch: tuple = ()
    hub: Optional[str] = None
    optional: bool = False
    default: Optional[Callable[[], Any]] = None  # the value where neither flag nor variable is set, if not ``hub``

    @property
    def dest(self) -> str:
        """The argparse destination of ``flag``."""
        return self.flag.lstrip("-").replace("-", "_")

    def resolve(self, value):
        """``value``, or where it is None the ``default`` (None where there is none)."""
        return value if value is not None or self.default is None else self.default()


@dataclass
class EvalContext:
    """What a metric's builder gets: the protocol, every input's value by ``InputSpec.dest`` (local
    paths: hub ids are resolved to the cache before building), the device the networks run on,
    the cache folder (FID's reference statistics) and the bootstrap resamples of set metrics."""

    protocol: "Protocol"
    inputs: Mapping[str, Any]
    device: str = "cpu"
    cache_dir: Path = Path("outputs/cache")
    fid_resamples: int = 100


class Scorer:
    """What ``evaluate`` runs for one metric of one protocol. ``pixels``: True, ``score`` is called
    on chunks of decoded RGB images (uint8 (H, W, 3) arrays) with their captions; False, once per
    method tag on the image files. ``score`` returns one row per image (a score, or features);
    ``summarize`` turns a tag's rows into its summary entry and per-sample values (None: none).
    ``protocol``: the protocol whose recipe this scorer computes (None: the same under every one);
    evaluate refuses to label its number with another."""

    pixels: bool = True
    protocol: Optional[str] = None

    def score(self, images_or_paths: Sequence, captions: Sequence[str]) -> np.ndarray:
        raise NotImplementedError

    def summarize(self, values: np.ndarray) -> tuple[Optional[dict], Optional[list]]:
        """Default: the mean with its 95% interval over images (``coolsd.util.stats.mean_ci``), and
        every image's score."""
        return mean_ci(values), values.tolist()


@dataclass(frozen=True)
class MetricInfo:
    """Every fact about one metric (the module docstring)."""

    name: str
    higher_is_better: bool
    computed_by: str
    doc: str = ""
    label: str = ""  # a table's header (default: the name)
    digits: int = 4  # decimals a table prints
    domain: tuple = (REAL, 0.0)  # (coolsd.util.stats domain, lower bound) of a per-image mean's interval
    noise: Optional[float] = None  # how far outside its domain float rounding may put a value (None: stats.FLOAT_NOISE)
    pareto: bool = False  # the comparison page plots it against accepted length and speed-up
    stands_for: Optional[str] = None  # the field's metric whose place this one takes in a paper's table
    inputs: tuple = ()  # evaluate: InputSpec, or the flag of an input the protocol defines
    prompt_sets: tuple = ("coco", "parti")  # evaluate: the prompt sets it can score
    build: Optional[Callable[[EvalContext], Scorer]] = None  # evaluate: the scorer under a protocol
    optional: bool = False  # an optional extra (its own environment): a report computes it only where its first input is set

    def __post_init__(self):
        if self.computed_by not in COMPUTED_BY:
            raise ValueError(f"metric {self.name!r}: computed_by must be one of {', '.join(COMPUTED_BY)}, "
                             f"got {self.computed_by!r}")
        if self.computed_by == "evaluate" and self.build is None:
            raise ValueError(f"metric {self.name!r}: a metric evaluate computes needs build(ctx) -> Scorer")
        if self.domain[0] not in DOMAINS:
            raise ValueError(f"metric {self.name!r}: domain must be one of {DOMAINS}, got {self.domain[0]!r}")

    @property
    def header(self) -> str:
        return self.label or self.name

    def fmt(self, v: float) -> str:
        return f"{v:.{self.digits}f}"


@dataclass(frozen=True)
class Protocol:
    """One evaluation protocol: ``inputs`` it defines (by flag), ``description`` of what it fixes per
    metric (and ``prompts``), ``fid_recipe`` (a key of ``coolsd.metrics.inception.FID_RECIPES``),
    ``clip`` (the CLIP scorer class, with ``from_pretrained``), ``prompt_sets`` it is defined on."""

    name: str
    doc: str
    inputs: Mapping[str, InputSpec]
    description: Mapping[str, str]
    fid_recipe: str
    clip: Any
    prompt_sets: tuple = ("coco",)


METRICS = Registry("metric", base=MetricInfo, discover="coolsd.metrics")
PROTOCOLS = Registry("protocol", base=Protocol, discover="coolsd.metrics")


def _add(name: str, build: Optional[Callable], origin: str, higher_is_better: bool, computed_by: str,
         facts: dict) -> MetricInfo:
    doc = facts.pop("doc", "") or ((build.__doc__ or "").strip().split("\n")[0] if build is not None else "")
    info = MetricInfo(name, higher_is_better, computed_by, doc=doc, build=build, **facts)
    return METRICS.add(name, info, origin=origin, computed_by=computed_by, higher_is_better=higher_is_better,
                       pareto=info.pareto, stands_for=info.stands_for)


def register_metric(name: str, *, higher_is_better: bool, **facts):
    """``@register_metric("name", higher_is_better=..., label=..., inputs=..., ...)`` on the builder
    ``build(ctx: EvalContext) -> Scorer`` of a metric ``evaluate`` computes from a run's images; the
    facts are ``MetricInfo``'s fields. The builder's docstring (first line) describes the metric."""

    def deco(build: Callable) -> Callable:
        _add(name, build, origin_of(build), higher_is_better, "evaluate", dict(facts))
        return build

    return deco


def declare_metric(name: str, *, higher_is_better: bool, computed_by: str, doc: str, **facts) -> MetricInfo:
    """Register a metric computed elsewhere (``computed_by``: ``world``, a toy world's quality numbers;
    ``loop``, the loop's per-token signals) with its facts, so every report reads them here."""
    return _add(name, None, origin_of(None, depth=2), higher_is_better, computed_by, {**facts, "doc": doc})


def register_protocol(protocol: Protocol) -> Protocol:
    """Register an evaluation protocol under its name."""
    return PROTOCOLS.add(protocol.name, protocol, origin=origin_of(None, depth=2), prompt_sets=protocol.prompt_sets)


def metric(name: str) -> MetricInfo:
    """The registered metric ``name`` (a ValueError naming the closest one if unknown)."""
    return METRICS.get(name)


def known_metric(name: str) -> Optional[MetricInfo]:
    """The registered metric ``name``, or None where ``name`` is no metric (a speed number, a
    difference to AR)."""
    return METRICS.get(name) if name in METRICS else None


def lower_is_better(name: str) -> Optional[bool]:
    """Whether a reported number is better lower (None: not a registered metric)."""
    m = known_metric(name)
    return None if m is None else not m.higher_is_better


def evaluate_metrics() -> list[str]:
    """The metrics ``python -m coolsd.cli.evaluate`` computes from a run's images."""
    return METRICS.names(computed_by="evaluate")


def analogues(computed_by: str = "world") -> dict[str, str]:
    """{the field's metric: the metric computed by ``computed_by`` that stands in for it}
    (``toy_clip`` for ``clip_score``): the columns of a paper's table a toy world fills."""
    return {METRICS.get(n).stands_for: n for n in METRICS.names(computed_by=computed_by)
            if METRICS.get(n).stands_for}


def protocol_inputs(protocol: Protocol, info: MetricInfo) -> list[InputSpec]:
    """The inputs ``info`` reads under ``protocol``: its own specs and the protocol's for the flags
    it names."""
    out = []
    for i in info.inputs:
        if isinstance(i, InputSpec):
            out.append(i)
        elif i in protocol.inputs:
            out.append(protocol.inputs[i])
        else:
            raise ValueError(f"metric {info.name!r} reads {i}, which protocol {protocol.name!r} does not define "
                             f"(it defines {', '.join(protocol.inputs) or 'no input'})")
    return out


def every_input_spec() -> dict[str, list[InputSpec]]:
    """flag -> every spec of it over the registered metrics and protocols (a flag's environment
    variable and file may differ between protocols)."""
    out: dict[str, list[InputSpec]] = {}
    for p in PROTOCOLS.names():
        for spec in PROTOCOLS.get(p).inputs.values():
            out.setdefault(spec.flag, []).append(spec)
    for n in evaluate_metrics():
        for i in METRICS.get(n).inputs:
            if isinstance(i, InputSpec) and i not in out.get(i.flag, []):
                out.setdefault(i.flag, []).append(i)
    return out


