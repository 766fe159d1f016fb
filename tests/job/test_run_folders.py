"""Default run folders (``hydra.run.dir``): the time and a short hash of the command's overrides, so
two launches of different configurations in the same second never pick one folder; the same
configuration picks the same one (the second launch is then refused while the first writes it)."""
import subprocess
import sys
from pathlib import Path

from coolsd.cli.runner import short_hash

ROOT = Path(__file__).resolve().parents[2]


def test_launches_in_the_same_second_get_a_folder_each(tmp_path):
    cmd = [sys.executable, str(ROOT / "run.py"), "method=coolsd", "dataset.n_prompts=1"]
    procs = [subprocess.Popen(cmd + [f"method.delta={d}"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for d in (2.0, 3.0)]  # started together
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    folders = sorted((tmp_path / "outputs" / "toy" / "coolsd").iterdir())
    assert len(folders) == 2 and all((f / "summary.json").exists() for f in folders)
    # <time>_<hash of Hydra's override_dirname> (its overrides sorted, joined by ",")
    suffixes = {f.name.rsplit("_", 1)[1] for f in folders}
    assert suffixes == {short_hash(f"dataset.n_prompts=1,method.delta={d},method=coolsd") for d in (2.0, 3.0)}
