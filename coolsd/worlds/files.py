"""What every real world does with the input files a user provides: name the missing ones
before any model loads -- every one at once, each with its config key, its environment variable
and where it comes from (``Need``, ``run_missing_inputs``) -- and identify the ones a run used.
A value ``hf://org/repo[@revision]/path`` names a file or folder of a Hugging Face hub repo; it
is resolved from the local hub cache (``coolsd.util.hub``; never the network) here, in
``Need.local``, and the loaders read the resolved paths (``with_local_files``).
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from coolsd.models.kl16_vae import KLVAEConfig, load_kl16
from coolsd.prompts.coco import SOURCE
from coolsd.util import hub
from coolsd.util.loading import MissingInputFile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")
DRAFTER_FOLDER = ("config.json", ("pytorch_model.bin", "model.safetensors"))  # what an EAGLE drafter folder holds
DOWNLOAD = "python -m coolsd.cli.download"  # fetches the hub files of a target and the metrics


class Need(NamedTuple):
    """One input file or folder a run needs, as the up-front check lists it.

    ``name``: what the user reads first; ``key``: the config key (``target.files.gpt``) or the
    command-line flag (``--clip``) that sets it, or (neither) a hint in words; ``path``: its value
    (None: not set; ``hf://org/repo/path``: a file or folder of a hub repo, from the local hub
    cache); ``source``: where the right file comes from; ``env``: the environment variable the
    value comes from (None: none, or the key was set explicitly); ``folder``: True a directory,
    False a file, None either; ``contains``: names a folder must hold (a tuple entry: any one of
    them); ``fetch``: the glob patterns a hub folder is downloaded with (a tuple entry: the first
    alternative the repo has; empty: ``contains``). ``problem()`` is None exactly when the input
    is usable as described."""

    name: str
    key: str
    path: Any
    source: str
    env: Optional[str] = None
    folder: Optional[bool] = None
    contains: tuple = ()
    fetch: tuple = ()

    def hub_file(self) -> Optional[hub.HubFile]:
        """The hub file the value names (None: a local path or not set); a malformed id: ValueError."""
        return hub.parse(self.path)

    def local(self) -> Optional[Path]:
        """The local path of the value: itself, or a hub value's cached copy (None: not cached, or not set)."""
        if self.path in (None, "", "null"):
            return None
        ref = self.hub_file()
        if ref is None:
            return Path(os.fspath(self.path))
        return hub.local_path(ref, self.folder, self.contains or ("config.json",))

    def problem(self, download: str = DOWNLOAD) -> Optional[str]:
        """None if the input is usable, else one line 'name: what is wrong (set KEY or $ENV) -- source';
        a hub value not in the cache names itself, the cache and ``download``, the command that fetches it."""
        flag, words = self.key.startswith("--"), " " in self.key
        how = self.key if words else f"set {self.key} /path" if flag else f"set {self.key}=/path"
        how += f" or ${self.env}" if self.env else ""
        if self.path in (None, "", "null"):
            return f"{self.name}: not set ({how}) -- {self.source}"
        try:
            ref = self.hub_file()
        except ValueError as e:
            return f"{self.name}: {e} ({how})"
        p = self.local()
        if ref is not None and p is None:
            return (f"{self.name}: {ref} is not in the Hugging Face cache {hub.cache_dir()}: run `{download}` "
                    f"(or {how}) -- {self.source}")
        fix = f"run `{download}` (or {how})" if ref is not None else how
        if not p.exists():
            wrong = "does not exist"
        elif self.folder is True and not p.is_dir():
            wrong = "is a file, expected a folder"
        elif self.folder is False and not p.is_file():
            wrong = "is a folder, expected a file"
        else:
            lacking = [" or ".join(c) if isinstance(c, tuple) else c for c in self.contains
                       if not any((p / n).exists() for n in (c if isinstance(c, tuple) else (c,)))]
            if not lacking:
                return None
            wrong = f"lacks {', '.join(lacking)}"
        return f"{self.name}: {ref or p} {wrong} ({fix}) -- {self.source}"


