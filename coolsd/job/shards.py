"""Deterministic prompt shards (``shard.index`` / ``shard.count``): shard k of n takes prompt
positions k, k + n, k + 2n, ... of the run's prompt list, so shards are balanced and the union
of all shards is every prompt exactly once. Every shard writes into the same run folder, its
records in its own file, its log in its own ``run.shard-<k>-of-<n>.log``; a shard holds the lock
of its record file while it writes (``coolsd.util.records.RunLock``), so no two processes append to one
file; ``coolsd.cli.merge`` joins them.
Per-prompt seeds come from the run seed and the prompt index (``coolsd.job.generation.prompt_seed``), never
from the shard or the order of work, so sharded records equal a one-process run's."""
from __future__ import annotations

import re
from dataclasses import dataclass

from coolsd.util.errors import ConfigError

SHARD_FILE = re.compile(r"^samples\.shard-(\d+)-of-(\d+)\.jsonl$")


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    def __post_init__(self):
        for name, v in (("shard.count", self.count), ("shard.index", self.index)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
        if self.count < 1:
            raise ConfigError(f"shard.count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ConfigError(f"shard.index {self.index} is out of range for shard.count {self.count} "
                             f"(valid: 0 .. {self.count - 1})")

    @classmethod
    def from_cfg(cls, cfg) -> "Shard":
        s = cfg.get("shard") or {}
        return cls(s.get("index", 0), s.get("count", 1))

    def select(self, n: int) -> list[int]:
        """Positions (0 .. n-1) of the prompts this shard generates."""
        return list(range(self.index, n, self.count))

    @property
    def suffix(self) -> str:
        """What tells this shard's files from its siblings' in the shared run folder ("" unsharded)."""
        return "" if self.count == 1 else f".shard-{self.index:03d}-of-{self.count:03d}"

    @property
    def records_name(self) -> str:
        return f"samples{self.suffix}.jsonl"

    def log_name(self, job: str = "run") -> str:
        """Hydra's job log file of this shard (``hydra.job_logging`` in conf/config.yaml): one per shard."""
        return f"{job}{self.suffix}.log"

    def identity(self) -> dict:
        """What binds a run folder: the shard count (shards of one run differ only in index)."""
        return {} if self.count == 1 else {"shards": self.count}


def log_name(job: str, index, count) -> str:
    """``${coolsd_log_name:job,index,count}``: the job log file name of a shard; values that are
    not a valid shard give the unsharded name (the job itself reports them, naming the key)."""
    try:
        return Shard(int(index), int(count)).log_name(str(job))
    except (TypeError, ValueError):
        return f"{job}.log"


def merge_commands(sweep_dir) -> list[str]:
    """``python -m coolsd.cli.merge <run folder>`` for each sharded run folder of a multirun."""
    import json
    import shlex
    from pathlib import Path

    out = []
    for ident in sorted(Path(sweep_dir).glob("*/run.json")):
        try:
            sharded = int(json.loads(ident.read_text()).get("shards", 1)) > 1
        except (OSError, ValueError, AttributeError):
            continue
        if sharded:
            out.append(f"python -m coolsd.cli.merge {shlex.quote(str(ident.parent))}")
    return out
