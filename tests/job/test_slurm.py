"""The scale-out path on a real SLURM cluster: a one-node cluster of Debian's
slurm-wlm and munge started by this module (tests/slurm_cluster.py; skipped without them or
without root), then ``run.py -m hydra/launcher=slurm`` with two shards as a real job array.

* without a cluster: the launcher's squeue poller (hydra_plugins/coolsd_slurm) on squeue's output;
* the array completes, ``python -m coolsd.cli.merge`` merges it, and the merged records equal a
  one-process run of the same config (timings aside, as tests/job/test_shards.py compares them:
  batch 1 everywhere, so the same batch shapes); the console has no sacct noise;
* ``scontrol requeue`` of one array task while it is writing its records (held mid-shard by
  ``$COOLSD_TEST_HOLD_FILE``, coolsd.util.records' test aid, so the requeue never races the shard's
  end); the old writer is dead (its pid gone, its flock dropped) before anything else writes;
  its successor waits for the shard's record-file lock (``RunLock``, ``$COOLSD_LOCK_WAIT`` from
  the launcher's setup lines) while a predecessor still holds it, then resumes; every (prompt,
  method) is in its shard file exactly once and the merge equals the one-process run.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, alive, missing_reason

ROOT = Path(__file__).resolve().parents[2]
N = 6  # prompts: 3 per shard, 6 records per shard file (ar + coolsd)
TIMING = ("latency_s", "signal_s", "decode_s")
RUN = f"coolsd_dataset.n_prompts={N},method=coolsd"  # the run folder (swept values, never the shard)


def _strip(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _complete_lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _etc_state():
    return {d: sorted(p.name for p in Path(d).rglob("*")) if Path(d).exists() else None
            for d in ("/etc/slurm", "/etc/munge")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    """The running cluster; every test that needs it is skipped, with the reason, where it cannot start."""
    if (why := missing_reason()) is not None:
        pytest.skip(why)
    etc = _etc_state()
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    request.addfinalizer(c.stop)  # the daemons and any job die even if a test (or start) fails
    c.etc_before = etc
    return c.start()


class OneProcessRun:
    """The one-process run of the sweep's configuration (``run.py``, no launcher), started in the
    background so that it shares the machine with the first array instead of running before it."""

    def __init__(self, out: Path):
        self.out, self._records = out, None
        self.log = open(out.parent / "single.txt", "w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "run.py"), "method=coolsd", f"dataset.n_prompts={N}",
                                      f"hydra.run.dir={out}"], cwd=out.parent, stdout=self.log, stderr=subprocess.STDOUT)

    def records(self) -> list[dict]:
        if self._records is None:
            rc = self.proc.wait(timeout=300)
            self.log.close()
            assert rc == 0, (self.out.parent / "single.txt").read_text()[-3000:]
            self._records = _strip(_lines(self.out / "samples.jsonl"))
            assert len(self._records) == 2 * N
        return self._records

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    ref = OneProcessRun(tmp_path_factory.mktemp("single") / "run")
    request.addfinalizer(ref.stop)
    return ref


def _sweep(sweep: Path) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=slurm", "method=coolsd",
            f"dataset.n_prompts={N}", "shard.index=0,1", "shard.count=2", "hydra.launcher.partition=debug",
            "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
            "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}"]


def _array_id(sweep: Path) -> str:
    ids = {p.name.split("_")[0] for p in (sweep / ".submitit").glob("*_*") if p.is_dir()}
    assert len(ids) == 1, f"expected one job array in {sweep}/.submitit, found {sorted(ids)}"
    return ids.pop()


def _console_is_readable(out: str) -> None:
    assert "Bypassing sacct error" not in out and "accounting storage is disabled" not in out, out[-3000:]
    assert out.count("job states from squeue") == 1, out[-3000:]


def _openers(path: Path) -> set[int]:
    """Pids other than this one with ``path`` open (a RunLock waiting for it keeps it open)."""
    pids = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == str(path) for fd in (d / "fd").iterdir()):
                pids.add(int(d.name))
        except OSError:
            pass
    return pids


def test_job_array_with_a_requeued_task_resumes_without_loss_or_repeat_and_merges(cluster, reference, tmp_path,
                                                                                  capsys):
    """The scale-out path end to end (one sweep, to keep the suite short): both shards run as the
    tasks of one real job array; one task is requeued mid-run while a stand-in predecessor still
    holds its record file's lock; the array completes, the console is readable and prints the
    merge command, and the merge equals the one-process run with every record once.

    Deterministic on any machine: the array runs with ``$COOLSD_TEST_HOLD_FILE`` (coolsd.util.records'
    test aid), so each task stops after its first durable record until the hold file goes; the
    requeue therefore always lands mid-shard (a toy shard otherwise finishes within KillWait), and
    the hold goes only once the old task's writer is dead, before its successor is released."""
    from coolsd.cli.merge import main as merge_main
    from coolsd.util.records import TEST_HOLD_ENV, RunLock
    from coolsd.job.shards import Shard

    sweep, log, hold = tmp_path / "sweep", tmp_path / "console.txt", tmp_path / "hold"
    run_dir = sweep / RUN
    hold.touch()
    with open(log, "w") as console:
        proc = subprocess.Popen(_sweep(sweep), cwd=ROOT, env={**cluster.env, TEST_HOLD_ENV: str(hold)}, stdout=console,
                                stderr=subprocess.STDOUT)
    try:
        # 1. a shard mid-run: its writer holds with at least one record on disk and not all 6
        target, deadline = None, time.monotonic() + 180
        while target is None and time.monotonic() < deadline and proc.poll() is None:
            target = next((k for k in (0, 1) if _complete_lines(run_dir / Shard(k, 2).records_name) >= 1), None)
            time.sleep(0.05)
        assert target is not None, "no shard wrote a record\n" + log.read_text()[-3000:]
        name = Shard(target, 2).records_name
        lock_file = run_dir / (name + ".lock")
        jid = _array_id(sweep)
        task = f"{jid}_{target}"
        submitted = (sweep / ".submitit" / task / f"{task}_submitted.pkl").read_bytes().decode("latin-1")
        assert f"shard.index={target}" in submitted  # array task k runs shard k
        writer = json.loads(lock_file.read_text())["pid"]  # RunLock names its holder: the old task's writer
        assert writer in cluster.task_pids(jid, target), (writer, cluster.task_pids(jid, target))
        n_held = _complete_lines(run_dir / name)
        assert 1 <= n_held < 6, n_held
        old = cluster.job(task)
        assert old["JobState"] == "RUNNING", old
        cluster.run("scontrol", "requeue", task)
        # PENDING at once, while its old processes still live: they get SIGTERM (which submitit
        # ignores), SIGKILL KillWait (1 s) later
        requeued = cluster.wait_job(task, ("PENDING",), timeout=60)
        assert requeued["JobState"] == "PENDING" and requeued["Restarts"] == "1", requeued
        t0 = time.monotonic()
        while cluster.task_pids(jid, target) and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert not alive(writer) and cluster.task_pids(jid, target) == [], "the requeued task's old processes live on"
        assert _complete_lines(run_dir / name) == n_held  # killed while held: it wrote nothing more
        hold.unlink()  # the other shard goes on; this one's successor will not hold

        # 2. stand in for a predecessor still flushing: take the shard's lock (free: its holder is
        # dead, the kernel dropped its flock) and hold it until the requeued task is waiting for it
        with RunLock(run_dir, name, wait=30):
            assert _complete_lines(run_dir / name) == n_held
            # slurmctld holds a requeued job ~2 min (Reason=BeginTime); release it at once
            cluster.run("scontrol", "update", f"JobId={task}", "StartTime=now")
            t0 = time.monotonic()
            while not _openers(lock_file) and time.monotonic() - t0 < 120 and proc.poll() is None:
                time.sleep(0.1)
            waiter = _openers(lock_file)
            assert waiter, "the requeued task never reached the lock\n" + log.read_text()[-3000:]
            assert writer not in waiter  # the successor, a new process
            time.sleep(1.5)
            assert _complete_lines(run_dir / name) == n_held  # it waits: writes nothing while another holds the lock
            assert cluster.job(task)["JobState"] == "RUNNING" and proc.poll() is None
        proc.wait(timeout=240)
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:] + "\n" + cluster.logs()
    _console_is_readable(out)
    assert f"python -m coolsd.cli.merge {run_dir}" in out
    other = f"{jid}_{1 - target}"  # the untouched shard: the plain path
    info = cluster.wait_job(other)
    assert (info["ArrayJobId"], info["ArrayTaskId"], info["JobState"]) == (jid, str(1 - target), "COMPLETED"), info
    info = cluster.wait_job(task)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), info  # ran twice: once killed, once to the end
    task_log = (sweep / ".submitit" / task / f"{task}_0_log.out").read_text()  # both runs (--open-mode=append)
    assert f"resuming {run_dir}: {n_held} of 6 samples already there" in task_log, task_log[-2000:]

    for k in (0, 1):  # each shard file: every (prompt, method) of the shard exactly once
        keys = [(r["prompt_index"], r["method"]) for r in _lines(run_dir / Shard(k, 2).records_name)]
        assert sorted(keys) == sorted((p, m) for p in Shard(k, 2).select(N) for m in ("ar", "coolsd")), keys
    capsys.readouterr()
    s = merge_main([str(run_dir)])  # python -m coolsd.cli.merge <run folder>, in this process (no second torch import)
    assert s["merged_shards"] == 2 and s["prompts_missing"] == []
    assert f"merged 2 of 2 shard(s): {N} complete prompts -> {run_dir}/summary.json" in capsys.readouterr().out
    assert _strip(_lines(run_dir / "samples.jsonl")) == reference.records()