def env_var(cfg, key: str) -> Optional[str]:
    """The environment variable the unresolved value of ``key`` reads (``${oc.env:NAME,...}``, as
    conf/ sets the defaults of input paths), or None (no such key, or a value set explicitly)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    raw = OmegaConf.to_container(node, resolve=False).get(leaf) if isinstance(node, DictConfig) else None
    m = _ENV.search(raw) if isinstance(raw, str) else None
    return m.group(1) if m else None


def config_need(cfg, key: str, name: str, source: str, folder: Optional[bool] = None, contains: tuple = (),
                fetch: tuple = ()) -> Need:
    """The ``Need`` of config ``key`` of a composed job config (its value and environment variable)."""
    return Need(name, key, OmegaConf.select(cfg, key), source, env_var(cfg, key), folder, contains, fetch)


def dataset_needs(cfg) -> list[Need]:
    """The input files of the configured data set, checked with every world's files before any model
    loads: ``coco2017val`` needs its captions file (``dataset.captions`` / $COCO_CAPTIONS), ``prompts``
    its prompt file (``dataset.path`` / $PROMPTS_FILE, docs/protocols.md "Prompt files"); the toy
    scenes and ImageNet class labels need none. (The val2017 images are FID's reference set:
    ``python -m coolsd.cli.evaluate --coco-images``.)"""

    name = (cfg.get("dataset") or {}).get("name")
    if name == "coco2017val":
        return [config_need(cfg, "dataset.captions", "COCO captions", SOURCE, folder=False)]
    if name == "prompts":
        return [config_need(cfg, "dataset.path", "prompt file", "your prompt list: a .txt, .jsonl, .csv or .tsv file "
                            "(docs/protocols.md)", folder=False)]
    return []


def download_command(cfg, needs=()) -> str:
    """The command that fetches the hub files of a composed job config's target and drafter: the
    target's name, and every hub value of ``needs`` set explicitly (no ``env``: not the conf default,
    e.g. ``target.files.gpt=hf://jadohu/LlamaGen-T2I``), so that it fetches what this run reads."""
    given = [f"{n.key}={n.path}" for n in needs if n.env is None and hub.is_hub(n.path) and not n.key.startswith("-")]
    return " ".join([f"{DOWNLOAD} target={cfg.target.name}", *given])


def run_missing_inputs(cfg, needs) -> list[str]:
    """Every problem of a run's inputs, one line each: the dataset's (``dataset_needs``, shared by
    every world) and then ``needs`` (the target's and drafter's files). Empty: all usable."""
    download = download_command(cfg, needs)
    return [p for n in [*dataset_needs(cfg), *needs] if (p := n.problem(download)) is not None]


def with_local_files(cfg, needs):
    """``cfg`` with every hub value of ``needs`` (``hf://...``) replaced by its cached local path (a
    copy; ``cfg`` itself when none is a hub value): what the loaders read. Call after the check."""
    local = {n.key: n.local() for n in needs if hub.is_hub(n.path)}
    if not local:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg), read_write(cfg):
        for key, path in local.items():
            OmegaConf.update(cfg, key, None if path is None else str(path), merge=False)
    return cfg


def require_inputs(who: str, missing: list[str]) -> None:
    """Stop before any work when inputs are missing, listing every one of them (one
    ``coolsd.util.errors.InputFileError``, also a FileNotFoundError): '<who> cannot run: missing files'."""

    if missing:
        raise MissingInputFile(f"{who} cannot run: missing files\n  " + "\n  ".join(missing))


def require_files(target: str, missing: list[str]) -> None:
    """``require_inputs`` for target ``target`` (the job's check: ``missing_files`` of its world)."""
    require_inputs(f"target {target!r}", missing)


def architecture(arch, where: str, presets: dict, config_cls):
    """A released architecture by name (a key of ``presets``), or a mapping of ``config_cls`` fields
    (own variants, tests); a wrong name or field is one error naming ``where`` and what is valid."""
    arch = OmegaConf.to_object(arch) if OmegaConf.is_config(arch) else arch
    what = config_cls.__name__
    if isinstance(arch, str):
        if arch not in presets:
            raise ValueError(f"{where}={arch!r} is not a released architecture; valid: {', '.join(presets)}, or a "
                             f"mapping of {what} fields")
        return presets[arch]
    fields = dict(arch)
    unknown = sorted(set(fields) - set(config_cls.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{where} has unknown {what} field(s) {unknown}; valid: {sorted(config_cls.__dataclass_fields__)}")
    return config_cls(**fields)


def load_kl16_vae(t, device):
    """The KL-16 VAE of target config ``t`` (``t.files.vae``): ``t.vae`` null is the released
    architecture, a mapping of ``KLVAEConfig`` fields otherwise (tests: tiny)."""
    vae_cfg = t.get("vae")
    fields = {k: tuple(v) if isinstance(v, (list, tuple)) or OmegaConf.is_list(v) else v
              for k, v in (vae_cfg or {}).items()}
    return load_kl16(t.files.vae, KLVAEConfig(**fields) if vae_cfg else KLVAEConfig(), device=device)
