"""The rule contract (coolsd.theory.contract): for every registered discrete rule, built-in or from
outside the package, the token a chain node emits through the production ``verify_tree`` follows
the rule's ``emitted()`` (which every distortion signal reads). A rule that overrides ``step``
alone, as docs/add_method.md once allowed, samples another distribution than ``emitted()`` claims:
the check fails it loudly, in Python and from ``python -m coolsd.theory --check``."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coolsd.engine import plugins
from coolsd.engine.decoding.rules import ExactRule, acceptance_prob, take
from coolsd.engine.methods import method_info, method_names, register_method
from coolsd.theory.contract import check_emitted, report
from coolsd.theory.lab import _method
from coolsd.theory.tabular import TabularAR

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "method"


class _StepOnly(ExactRule):
    """The documented mistake: accepts as EAGLE does but resamples a rejection from p itself
    (``step`` overridden, ``emitted`` left at the base class's G* form, which says p)."""

    name = "step_only"

    def step(self, p_res, q, x, depth, choice=None):
        return acceptance_prob(take(p_res, x), take(q, x)), p_res


@register_method("_step_only", drafter="model")
def _step_only(ctx):
    """Negative control of the rule contract: its samples are not its emitted()."""
    return _StepOnly(), None


def _with_rule() -> list[str]:
    """Every method of the package with an acceptance rule, and ``power_rsd`` (from outside it,
    loaded by the test: collection registers nothing)."""
    lab = TabularAR.random(4, 2, seed=0)
    return [n for n in method_names("discrete")
            if method_info(n).builtin and _method(lab, n, 3, "chain", {}).rule is not None] + ["power_rsd"]


@pytest.mark.parametrize("method", _with_rule())
def test_every_registered_rule_emits_what_it_says(method):
    plugins.load([PLUGIN])
    result = check_emitted(method)
    assert result["ok"], report(result)
    assert len([c for c in result["cases"] if not c.skipped]) == 12


def test_a_rule_that_overrides_step_alone_fails_the_check_loudly():
    result = check_emitted("_step_only")
    text = report(result)
    assert not result["ok"]
    assert "does NOT follow" in text and "<-- sampled != emitted()" in text and "docs/add_method.md" in text
    worst = max(c.tv for c in result["cases"])
    assert worst > 0.05, text  # resampling from p instead of the residual: far from p, not noise
    # the same rule with emitted() overridden to what it samples passes: the check reads emitted()
    _StepOnly.emitted = lambda self, p, q, depth: (
        torch.minimum(p, q) + (1 - torch.minimum(p, q).sum(-1, keepdim=True)) * p)
    try:
        assert check_emitted("_step_only")["ok"]
    finally:
        del _StepOnly.emitted


def test_the_check_from_the_command_line(tmp_path):
    """``--check`` on a rule from an included file: exit status 1 and the verdict, beside an
    included rule that passes; refusals (a method without a rule) are one usage line, status 2."""
    bad = tmp_path / "mistake.py"
    bad.write_text(
        "from coolsd.engine.decoding.rules import ExactRule, acceptance_prob, take\n"
        "from coolsd.engine.methods import register_method\n\n\n"
        "class StepOnly(ExactRule):\n"
        "    def step(self, p_res, q, x, depth, choice=None):\n"
        "        return acceptance_prob(take(p_res, x), take(q, x)), p_res\n\n\n"
        "@register_method('mistake', drafter='model')\n"
        "def mistake(ctx):\n"
        "    return StepOnly(), None\n")
    cmd = [sys.executable, "-m", "coolsd.theory", "--include", str(bad), "--include", str(PLUGIN)]
    proc = subprocess.run(cmd + ["--check", "mistake", "--check", "power_rsd", "gamma=0.5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "mistake {" in proc.stdout and "does NOT follow" in proc.stdout
    assert "power_rsd {" in proc.stdout and "'gamma': 0.5" in proc.stdout
    assert proc.stdout.count("the emitted token follows") == 1
    ok = subprocess.run(cmd[:3] + ["--check", "eagle"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "eagle {" in ok.stdout, ok.stdout + ok.stderr
    refused = subprocess.run(cmd[:3] + ["--check", "zipar"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--check zipar: the method has no acceptance rule" in refused.stderr
    assert "Traceback" not in refused.stderr