def test_cluster_stops_and_leaves_nothing_behind(cluster):
    daemons = [p.pid for p in cluster.procs.values()]
    cluster.stop()
    for pid in daemons:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    assert cluster._job_pids() == []
    assert _etc_state() == cluster.etc_before  # the cluster lived in its temporary folder only


def test_queue_poller_reads_squeue_and_waits_through_requeue_states(monkeypatch):
    """Where the cluster keeps no accounting the launcher polls squeue (hydra_plugins/coolsd_slurm):
    its array lines parse into per-task states, and only end states count as done (a task in
    REQUEUE_HOLD or CONFIGURING may run again; submitit would call those done)."""
    import hydra_plugins.coolsd_slurm as launcher

    w = launcher.queue_watcher_class()(delay_s=60)
    for task in ("7_0", "7_1", "7_2", "8"):
        w.register_job(task)
    assert w._make_command()[-1] == "--jobs=7,8"
    w._info_dict.update(w.read_info("7_0|COMPLETED|vm\n7_1|REQUEUE_HOLD|vm\n7_2|CANCELLED by 0|\n8|CONFIGURING|vm\n"))
    assert [w.is_done(t, mode="cache") for t in ("7_0", "7_1", "7_2", "8")] == [True, False, True, False]
    w._info_dict.update(w.read_info("7_[3-4]|PENDING|\n"))  # a pending range, as squeue may print it
    assert w.get_state("7_4", mode="cache") == "PENDING" and not w.is_done("7_9", mode="cache")  # unknown: not done

    class Out:
        stdout = "AccountingStorageHost   = (null)\nAccountingStorageType   = accounting_storage/none\n"

    monkeypatch.setattr(launcher.subprocess, "run", lambda *a, **k: Out())
    assert launcher.accounting_storage() == "accounting_storage/none"
    monkeypatch.setattr(launcher.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("scontrol")))
    assert launcher.accounting_storage() is None  # no scontrol: submitit's own sacct poller stays
