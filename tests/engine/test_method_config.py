"""A method's config comes from its registry entry (coolsd.engine.methods.registry): the ``method``
node of ``method=<name>`` is generated from the method's ``Param``s (``config_node``, stored in
Hydra's ConfigStore by ``coolsd.job.config_schema.register_schemas``), so its defaults live in one
place; a yaml in conf/method/ can only select a generated node (a preset), checked against the
``Param``s. What a method cannot run with (a job setting) is registered with it
(``register_method(config_checks=...)``): the config check names no method, and the loop asks a
drafter what it does, not which class it is."""
import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import factories
from coolsd.engine import plugins
from coolsd.engine.methods import check_params, config_node, method_info, method_names, method_params
from coolsd.job.config_schema import check_config, register_schemas
from coolsd.util.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "method"


def test_every_method_node_is_generated_from_its_params():
    """``method=<name>`` composes to the name and every parameter at its ``Param`` default, in the
    ``Param``s' order, for every registered method: built-in, included from outside the package
    (registered after Hydra discovered its plugins) and of either family."""
    plugins.load([PLUGIN])
    assert "power_rsd" in method_names()
    for name in method_names():
        m = OmegaConf.to_container(factories.compose(f"method={name}").method)
        assert list(m.items()) == list(config_node(name).items()) == [("name", name), *method_params(name).items()]
    # the continuous method object's defaults agree with its builder's
    from coolsd.engine.methods.cspd import ContinuousMethod

    assert method_params("cspd") == {f.name: f.default for f in dataclasses.fields(ContinuousMethod) if f.name != "name"}
    assert OmegaConf.to_container(factories.compose("method=gsd", "method.G=3").method)["G"] == 3


def test_no_yaml_holds_a_method_s_defaults():
    """No conf/method/<name>.yaml of a registered method, here or in an included folder: Hydra would
    merge it over the generated node (its deprecated "automatic schema matching", a warning on every
    start) and its values would win, a second place for the defaults. A yaml of another name is a
    preset: it composes, and its values pass the method's ``Param``s."""
    plugins.load([PLUGIN])
    folders = [ROOT / "conf" / "method", PLUGIN / "conf" / "method"]
    yamls = [p for d in folders if d.is_dir() for p in sorted(d.glob("*.yaml"))]
    assert [p for p in yamls if p.stem in method_names()] == []
    for p in yamls:
        m = OmegaConf.to_container(factories.compose(f"method={p.stem}").method)
        check_params(m.pop("name"), m)


def test_a_preset_yaml_selects_a_generated_node_and_is_checked_against_its_params(tmp_path):
    """conf/method/<preset>.yaml naming a method's node first in its defaults takes every other value
    from the ``Param``s; a key the method does not have is refused by the registry's check."""
    (tmp_path / "method").mkdir()
    (tmp_path / "config.yaml").write_text("defaults:\n  - method: linear\n  - _self_\n")
    (tmp_path / "method" / "linear.yaml").write_text("defaults:\n  - coolsd\n  - _self_\nschedule: linear\n")
    (tmp_path / "method" / "typo.yaml").write_text("defaults:\n  - coolsd\n  - _self_\nschedul: linear\n")
    register_schemas()
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        m = OmegaConf.to_container(compose("config", overrides=["method.delta=3.0"]).method)
        typo = OmegaConf.to_container(compose("config", overrides=["method=typo"]).method)
    assert m == {**config_node("coolsd"), "schedule": "linear", "delta": 3.0}
    assert check_params(m.pop("name"), m)["schedule"] == "linear"
    with pytest.raises(ValueError, match=r"method 'coolsd' has no parameter\(s\) \['schedul'\]"):
        check_params(typo.pop("name"), typo)


@pytest.mark.parametrize("overrides, message, accepted", [
    (["method=zipar", "method.window=8"],
     "method.window=8 is invalid: it must be an integer in [1, 7] (target toy's grid is 8 tokens wide)",
     ["method=zipar", "method.window=7"]),
    (["method=pjd", "deterministic.batch_invariant=true", "batch_size=2"],
     "method=pjd pads each forward to the batch's longest schedule, which is not batch-invariant: set batch_size=1 "
     "or deterministic.batch_invariant=false",
     ["method=sjd", "deterministic.batch_invariant=true", "batch_size=2"]),
    (["method=budget", "method.tv_per_image=0.1", "compile=true"],
     "method.tv_per_image tunes the price between batches, which the compiled graphs would bake in: set "
     "compile=false",
     ["method=budget", "compile=true"]),
])
def test_a_method_s_own_refusals_of_job_settings_are_registered_with_it(overrides, message, accepted):
    """The refusals that were special cases of the config check by method name are each method's
    ``config_checks``; the words are unchanged, and settings they do not refuse pass."""
    with pytest.raises(ConfigError) as e:
        check_config(factories.compose(*overrides))
    assert str(e.value) == message
    assert method_info(overrides[0].split("=")[1]).config_checks
    check_config(factories.compose(*accepted), overrides=[])


def _method_strings(path: Path) -> list:
    names = set(method_names())
    return [(n.lineno, n.value) for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Constant) and n.value in names]


def test_the_config_check_and_the_loop_name_no_method_and_no_drafter_class():
    """The config check asks the registry (facts, ``config_checks``), never a method's name; the
    loop asks a drafter for its ``own_loop``, never its class."""
    assert _method_strings(ROOT / "coolsd" / "job" / "config_schema.py") == []
    tree = ast.parse((ROOT / "coolsd" / "engine" / "loop.py").read_text())
    classes = [n.args[1] for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"
               and isinstance(n.args[0], ast.Name) and n.args[0].id == "drafter"]
    assert classes == []


def test_a_drafter_with_its_own_loop_runs_the_generation():
    """``speculative_generate`` hands the whole generation to a drafter's ``own_loop`` (what the
    row-parallel drafters of ``coolsd.engine.rows`` have), with a tree or rule refused."""
    from coolsd.engine.decoding.trees import make_tree
    from coolsd.engine.loop import speculative_generate
    from coolsd.engine.rows import PJDRows, RowParallel

    calls = []

    class Own:
        def own_loop(self, *args):
            calls.append(args)
            return "done"

    rng = SimpleNamespace(on=lambda dev: "rng on " + str(dev))
    assert speculative_generate(SimpleNamespace(device="cpu"), 5, rng, drafter=Own(), batch_size=2) == "done"
    assert calls[0][:3][1:] == (5, "rng on cpu") and calls[0][4:6] == (None, 2)
    with pytest.raises(ValueError, match="row-parallel decoding takes no bos_token, tree or rule"):
        speculative_generate(SimpleNamespace(device="cpu"), 5, rng, drafter=Own(), tree=make_tree("chain", 2))
    assert callable(RowParallel(None, 8).own_loop) and callable(PJDRows(8, 8, 8, 16).own_loop)


def test_a_continuous_method_object_takes_the_registry_s_continuous_names():
    from coolsd.engine.methods.cspd import ContinuousMethod

    assert ContinuousMethod(name="ar").name == "ar"
    with pytest.raises(ValueError, match=r"^continuous targets run method=ar or method=cspd or method=disa, not 'eagle'$"):
        ContinuousMethod(name="eagle")
