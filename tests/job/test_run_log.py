"""A run's folder keeps what the run said: ``run.log`` (Hydra's job log) holds every message the
run printed (the summary table, the warm-up, the ``wrote`` line), each printed once on the console,
and ``summary.md`` holds the summary table as Markdown beside ``summary.json``."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_run_log_and_summary_md_hold_what_the_run_printed(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "method=eagle", "dataset.n_prompts=2",
                           f"hydra.run.dir={out}"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (out / "run.log").read_text()
    for said in ("warm-up (excluded from latency)", "accepted length", f"wrote {out}/summary.json, summary.md"):
        assert said in log and proc.stdout.count(said) == 1, said  # logged, and printed once, not twice
    assert "[coolsd][INFO]" not in proc.stdout + proc.stderr
    md = (out / "summary.md").read_text().splitlines()
    assert md[0].startswith("| method | accepted length | latency s |") and md[1].startswith("|---|---|")
    assert [line.split(" | ")[0] for line in md[2:4]] == ["| ar", "| eagle"]
    assert md[2].count("|") == md[0].count("|")  # a cell per column
