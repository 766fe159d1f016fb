"""Every registered world has its declaration and its conf file: one declaration per target name
(tests/target_contract.py: the target's test module declares its tiny files, their overrides and
the contract's settings, and runs the world contract there), one conf file per registry entry,
and every target follows the recipe of docs/add_target.md."""
from pathlib import Path

import pytest

from coolsd.worlds import TARGETS, world_class, world_names
from target_contract import DECLARED, TargetContract, declarations

ROOT = Path(__file__).resolve().parents[2]


def test_every_registered_world_has_its_conf_its_declaration_and_every_conf_a_world():
    confs = sorted(p.stem for p in (ROOT / "conf" / "target").glob("*.yaml"))
    builtin = [n for n in world_names() if TARGETS.entry(n).builtin]  # not one a test included
    declared = sorted(n for n, cls in declarations().items() if cls.include is None)
    assert confs == builtin == declared
    for name in builtin:
        cls = world_class(name)
        assert cls.family in ("discrete", "continuous") and callable(cls.load)


def test_a_target_declared_twice_is_refused_naming_both():
    name = next(iter(DECLARED))
    first = DECLARED[name]
    with pytest.raises(ValueError, match=f"target '{name}' is declared by {first.__module__}.{first.__qualname__} "
                                         "and by test_worlds.Again"):
        type("Again", (TargetContract,), {"runs": {name: []}, "__module__": "test_worlds"})
    assert DECLARED[name] is first


def test_every_target_follows_the_recipe():
    """docs/add_target.md: a target is its model file, its world file (the world class, which
    registers itself under the name and holds its config schema beside it) and its conf file,
    whose first default is that schema."""
    import yaml

    for conf in sorted((ROOT / "conf" / "target").glob("*.yaml")):
        name = conf.stem
        cls = world_class(name)
        assert name in cls.targets, name
        assert cls.__module__.startswith("coolsd.worlds."), name
        schema_name, schema = cls.schema
        assert schema.__module__ == cls.__module__, f"{name}: the schema sits beside the world class"
        assert yaml.safe_load(conf.read_text())["defaults"][0] == schema_name, name
        assert (ROOT / (cls.__module__.replace(".", "/") + ".py")).is_file()
