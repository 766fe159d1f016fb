"""The world registry: a target name (``target=<name>``, conf/target/<name>.yaml) -> the world
class that assembles it, as a lazy ``"module:Class"`` string (registering imports nothing, so the
registry can never create an import cycle). A new target is its model file(s), one world file
(or an existing world class), one conf file and one line here."""
from __future__ import annotations

import importlib

WORLDS = {
    "toy": "coolsd.worlds.toy:ToyWorld",
    "toy_continuous": "coolsd.worlds.toy_continuous:ToyContinuousWorld",
    "llamagen_xl": "coolsd.worlds.llamagen:LlamaGenWorld",
    "llamagen_xl_512": "coolsd.worlds.llamagen:LlamaGenWorld",
    "lumina_mgpt": "coolsd.worlds.lumina:LuminaWorld",
    "mar_h": "coolsd.worlds.mar:MARWorld",
    "mar_l": "coolsd.worlds.mar:MARWorld",
    "tabular": "coolsd.worlds.tabular:TabularWorld",
}


def world_names() -> list[str]:
    return sorted(WORLDS)


def world_class(name: str):
    """The world class registered for target ``name`` (imported on first use)."""
    if name not in WORLDS:
        raise ValueError(f"unknown target {name!r}; valid: {', '.join(world_names())}")
    module, _, cls = WORLDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def load_world(cfg):
    """The world of a composed job config, after checking its files (every missing one at once)."""
    from coolsd.worlds.files import require_files

    cls = world_class(cfg.target.name)
    require_files(cfg.target.name, cls.missing_files(cfg))
    world = cls.load(cfg)
    world.signals = bool(cfg.get("quality_signals", True))
    return world
