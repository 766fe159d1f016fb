"""coolsd's SLURM launcher (conf/hydra/launcher/slurm.yaml ``_target_``): Hydra's submitit SLURM
launcher, whose job-state poller also works on a cluster that keeps no accounting.

submitit learns job states from ``sacct`` (submitit/core/core.py ``InfoWatcher.update``,
submitit/slurm/slurm.py ``SlurmInfoWatcher``). Where the cluster runs without accounting
(``AccountingStorageType=accounting_storage/none``: no slurmdbd, e.g. a one-node test cluster)
every poll fails, prints sacct's "Slurm accounting storage is disabled" plus three copies of
submitit's "Bypassing sacct error" warning, and a job that dies without a result stays
"UNKNOWN" for ever. Here the launcher asks ``scontrol show config`` once; without accounting it
polls ``squeue`` instead (says so in one line on the console) and at least every 60 s, well
inside slurmctld's MinJobAge (300 s by default) during which a finished job is still listed, so
every job's end state is seen. With accounting, submitit's own poller runs unchanged.

Invariant: only the launching process's poller changes (``SlurmJob.watcher``, a class attribute
read there); what runs in the job, the sbatch script and the requeue handling are submitit's.
"""
from __future__ import annotations

import logging
import subprocess
from functools import lru_cache
from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

log = logging.getLogger(__name__)

QUEUE_POLL_S = 60  # < MinJobAge (300 s default): squeue still lists a job this long after it ends
# squeue states after which a job never runs again (slurm's squeue(1) JOB STATE CODES); every
# other state (PENDING, RUNNING, COMPLETING, CONFIGURING, REQUEUED, REQUEUE_HOLD, PREEMPTED,
# SUSPENDED, ...) is a job that is or may again be running
TERMINAL = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}


def accounting_storage() -> str | None:
    """The cluster's ``AccountingStorageType`` (``scontrol show config``), None if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "AccountingStorageType":
            return value.strip()
    return None


@lru_cache(maxsize=1)
def queue_watcher_class():
    """A submitit ``SlurmInfoWatcher`` that reads ``squeue`` (defined on first use: plugin
    discovery imports this module on every start, submitit only when a sweep is launched)."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    class QueueWatcher(SlurmInfoWatcher):
        """Job states from ``squeue --array --states=all`` (one line per array task, finished
        ones included for MinJobAge), in sacct's ``--parsable2`` layout for ``read_info``."""

        def _make_command(self):
            ids = sorted({x.split("_")[0] for x in self._registered - self._finished})
            if not ids:
                return None
            return ["squeue", "--noheader", "--array", "--states=all", "--format=%i|%T|%N", "--jobs=" + ",".join(ids)]

        def read_info(self, string):
            text = string.decode() if isinstance(string, bytes) else string
            return super().read_info("JobID|State|NodeList\n" + text)

        def is_done(self, job_id: str, mode: str = "standard") -> bool:
            return self.get_state(job_id, mode=mode).split(" ")[0].upper() in TERMINAL

    return QueueWatcher


class CoolsdSlurmLauncher(SlurmLauncher):
    """``SlurmLauncher`` that polls ``squeue`` where the cluster keeps no accounting."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        from submitit.slurm import slurm

        storage = accounting_storage()
        if storage == "accounting_storage/none" and not isinstance(slurm.SlurmJob.watcher, queue_watcher_class()):
            slurm.SlurmJob.watcher = queue_watcher_class()(delay_s=QUEUE_POLL_S)
            log.info(f"this SLURM cluster keeps no accounting ({storage}): job states from squeue, "
                     f"polled at least every {QUEUE_POLL_S} s (sacct would fail on every poll)")
        return super().launch(job_overrides, initial_job_idx)
