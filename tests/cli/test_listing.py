"""``python run.py --list methods|targets|drafters|trees|metrics|protocols`` (coolsd.cli.listing): what can be chosen,
printed from the registries, with every method parameter's default and valid values, entries from
``--include`` files among them; an unknown kind is one line, exit status 2."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coolsd.cli.listing import listing
from coolsd.engine.decoding.trees import TREE_NAMES
from coolsd.engine.drafting import DRAFTERS
from coolsd.engine.methods import method_info, method_names
from coolsd.worlds import TARGETS

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "COOLSD_INCLUDE"}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_methods_are_listed_with_every_parameter_its_default_and_its_valid_values():
    text = listing("methods")
    heads = [line.split()[0] for line in text.splitlines() if not line.startswith(" ")]
    assert heads == [n for n in method_names() if not n.startswith("_")]
    assert "coolsd  (discrete, drafter model; lossless: False; coolsd/engine/methods/relaxed.py:" in text
    assert "    method.delta=2.0   (a finite number > 0)  the relaxation: omega's mean over the draft depths" in text
    assert "    method.schedule=exp   (valid: uniform, exp, exp_geomean, linear, toward_one)" in text
    sections = {}  # method -> its lines
    for line in text.splitlines():
        if not line.startswith(" "):
            name = line.split()[0]
        sections.setdefault(name, []).append(line)
    for name in heads:
        keys = [line.split("=")[0].strip().removeprefix("method.") for line in sections[name]
                if line.startswith("    method.")]
        assert keys == list(method_info(name).params), name


@pytest.mark.parametrize("kind, names", [("targets", lambda: TARGETS.names()), ("drafters", lambda: DRAFTERS.names()),
                                         ("trees", lambda: list(TREE_NAMES))])
def test_targets_drafters_and_trees_are_listed_from_their_registries(kind, names):
    heads = [line.split()[0] for line in listing(kind).splitlines() if not line.startswith(" ")]
    assert heads == names()
    if kind == "targets":  # with what a toy prompt may be: its vocabulary and caption limit
        assert "toy  (discrete; ToyWorld, coolsd/worlds/toy.py:" in listing(kind)
        from coolsd.toy.scenes import MAX_CAPTION_TOKENS, WORDS

        toy = listing(kind).split("toy  (discrete")[1].split("\n")[1]
        assert toy.startswith(f"    prompts: captions of at most {MAX_CAPTION_TOKENS} words from the toy vocabulary")
        assert all(f" {w}," in toy or f" {w})" in toy for w in WORDS if not w.startswith("<"))
    if kind == "drafters":
        assert "jacobi  (jacobi; coolsd/engine/drafting.py:" in listing(kind)


def test_run_py_lists_included_methods_and_refuses_an_unknown_kind_in_one_line():
    proc = _run("--include", str(ROOT / "examples" / "method"), "--list", "methods")
    assert proc.returncode == 0, proc.stderr
    assert "power_rsd  (discrete, drafter model; lossless: depends on its parameters; " \
           "examples/method/power_rsd.py:" in proc.stdout
    assert "    method.gamma=0.8   (a finite number > 0 and <= 1.0)  a = p_res ** gamma" in proc.stdout
    targets = _run("--include", str(ROOT / "examples" / "target"), "--list", "targets")
    assert targets.returncode == 0 and "toy_guided  (discrete; ToyGuidedWorld, examples/target/toy_guided.py:" in targets.stdout
    bad = _run("--list=bogus")
    assert bad.returncode == 2 and bad.stderr.strip() == ("error: --list bogus: valid: methods, targets, drafters, trees, "
                                                          "metrics, protocols")
    assert bad.stdout == ""


def test_metrics_and_protocols_are_listed_from_their_registries():
    from coolsd.metrics.registry import METRICS, PROTOCOLS

    metrics, protocols = listing("metrics"), listing("protocols")
    assert [x.split()[0] for x in metrics.splitlines() if not x.startswith(" ")] == METRICS.names()
    assert "fid  (computed by evaluate; lower is better; coolsd/metrics/image_metrics.py:" in metrics
    assert "toy_clip  (computed by world; higher is better; stands in for clip_score, is not it;" in metrics
    assert "--metrics fid   (inputs: --inception (per protocol), --coco-images; prompt sets: coco)" in metrics
    assert [x.split()[0] for x in protocols.splitlines() if not x.startswith(" ")] == PROTOCOLS.names()
    assert "sjd  (prompt sets: coco, parti; coolsd/metrics/protocols.py:" in protocols
    assert "    --clip: CLIP ViT-B/16 model folder [$CLIP_B16_DIR]" in protocols


def test_help_lists_the_groups_to_choose_from_without_the_schema_nodes():
    """``--help``'s group list (``coolsd.cli.runner.config_groups``): every option a person picks,
    none of the ``*_schema`` nodes the conf files type themselves against (before: target: emu3,
    emu3_schema, ...), and the pointer to ``--list``."""
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "_schema" not in groups and "--list" in groups
    lines = {x.split(": ")[0]: x.split(": ")[1].split(", ") for x in groups.splitlines() if ": " in x}
    assert {"coolsd", "eagle", "sjd"} <= set(lines["method"]) and {"toy", "llamagen_xl"} <= set(lines["target"])
    assert lines["tree"] == ["chain", "mc_sim_7b_63", "naive_extend_57"] and "coco2017val" in lines["dataset"]
