"""Ctrl-C during a run (``coolsd.job.generation.Interrupted``): one line saying how many records are
kept and the command that resumes, exit status 130; the resumed run generates only the rest."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_ctrl_c_keeps_the_records_and_says_how_to_resume(tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "COOLSD_VERBOSE", "COOLSD_INCLUDE")}
    cmd = [sys.executable, str(ROOT / "run.py"), "dataset.n_prompts=6", f"hydra.run.dir={out}"]
    # SIGINT as a terminal delivers it (a background shell may have set it to ignored)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while len(_records(out / "samples.jsonl")) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("samples:")]
    kept = len(_records(out / "samples.jsonl"))
    assert proc.returncode == 130, stderr
    assert lines == [f"error: interrupted: {kept} sample record(s) are kept in {out / 'samples.jsonl'}; to resume, run "
                     f"the same command with hydra.run.dir={out} (nothing kept is generated again)"], stderr
    assert "Traceback" not in stdout + stderr and 2 <= kept < 12
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resuming {out}: {kept} of 12 samples already there" in done.stdout + done.stderr
    records = _records(out / "samples.jsonl")
    assert len(records) == 12 and len({(r["method"], r["prompt_index"]) for r in records}) == 12
