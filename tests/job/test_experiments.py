"""The sweep configs under experiments/: every point of every sweep composes through Hydra (with
the repository's search-path plugin) into a method that builds, and a Table 2 sweep runs end to
end as a Hydra multirun on the toy world."""
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from coolsd.engine.methods import build_method
from coolsd.job.generation import method_from_cfg
from coolsd.worlds import load_world

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "experiments" / "experiment").glob("*.yaml"))


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def _sweep_points(params: dict) -> list[list[str]]:
    """The basic sweeper's cartesian product of ``key: a,b,c`` entries, as override lists."""
    axes = [[f"{k}={v}" for v in str(vals).split(",")] for k, vals in params.items()]
    return [list(p) for p in itertools.product(*axes)]


@pytest.fixture(scope="module")
def neighbours():
    return load_world(_compose("target=toy")).neighbours


def test_the_expected_sweeps_exist():
    assert {"table2_llamagen_xl", "table2_lumina_mgpt", "table2_toy", "ablation_schedule",
            "ablation_gstar_lantern_pp", "pareto_delta"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_sweep_point_builds_a_method(name, neighbours):
    # target/dataset are put back to the toy world: the real targets' files are not here
    base = [f"+experiment={name}", "target=toy", "dataset=toy"]
    params = OmegaConf.to_container(_compose(*base).hydra.sweeper.params)
    assert params, f"experiment {name} defines no sweep"
    points = _sweep_points(params)
    described = set()
    for point in points:
        cfg = _compose(*base, *point)
        method, p = method_from_cfg(cfg)
        m = build_method(method, tree=cfg.tree.name, draft_length=cfg.tree.get("draft_length"), neighbours=neighbours, **p)
        described.add(json.dumps(m.describe(), sort_keys=True))
    assert len(described) == len(points), f"{name}: two sweep points run the same configuration"


def test_table2_rows_match_the_paper_rows():
    from coolsd.report.paper import table2_rows

    for target in ("llamagen_xl", "lumina_mgpt"):
        params = OmegaConf.load(ROOT / "experiments" / "experiment" / f"table2_{target}.yaml").hydra.sweeper.params
        rows = str(params["+row"]).split(",")
        got = []
        for row in rows:
            method, p = method_from_cfg(_compose(f"+row={row}", "target=toy"))
            got.append((method, {k: v for k, v in p.items() if k in ("delta", "lam", "k")}))
        want = [(r["method"], {k: v for k, v in r["params"].items()}) for r in table2_rows(target)]
        assert got == want


def test_table2_toy_runs_as_a_hydra_multirun(tmp_path):
    out = tmp_path / "multirun"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "-m", "+experiment=table2_toy", "+row=eagle,coolsd_2",
                           "dataset.n_prompts=1", f"hydra.sweep.dir={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)  # from another cwd
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.name for p in out.iterdir() if p.is_dir())  # folders named by the swept values
    assert runs == ["coolsd_+row=coolsd_2,dataset.n_prompts=1", "eagle_+row=eagle,dataset.n_prompts=1"]
    summary = json.loads((out / runs[0] / "summary.json").read_text())
    assert summary["method"]["delta"] == 2.0 and summary["n_prompts"] == 1
