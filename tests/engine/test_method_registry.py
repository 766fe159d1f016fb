"""The method registry holds every fact about a method (coolsd.engine.methods.registry): parameters
with types and ranges, checked in one place before any model loads (a one-line refusal from
run.py); whether the method is lossless and which drafter runs it, read by everything that asks
(no list of method names elsewhere in the package); and a method defined outside the package
(examples/method/) registers the same way and runs through run.py, its distortion signals
and the lab without any file in coolsd/ naming it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from coolsd.engine import loop  # noqa: F401  (registers the row-parallel drafter kinds)
from coolsd.engine.drafting import DRAFTERS
from coolsd.engine.methods import Param, check_params, method_info, method_names, method_params
from coolsd.worlds import world_names
from name_scan import name_lists
from test_config_validation import cli

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "method"


def test_every_default_is_valid_and_every_fact_is_declared():
    for name in method_names():
        info = method_info(name)
        assert check_params(name, {}) == method_params(name)
        assert all(isinstance(p, Param) for p in info.params.values()), name
        assert isinstance(info.is_lossless(), bool)
        assert info.drafter is None or info.drafter in DRAFTERS, name  # a registered drafter kind
    assert {n for n in method_names() if method_info(n).jacobi} >= {"sjd", "mc_sjd", "sjd_pac", "gsd"}
    lossless = {n for n in method_names("discrete") if method_info(n).is_lossless() and method_info(n).builtin}
    assert lossless == {"ar", "eagle", "sjd", "mc_sjd", "sjd_pac"}
    cspd = method_info("cspd")  # lossless with the exact rule and prefix verification only
    assert cspd.is_lossless({"mode": "exact", "verify": "prefix"}) and not cspd.is_lossless()
    assert not cspd.is_lossless({"mode": "exact"}) and not cspd.is_lossless({"verify": "prefix"})


@pytest.mark.parametrize("name, params, message", [
    ("sjd", {"window": 1}, "sjd window must be an integer >= 2, got 1"),
    ("sjd", {"window": 2.5}, "sjd window must be an integer >= 2, got 2.5"),
    ("lantern_pp", {"k": 0}, "lantern_pp k must be an integer >= 1, got 0"),
    ("coolsd", {"schedule": "cosine"}, "unknown schedule 'cosine'; valid: uniform, exp, exp_geomean, linear, toward_one"),
    ("mc_sjd", {"coupling": None}, "unknown coupling None; valid: maximal, gumbel (method mc_sjd)"),
    ("gsd", {"coupling": "max"}, "unknown coupling 'max'; valid: maximal, gumbel, null (method gsd)"),
    ("sjd_pac", {"window": 4, "tree_depth": 5}, "sjd_pac tree_depth must be <= window (4), got 5"),
    ("cspd", {"prefill": 1.5}, "cspd prefill must be a finite number >= 0 and <= 1, got 1.5"),
    ("uniform_rsd", {"delta": True}, "uniform_rsd delta must be a finite number > 0, got True"),
])
def test_parameters_are_checked_in_one_place(name, params, message):
    with pytest.raises(ValueError) as e:
        check_params(name, params)
    assert str(e.value).startswith(message), str(e.value)


def _run(tmp_path, *args, env=None):
    """``python run.py <args>`` in ``tmp_path`` (tests/job/test_config_validation.py's ``cli``)."""
    return cli(tmp_path, *args, env_extra=env, timeout=600)[0]


@pytest.mark.parametrize("args, line", [
    (["method=sjd", "method.window=1"], "method.window=1 is invalid: it must be an integer >= 2"),
    (["method=sjd_pac", "method.tree_width=0"], "method.tree_width=0 is invalid: it must be an integer >= 1"),
    (["method=coolsd", "method.schedule=cosine"], "method.schedule='cosine' is invalid: valid: uniform, exp"),
    (["--include", str(PLUGIN), "method=power_rsd", "method.gamma=2"],
     "method.gamma=2 is invalid: it must be a finite number > 0 and <= 1.0"),
])
def test_a_bad_method_parameter_is_refused_in_one_line_before_the_world_loads(tmp_path, args, line):
    """Integer, choice and outside-method parameters: one line, exit status 2, nothing written
    (before: integer and choice values were refused by the builder, after the world had loaded,
    through a traceback)."""
    proc = _run(tmp_path, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert line in proc.stderr and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_missing_include_path_is_refused_in_one_line(tmp_path):
    proc = _run(tmp_path, "--include", str(tmp_path / "nothing_here"), "method=eagle")
    assert proc.returncode != 0 and "--include" in proc.stderr and "nothing_here" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run(tmp_path, "method=eagle", env={"COOLSD_INCLUDE": str(tmp_path / "nothing_here")})
    assert proc.returncode == 2 and "nothing_here does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_a_method_from_outside_the_package_runs_through_run_py_with_its_signals(tmp_path):
    proc = _run(tmp_path, "--include", str(PLUGIN), "method=power_rsd", "method.gamma=0.6", "dataset.n_prompts=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    ours = [r for r in records if r["method"] == "power_rsd"]
    assert len(ours) == 2 and all(r["params"]["gamma"] == 0.6 and r["params"]["rule"] == "power" for r in ours)
    assert all(r["step_tv"] > 0 for r in ours)  # relaxed: its exact per-token distortion is recorded
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "power_rsd" in summary["results"] and "speedup" in summary["results"]["power_rsd"]
    # nothing in the package names it
    hits = subprocess.run(["grep", "-rl", "power_rsd", str(ROOT / "coolsd")], capture_output=True, text=True).stdout
    assert hits == ""


def test_a_method_from_outside_the_package_runs_in_the_lab():
    """Its losslessness is the lab's to judge: gamma = 1 is the exact rule and passes the
    chi-square test against the target's sequence distribution; gamma = 0.3 fails it."""
    from coolsd.engine import plugins
    from coolsd.theory import TabularAR, chi_square_pvalue, sample_stats

    plugins.load([PLUGIN])
    P, Q = TabularAR.random(3, 4, seed=0, concentration=0.4), TabularAR.random(3, 4, seed=1, concentration=0.4)
    exact = P.sequence_distribution()
    ok = sample_stats(P, Q, "power_rsd", 3, 20_000, seed=3, gamma=1.0)
    bad = sample_stats(P, Q, "power_rsd", 3, 20_000, seed=3, gamma=0.3)
    assert chi_square_pvalue(ok["counts"], exact) > 1e-3
    assert chi_square_pvalue(bad["counts"], exact) < 1e-6
    assert bad["accepted_length"] > ok["accepted_length"]


def _name_lists(path: Path, names: set, registering: str = "") -> list:
    """``name_scan.name_lists`` less the lists assigned to ``registering`` (a class's registration:
    a world's ``targets``)."""
    return name_lists(path, names, (registering,) if registering else ())


# not lists of methods, though their strings are method names
NOT_METHOD_LISTS = {
    # the lab's independent exact oracle implements each method's rule a second time, on purpose
    # without the registry's rules, and names the methods it implements
    "coolsd/theory/exact.py": "ChainOracle.METHODS",
}


def test_no_list_of_method_names_outside_the_registry():
    """What a method is (lossless, Jacobi-style, its drafter) is asked of the registry, never
    kept as a list of names (before: six such lists, in worlds/tabular.py, report/sota.py,
    theory/lab.py twice, drafting.py's parameter sniff, benchmarks/exactness.py)."""
    names = set(method_names())
    found = {str(p.relative_to(ROOT)): lists for p in sorted((ROOT / "coolsd").rglob("*.py"))
             if p.parent.name != "methods" and str(p.relative_to(ROOT)) not in NOT_METHOD_LISTS
             and (lists := _name_lists(p, names))}
    assert found == {}
    for path, what in NOT_METHOD_LISTS.items():
        assert what.split(".")[-1] in (ROOT / path).read_text(), f"{path}: {what} is gone: drop the entry"


@pytest.mark.parametrize("what", ["targets", "drafter kinds"])
def test_no_list_of_target_or_drafter_names_outside_their_registries(what):
    """Targets and drafter kinds too (``TARGETS``, ``DRAFTERS``: ``coolsd.util.registry``): what a
    drafter kind is (``jacobi``, ``row_parallel``) is a fact registered with it, and the only lists
    of target names are the worlds' own ``targets`` (their registration). Before: ``MethodInfo``
    kept the Jacobi and row-parallel drafter kinds as lists of names."""
    names, registering = (set(world_names()), "targets") if what == "targets" else (set(DRAFTERS.names()), "")
    found = {str(p.relative_to(ROOT)): lists for p in sorted((ROOT / "coolsd").rglob("*.py"))
             if (lists := _name_lists(p, names, registering))}
    assert found == {}


def test_a_method_from_outside_the_package_is_a_curve_of_make_theory(tmp_path):
    """``python -m coolsd.theory --include PATH --curve NAME KEY=V1,V2``: its points join the
    sweep's table and plot (sampled: the lab's exact oracle does not implement it); relaxing
    (gamma < 1) buys accepted length at a TV cost the exact rule (gamma = 1) does not pay."""
    import csv

    proc = subprocess.run([sys.executable, "-m", "coolsd.theory", "--include", str(PLUGIN), "--curve", "power_rsd",
                           "gamma=0.4,1.0", "--seeds", "0", "--n-sampled", "4000", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [r for r in csv.DictReader(open(tmp_path / "tv_vs_accepted_length.csv")) if r["method"] == "power_rsd"]
    by = {float(r["param"]): r for r in rows}
    assert sorted(by) == [0.4, 1.0] and all(r["sampled"] == "True" for r in rows)
    assert float(by[0.4]["accepted_length"]) > float(by[1.0]["accepted_length"])
    assert float(by[0.4]["tv"]) > float(by[1.0]["tv"])
    assert (tmp_path / "tv_vs_accepted_length.png").exists()
    bad = subprocess.run([sys.executable, "-m", "coolsd.theory", "--curve", "power_rsd", "gamma=0.5"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert bad.returncode == 2 and "unknown method 'power_rsd'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_method_from_outside_the_package_is_a_claim_and_a_sota_row(tmp_path):
    """``make claims`` (benchmarks/claims.py) and ``make sota-table`` (coolsd.report.sota) take an
    included method: a claims curve tested against UniformRSD at equal accepted length (toy world
    and exact lab), and a row of the state-of-the-art table; a bad value is refused in one line."""
    claims = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "claims.py"), "--include", str(PLUGIN), "--only", "uniform_rsd",
         "--versus", "uniform_rsd", "--curve", "power_rsd", "gamma=0.5,0.8", "--prompts", "6", "--batch-size", "6",
         "--threads", "1", "--lab-sampled", "2000", "--out", str(tmp_path / "claims"),
         "--records", str(tmp_path / "claims_records")],
        capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert claims.returncode == 0, claims.stdout[-3000:] + claims.stderr[-3000:]
    md = (tmp_path / "claims" / "claims.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| power_rsd gamma=0.5,0.8 beats uniform_rsd |"))
    assert row.count("|") == 10  # a verdict per toy metric and the lab's two answers
    lab_cells = [c.strip() for c in row.split("|")[-3:-1]]
    assert all(c and "not" not in c.split()[0] for c in lab_cells), row  # the lab compared the curves
    assert "annealing beats uniform" not in md  # --only: the other curves' claims are not run
    sota = subprocess.run(
        [sys.executable, "-m", "coolsd.report.sota", "--targets", "toy", "--prompts", "2", "--include", str(PLUGIN),
         "--row", "power_rsd", "gamma=0.6", "--out", str(tmp_path / "sota"), "--records", str(tmp_path / "sota_rec")],
        capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert sota.returncode == 0, sota.stdout[-3000:] + sota.stderr[-3000:]
    table = (tmp_path / "sota" / "sota.md").read_text()
    assert "| toy | power_rsd gamma=0.6 |" in table
    bad = subprocess.run([sys.executable, "-m", "coolsd.report.sota", "--include", str(PLUGIN), "--row", "power_rsd",
                          "gamma=2", "--out", str(tmp_path / "bad")], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600)
    assert bad.returncode != 0 and "gamma" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
