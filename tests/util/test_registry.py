"""The one registry behind every extension point (coolsd.util.registry): each entry knows where it
was registered, a name registered from two places is refused naming both, an entry of the wrong
kind is refused, an unknown name is answered with the closest one, and the package's methods,
drafter kinds and targets are all held in it (their origins point at their definitions)."""
import inspect
import sys
from pathlib import Path

import pytest

from coolsd.engine.drafting import DRAFTERS
from coolsd.engine.methods import METHODS, MethodInfo, method_info
from coolsd.util.registry import Registry
from coolsd.worlds import TARGETS, world_class
from coolsd.worlds.base import World

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT)


def _line_of(obj) -> int:
    return inspect.getsourcelines(obj)[1]


def factory_a():
    """Makes an a."""


def factory_b():
    """Makes a b."""


def test_an_entry_knows_where_it_was_registered_and_what_it_is():
    reg = Registry("widget", callables=True)
    reg.add("a", factory_a, colour="red")
    reg.register("b", colour="blue")(factory_b)
    assert reg.entry("a").origin == f"{HERE}:{_line_of(factory_a)}"
    assert reg.entry("b").origin == f"{HERE}:{_line_of(factory_b)}"
    assert reg.describe("a") == {"name": "a", "origin": f"{HERE}:{_line_of(factory_a)}", "doc": "Makes an a.",
                                 "colour": "red"}
    assert reg.names() == ["a", "b"] and reg.names(colour="blue") == ["b"]
    assert reg.names(colour=lambda c: c in ("red", "green")) == ["a"]
    assert "a" in reg and len(reg) == 2 and reg.get("b") is factory_b
    # an instance has no source of its own: the registering call's line is its origin
    inst = Registry("thing")
    line = sys._getframe().f_lineno + 1
    inst.add("x", object())
    assert inst.entry("x").origin == f"{HERE}:{line}"


def test_a_name_from_two_places_is_refused_naming_both_and_a_reimport_is_not():
    reg = Registry("widget", callables=True)
    reg.add("a", factory_a)
    reg.add("a", factory_a)  # the same definition again (a module imported twice): no clash
    with pytest.raises(ValueError) as e:
        reg.add("a", factory_b)
    assert str(e.value) == (f"widget 'a' is registered twice: at {HERE}:{_line_of(factory_a)} "
                            f"and at {HERE}:{_line_of(factory_b)}")
    assert reg.get("a") is factory_a


def test_an_entry_of_the_wrong_kind_is_refused():
    with pytest.raises(TypeError, match="drafter kind 'x': 3 is not callable"):
        DRAFTERS.add("x", 3)
    with pytest.raises(TypeError, match="method 'x': .* is not a MethodInfo"):
        METHODS.add("x", factory_a)
    with pytest.raises(TypeError, match="target 'x': <class 'int'> is not a subclass of World"):
        TARGETS.add("x", int)
    assert "x" not in DRAFTERS and "x" not in METHODS and "x" not in TARGETS


def test_a_world_for_a_registered_target_is_refused_naming_both_definitions():
    first = TARGETS.entry("toy").origin
    with pytest.raises(ValueError) as e:
        class Impostor(World):  # noqa: F841
            targets = ("toy",)
            family = "discrete"
    assert f"target 'toy' is registered twice: at {first} and at {HERE}:" in str(e.value)
    assert world_class("toy").__module__ == "coolsd.worlds.toy"


def test_an_unknown_name_gets_the_closest_one_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"^unknown method 'eagel' \(did you mean 'eagle'\?\); valid: .*ar, .*eagle"):
        method_info("eagel")
    with pytest.raises(ValueError, match=r"^unknown target 'llamagen_xxl' \(did you mean 'llamagen_xl'\?\); valid: "):
        world_class("llamagen_xxl")
    with pytest.raises(ValueError, match=r"^unknown target 'qqq'; valid: "):
        world_class("qqq")


def test_discovery_imports_a_package_once_before_the_first_lookup(tmp_path, monkeypatch):
    pkg = tmp_path / "regdemo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from coolsd.util.registry import Registry\nREG = Registry('demo', "
                                     "discover='regdemo_pkg')\n")
    (pkg / "one.py").write_text("from regdemo_pkg import REG\n\n\n@REG.register('one')\ndef one():\n    pass\n")
    (pkg / "two.py").write_text("from regdemo_pkg import REG\nREG.add('two', 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import regdemo_pkg

    assert "regdemo_pkg.one" not in sys.modules
    assert regdemo_pkg.REG.names() == ["one", "two"]
    assert regdemo_pkg.REG.entry("one").origin.endswith("regdemo_pkg/one.py:4")
    assert regdemo_pkg.REG.entry("two").origin.endswith("regdemo_pkg/two.py:2")
    for m in [m for m in sys.modules if m.startswith("regdemo_pkg")]:
        del sys.modules[m]


@pytest.mark.parametrize("registry", [METHODS, DRAFTERS, TARGETS], ids=["methods", "drafters", "targets"])
def test_every_builtin_entry_points_at_its_definition(registry):
    """Each built-in entry's origin is a line in coolsd/ that defines it (a decorator, def or class);
    one registered from a test is not built in."""
    builtin = [n for n in registry.names() if registry.entry(n).builtin]
    assert len(builtin) >= 6
    for name in builtin:
        path, line = registry.entry(name).origin.rsplit(":", 1)
        text = (ROOT / path).read_text().splitlines()[int(line) - 1].strip()
        assert text.startswith(("@register", "def ", "class ")), (name, path, line, text)
    assert isinstance(METHODS.get("eagle"), MethodInfo)
    outside = Registry("widget", callables=True)
    outside.add("a", factory_a)
    assert not outside.entry("a").builtin
