"""Latency as docs/methods.md#6-evaluation-protocol measures it: host clocks read only after the device has finished
its queued work, so that asynchronous CUDA launches are not mistaken for finished compute."""
from __future__ import annotations

import functools
import time
from typing import Callable

import torch


def device_sync(device) -> Callable[[], None]:
    """A no-argument function that waits for ``device``: ``torch.cuda.synchronize(device)`` on
    CUDA, ``torch.mps.synchronize()`` on MPS, nothing on the CPU (its ops run synchronously)."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


class IntervalTimer:
    """Sums the time of bracketed stretches of work on ``device`` without syncing inside the loop
    (docs/methods.md#6-evaluation-protocol): on CUDA each stretch is a pair of timing events recorded on the current stream,
    read by ``seconds()`` once the caller has synchronised (the loop's end); on the CPU (synchronous)
    the host clock. Work timed this way is the device's, not the host's launch time."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._host = 0.0
        self._events: list = []
        self._t0 = None

    def start(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._t0 = ev
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((self._t0, ev))
        else:
            self._host += time.perf_counter() - self._t0

    def seconds(self) -> float:
        """The stretches' total (on CUDA: call after the device finished them)."""
        return self._host + sum(a.elapsed_time(b) for a, b in self._events) / 1e3


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``), or what ``platform`` knows."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def reset_peak_memory(device) -> None:
    """Start a peak-memory window on ``device``: ``torch.cuda.reset_peak_memory_stats(device)`` on
    CUDA, nothing elsewhere (a host-side reset of the caching allocator's counters: no sync)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device) -> float | None:
    """The most memory tensors held on ``device`` since ``reset_peak_memory`` (or since the process
    started), in GiB: ``torch.cuda.max_memory_allocated(device) / 2**30`` on CUDA (the caching
    allocator's counter, read on the host: no sync); None elsewhere (the CPU has no such counter,
    and no number is made up)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def hardware_name(device) -> str:
    """What measured a latency: the GPU's name on CUDA, else the CPU model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_name()
