"""The world registry: a target name (``target=<name>``, conf/target/<name>.yaml) -> the world
class that assembles it. Every world registers itself (``World.targets``, beside its code): the
package's own worlds are every module of this folder, imported on the first lookup; a world from
outside the package registers when its file is included (``run.py --include PATH``,
``coolsd.engine.plugins``). A new target is its model file(s), one world file and one conf file
(docs/add_target.md)."""
from __future__ import annotations

from coolsd.worlds.base import TARGETS
from coolsd.worlds.files import require_files, with_local_files


def world_names() -> list[str]:
    return TARGETS.names()


def world_class(name: str):
    """The world class registered for target ``name``."""
    return TARGETS.get(name)


def target_schemas() -> dict:
    """Schema name -> the target config dataclass of every registered world (``World.schema``)."""
    return dict(cls.schema for _, cls in TARGETS.items() if cls.schema is not None)


def load_world(cfg):
    """The world of a composed job config, after checking its files (every missing one at once);
    it loads the cached local copies of hub values (``hf://...``, ``coolsd.worlds.files.with_local_files``)."""

    cls = world_class(cfg.target.name)
    require_files(cfg.target.name, cls.missing_files(cfg))
    world = cls.load(with_local_files(cfg, cls.needs(cfg)))
    world.signals = bool(cfg.get("quality_signals", True))
    return world
