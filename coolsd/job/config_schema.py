"""The job config's schema and its range checks: nothing silently wrong.

Two layers, both before any model loads:

* **types, at compose time**: Hydra structured configs (dataclasses registered in Hydra's
  ConfigStore by ``register_schemas``, which the ``hydra_plugins.coolsd_schema`` plugin calls on
  every Hydra start): the top level (``coolsd_schema``, first in conf/config.yaml's defaults),
  ``dataset``, ``sampling``, ``tree``, ``shard`` and every ``target`` (a base schema with the common
  fields in ``coolsd.worlds.schema``, one subclass per kind of target beside its world's code;
  each conf/<group>/<name>.yaml names its schema first in its defaults). Every registered method's
  ``method`` node is generated from its ``Param``s (``coolsd.engine.methods.config_node``) and stored
  as ``method/<name>``: the one place its defaults live; conf/method/ holds no yaml of a registered
  method's name (Hydra would merge it over the node, its deprecated "automatic schema matching").
  ``sampling.top_k=abc`` fails
  while composing, naming the key. The schemas are *open* (struct flag off) so that ``+key=value``
  composes (tests point targets at tiny configs with ``+target.vq_config=...``); they type the keys
  they declare, and ``check_known_settings`` refuses every key they do not declare, naming the
  closest valid one, before any other check.
* **settings that apply**: a setting the run would not use is refused, never dropped
  (``check_settings_apply``: a tree for a method that drafts without one, ``tree.draft_length`` of a
  fixed tree, a draft model for a method that uses none; a toy target has no ``target.device``).
* **ranges, in one place**: ``check_config(cfg, world_cls, out_dir)`` raises a ``ConfigError``
  naming the key, the value and the valid range (finite numbers, ``n_prompts`` within the prompt
  pool, ``seed >= 0``, ``threads >= 1``, ``batch_size >= 1``, ``tree.draft_length`` within the
  target's image tokens, a CUDA device that exists, an output folder that can be written, ...).
  Method parameters are checked against the method registry's declarations (names, types,
  ranges, choices: ``coolsd.engine.methods.check_params``, the one place they are validated).

Invariant: a config that ``check_config`` accepts composes, its values are in range, and its run
folder can be created; a refused one has written nothing (``coolsd.cli.runner.CheckBeforeRun`` runs the
check before Hydra creates the run folder).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from coolsd.engine.methods import ParamError, check_method, config_node, method_info, method_names
from coolsd.engine.methods.cspd import refuse_flow_head_params
from coolsd.job.shards import Shard
from coolsd.prompts import load_prompt_file, prompt_pool
from coolsd.util.errors import ConfigError
from coolsd.worlds import target_schemas, world_class, world_names
from coolsd.worlds.files import DTYPES, require_files
from coolsd.worlds.schema import SamplingSchema


# ------------------------------------------------------------------------------ the schemas
@dataclass
class ShardSchema:
    index: int = 0
    count: int = 1


@dataclass
class DeterministicSchema:
    batch_invariant: bool = False


@dataclass
class DatasetSchema:
    name: str = MISSING
    n_prompts: int = MISSING
    offset: int = 0


@dataclass
class CocoDatasetSchema(DatasetSchema):
    captions: Optional[str] = None
    images: Optional[str] = None
    cache_dir: str = "outputs/cache"


@dataclass
class PromptsDatasetSchema(DatasetSchema):
    """``dataset=prompts``: a prompt file (``coolsd.prompts.files``); ``n_prompts`` null = all of it."""

    n_prompts: Optional[int] = None
    path: Optional[str] = None
    column: Optional[str] = None


@dataclass
class TreeSchema:
    name: str = MISSING
    draft_length: Optional[int] = None


@dataclass
class ConfigSchema:
    """The top level (conf/config.yaml). Groups a registry validates (method, draft, logger) stay
    untyped here."""

    target: Any = MISSING
    out_dir: Optional[str] = None  # +out_dir=<folder>: the run folder instead of hydra.run.dir (scripts, tests)
    draft: Any = None
    method: Any = MISSING
    tree: Any = MISSING
    dataset: Any = MISSING
    logger: Any = None
    seed: int = 0
    baseline: bool = True
    fastest_ar: Any = "auto"  # auto | true | false (``check_fastest_ar``)
    threads: int = 1
    batch_size: int = 1
    compile: bool = False
    quality_signals: bool = True
    deterministic: DeterministicSchema = field(default_factory=DeterministicSchema)
    shard: ShardSchema = field(default_factory=ShardSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)


# (group, name) -> schema: conf/<group>/<file>.yaml lists ``- <name>`` first in its defaults
SCHEMAS = {
    (None, "coolsd_schema"): ConfigSchema,
    ("dataset", "dataset_schema"): DatasetSchema,
    ("dataset", "coco_dataset_schema"): CocoDatasetSchema,
    ("dataset", "prompts_dataset_schema"): PromptsDatasetSchema,
    ("tree", "tree_schema"): TreeSchema,
}


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (open: ``+key=value`` may add keys): the job's
    own, each registered world's target schema (``World.schema``, beside the world's code) and
    each registered method's config node (``method/<name>``, from its ``Param``s: untyped, the
    registry checks its values). Called again once included files have registered theirs."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    targets = {("target", name): schema for name, schema in target_schemas().items()}
    for (group, name), schema in {**SCHEMAS, **targets}.items():
        node = OmegaConf.structured(schema)
        OmegaConf.set_struct(node, False)
        cs.store(group=group, name=name, node=node)
    for name in method_names():
        cs.store(group="method", name=name, node=OmegaConf.create(config_node(name)))


# ------------------------------------------------------------------------------ unknown and unused settings
def unknown_settings(node, prefix: str = "", kind=None) -> list[tuple[str, list[str]]]:
    """(full key, the keys its schema declares there) for every key of ``node`` and its typed
    sub-nodes that the node's schema does not declare (``OmegaConf.get_type``: the dataclass
    registered for its group, ``register_schemas``). The schemas are open so that ``+key=value``
    composes; this is where an undeclared key is refused, whichever way it came in. Untyped nodes
    (``method``: the method registry checks its parameters; ``draft``; mappings such as
    ``target.files``) accept any key; their typed sub-nodes do not. ``kind``: the node's schema where
    the node lost it (a job config is a ``ConfigSchema``, also as a masked copy without ``hydra``)."""
    kind = kind or OmegaConf.get_type(node)
    names = [f.name for f in dataclasses.fields(kind)] if dataclasses.is_dataclass(kind) else None
    out = []
    for key in node.keys():
        if names is not None and key not in names:
            out.append((prefix + str(key), names))
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            out.extend(unknown_settings(child, f"{prefix}{key}."))
    return out


def check_known_settings(cfg) -> None:
    """Refuse the first key no schema declares, naming the closest valid one (``unknown_settings``)."""
    unknown = unknown_settings(cfg, kind=ConfigSchema)
    if not unknown:
        return
    key, names = unknown[0]
    group, _, leaf = key.rpartition(".")
    named = _get(cfg, f"{group}.name") if group else None  # a group's choice: target=toy, tree=chain
    where = f"{group}={named}" if isinstance(named, str) else (group or "the top level")
    if key == "target.device":
        raise ConfigError(f"target={cfg.target.name} runs on the CPU only: it has no target.device setting; "
                          f"drop target.device={_get(cfg, key)}")
    close = difflib.get_close_matches(leaf, names, n=1, cutoff=0.6)
    fix = f"did you mean {group + '.' if group else ''}{close[0]}?" if close else f"its settings: {', '.join(names)}"
    raise ConfigError(f"{key} is not a setting of {where}: {fix}")


def explicit_keys(overrides) -> set[str]:
    """The config keys and groups a command line sets (Hydra's override grammar: ``tree=chain``,
    ``+tree.x=1``, ``~draft`` all name their key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(overrides))}


