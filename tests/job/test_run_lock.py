"""The locked run folder (coolsd.util.records.RunLock): one process at a time writes a
record file. Two identical runs started together into one folder leave each (prompt, method)
exactly once and the loser names the holder; a live holder refuses a run before it loads
anything and before it writes run.json; a lock left by a kill -9 is taken over and the run
resumes; two shards of a run keep separate locks and separate job logs."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from coolsd.util.records import RunFolderLocked, RunLock
from coolsd.cli.runner import run
from coolsd.job.shards import Shard
from factories import compose

ROOT = Path(__file__).resolve().parents[2]


def _cmd(out: Path, *overrides, n: int = 3) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "method=ar", f"dataset.n_prompts={n}", f"hydra.run.dir={out}",
            *overrides]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _pairs(path: Path) -> Counter:
    return Counter((r["method"], r["prompt_index"]) for r in map(json.loads, path.read_text().splitlines()))


def test_two_identical_runs_started_together_write_every_sample_once(tmp_path):
    out = tmp_path / "run"
    procs = [subprocess.Popen(_cmd(out, n=4), cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stdout.read()) for p in procs]
    pairs = _pairs(out / "samples.jsonl")
    assert set(pairs.values()) == {1} and len(pairs) == 4, pairs  # 4 prompts, none twice
    codes = sorted(rc for rc, _ in results)
    assert codes[0] == 0, results
    if codes[1] != 0:  # they overlapped (the usual case): the loser names the live holder, in one line
        loser = next(text for rc, text in results if rc != 0)
        assert f"samples.jsonl is being written by host {socket.gethostname()}, pid" in loser, loser[-2000:]
        assert "Traceback" not in loser
    else:  # the second started after the first had finished: it resumed with nothing to do
        assert any("4 of 4 samples already there" in text for _, text in results), results


def test_a_live_holder_refuses_a_run_before_it_loads_or_writes(tmp_path):
    out = tmp_path / "run"
    with RunLock(out, "samples.jsonl"):  # this test process holds the folder
        t0 = time.perf_counter()
        proc = subprocess.run(_cmd(out), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        took = time.perf_counter() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"being written by host {socket.gethostname()}, pid {os.getpid()}, since 20" in text, text[-2000:]
    assert "COOLSD_LOCK_WAIT" in text and "Traceback" not in text
    assert not (out / "run.json").exists() and not (out / "samples.jsonl").exists()
    assert took < 30, took  # process start-up and the check only (no model loaded)
    with RunLock(out, "samples.jsonl"):  # in-process callers (sweeps, tests) get the same error
        with pytest.raises(RunFolderLocked, match=f"pid {os.getpid()}"):
            run(compose("method=ar", "dataset.n_prompts=1", f"+out_dir={out}"))
    assert not (out / "run.json").exists()


def test_waiting_for_the_holder_then_resuming(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run(compose("method=ar", "dataset.n_prompts=2", f"+out_dir={out}"))
    before = (out / "samples.jsonl").read_text()
    monkeypatch.setenv("COOLSD_LOCK_WAIT", "30")
    lock = RunLock(out, "samples.jsonl").__enter__()
    import threading

    threading.Timer(1.0, lock.__exit__).start()  # the holder finishes after a second
    t0 = time.perf_counter()
    run(compose("method=ar", "dataset.n_prompts=2", f"+out_dir={out}"))  # waits, then resumes: nothing to do
    assert time.perf_counter() - t0 >= 0.9 and (out / "samples.jsonl").read_text() == before
    monkeypatch.setenv("COOLSD_LOCK_WAIT", "soon")
    with pytest.raises(ValueError, match=r"\$COOLSD_LOCK_WAIT must be a number of seconds >= 0, got 'soon'"):
        run(compose("method=ar", "dataset.n_prompts=2", f"+out_dir={out}"))


def test_a_lock_left_by_kill_9_is_taken_over_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out, n=4), cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    records, deadline = out / "samples.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if records.exists() and 1 <= len(records.read_text().splitlines()) < 4:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run was not caught mid-way"
    holder = json.loads((out / "samples.jsonl.lock").read_text())
    assert holder["pid"] == proc.pid  # the dead holder's line is still there: it must not block
    assert RunLock.held_by(out) is None
    again = subprocess.run(_cmd(out, n=4), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"resuming {out}" in again.stdout
    pairs = _pairs(records)
    assert set(pairs.values()) == {1} and len(pairs) == 4
    assert (out / "samples.jsonl.lock").read_text() == ""  # released: no holder named


def test_shards_keep_separate_locks_and_logs(tmp_path):
    out = tmp_path / "run"
    with RunLock(out, Shard(0, 2).records_name):  # shard 0 is being written elsewhere: shard 1 runs
        proc = subprocess.run(_cmd(out, "shard.index=1", "shard.count=2"), cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        with pytest.raises(RunFolderLocked, match="samples.shard-000-of-002.jsonl is being written"):
            run(compose("method=ar", "dataset.n_prompts=3", f"+out_dir={out}", "shard.index=0", "shard.count=2"))
    assert (out / "samples.shard-001-of-002.jsonl").is_file() and not (out / "samples.shard-000-of-002.jsonl").exists()
    assert sorted(p.name for p in out.glob("*.log")) == ["run.shard-001-of-002.log"]  # Hydra's job log, per shard
    assert Shard().log_name() == "run.log" and Shard(2, 3).log_name("job") == "job.shard-002-of-003.log"


def test_the_refusal_advises_by_the_holders_configuration(tmp_path):
    """Waiting helps a run of the holder's configuration (it then resumes); a run of another
    configuration is told to choose another folder instead (the lock keeps the holder's digest)."""
    from coolsd.job.generation import config_digest

    out = tmp_path / "run"
    mine = compose("method=ar", "dataset.n_prompts=1", f"+out_dir={out}")
    other = compose("method=coolsd", "dataset.n_prompts=1", f"+out_dir={out}")
    assert config_digest(mine) == config_digest(compose("method=ar", "dataset.n_prompts=1", "shard.count=2",
                                                        f"+out_dir={tmp_path / 'elsewhere'}"))
    with RunLock(out, "samples.jsonl", config=config_digest(other)):
        with pytest.raises(RunFolderLocked, match="a run of another configuration: .*use another output folder") as e:
            run(mine)
        assert "wait" not in str(e.value) and "resumes" not in str(e.value)
    with RunLock(out, "samples.jsonl", config=config_digest(mine)):
        with pytest.raises(RunFolderLocked, match=r"wait for it to finish \(a rerun then resumes\)"):
            run(mine)
    assert not (out / "run.json").exists()
