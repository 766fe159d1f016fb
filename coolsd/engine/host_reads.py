"""Counting the host's reads of tensor values (each is a device sync on CUDA) and the tensors
the host makes from Python data (each is a host-to-device copy on CUDA).

``count_host_reads()`` patches the conversions through which Python reads a tensor's value
(``bool``, ``int``, ``float``, ``__index__``, ``item``, ``tolist``, ``numpy``, ``cpu``) and counts
them, the ops whose output shape depends on tensor values (``nonzero``, boolean-mask indexing,
``masked_select``, ``unique``: the host waits for them too), with where the first few came from,
and counts every tensor of one or more dimensions lifted
from Python data (``torch.tensor(list)``, indexing with a list: ``aten.lift_fresh``; a 0-dim
scalar is passed by value and is not counted), so a CPU run shows how many syncs and copies the
same code makes on a GPU (the generation loop's budget: docs/gpu.md). On CUDA,
``torch.cuda.set_sync_debug_mode`` confirms the reads independently.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CHECKS_ENV = "COOLSD_CHECKS"


def host_checks() -> bool:
    """Whether validations that read tensor values on the host run (a caller's bad ``n_keep`` or
    token ids): off by default, since each is a device sync every round; ``COOLSD_CHECKS=1`` turns
    them on to debug a new adapter or drafter."""
    return os.environ.get(CHECKS_ENV, "") == "1"


_CONVERSIONS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu")


@dataclass
class HostReads:
    count: int = 0
    lifted: int = 0  # tensors (ndim >= 1) made from Python data
    by_kind: dict = field(default_factory=dict)
    where: list = field(default_factory=list)  # (kind, "file:line function") of the first ``keep`` reads
    keep: int = 4096

    def _hit(self, kind: str) -> None:
        if kind == "lift":
            self.lifted += 1
        else:
            self.count += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if len(self.where) < self.keep:
            f = sys._getframe(2)  # the caller's innermost frame outside this module and torch's own code
            while f is not None and ("host_reads.py" in f.f_code.co_filename or "site-packages" in f.f_code.co_filename):
                f = f.f_back
            self.where.append((kind, f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" if f else "?"))


_aten = torch.ops.aten
# ops whose output shape depends on tensor values: the host must wait for them (a sync on CUDA)
_DATA_DEPENDENT = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                   _aten.unique_dim.default, _aten.unique_consecutive.default}


class _Lifts(TorchDispatchMode):
    def __init__(self, reads: HostReads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten.lift_fresh.default and args and args[0].dim() >= 1:
            self.reads._hit("lift")
        elif func in _DATA_DEPENDENT or (func is _aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)):
            self.reads._hit(func.__name__)  # boolean-mask indexing runs a nonzero
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_reads(lifts: bool = True):
    """Counts every host read of a tensor's value in the block (``HostReads``). Reads inside
    torch's own Python code count too: they sync all the same. ``lifts``: also count tensors made
    from Python data (a dispatch mode, which compiled code refuses to run under: False there)."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in _CONVERSIONS}

    def patched(name, fn):
        def wrapper(self, *args, **kwargs):
            if not torch.compiler.is_compiling():
                reads._hit(name)
            return fn(self, *args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, patched(name, fn))
        with _Lifts(reads) if lifts else contextlib.nullcontext():
            yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