def task_overrides() -> list[str]:
    """The running Hydra job's command-line overrides (empty outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def check_settings_apply(cfg, world_cls, overrides) -> None:
    """A setting the run would not use is refused, never dropped: the tree (``tree=``,
    ``tree.*``) of a method that does not draft with it (AR, SJD's family, row-parallel and
    continuous methods), the drafter (``draft=``, ``draft.*``) of a method that drafts with none,
    ``tree.draft_length`` of a fixed tree. ``overrides``: the command line's (a config file may
    set both for every method of a sweep; only what the user typed is refused)."""
    length = _get(cfg, "tree.draft_length")
    if length is not None and cfg.tree.name != "chain":
        raise ConfigError(f"tree.draft_length={length} does not apply to tree={cfg.tree.name}, a fixed tree: "
                          f"set tree=chain tree.draft_length={length}, or drop tree.draft_length")
    keys = explicit_keys(overrides)
    if not keys:
        return
    name, _ = method_from_cfg(cfg)
    info = _known_method(name)
    if info is None:
        return  # an unknown method: the registry's check words it
    discrete = world_cls.family == "discrete"
    uses_tree = discrete and info.drafter == "model"
    uses_draft = uses_tree or (not discrete and info.drafter != "none")
    for group, used in (("tree", uses_tree), ("draft", uses_draft)):
        typed = sorted(k for k in keys if k == group or k.startswith(group + "."))
        if typed and not used:
            own = " (it drafts from the target itself: its window is method.window)" if info.jacobi else ""
            if not discrete and group == "tree":
                own = " (a continuous method's draft length is method.gamma)"
            raise ConfigError(f"{typed[0]} does not apply to method={name} on target={cfg.target.name}, which drafts "
                              f"with no {'tree' if group == 'tree' else 'draft model'}{own}: drop {typed[0]}")


# ------------------------------------------------------------------------------ the range checks
def _get(cfg, key: str, default=None):
    v = OmegaConf.select(cfg, key, default=default) if isinstance(cfg, DictConfig) else default
    return default if v is None else v


def require_int(key: str, value, low: int, high: Optional[int] = None, hint: str = "") -> int:
    """``value`` as an int within [low, high], else a ConfigError naming ``key``."""
    ok = not isinstance(value, bool) and isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if ok and value >= low and (high is None or value <= high):
        return int(value)
    valid = f"an integer >= {low}" if high is None else f"an integer in {low} .. {high}"
    raise ConfigError(f"{key}={value!r} is invalid: it must be {valid}{hint}")


def require_number(key: str, value, *, low=None, low_open=False, high=None) -> float:
    """``value`` as a finite float within the bounds, else a ConfigError naming ``key``."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    ok = not isinstance(value, bool) and math.isfinite(v) and (low is None or (v > low if low_open else v >= low)) \
        and (high is None or v <= high)
    if ok:
        return v
    rng = " and".join(s for s in [(f" {'>' if low_open else '>='} {low}" if low is not None else ""),
                                  (f" <= {high}" if high is not None else "")] if s)
    raise ConfigError(f"{key}={value!r} is invalid: it must be a finite number{rng}")


