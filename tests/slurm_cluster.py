"""A real one-node SLURM cluster for tests (tests/job/test_slurm.py): Debian's ``slurm-wlm`` and
``munge`` daemons, started as root from a temporary folder and stopped afterwards.

Everything lives in that folder: a generated munge key and munged's socket, a ~25-line
``slurm.conf`` (this host as controller and only node, ``CPUs`` = its core count, partition
``debug``, ``proctrack/linuxproc``, ``task/none``, no accounting, free ports), state, spool, pid
and log files. Clients find it through ``$SLURM_CONF`` (``SlurmCluster.env``); nothing is
written to /etc, /run or /var. ``stop`` cancels every job, kills what is left of them (found by
``SLURM_CONF=<this conf>`` in their environment, by pid) and then the three daemons it started.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")


def missing_reason() -> str | None:
    """Why a cluster cannot start here (None: it can)."""
    absent = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if absent:
        return (f"SLURM test cluster needs slurm-wlm and munge ({', '.join(absent)} not found): "
                "apt-get install -y --no-install-recommends slurm-wlm munge (.ci/run does this as root)")
    if os.geteuid() != 0:
        return "SLURM test cluster runs its daemons as root (slurmd starts jobs as their user); run as root"
    return None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie has exited: it holds no files or locks)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o711)  # munged: the socket's folder must be reachable, the key private
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld_port, d_port = _free_ports(2)
        self.conf.write_text("\n".join([
            "ClusterName=coolsdtest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={d_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge/munge.socket",
            "SlurmUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "AccountingStorageType=accounting_storage/none",  # no slurmdbd: sacct fails (hydra_plugins/coolsd_slurm)
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=1",  # a requeued / cancelled job gets SIGKILL 1 s after SIGTERM (submitit ignores SIGTERM)
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} "
            f"RealMemory={max(1024, _memory_mb() - 512)} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            ""]))

    def _start(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.console", "w")
        self.procs[name] = subprocess.Popen([_binary(name), *args], stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env, start_new_session=True)
        log.close()

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        self.write_conf()
        r = self.root
        self._start("munged", "--foreground", "--force", f"--key-file={r}/munge/munge.key",
                    f"--socket={r}/munge/munge.socket", f"--pid-file={r}/munge/munged.pid",
                    f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/munged.seed")
        self._wait(lambda: (r / "munge" / "munge.socket").exists(), 10, "munged's socket")
        self._start("slurmctld", "-D", "-f", str(self.conf))
        self._start("slurmd", "-D", "-f", str(self.conf))
        self._wait(self.node_idle, timeout, f"node {self.host} idle in sinfo")
        return self

    def node_idle(self) -> bool:
        out = self.run("sinfo", "--noheader", "--nodes", self.host, "--format=%t", check=False)
        return out.returncode == 0 and out.stdout.strip().startswith("idle")

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}\n{self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} after {timeout:.0f} s\n{self.logs()}")

    def logs(self, tail: int = 20) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` of one job (or array task) as {key: value}."""
        text = self.run("scontrol", "--oneliner", "show", "job", job_id).stdout
        return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)

    def wait_job(self, job_id: str, states=("COMPLETED",), timeout: float = 60) -> dict:
        """``job`` once its JobState is one of ``states`` (a task that has returned its result may
        still be exiting for a moment)."""
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id))["JobState"] not in states and time.monotonic() < deadline:
            time.sleep(0.2)
        return info

    def _job_environs(self) -> dict[int, list[bytes]]:
        """{pid: environment} of this cluster's job processes: slurmstepd gives them this cluster's
        ``SLURM_CONF`` and a ``SLURM_JOB_ID`` (the daemons and slurmctld's slurmscriptd have no job id)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        out = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != os.getpid():
                try:
                    env = (d / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if mark in env and any(v.startswith(b"SLURM_JOB_ID=") for v in env) and alive(int(d.name)):
                    out[int(d.name)] = env
        return out

    def _job_pids(self) -> list[int]:
        """Live processes of this cluster's jobs."""
        return sorted(self._job_environs())

    def task_pids(self, array_job_id: str, task_id: int) -> list[int]:
        """Live processes of one array task (``SLURM_ARRAY_JOB_ID`` / ``SLURM_ARRAY_TASK_ID`` in their
        environment): what a requeue must kill before the task's successor may write."""
        want = {f"SLURM_ARRAY_JOB_ID={array_job_id}".encode(), f"SLURM_ARRAY_TASK_ID={task_id}".encode()}
        return sorted(pid for pid, env in self._job_environs().items() if want <= set(env))

    def stop(self) -> None:
        """Cancel every job, kill their leftovers and the daemons (by pid); safe to call twice."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user=root", check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.run("squeue", "--noheader", check=False).stdout.strip():
                time.sleep(0.2)
        for pid in self._job_pids():  # a job the scheduler did not end in time
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in reversed(DAEMONS):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
