"""The compiled decode path (``compile=true``): model forwards under ``torch.compile``.

gpt-fast's recipe: every forward has static shapes. The KV cache is static
(``KVCache(static=True)``: attention over the whole buffer under a mask, writes by scatter), so
a forward's graph depends only on its token count m and the pending count P of its cache, which
a static draft tree fixes: a method needs a handful of graphs (AR step, tree verification,
one per drafter level), all compiled during the job's warm-up. Inductor generates C++ on the
CPU and Triton with CUDA graphs (``mode="reduce-overhead"``) on CUDA.

``compile_count()`` counts graphs compiled in this process (dynamo's ``unique_graphs``), so a
job can report how many compilations happened after its warm-up (the goal: 0). Compiled and
eager forwards agree within float tolerance, not bit for bit (fused kernels round differently),
so a compiled run's tokens equal an eager run's in distribution only.
"""
from __future__ import annotations

from typing import Callable

import torch

# graphs per compiled function: one per (m, P) a tree asks for; beyond this dynamo falls back to eager
RECOMPILE_LIMIT = 64


def compile_step(fn: Callable, device) -> Callable:
    """``fn`` under ``torch.compile`` with static shapes and the whole forward as one graph."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if torch.device(device).type == "cuda":
        return torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")
    # CPU: a C++ wrapper calls the kernels (less Python per call than the default Python wrapper)
    return torch.compile(fn, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})


def compile_count() -> int:
    """Graphs compiled so far in this process (all compiled functions together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiling() -> bool:
    """Whether the calling code is being traced by ``torch.compile``."""
    return torch.compiler.is_compiling()


def compiled_for(owner, name: str, fn: Callable) -> Callable:
    """``compile_step(fn)`` made once per ``owner`` (a model object) and kept on it: graphs are
    cached per owner, so one process running many models never reaches ``RECOMPILE_LIMIT``."""
    cache = owner.__dict__.setdefault("_compiled_fns", {})
    if name not in cache:
        cache[name] = compile_step(fn, getattr(owner, "device", "cpu"))
    return cache[name]