def check_sampling(key: str, sampling) -> None:
    """``<key>.temperature`` >= 0, ``<key>.top_k`` an integer >= 0 (0 = the whole vocabulary) and
    ``<key>.top_p`` in (0, 1], each finite; null entries fall back to the target's."""
    if not sampling:
        return
    s = dict(sampling)
    if s.get("temperature") is not None:
        require_number(f"{key}.temperature", s["temperature"], low=0)
    if s.get("top_k") is not None:
        require_int(f"{key}.top_k", s["top_k"], 0, hint=" (0 = the whole vocabulary) or null")
    if s.get("top_p") is not None:
        require_number(f"{key}.top_p", s["top_p"], low=0, low_open=True, high=1)


def _torch_built_with_cuda() -> Optional[bool]:
    """Whether the installed torch is a CUDA build, read from ``torch/version.py`` (``cuda = None``
    in a CPU build) WITHOUT importing torch (seconds of CPU); None if that cannot be read."""
    import importlib.util
    import re
    import sys

    if "torch" in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec("torch")
        text = (Path(spec.origin).parent / "version.py").read_text()
    except (ImportError, AttributeError, TypeError, OSError):
        return None
    m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*(\S.*)$", text, re.M)
    return None if m is None else m.group(1).strip() != "None"


def check_device(cfg) -> None:
    """``target.device`` must exist here: a CUDA device without CUDA is refused with how to run on
    CPU (a CPU build of torch is recognised without importing it)."""
    device = _get(cfg, "target.device")
    if device is None or not str(device).startswith("cuda"):
        return
    if _torch_built_with_cuda() is False:
        available = False
    else:
        import torch

        available = torch.cuda.is_available()
    if not available:
        dtypes = " ".join(f"{k}=float32" for k in ("target.dtype", "target.t5_dtype") if _get(cfg, k) is not None)
        raise ConfigError(f"target.device={device} but CUDA is not available on this machine "
                          f"(torch.cuda.is_available() is False); to run on the CPU: target.device=cpu {dtypes}".rstrip()
                          + " (float32 works there; bfloat16 is slow or unsupported on CPUs)")


def check_dtypes(cfg) -> None:
    for key in ("target.dtype", "target.t5_dtype"):
        v = _get(cfg, key)
        if v is not None and v not in DTYPES:
            raise ConfigError(f"{key}={v!r} is invalid: valid: {', '.join(DTYPES)}")


def check_target_variant(cfg, world_cls) -> None:
    """``target.variant`` of a target that has variants (``world_cls.variants``: LlamaGen's
    padded-text-slot attention, ``coolsd.models.llamagen.VARIANTS``) is one of them."""
    valid = getattr(world_cls, "variants", ())
    v = _get(cfg, "target.variant")
    if valid and v is not None and v not in valid:
        raise ConfigError(f"target.variant={v!r} is invalid: valid: {', '.join(valid)} (upstream = LlamaGen's "
                          f"padded-text-slot attention, lantern = LANTERN's, which the paper ran)")


