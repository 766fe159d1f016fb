"""Where the metric networks run, and at what float32 precision (``python -m coolsd.cli.evaluate``).

Device: ``default_device()`` is ``"cuda"`` when ``torch.cuda.is_available()``, else ``"cpu"``;
``check_device`` refuses a CUDA device on a machine without CUDA (one line naming the flag and
the fix) before any input is read or network loaded.

Precision policy: every metric network (Inception-v3 for FID, both CLIP scorers, the toy
feature network) runs in float32 with TF32 off, inside ``ieee_fp32()``, which restores the
caller's settings on exit. TF32 rounds matmul / convolution inputs to a 10-bit mantissa
(PyTorch notes, "TensorFloat-32 (TF32) on Ampere (and later) devices"); cuDNN convolutions use
it by default (``torch.backends.cudnn.allow_tf32 = True``), so Inception-v3, a stack of 94
convolutions, would otherwise give GPU features that differ from the CPU's far beyond float32
rounding. With TF32 off the two differ only by float32 summation order.

The FID reference statistics are cached under a key that also names ``metric_numerics``: the
device type and the precision in effect inside ``ieee_fp32()`` (``metric_precision``). So
statistics made on one device or under one precision are never read on another or under
another, even though the policy makes them agree to float32 rounding: the cache is only ever
read back by a computation that would have produced it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from coolsd.util.errors import ConfigError


def default_device() -> str:
    """``"cuda"`` when this machine has CUDA (``torch.cuda.is_available()``), else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device, flag: str = "--device") -> str:
    """``device`` as given, checked to exist here: a device string torch does not parse, or a
    CUDA device without CUDA (or past the last GPU), is a ``ConfigError`` naming ``flag`` and the fix."""

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{flag} {device!r} is not a torch device: valid: cpu, cuda, cuda:N") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{flag} {device} but CUDA is not available on this machine "
                              f"(torch.cuda.is_available() is False); pass {flag} cpu, or leave {flag} out "
                              "(default: cuda when available, else cpu)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ConfigError(f"{flag} {device} but this machine has {torch.cuda.device_count()} CUDA device(s) "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}); pass {flag} cuda")
    elif d.type != "cpu":
        raise ConfigError(f"{flag} {device}: the metrics run on cpu or cuda only")
    return str(device)


@contextmanager
def ieee_fp32():
    """float32 matmuls and convolutions in IEEE float32, TF32 off, inside; the caller's settings
    back on exit. ``torch.set_float32_matmul_precision("highest")`` covers cuBLAS and oneDNN
    matmuls (it also sets ``torch.backends.cuda.matmul.allow_tf32 = False``) and
    ``torch.backends.cudnn.allow_tf32 = False`` the cuDNN convolutions and RNNs. Only the legacy
    setters are used: in torch >= 2.9 they keep the per-backend ``fp32_precision`` flags in step,
    where setting those directly beside the legacy ones leaves a state torch refuses to read."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


def fp32_settings() -> str:
    """The float32 precision settings now: matmul precision and cuDNN's TF32 flag."""
    return (f"float32_matmul_precision={torch.get_float32_matmul_precision()},"
            f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}")


def metric_precision() -> str:
    """The precision the metric networks run at: ``fp32_settings()`` inside ``ieee_fp32()``."""
    with ieee_fp32():
        return "float32|" + fp32_settings()


def metric_numerics(device) -> str:
    """``<device type>|<metric_precision()>``: what the FID reference cache key names, so that
    statistics are only read back on the device type and precision that made them."""
    return f"{torch.device(device).type}|{metric_precision()}"
