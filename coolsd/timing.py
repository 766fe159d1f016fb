"""Latency as METHODS.md 6 measures it: host clocks read only after the device has finished
its queued work, so that asynchronous CUDA launches are not mistaken for finished compute."""
from __future__ import annotations

import functools
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


def hardware_name(device) -> str:
    """What measured a latency: the GPU's name on CUDA, else the CPU model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_name()