def writable_dir_error(folder) -> Optional[str]:
    """Why ``folder`` cannot be used as an output folder (None: it can). It is created if need be
    (Hydra would create it next); root ignores permission bits, so creating it is the test."""
    p = Path(os.fspath(folder))
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{p} cannot be created ({e.strerror or e})"
    if not p.is_dir():
        return f"{p} is not a folder"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p} is not writable by this user"
    return None


def check_output_dir(folder, key: str = "hydra.run.dir") -> None:
    why = writable_dir_error(folder)
    if why:
        raise ConfigError(f"output folder {why}; set {key}=<a writable folder>")


def method_from_cfg(cfg) -> tuple[str, dict]:
    """(method name, its parameters) of a job config."""
    m = OmegaConf.to_container(cfg.method, resolve=True)
    return m.pop("name"), m


_PASSED: dict = {}  # config (yaml) check_config accepted in this process -> the world class it was checked for


def check_config(cfg, world_cls=None, out_dir=None, out_key: str = "hydra.run.dir", overrides=None) -> None:
    """Every check of a composed job config before any model loads (see the module docstring):
    the ranges, the files the target needs (its ``missing_files``), the device and the run
    folder, in that order (the value checks import no torch: they refuse in ~1 s); ``world_cls``: the target's world class (default: from ``target.name``);
    ``out_dir``: the run folder, checked for being writable; ``overrides``: the command line's
    (default: the running Hydra job's), whose settings must apply to the run. The checks of values alone are not
    repeated for a config they accepted in this process (a run checks before Hydra writes, then
    as its job starts); the files, the device and the folder, which can change, always are."""

    key = OmegaConf.to_yaml(cfg)
    if key not in _PASSED or (world_cls is not None and world_cls is not _PASSED[key]):
        _PASSED[key] = _check_values(cfg, world_cls)
    world_cls = world_cls or _PASSED[key]
    check_settings_apply(cfg, world_cls, task_overrides() if overrides is None else overrides)
    # the files (coolsd.worlds.files: every missing one at once), then the device they would load on
    require_files(cfg.target.name, world_cls.missing_files(cfg))
    check_prompt_file(cfg, world_cls)  # after the files: a missing prompt file is in their list
    check_device(cfg)  # after the files: a run without weights lists them whatever the device
    if out_dir is not None:
        check_output_dir(out_dir, out_key)


def check_prompt_file(cfg, world_cls) -> None:
    """``dataset=prompts``: the file parses (``coolsd.prompts.files``: one line naming file and line),
    ``dataset.offset`` / ``dataset.n_prompts`` lie within its prompts, and the target can condition
    on the chosen ones (``World.check_prompts``). Read every time: a file can change."""
    d = cfg.get("dataset") or {}
    if d.get("name") != "prompts":
        return
    prompts = load_prompt_file(d.get("path"), d.get("column"))
    pool, n = len(prompts), d.get("n_prompts")
    hint = f" (the prompt file {d.get('path')} holds {pool} prompts)"
    offset = require_int("dataset.offset", d.get("offset", 0), 0, pool - 1, hint)
    if n is not None:
        n = require_int("dataset.n_prompts", n, 1, pool - offset, hint[:-1] + f", from dataset.offset={offset})")
    world_cls.check_prompts(prompts[offset: None if n is None else offset + n], d.get("path"))


