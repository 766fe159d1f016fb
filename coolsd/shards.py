"""Deterministic prompt shards (``shard.index`` / ``shard.count``): shard k of n takes prompt
positions k, k + n, k + 2n, ... of the run's prompt list, so shards are balanced and the union
of all shards is every prompt exactly once. Every shard writes into the same run folder, its
records in its own file (no two processes append to one file); ``coolsd.merge`` joins them.
Per-prompt seeds come from the run seed and the prompt index (``coolsd.job.prompt_seed``), never
from the shard or the order of work, so sharded records equal a one-process run's."""
from __future__ import annotations

import re
from dataclasses import dataclass

SHARD_FILE = re.compile(r"^samples\.shard-(\d+)-of-(\d+)\.jsonl$")


@dataclass(frozen=True)
class Shard:
    index: int = 0
    count: int = 1

    def __post_init__(self):
        for name, v in (("shard.count", self.count), ("shard.index", self.index)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.count < 1:
            raise ValueError(f"shard.count must be >= 1, got {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard.index {self.index} is out of range for shard.count {self.count} "
                             f"(valid: 0 .. {self.count - 1})")

    @classmethod
    def from_cfg(cls, cfg) -> "Shard":
        s = cfg.get("shard") or {}
        return cls(s.get("index", 0), s.get("count", 1))

    def select(self, n: int) -> list[int]:
        """Positions (0 .. n-1) of the prompts this shard generates."""
        return list(range(self.index, n, self.count))

    @property
    def records_name(self) -> str:
        return "samples.jsonl" if self.count == 1 else f"samples.shard-{self.index:03d}-of-{self.count:03d}.jsonl"

    def identity(self) -> dict:
        """What binds a run folder: the shard count (shards of one run differ only in index)."""
        return {} if self.count == 1 else {"shards": self.count}
