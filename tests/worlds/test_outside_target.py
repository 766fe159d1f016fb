"""A target from outside the package (docs/add_target.md), through ``--include``: the toy world
under a guidance scale of its own, with its own schema and conf file, in a folder of its own
(examples/target/). It registers in the one target registry, composes against its schema
(before: "Could not load 'target/toy_guided_schema'", the schemas were stored before the included
file was imported), refuses a mistyped key in one line, runs through run.py, and declares its tests
as a built-in target does (``TestToyGuidedContract``: the world contract)."""
import json
import subprocess
from pathlib import Path

from coolsd.engine import plugins
from coolsd.worlds import TARGETS, world_class
from target_contract import TargetContract
from test_config_validation import cli

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "target"


class TestToyGuidedContract(TargetContract):
    """An outside target declares its tests as a built-in one does (tests/target_contract.py), with
    the folder it is included from: the world contract runs on it in-process (batch invariance,
    kill and resume, shards and merge)."""

    runs = {"toy_guided": ["method=eagle"]}
    include = PLUGIN
    lists_missing_files = False  # the toy's shipped weights: no file of its own


def test_an_included_world_registers_with_its_origin():
    plugins.load([PLUGIN])
    cls = world_class("toy_guided")
    assert cls.__name__ == "ToyGuidedWorld" and cls.schema[0] == "toy_guided_schema"
    entry = TARGETS.entry("toy_guided")
    assert entry.origin.startswith("examples/target/toy_guided.py:") and not entry.builtin
    assert TARGETS.describe("toy_guided")["family"] == "discrete"


def test_an_included_target_runs_through_run_py_with_its_own_settings(tmp_path):
    proc = cli(tmp_path, "--include", str(PLUGIN), "target=toy_guided", "method=eagle", "dataset.n_prompts=2",
               timeout=600)[0]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "toy_guided" in json.dumps(run) and '"cfg_scale": 4.5' in json.dumps(run), run
    records = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["method"] for r in records}) == ["ar", "eagle"] and len(records) == 4
    assert (tmp_path / "run" / "summary.md").is_file()
    hits = subprocess.run(["grep", "-rl", "toy_guided", str(ROOT / "coolsd"), str(ROOT / "conf")],
                          capture_output=True, text=True).stdout
    assert hits == ""  # nothing in the package or its conf names it


def test_a_mistyped_key_of_an_included_target_is_refused_in_one_line(tmp_path):
    proc = cli(tmp_path, "--include", str(PLUGIN), "target=toy_guided", "target.cfg_scal=2")[0]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("error: target.cfg_scal is not a setting of target=toy_guided: did you mean "
                                   "target.cfg_scale?"), proc.stderr
    assert not (tmp_path / "run").exists()