def _check_values(cfg, world_cls):
    """The value, method, file and device checks of ``check_config``; returns the world class."""

    # the value checks first, torch-free (~1 s to refuse); the world modules and the method
    # registry import torch (~4 s of CPU on a small machine)
    check_known_settings(cfg)
    require_int("seed", _get(cfg, "seed", 0), 0)
    require_int("threads", _get(cfg, "threads", 1), 1)
    require_int("batch_size", _get(cfg, "batch_size", 1), 1)
    s = cfg.get("shard") or {}
    Shard(s.get("index", 0), s.get("count", 1))
    check_sampling("target.sampling", _get(cfg, "target.sampling"))
    check_sampling("sampling", cfg.get("sampling"))
    for key in ("target.cfg_scale",):
        if _get(cfg, key) is not None:
            require_number(key, _get(cfg, key), low=0)
    d = cfg.get("dataset")
    if d is not None and d.get("name") == "prompts":  # a prompt file: its own count, once the file is there
        require_int("dataset.offset", d.get("offset", 0), 0)
        if d.get("n_prompts") is not None:
            require_int("dataset.n_prompts", d.get("n_prompts"), 1, hint=" or null (every prompt from dataset.offset)")
    elif d is not None and d.get("n_prompts") is not None:
        pool = prompt_pool(d.get("name"))
        offset = require_int("dataset.offset", d.get("offset", 0), 0, None if pool is None else pool - 1)
        high = None if pool is None else pool - offset
        require_int("dataset.n_prompts", d.get("n_prompts"), 1, high,
                    "" if pool is None else f" (the {d.get('name')} pool has {pool} prompts, from dataset.offset={offset})")
    name, params = method_from_cfg(cfg)
    world_cls = world_cls or world_class(cfg.target.name)
    length = _get(cfg, "tree.draft_length")
    if length is not None:
        n = world_cls.image_tokens(cfg)
        require_int("tree.draft_length", length, 1, n,
                    "" if n is None else f" (no longer than target {cfg.target.name}'s {n} image tokens)")
    invariant = bool(_get(cfg, "deterministic.batch_invariant", False))
    if cfg.get("compile", False) and not world_cls.compiles:
        have = ", ".join(n for n in world_names() if world_class(n).compiles)
        raise ConfigError(f"compile=true is not implemented for target={cfg.target.name} yet ({have} have it); "
                          f"run it eagerly with compile=false")
    if cfg.get("compile", False) and invariant:
        raise ConfigError("compile=true and deterministic.batch_invariant=true exclude each other (compiled kernels "
                          "fuse and reorder float operations); set one of them to false")
    check_fastest_ar(cfg, world_cls, invariant)

    if world_cls.family == "discrete" and _row_parallel(name) and not world_cls.row_parallel:
        have = ", ".join(n for n in world_names() if world_class(n).row_parallel)
        raise ConfigError(f"method={name} decodes several image rows a forward, which target={cfg.target.name} does "
                          f"not implement yet ({have} do)")
    info = _known_method(name)
    for check in info.config_checks if info is not None else ():  # its refusals of job settings (its registration)
        try:
            check(params, cfg, world_cls)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.get("compile", False) and _row_parallel(name):
        raise ConfigError(f"method={name} runs eagerly only (its forwards change shape with the rows): set compile=false")

    try:  # the registry's names, family and parameters (coolsd.engine.methods.check_params: the one place)
        check_method(name, world_cls.family, params)
        if world_cls.family == "continuous" and _get(cfg, "target.flow") is not None:  # no head to override
            refuse_flow_head_params(params)
    except ParamError as e:
        it = e.why if e.why.startswith("valid:") else f"it {e.why}"
        raise ConfigError(f"method.{e.name}={e.value!r} is invalid: {it}") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_dtypes(cfg)
    check_target_variant(cfg, world_cls)
    return world_cls


def check_fastest_ar(cfg, world_cls, invariant: bool) -> None:
    """``fastest_ar``: auto (compiled AR beside the run on CUDA, where it is eager, times AR and its
    target compiles: ``coolsd.job.generation.wants_fastest_ar``), true (the same, on any device, the
    CPU included) or false. ``true`` is refused where it cannot run: a target without a compiled
    path, a run that is compiled already (its ``ar`` is compiled AR) or batch-invariant."""
    v = cfg.get("fastest_ar", "auto")
    if not (isinstance(v, bool) or v == "auto"):
        raise ConfigError(f"fastest_ar={v!r} is invalid: valid: auto, true, false (auto = also time compiled AR "
                          "on CUDA when the run is eager)")
    if v is not True:
        return
    if not world_cls.compiles:
        have = ", ".join(n for n in world_names() if world_class(n).compiles)
        raise ConfigError(f"fastest_ar=true times compiled AR, which target={cfg.target.name} does not have ({have} do): "
                          "set fastest_ar=auto or false")
    if cfg.get("compile", False):
        raise ConfigError("fastest_ar=true adds compiled AR beside an eager run, but compile=true compiles the run's "
                          "own ar already (speedup is then against compiled AR): set fastest_ar=auto or false")
    if invariant:
        raise ConfigError("fastest_ar=true compiles AR, which deterministic.batch_invariant=true excludes: set "
                          "fastest_ar=auto or false")


def _known_method(name: str):
    """The registry entry of method ``name`` (``MethodInfo``); None for an unknown name (the
    registry's check words that error)."""
    try:
        return method_info(name)
    except ValueError:
        return None


def _row_parallel(name: str) -> bool:
    """Whether method ``name`` is row-parallel (``MethodInfo.row_parallel``); False for unknown names."""
    info = _known_method(name)
    return info is not None and info.row_parallel
