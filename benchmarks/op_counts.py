"""Aten ops a GPU would launch per eager AR token and per EAGLE tree round, counted on the CPU, and
the Inductor kernels of the compiled rounds: the numbers that lean-round work is held to (on a GPU,
batch-1 decode time is dominated by kernel launches).

    python benchmarks/op_counts.py --label before                 # both targets -> results/gpu/op_counts.{json,md}
    python benchmarks/op_counts.py --label after --targets llamagen --no-compiled
    python benchmarks/op_counts.py --label before --out /path/to/results/gpu   # another checkout's code, one file

What is counted (``count_ops``): every aten op the dispatcher runs, as a GPU would launch it --
* views and aliasing ops count 0 (``func.is_view``, or a schema whose returns alias an input
  without writing it: view, _unsafe_view, expand, as_strided, t, transpose, permute, (un)squeeze,
  slice, select, split, alias, detach, lift_fresh, view_as_complex / view_as_real; ``reshape``
  reaches the dispatcher as a view, or as clone (1) + _unsafe_view (0));
* ops that launch no kernel count 0: allocations (empty, empty_strided, ...), metadata (sym_size,
  is_same_size, and any op that returns no tensor: promote_types, result_type), 0-dim scalars made
  from Python numbers (``scalar_tensor``: passed to a CUDA kernel by value), ``_local_scalar_dense``
  (a host read: counted as such, below);
* ops that CUDA runs as one fused kernel but the CPU decomposes (``F.rms_norm``,
  ``F.scaled_dot_product_attention``, ``F.layer_norm``) count ONCE: they are intercepted at the
  torch-function level (``TorchFunctionMode``) and the dispatch-level counting of their internals is
  suppressed (on CUDA, SDPA with a boolean mask also converts the mask: about 2 more kernels, not
  counted);
* every other op counts 1. Casts, counted apart too: ``_to_copy`` that changes the dtype, ``copy_``
  between dtypes. Host reads (device syncs on a GPU) and tensors lifted from Python data:
  ``coolsd.engine.host_reads.count_host_reads``.
Each op is attributed to its coolsd call path (the stack's frames under ``coolsd/``): its source
(the innermost: ``models/llamagen:Attention.forward``) and its phase (the function the generation
loop ``_generate`` called: ``engine/loop:verify_round``, the drafter's ``propose`` / ``observe``, ...).

Device-dependent branches are taken as on a GPU while counting (``gpu_like``): the eager signal
sink (``DeferredSignals``) holds as many rounds as on a GPU before it flushes (on the CPU it
flushes every round of a tree). A flush's ops are amortised over the rounds it holds on a GPU, and
the RNG pool's refills (the pool doubles: a few per image) are left out of the per-round numbers.

Shapes: LlamaGen GPT-XL (dim 1280, vocab 16384, CFG 3: batch 2 inside the target) and Chameleon-7B
(Lumina-mGPT: hidden 4096, 48x48 image tokens, 8192 codes), bf16, random weights, on the CPU, 1
thread, with 1 and 2 layers (one set of weights: ``specs``): slope = count(2) - count(1) a layer,
fixed = count(1) - slope, the full-depth estimate = fixed + slope x 36 (32). The layers past the
first are zero (``ghost_layers``): every layer count then decodes the same tokens through the same
rounds, so the counts differ by the layers' own ops only (random layers would change acceptance,
whose noise, times 36, would swamp the per-layer count).

Per AR token and per EAGLE-1 ``mc_sim_7b_63`` round, from one run each (``per_round``): what the
run adds between the marks of rounds 1 and k (a mark: the count when ``verify_round`` starts) over
k - 1, i.e. what a run of more rounds adds over one of fewer, taken inside one run: only rounds
1 .. n - 1 - max_depth draft the full tree (the loop lets the drafter draft fewer levels when fewer
tokens remain), so two runs of different lengths end in different numbers of shallower rounds and
their difference is not a steady round (on Lumina it was off by ~7%). For AR both ways agree exactly
(``two_run_difference``; the tests check it). A round in AR tokens = round ops / AR token ops,
split into the target side (``verify_round``: the forward, the walk, the commit), the drafter's
(``propose`` / ``observe``) and the loop's. The quality signals: the same run with
``distortion=False`` (at 1 layer: the signals read the logits and the walk's result, not the
layers), their share = the difference / the full-depth count. The EAGLE head is random with its
decoder layers zeroed (``--random-head`` keeps them random: its matmuls cost most of a Chameleon-7B
round on a CPU; the counts are the same, checked on LlamaGen: 1768.8 ops a round either way).
Lumina's runs have no row end before token 48: a row end's newline entry (one a row) is not in its
counts. While counting, CPU speed-ups that leave every count as it is: a matmul with a zeroed
weight gives zeros without computing, bf16 matmuls of >= 8 rows run in fp32 (cast back: the last
bit may differ), 16-bit float scatters (KV cache writes) run on int16 views of the same bits
(``--exact-bf16`` turns them off).

Compiled (``--no-compiled`` skips it): LlamaGen's target built with ``compile=True`` at tiny widths
(bf16, 1 and 2 layers), AR and EAGLE (eager drafter); the first graph compiled in a run is the round's
(the prefill and the drafter run eagerly); its code is captured at code generation and the compile
stopped there (``Captured``: the C++ compiler is not needed to count). Two counts: the wrapper's
kernel calls (``cpp_fused_*`` functions and extern calls: mm, addmm, bmm, SDPA, ...), and a GPU-like
count, the fused scheduler nodes + extern calls: Inductor's C++ backend groups every loop nest
between two extern calls into one ``cpp_fused_*`` function, where Triton gives each fused node its
own kernel; the CPU's scheduler also fuses a little differently from the CUDA one (outer-loop
fusion; reductions and their consumers). Both are indicative of the GPU's count.

Output: ``<out>/op_counts.json`` keyed by ``--label`` (a run replaces only its label's entry) and
``<out>/op_counts.md``: one table per target with a column per label, checked against the budgets
(``BUDGETS``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import coolsd  # noqa: E402
from coolsd.engine.decoding.rng import PerSampleRNG  # noqa: E402
from coolsd.engine.drafting import SamplingConfig, build_drafter  # noqa: E402
from coolsd.engine.host_reads import count_host_reads  # noqa: E402
from coolsd.engine.loop import speculative_generate  # noqa: E402
from coolsd.engine.methods import build_method  # noqa: E402
from coolsd.util.fingerprint import code_commit  # noqa: E402

TARGETS = ("llamagen", "lumina")
REAL_LAYERS = {"llamagen": 36, "lumina": 32}  # GPT-XL, Chameleon-7B
TREE = "mc_sim_7b_63"
CFG_SCALE = 3.0
# EAGLE's counted run (tokens): its rounds 1 .. n - 1 - max_depth (5) draft the full tree and are
# averaged; a Chameleon-7B-wide round costs seconds on a CPU, so Lumina's run is shorter
TREE_TOKENS = {"llamagen": 16, "lumina": 12}
# the budgets the project is held to (at GPT-XL shapes; the same checks are shown for Lumina)
BUDGETS = {"ar_ops_per_token": 800, "ar_casts_per_token": 150, "round_in_ar_tokens": 1.4,
           "compiled_kernels_per_layer": 10, "compiled_kernels_fixed": 15, "signals_share": 0.05}

# ------------------------------------------------------------------------------------- counting rules
_aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


# aliasing ops (also caught by ``func.is_view`` / the schema's alias info; listed for the record)
VIEW_OPS = _packets("view", "_unsafe_view", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze",
                    "squeeze", "slice", "select", "alias", "detach", "lift_fresh", "reshape", "_reshape_alias",
                    "view_as_complex", "view_as_real", "unfold", "diagonal", "split", "split_with_sizes",
                    "unbind", "chunk", "narrow", "expand_as", "view_as", "flatten", "unflatten", "movedim",
                    "_conj", "_neg_view", "real", "imag", "indices", "values")
# ops that launch no kernel: allocation, metadata, scalars passed by value, the host read itself
NO_KERNEL_OPS = _packets("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "sym_size",
                         "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "size", "stride", "dim",
                         "numel", "is_contiguous", "_has_compatible_shallow_copy_type", "scalar_tensor",
                         "_local_scalar_dense", "resize_", "set_", "_version", "record_stream")
_CAST_OPS = _packets("_to_copy", "to", "_to_copy_out")
_COPY_OPS = _packets("copy_", "copy")

# torch functions that CUDA runs as one fused kernel and the CPU decomposes: each counts once
FUSED_FUNCTIONS = {F.rms_norm: "rms_norm", F.scaled_dot_product_attention: "scaled_dot_product_attention",
                   F.layer_norm: "layer_norm"}
for _name in ("rms_norm", "layer_norm"):
    if hasattr(torch, _name):
        FUSED_FUNCTIONS[getattr(torch, _name)] = _name


def is_view(func) -> bool:
    """Whether ``func`` only aliases its input (no kernel): ``func.is_view``, or every return aliases
    an input without writing it (split, unbind: lists of views)."""
    if func.is_view or func.overloadpacket in VIEW_OPS:
        return True
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def launches(func) -> bool:
    """Whether ``func`` launches a kernel on a GPU (the counting rule, ``count_ops``)."""
    return not (is_view(func) or func.overloadpacket in NO_KERNEL_OPS)


def _makes_tensor(out, func) -> bool:
    """An op that returns no tensor computes metadata on the host (promote_types, result_type) or
    reads a value (a host read, counted as such): no kernel."""
    if isinstance(out, torch.Tensor):
        return True
    if isinstance(out, (tuple, list)):
        return any(isinstance(o, torch.Tensor) for o in out)
    return False


def is_cast(func, args, kwargs, out) -> bool:
    """A dtype conversion: ``_to_copy`` / ``to`` to another dtype, ``copy_`` between dtypes."""
    pk = func.overloadpacket
    if pk in _CAST_OPS:
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        return src is not None and isinstance(out, torch.Tensor) and out.dtype != src.dtype
    if pk in _COPY_OPS and len(args) >= 2 and isinstance(args[0], torch.Tensor) and isinstance(args[1], torch.Tensor):
        return args[0].dtype != args[1].dtype
    return False


# ------------------------------------------------------------------------------------- attribution
_PKG = str(Path(coolsd.__file__).resolve().parent) + os.sep
_label_cache: dict = {}


def _label(code) -> str:
    """``engine/loop:verify_round`` for a coolsd code object."""
    lab = _label_cache.get(code)
    if lab is None:
        rel = code.co_filename[len(_PKG):]
        rel = rel[:-3] if rel.endswith(".py") else rel
        lab = _label_cache[code] = f"{rel.replace(os.sep, '/')}:{getattr(code, 'co_qualname', code.co_name)}"
    return lab


def coolsd_path() -> tuple:
    """The calling coolsd frames, outermost first (labels)."""
    out = []
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith(_PKG):
            out.append(_label(f.f_code))
        f = f.f_back
    return tuple(reversed(out))


LOOP_FRAME = "engine/loop:_generate"  # the generation loop: its callees are the phases


def phase_of(path: tuple) -> str:
    """The function the generation loop called (``engine/loop:verify_round``, the drafter's
    ``propose``...), ``engine/loop:_generate`` for the loop's own ops, else the outermost frame."""
    if LOOP_FRAME in path:
        i = path.index(LOOP_FRAME)
        return path[i + 1] if i + 1 < len(path) else LOOP_FRAME
    return path[0] if path else "-"


# ------------------------------------------------------------------------------------- the counter
@dataclasses.dataclass
class OpCount:
    """Counted ops (``count_ops``). ``by_key``: (coolsd path, op name) -> ops; ``casts_by_key`` the
    same for casts; ``fused``: the torch-function-level ops among them."""

    ops: float = 0
    casts: float = 0
    host_reads: float = 0
    lifted: float = 0
    by_key: Counter = dataclasses.field(default_factory=Counter)
    casts_by_key: Counter = dataclasses.field(default_factory=Counter)
    fused: float = 0
    result: Any = None
    reads: Any = None  # the live host-read counter while counting

    def snapshot(self) -> "OpCount":
        """A copy of the count so far (host reads from the live counter)."""
        r = self.reads
        return OpCount(self.ops, self.casts, r.count if r is not None else self.host_reads,
                       r.lifted if r is not None else self.lifted, Counter(self.by_key), Counter(self.casts_by_key),
                       self.fused)

    @property
    def by_op(self) -> Counter:
        out = Counter()
        for (_, op), n in self.by_key.items():
            out[op] += n
        return out

    @property
    def by_path(self) -> Counter:
        out = Counter()
        for (path, _), n in self.by_key.items():
            out[path] += n
        return out

    @property
    def by_source(self) -> Counter:
        """Ops by the innermost coolsd function that called them."""
        out = Counter()
        for (path, _), n in self.by_key.items():
            out[path[-1] if path else "-"] += n
        return out

    @property
    def by_phase(self) -> Counter:
        out = Counter()
        for (path, _), n in self.by_key.items():
            out[phase_of(path)] += n
        return out

    def where(self, pred: Callable[[tuple], bool]) -> "OpCount":
        """The ops (and casts) whose coolsd path satisfies ``pred`` (host reads not split: 0)."""
        keep = Counter({k: n for k, n in self.by_key.items() if pred(k[0])})
        keep_c = Counter({k: n for k, n in self.casts_by_key.items() if pred(k[0])})
        fused = sum(n for (_, op), n in keep.items() if op.endswith("(fused)"))
        return OpCount(sum(keep.values()), sum(keep_c.values()), 0, 0, keep, keep_c, fused)

    def __sub__(self, other: "OpCount") -> "OpCount":
        by, bc = Counter(self.by_key), Counter(self.casts_by_key)
        by.subtract(other.by_key)
        bc.subtract(other.casts_by_key)
        return OpCount(self.ops - other.ops, self.casts - other.casts, self.host_reads - other.host_reads,
                       self.lifted - other.lifted, by, bc, self.fused - other.fused)

    def __add__(self, other: "OpCount") -> "OpCount":
        by, bc = Counter(self.by_key), Counter(self.casts_by_key)
        by.update(other.by_key)
        bc.update(other.casts_by_key)
        return OpCount(self.ops + other.ops, self.casts + other.casts, self.host_reads + other.host_reads,
                       self.lifted + other.lifted, by, bc, self.fused + other.fused)

    def scaled(self, s: float) -> "OpCount":
        return OpCount(self.ops * s, self.casts * s, self.host_reads * s, self.lifted * s,
                       Counter({k: n * s for k, n in self.by_key.items()}),
                       Counter({k: n * s for k, n in self.casts_by_key.items()}), self.fused * s)


class _Shared:
    def __init__(self):
        self.suppress = 0  # > 0 inside a fused function: its decomposition is not counted


# the Tensor methods through which the host reads values, unpatched (``count_host_reads`` patches
# them; a torch-function mode handed the patched method must call the original, or a read counts twice)
_READ_METHODS = {n: getattr(torch.Tensor, n) for n in ("__bool__", "__int__", "__float__", "__index__", "item",
                                                       "tolist", "numpy", "cpu") if hasattr(torch.Tensor, n)}


class _FusedFunctions(TorchFunctionMode):
    """Counts a ``FUSED_FUNCTIONS`` call once and suppresses the counting of its CPU decomposition."""

    def __init__(self, count: OpCount, shared: _Shared):
        super().__init__()
        self.count, self.shared = count, shared
        self.unpatched = {getattr(torch.Tensor, n): f for n, f in _READ_METHODS.items()
                          if getattr(torch.Tensor, n) is not f}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = FUSED_FUNCTIONS.get(func) if not self.shared.suppress else None
        if name is None:
            return self.unpatched.get(func, func)(*args, **kwargs)
        self.count.ops += 1
        self.count.fused += 1
        self.count.by_key[(coolsd_path(), f"{name} (fused)")] += 1
        self.shared.suppress += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.shared.suppress -= 1


FAST_MM_ROWS = 8  # fewer rows: bf16 is as fast (the fp32 weight's reading dominates)
_MM = {_aten.mm.default: 0, _aten.addmm.default: 1}  # op -> index of its first matrix
_SCATTER = {_aten.scatter_.src, _aten.scatter.src}
_HALF = (torch.bfloat16, torch.float16)


class _Dispatch(TorchDispatchMode):
    """Counts the ops that launch a kernel (``launches``), their casts, by coolsd path. With
    ``fast``, CPU speed-ups of the counting runs that leave every count as it is (each op still
    counts once as itself): a matmul with a zeroed weight (``zeros``) gives zeros (or its bias)
    without computing, a bf16 matmul of >= FAST_MM_ROWS rows runs in fp32 and is cast back
    (fp32 copies of ``frozen`` storages, the weights, are kept), and a 16-bit float scatter (a KV
    cache write) runs on int16 views of the same bits (the CPU's bf16 scatter is ~300x slower; the
    result is bit for bit the same)."""

    def __init__(self, count: OpCount, shared: _Shared, fast: bool, frozen: frozenset, zeros: frozenset = frozenset()):
        super().__init__()
        self.count, self.shared, self.fast, self.frozen, self.zeros = count, shared, fast, frozen, zeros
        self.fp32: dict = {}

    def _fast(self, func, args, kwargs):
        if not self.fast:
            return None
        if func in _SCATTER and not kwargs and len(args) == 4 and args[0].dtype in _HALF \
                and args[3].dtype == args[0].dtype:
            self_, dim, index, src = args
            out = self_ if func is _aten.scatter_.src else self_.clone()
            out.view(torch.int16).scatter_(dim, index, src.view(torch.int16))
            return out
        i = _MM.get(func)
        if i is None or kwargs:
            return None
        a, b = args[i], args[i + 1]
        ptr = b.untyped_storage().data_ptr()
        # a @ 0 = 0 exactly for finite a (read with the unpatched method: no host read of the run's)
        if ptr in self.zeros and a.dtype == b.dtype and _READ_METHODS["item"](torch.isfinite(a).all()):
            out = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
            return out if i == 0 else out + args[0]
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.shape[0] < FAST_MM_ROWS:
            return None
        key = (ptr, b.storage_offset(), tuple(b.shape), tuple(b.stride()), b._version)
        bf = self.fp32.get(key) if ptr in self.frozen else None
        if bf is None:
            bf = b.float()
            if ptr in self.frozen:
                self.fp32[key] = bf
        if i == 0:
            return torch.mm(a.float(), bf).to(torch.bfloat16)
        return torch.addmm(args[0].float(), a.float(), bf).to(torch.bfloat16)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._fast(func, args, kwargs) if not self.shared.suppress else None
        if out is None:
            out = func(*args, **kwargs)
        if self.shared.suppress or not launches(func) or not _makes_tensor(out, func):
            return out
        path = coolsd_path()
        name = str(func.overloadpacket).replace("aten.", "")
        self.count.ops += 1
        self.count.by_key[(path, name)] += 1
        if is_cast(func, args, kwargs, out):
            self.count.casts += 1
            self.count.casts_by_key[(path, name)] += 1
        return out


def resident_tensors(*objs, depth: int = 2, min_numel: int = 1 << 20) -> list:
    """Large tensors held by ``objs`` (modules: their parameters and buffers; other objects: their
    attributes, ``depth`` levels down): the weights a run reads and never writes."""
    out, seen = [], set()

    def walk(o, d):
        if id(o) in seen or o is None:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.numel() >= min_numel:
                out.append(o)
        elif isinstance(o, torch.nn.Module):
            out.extend(list(o.parameters()) + list(o.buffers()))
        elif d > 0 and hasattr(o, "__dict__"):
            for v in vars(o).values():
                walk(v, d - 1)

    for o in objs:
        walk(o, depth)
    return out


@contextlib.contextmanager
def counting(host_reads: bool = True, fast_mm: bool = False, models=(), zeros: frozenset = frozenset()):
    """Counts the ops of the block into the yielded ``OpCount`` (the rules: module docstring).
    ``fast_mm``: the counting runs' CPU speed-ups (``_Dispatch``); ``models``: objects whose large
    tensors are weights (``resident_tensors``)."""
    count, shared = OpCount(), _Shared()
    frozen = frozenset(t.untyped_storage().data_ptr() for t in resident_tensors(*models))
    with contextlib.ExitStack() as st:
        reads = st.enter_context(count_host_reads(lifts=True)) if host_reads else None
        count.reads = reads
        st.enter_context(_Dispatch(count, shared, fast_mm, frozen, zeros))
        st.enter_context(_FusedFunctions(count, shared))
        try:
            yield count
        finally:
            if reads is not None:
                count.host_reads, count.lifted = reads.count, reads.lifted
            count.reads = None


def count_ops(fn: Callable, *args, host_reads: bool = True, **kwargs) -> OpCount:
    """The ops ``fn(*args, **kwargs)`` runs, counted as a GPU launches them; ``.result`` is its value."""
    with counting(host_reads=host_reads) as c:
        c.result = fn(*args, **kwargs)
    return c


# ------------------------------------------------------------------------------------- GPU-like branches
class _FlushLog:
    """Calls of the eager signal sink's flush: (rounds held, rounds it can hold) each."""

    def __init__(self):
        self.calls: list = []


@contextlib.contextmanager
def gpu_like():
    """Device branches as on a GPU while counting: ``DeferredSignals`` holds as many rounds as on a
    GPU before it flushes (its CPU limit is smaller); its flushes are logged (``_FlushLog``)."""
    log = _FlushLog()
    try:
        from coolsd.engine.signals import DeferredSignals
    except ImportError:
        yield log
        return
    saved = {}
    if hasattr(DeferredSignals, "cpu_max_elements") and hasattr(DeferredSignals, "max_elements"):
        saved["cpu_max_elements"] = DeferredSignals.__dict__["cpu_max_elements"]
        DeferredSignals.cpu_max_elements = DeferredSignals.max_elements
    flush = DeferredSignals.__dict__.get("flush")
    if flush is not None:
        def logged(self):
            big = getattr(self, "big", None)
            small = getattr(self, "small", None)
            if small:
                log.calls.append((len(small), big[0].shape[0] if big else None))
            return flush(self)

        saved["flush"] = flush
        DeferredSignals.flush = logged
    try:
        yield log
    finally:
        for k, v in saved.items():
            setattr(DeferredSignals, k, v)


def _is_flush(path: tuple) -> bool:
    return any(p.startswith("engine/signals:DeferredSignals.") and p.endswith("flush") for p in path)


def _is_rng_refill(path: tuple) -> bool:
    return any(p.startswith("engine/decoding/rng:") and p.endswith("stream_uniforms") for p in path)


# ------------------------------------------------------------------------------------- targets
@dataclasses.dataclass
class Spec:
    name: str
    layers: int
    shapes: str
    target: Callable[[bool], Any]  # compile -> a fresh target object
    draft_model: Callable[[Any, bool], Any]  # (target, compile) -> the EAGLE drafter model
    cond: Any
    sampling: SamplingConfig
    models: list  # [target model, drafter head]
    zeros: frozenset = frozenset()  # storages of zeroed weights (``ghost_layers``, ``zero_layers``)


def fewer_layers(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """A model of config ``cfg`` (fewer layers) sharing ``model``'s tensors: its first layers, its
    embedding and head (built on the meta device, then given ``model``'s tensors), so one set of
    random weights serves every layer count."""
    with torch.device("meta"):
        small = type(model)(cfg)
    sd = model.state_dict()
    small.load_state_dict({k: sd[k] for k in small.state_dict()}, assign=True, strict=True)
    if any(t.is_meta for t in list(small.parameters()) + list(small.buffers())):
        raise RuntimeError(f"{type(model).__name__}: a tensor outside the state dict stayed on the meta device")
    return small.eval().requires_grad_(False)


def llamagen(layers: int, dtype=torch.bfloat16, tiny: bool = False, base: Optional[Spec] = None) -> Spec:
    """LlamaGen GPT-XL (or ``coolsd.models.llamagen.tiny``) with ``layers`` layers, random weights, and
    a random EAGLE-1 head (as ``benchmarks/gpu_check.py`` builds them); ``base``: a deeper spec of the
    same kind whose weights (and head) it shares."""
    from coolsd.models.eagle.model import EagleDrafter, EagleHead
    from coolsd.models.llamagen import GPT_XL, LlamaGenGPT, LlamaGenTarget
    from coolsd.models.llamagen import tiny as tiny_cfg

    cfg = dataclasses.replace(tiny_cfg(block_size=64) if tiny else GPT_XL, n_layer=layers)
    if base is not None:
        gpt, head, cond = fewer_layers(base.models[0], cfg), base.models[1], base.cond
    else:
        torch.manual_seed(0)
        gpt = LlamaGenGPT(cfg, **({"init_std": 0.2} if tiny else {})).to(dtype).eval().requires_grad_(False)
        head = EagleHead.from_target(gpt, seed=0).to(dtype).eval().requires_grad_(False)
        g = torch.Generator().manual_seed(0)
        cond = {"caption_embs": torch.randn(1, cfg.cls_token_num, cfg.caption_dim, generator=g).to(dtype),
                "emb_mask": torch.ones(1, cfg.cls_token_num, dtype=torch.bool)}
        cond["emb_mask"][0, : cfg.cls_token_num // 3] = False  # a left-padded caption
    return Spec("llamagen", layers, f"LlamaGen {'tiny' if tiny else 'GPT-XL'} (dim {cfg.dim}, vocab {cfg.vocab_size}, "
                f"{cfg.block_size} image tokens), {layers} layer(s), {str(gpt.dtype)[6:]}",
                lambda compile: LlamaGenTarget(gpt, cfg_scale=CFG_SCALE, prefill_features="all", compile=compile),
                lambda t, compile: EagleDrafter.for_target(head, t, text_prefix=True, compile=compile),
                cond, SamplingConfig(temperature=1.0, top_k=min(2000, cfg.vocab_size), top_p=1.0), [gpt, head])


def _image_vocab(n_codes: int, first_id: int):
    """An ``ImageVocab`` with codes 0..n-1 on BPE ids first_id.. (Chameleon's layout: 4..8195)."""
    from coolsd.models.lumina import ImageVocab

    name = lambda c: "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(c)) + "Z"  # noqa: E731
    return ImageVocab({name(c): first_id + c for c in range(n_codes)}, n_codes)


def lumina(layers: int, dtype=torch.bfloat16, tiny: bool = False, base: Optional[Spec] = None) -> Spec:
    """Lumina-mGPT over Chameleon-7B (or ``coolsd.models.chameleon.tiny``) with ``layers`` layers,
    random weights, and a random LANTERN EAGLE-1 head (as ``benchmarks/gpu_check.py``); ``base``: a
    deeper spec whose weights (and head) it shares."""
    from coolsd.models.chameleon import CHAMELEON_7B, ChameleonLM
    from coolsd.models.chameleon import tiny as tiny_cfg
    from coolsd.models.eagle.lumina import LuminaEagleDrafter, LuminaEagleHead
    from coolsd.models.lumina import LuminaTarget, LuminaTokens

    if tiny:
        cfg, latent, n_codes = tiny_cfg(num_layers=layers), 8, 16
        tokens = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)
        prompt = [0, 30, 31, 32, 33, 26]
    else:
        cfg, latent, n_codes = dataclasses.replace(CHAMELEON_7B, num_layers=layers), 48, 8192
        tokens = LuminaTokens()
        prompt = [0] + list(range(10000, 10040)) + [tokens.sep]  # BOS, 40 text ids, end of turn
    if base is not None:
        model, head = fewer_layers(base.models[0], cfg), base.models[1]
    else:
        torch.manual_seed(0)
        model = ChameleonLM(cfg, init_std=0.3 if tiny else 0.02).to(dtype).eval().requires_grad_(False)
        head = LuminaEagleHead.from_target(model, seed=3).eval().requires_grad_(False)
    vocab = _image_vocab(n_codes, 4)
    return Spec("lumina", layers, f"Lumina-mGPT over Chameleon-7B{' (tiny)' if tiny else ''} "
                f"(hidden {cfg.hidden_size}, "
                f"vocab {cfg.vocab_size}, {latent}x{latent} tokens, {n_codes} codes), {layers} layer(s), "
                f"{str(model.dtype)[6:]}",
                lambda compile: LuminaTarget(model, vocab, h_latent=latent, w_latent=latent, cfg_scale=CFG_SCALE,
                                             tokens=tokens, prefill_features="all"),
                lambda t, compile: LuminaEagleDrafter.for_target(head, t),
                [prompt], SamplingConfig(temperature=1.0, top_k=min(2000, n_codes), top_p=1.0), [model, head])


BUILDERS = {"llamagen": llamagen, "lumina": lumina}


def layer_list(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of transformer layers (``layers``, ``model.layers``)."""
    lists = [m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n.split(".")[-1] == "layers"]
    if len(lists) != 1:
        raise RuntimeError(f"{type(model).__name__}: expected one ModuleList named 'layers', found {len(lists)}")
    return lists[0]


def zero_layers(layers) -> frozenset:
    """Zeroes every parameter of ``layers`` in place; returns their storages. A zero layer adds exactly
    zero to the residual stream (its norms, projections and attention see and give zeros)."""
    ptrs = set()
    with torch.no_grad():
        for layer in layers:
            for p in layer.parameters():
                p.zero_()
                ptrs.add(p.untyped_storage().data_ptr())
    return frozenset(ptrs)


def ghost_layers(model: torch.nn.Module) -> frozenset:
    """Zeroes every parameter of the layers past the first, in place: each such layer then adds
    exactly zero to the residual stream (its norms, projections and attention see and give zeros),
    so a model with more of them decodes the same tokens through the same rounds as the one-layer
    model, and the counts differ by the layers' own ops only (exactly linear in the layer count;
    with random layers, acceptance would differ from depth to depth and its noise, times 36, would
    swamp the per-layer count)."""
    return zero_layers(list(layer_list(model))[1:])


def specs(target_name: str, layer_counts, tiny: bool = False, zero_head: bool = True) -> dict:
    """{L: Spec} for each layer count: the deepest built, its layers past the first zeroed
    (``ghost_layers``), the others sharing its weights (``fewer_layers``). ``zero_head``: the EAGLE
    head's decoder layers zeroed too (``zero_layers``), so that the counting runs skip their matmuls
    (``_Dispatch``): on the CPU they cost most of a Chameleon-7B-wide round. The counts do not depend
    on the values; the head stays a random one (its input projection and the target's embedding and
    lm_head are random): drafts are still rarely accepted, as with the random head of gpu_check."""
    deepest = max(layer_counts)
    out = {deepest: BUILDERS[target_name](deepest, tiny=tiny)}
    zeros = ghost_layers(out[deepest].models[0])
    if zero_head:
        zeros |= zero_layers(layer_list(out[deepest].models[1]))
    out[deepest].zeros = zeros
    for L in layer_counts:
        if L != deepest:
            out[L] = BUILDERS[target_name](L, tiny=tiny, base=out[deepest])
            out[L].zeros = zeros
    return out


# ------------------------------------------------------------------------------------- one counted run
def make(spec: Spec, method, compile: bool = False, draft_compile: bool = False):
    """Fresh target and drafter objects for one run (made outside the counted block: their set-up is no
    round's work)."""
    t = spec.target(compile)
    d = build_drafter(method, spec.draft_model(t, draft_compile) if method.drafter == "model" else None,
                      spec.sampling, t.vocab_size)
    return t, d


def generate(spec: Spec, method, n: int, distortion: bool, objects=None, compile: bool = False,
             draft_compile: bool = False):
    """One image (batch 1, seed 0) of ``n`` tokens through ``speculative_generate``."""
    t, d = objects or make(spec, method, compile, draft_compile)
    with torch.no_grad():
        return speculative_generate(t, n, PerSampleRNG([0]), rule=method.rule, drafter=d, tree=method.tree,
                                    sampling=spec.sampling, cond=spec.cond, batch_size=1, distortion=distortion)


@contextlib.contextmanager
def round_marks(count: OpCount):
    """Snapshots of ``count`` at the start of every round's ``verify_round`` call (the loop looks the
    function up in its module each run: wrapped there for the block). Yields the list; empty if the
    loop has no ``verify_round``."""
    from coolsd.engine import loop

    marks: list = []
    orig = getattr(loop, "verify_round", None)
    if orig is None:
        yield marks
        return

    def marked(*a, **kw):
        marks.append(count.snapshot())
        return orig(*a, **kw)

    loop.verify_round = marked
    try:
        yield marks
    finally:
        loop.verify_round = orig


@dataclasses.dataclass
class Run:
    count: OpCount
    rounds: int
    tokens: int
    flushes: list  # (rounds held, capacity) per flush of the signal sink
    marks: list  # the count at the start of each round's verify_round
    seconds: float


def counted_run(spec: Spec, method, n: int, distortion: bool, fast_mm: bool = True) -> Run:
    """One counted run of ``n`` tokens (fresh target and drafter objects, made before counting)."""
    t0 = time.perf_counter()
    objects = make(spec, method)
    with gpu_like() as log, counting(fast_mm=fast_mm, models=[*spec.models, *objects], zeros=spec.zeros) as c, \
            round_marks(c) as marks:
        res = generate(spec, method, n, distortion, objects)
    return Run(c, len(res.round_lengths[0]), n, list(log.calls), list(marks), time.perf_counter() - t0)


def _regular(path: tuple) -> bool:
    return not (_is_flush(path) or _is_rng_refill(path))


def _amortised_flush(run: Run) -> tuple:
    """(a round's share of the signal sink's flushes: a flush's ops / the rounds a flush holds on a
    GPU, a note) -- the run's flushes hold fewer rounds (the last one holds what is left)."""
    if not run.flushes:
        return OpCount(), None
    fl = run.count.where(_is_flush)
    capacity = run.flushes[0][1] or 1
    return fl.scaled(1 / (len(run.flushes) * capacity)), {"ops_per_flush": round(fl.ops / len(run.flushes), 2),
                                                          "rounds_per_flush": capacity}


def steady_rounds(run: Run, depth: int) -> tuple:
    """(k1, k2): the rounds whose ops are averaged, from the marks of rounds k1 and k2 (what the run
    adds between them). Round 0 is left out (its drafter and walk build what later rounds reuse), and
    so are the rounds from n - 1 - depth on: the loop lets the drafter draft fewer levels when fewer
    tokens remain (the host's depth bound), so only earlier rounds draft the full tree; the
    ops between marks k and k + 1 are round k's verification and observation and round k + 1's
    drafting. AR (depth 0): every round but the first and the last."""
    full = run.tokens - 1 - depth  # the last round that drafts the full tree (the first token: prefill)
    k2 = min(full, len(run.marks) - 1)
    return 1, k2


def per_round(run: Run, depth: int) -> dict:
    """A round's (AR: a token's) count in the steady state, from one run: what the run adds between
    the marks of rounds k1 and k2 (``steady_rounds``) / (k2 - k1), the signal sink's flushes
    amortised over the rounds a flush holds on a GPU, RNG pool refills (the pool doubles: a few per
    image) left out."""
    k1, k2 = steady_rounds(run, depth)
    if k2 - k1 < 2:
        raise RuntimeError(f"{run.tokens} tokens give {k2 - k1} steady rounds of {run.rounds}: use more tokens")
    a, b = run.marks[k1], run.marks[k2]
    per = (b.where(_regular) - a.where(_regular)).scaled(1 / (k2 - k1))
    per.host_reads = (b.host_reads - a.host_reads) / (k2 - k1)
    per.lifted = (b.lifted - a.lifted) / (k2 - k1)
    flush, note = _amortised_flush(run)
    per = per + flush
    return {"count": per, "steady_rounds": [k1, k2], "rounds": run.rounds, "tokens": run.tokens,
            "tokens_per_round": round((run.tokens - 1) / max(run.rounds, 1), 3), "flush": note,
            "rng_refill_ops_in_run": run.count.where(_is_rng_refill).ops, "run_seconds": round(run.seconds, 2)}


def two_run_difference(short: Run, long: Run) -> OpCount:
    """A round's count as (ops of the longer run - the shorter) / (extra rounds), flushes amortised,
    refills left out: exact for AR (every round alike; ``per_round`` gives the same), not for trees
    (the runs' last rounds draft shallower trees, in a number that depends on acceptance)."""
    dr = long.rounds - short.rounds
    if dr <= 0:
        raise RuntimeError(f"the longer run has no extra rounds ({short.rounds} -> {long.rounds})")
    per = (long.count.where(_regular) - short.count.where(_regular)).scaled(1 / dr)
    per.host_reads = (long.count.host_reads - short.count.host_reads) / dr
    per.lifted = (long.count.lifted - short.count.lifted) / dr
    return per + _amortised_flush(long)[0]


# ------------------------------------------------------------------------------------- summaries
def _top(c: Counter, k: int) -> list:
    return [[name, round(n, 2)] for name, n in sorted(c.items(), key=lambda x: -x[1])[:k] if abs(n) > 1e-9]


DRAFTER_FUNCS = ("propose", "observe", "depth_cap")


def side_of(path: tuple) -> str:
    """target (``verify_round``: the forward, the walk, the commit, the bookkeeping), drafter
    (propose / observe), signals (the eager sink's flush), loop (the loop's own ops, the RNG)."""
    if _is_flush(path):
        return "signals flush"
    ph = phase_of(path)
    if ph.endswith(":verify_round"):
        return "target"
    if ph.rsplit(".", 1)[-1] in DRAFTER_FUNCS or ph.rsplit(":", 1)[-1] in DRAFTER_FUNCS:
        return "drafter"
    return "loop"


def area_of(path: tuple) -> str:
    """Within the target side: the forward (by model part), the walk, the commit, ..."""
    side = side_of(path)
    if side != "target":
        return side
    i = next(i for i, p in enumerate(path) if p.endswith(":verify_round"))
    inner = path[i + 1:]
    if not inner:
        return "target: verify_round itself"
    models = [p for p in inner if p.startswith("models/")]
    if models:
        kv = [p for p in models if p.startswith("models/kv_cache:")]
        if kv:  # the cache's own work (its mask, writes, commit), wherever it is called from
            return "target: " + kv[0].split(":")[-1]
        if any(re.search(r"(Attention|Block|Layer|MLP|FeedForward|RMSNorm|rope|Norm)", p) for p in models):
            return "target: model layers"
        return "target: model (" + models[-1].split(":")[-1] + ")"
    return "target: " + inner[0].split(":")[-1]


def _areas(count: OpCount) -> Counter:
    out = Counter()
    for (path, _), n in count.by_key.items():
        out[area_of(path)] += n
    return out


def _in_signals(path: tuple) -> bool:
    """An op of the quality signals (``coolsd.engine.signals``, ``decoding/distortion``)."""
    return any(p.startswith(("engine/signals:", "engine/decoding/distortion:")) for p in path)


def summary(count: OpCount, top: int = 12) -> dict:
    sides, areas = Counter(), _areas(count)
    for (path, _), n in count.by_key.items():
        sides[side_of(path)] += n
    return {"ops": round(count.ops, 2), "casts": round(count.casts, 2), "host_reads": round(count.host_reads, 3),
            "lifted": round(count.lifted, 3), "fused": round(count.fused, 2),
            "sides": {k: round(v, 2) for k, v in sides.items() if abs(v) > 1e-9},
            "areas": _top(areas, 20), "top_ops": _top(count.by_op, top), "top_sources": _top(count.by_source, top),
            "top_cast_sources": _top(_casts_by_source(count), 8)}


def _casts_by_source(count: OpCount) -> Counter:
    out = Counter()
    for (path, _), n in count.casts_by_key.items():
        out[path[-1] if path else "-"] += n
    return out


# ------------------------------------------------------------------------------------- measuring
def _say(*a) -> None:
    print(*a, flush=True)


def methods() -> dict:
    """AR and EAGLE-1 over ``TREE``; one set per target, shared by its layer counts (a tree keeps
    its drafting masks once made: no round after the first few builds one)."""
    return {"ar": build_method("ar"), "eagle": build_method("eagle", tree=TREE)}


def measure(target_name: str, layers: int, *, ar_tokens: int = 12, tree_tokens: int = 16,
            signals: bool = True, tiny: bool = False, fast_mm: bool = True, spec: Optional[Spec] = None,
            method_set: Optional[dict] = None, warm: bool = True, log: Callable = None) -> dict:
    """The eager counts of one target at one layer count, each from one run (``per_round``): per AR
    token (a run of ``ar_tokens``), per EAGLE ``mc_sim_7b_63`` round (a run of ``tree_tokens``:
    its rounds before the last max_depth + 1 draft the full tree), with the quality signals on and
    (``signals``) off. ``warm``: one uncounted run of 2 tokens first (one-time work, lazily built
    constants, belongs to no round; a tree's drafting masks, made once per (depth, levels) as rounds
    first need them, are a few ops in the first rounds: < 1 op a round)."""
    log = log or _say
    spec = spec or BUILDERS[target_name](layers, tiny=tiny)
    method_set = method_set or methods()
    out = {"shapes": spec.shapes, "layers": layers}
    t0 = time.perf_counter()
    lengths = {"ar": ar_tokens, "eagle": tree_tokens}
    for name, method in method_set.items():
        if warm:
            generate(spec, method, 2, True)
        depth = method.tree.max_depth if method.drafter != "none" else 0
        for distortion in ((True, False) if signals else (True,)):
            run = counted_run(spec, method, lengths[name], distortion, fast_mm)
            u = per_round(run, depth)
            key = name + ("" if distortion else "_nosignals")
            out[key] = {**summary(u["count"]), **{k: v for k, v in u.items() if k != "count"}}
            out["_counts_" + key] = u["count"]  # kept for the caller (not written)
            log(f"  [{target_name} {layers} layer(s) {key}] {u['count'].ops:.1f} ops a "
                f"{'token' if name == 'ar' else 'round'} (rounds {u['steady_rounds'][0]}..{u['steady_rounds'][1]} "
                f"of {run.rounds}; {run.seconds:.1f} s)")
    out["seconds"] = time.perf_counter() - t0
    return out


def linear_fit(at: dict, real: int) -> dict:
    """``at``: {L: v(L), L + 1: v(L + 1)}. slope = v(L + 1) - v(L) a layer, fixed = v(L) - slope x L,
    full = fixed + slope x real (the count is linear in the layer count: every layer runs the same ops)."""
    lo, hi = sorted(at)
    slope = (at[hi] - at[lo]) / (hi - lo)
    fixed = at[lo] - slope * lo
    return {"per_layer": round(slope, 2), "fixed": round(fixed, 2), "full": round(fixed + slope * real, 2)}


def eager_target(target_name: str, layer_counts=(1, 2), tiny: bool = False, fast_mm: bool = True,
                 ar_tokens: int = 12, tree_tokens: Optional[int] = None, zero_head: bool = True,
                 log: Callable = None) -> dict:
    """Both layer counts of one target (one set of weights), and the fits to its real depth. The
    signals-off runs are made at the first layer count only: the signals' work does not depend on
    the depth (it reads the logits, the probabilities and the walk's result)."""
    log = log or _say
    real = REAL_LAYERS[target_name]
    tree_tokens = tree_tokens or TREE_TOKENS[target_name]
    t0 = time.perf_counter()
    built = specs(target_name, layer_counts, tiny=tiny, zero_head=zero_head)
    build_s = time.perf_counter() - t0
    log(f"[{target_name}] built in {build_s:.1f} s")
    ms = methods()
    per_layers = {}
    for i, L in enumerate(layer_counts):
        t1 = time.perf_counter()
        m = measure(target_name, L, tiny=tiny, fast_mm=fast_mm, ar_tokens=ar_tokens, tree_tokens=tree_tokens,
                    signals=i == 0, spec=built[L], method_set=ms, warm=i == 0, log=log)
        per_layers[L] = m
        log(f"[{target_name} {L} layer(s)] AR {m['ar']['ops']:.1f} ops/token, EAGLE round {m['eagle']['ops']:.1f} "
            f"ops, {time.perf_counter() - t1:.1f} s")
    lo = layer_counts[0]
    fits = {}
    for key in ("ar", "eagle"):
        for q in ("ops", "casts", "host_reads", "lifted"):
            fits[f"{key}.{q}"] = linear_fit({L: per_layers[L][key][q] for L in layer_counts}, real)
        for side in ("target", "drafter", "loop", "signals flush"):
            fits[f"{key}.side.{side}"] = linear_fit({L: per_layers[L][key]["sides"].get(side, 0.0)
                                                     for L in layer_counts}, real)
    sig = {key: per_layers[lo][key]["ops"] - per_layers[lo][key + "_nosignals"]["ops"] for key in ("ar", "eagle")}
    sig_attr = {key: per_layers[lo]["_counts_" + key].where(_in_signals).ops for key in ("ar", "eagle")}
    ar, rnd = fits["ar.ops"]["full"], fits["eagle.ops"]["full"]
    full = {
        "ar_ops_per_token": ar, "ar_casts_per_token": fits["ar.casts"]["full"],
        "ar_host_reads_per_token": fits["ar.host_reads"]["full"], "ar_lifted_per_token": fits["ar.lifted"]["full"],
        "round_ops": rnd, "round_casts": fits["eagle.casts"]["full"],
        "round_host_reads": fits["eagle.host_reads"]["full"], "round_lifted": fits["eagle.lifted"]["full"],
        "round_in_ar_tokens": round(rnd / ar, 3),
        "round_target_in_ar_tokens": round(fits["eagle.side.target"]["full"] / ar, 3),
        "round_drafter_in_ar_tokens": round(fits["eagle.side.drafter"]["full"] / ar, 3),
        "round_loop_in_ar_tokens": round((fits["eagle.side.loop"]["full"] + fits["eagle.side.signals flush"]["full"])
                                         / ar, 3),
        "signals_ops_per_token": round(sig["ar"], 2), "signals_ops_per_round": round(sig["eagle"], 2),
        "signals_share_ar": round(sig["ar"] / ar, 4), "signals_share_round": round(sig["eagle"] / rnd, 4),
        "signals_ops_by_attribution": {k: round(v, 2) for k, v in sig_attr.items()},
    }
    layers_out = {str(L): {k: v for k, v in m.items() if not k.startswith("_")} for L, m in per_layers.items()}
    # the per-layer and fixed parts by source (AR token and tree round)
    breakdown = {}
    for key in ("ar", "eagle"):
        lo, hi = layer_counts
        c1, c2 = per_layers[lo]["_counts_" + key], per_layers[hi]["_counts_" + key]
        slope = c2 - c1
        fixed = c1 - slope.scaled(lo)
        breakdown[key] = {"per_layer_sources": _top(slope.by_source, 16), "fixed_sources": _top(fixed.by_source, 20),
                          "per_layer_ops": _top(slope.by_op, 20), "fixed_ops": _top(fixed.by_op, 20),
                          "per_layer_casts": _top(_casts_by_source(slope), 8),
                          "fixed_casts": _top(_casts_by_source(fixed), 8),
                          "fixed_phases": _top(fixed.by_phase, 12), "fixed_areas": _top(_areas(fixed), 16)}
    return {"real_layers": real, "shapes": per_layers[lo]["shapes"], "zero_head": zero_head,
            "ar_tokens": ar_tokens, "tree_tokens": tree_tokens, "layers": layers_out, "fits": fits, "full": full,
            "breakdown": breakdown, "build_seconds": round(build_s, 1)}


# ------------------------------------------------------------------------------------- compiled
_KERNEL_CALL = re.compile(r"\b(cpp_fused_\w+|triton_\w+)\s*\(")
_EXTERN_PY = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.aten\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\s*\(")
_EXTERN_CPP = re.compile(r"\b(aoti_torch_cpu_\w+|aoti_torch__\w+|at::\w+_out|aoti_torch_mm\w*|aoti_torch_addmm\w*|"
                         r"aoti_torch_bmm\w*|aoti_torch_proxy_executor_call_function)\s*\(")
# wrapper calls that move no data (allocation, reinterpretation, handles): not kernels
_NOT_KERNELS = ("empty_strided", "reinterpret_tensor", "delete_tensor", "new_tensor_handle", "get_data_ptr",
                "alloc", "as_strided", "assert_", "check_", "wrap_", "get_", "item", "convert_", "_reinterpret")


def count_kernels(code: str) -> dict:
    """Kernel launches in one Inductor wrapper: its generated kernels (``cpp_fused_*``; ``triton_*``
    on CUDA) called from the wrapper's ``call`` path, and its extern calls (mm, addmm, bmm, SDPA...).
    A kernel's definition (``def``/``extern "C" void``) is not a call; each call site counts once."""
    calls, externs = Counter(), Counter()
    body = code
    # the Python wrapper: kernels are defined as ``cpp_fused_x = async_compile.cpp_pybinding(...)``
    for line in body.splitlines():
        s = line.strip()
        if not s or s.startswith(("#", "//")) or "async_compile" in s or s.startswith(("def ", "extern ", "void ")):
            continue
        if re.match(r"^(cpp_fused_\w+|triton_\w+)\s*=", s):
            continue
        for m in _KERNEL_CALL.finditer(s):
            calls[m.group(1)] += 1
        for m in list(_EXTERN_PY.finditer(s)) + list(_EXTERN_CPP.finditer(s)):
            name = m.group(1)
            if not any(k in name for k in _NOT_KERNELS):
                externs[name] += 1
    return {"kernels": sum(calls.values()) + sum(externs.values()), "generated": sum(calls.values()),
            "extern": sum(externs.values()), "extern_calls": dict(externs)}


def _classify(nodes) -> dict:
    """One graph's scheduled nodes: fused loop nests (each a kernel on a GPU, where Triton gives every
    fused node its own kernel; Inductor's C++ code on the CPU groups the nests between two extern
    calls into one ``cpp_fused_*`` function) and extern kernels (mm, SDPA, fallbacks)."""
    from torch._inductor.scheduler import NopKernelSchedulerNode

    fused, externs = 0, Counter()
    for n in nodes:
        if isinstance(n, NopKernelSchedulerNode):
            continue
        if n.is_extern():
            kind = type(n.node).__name__
            if kind in ("MultiOutput",):  # a tuple element of an extern's result: no kernel
                continue
            name = getattr(n.node, "python_kernel_name", None) or kind
            externs[str(name).replace("torch.ops.", "").replace("extern_kernels.", "")] += 1
        elif n.is_foreach():
            fused += len(getattr(n, "snodes", [n]))
        else:
            fused += 1
    return {"fused_nodes": fused, "extern": sum(externs.values()), "extern_kinds": dict(externs),
            "kernels": fused + sum(externs.values())}


class Captured(Exception):
    """Raised by ``capture_inductor_code(stop_after=n)`` once n graphs' code is generated."""


@contextlib.contextmanager
def capture_inductor_code(stop_after: Optional[int] = None):
    """Every Inductor graph compiled in the block, in order: ``{"code": its wrapper code, "nodes": its
    scheduled nodes (``_classify``)}``. ``stop_after``: raise ``Captured`` once that many graphs'
    code is generated, before the C++ compiler runs (most of a CPU compile's time; counting needs
    the code only); the caller catches it."""
    import torch._inductor.config
    from torch._inductor import graph as ind_graph
    from torch._inductor import scheduler as ind_sched

    graphs: list = []
    stack: list = []
    orig_codegen, orig_sched = ind_graph.GraphLowering.codegen, ind_sched.Scheduler._codegen

    def codegen(self, *a, **kw):
        stack.append({"code": None, "nodes": None})
        try:
            res = orig_codegen(self, *a, **kw)
        finally:
            rec = stack.pop()
        code = res[0] if isinstance(res, tuple) else res
        rec["code"] = code if isinstance(code, str) else getattr(code, "value", str(code))
        graphs.append(rec)
        if stop_after is not None and len(graphs) >= stop_after:
            raise Captured()
        return res

    def sched_codegen(self, nodes, *a, **kw):
        if stack and stack[-1]["nodes"] is None:
            stack[-1]["nodes"] = _classify(nodes)
        return orig_sched(self, nodes, *a, **kw)

    kept: list = []

    class _KeptDirs(logging.Filter):
        """Inductor keeps its fresh cache folder when a compile stops (``Captured``): noted, removed."""

        def filter(self, record):
            if "temporary cache dir kept" in str(record.msg):
                kept.append(record.args[0] if record.args else None)
                return False
            return True

    utils_log = logging.getLogger("torch._inductor.utils")
    quiet = _KeptDirs()
    ind_graph.GraphLowering.codegen = codegen
    ind_sched.Scheduler._codegen = sched_codegen
    utils_log.addFilter(quiet)
    try:
        # no cached graph: a cache hit would skip the code generation that is captured here
        with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*force_disable_caches.*")
            yield graphs
    finally:
        ind_graph.GraphLowering.codegen = orig_codegen
        ind_sched.Scheduler._codegen = orig_sched
        utils_log.removeFilter(quiet)
        for d in kept:
            if d and os.path.isdir(d):
                shutil.rmtree(d, ignore_errors=True)


def _caused_by(e: BaseException, kind) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = e.__cause__ or e.__context__
    return False


def compiled_counts(layer_counts=(1, 2), ar_tokens: int = 3, tree_tokens: int = 3, log: Callable = None) -> dict:
    """Inductor kernels per compiled round of LlamaGen at tiny widths, bf16 (kernel counts do not
    depend on the widths; Inductor on a CPU compiles a GPT-XL graph far slower): the AR round graph
    and the EAGLE ``mc_sim_7b_63`` round graph (the drafter eager: only the target's round is
    compiled), at each layer count; a layer's kernels and the fixed ones. Two counts per graph:
    ``kernels``, the wrapper's calls (``cpp_fused_*`` + extern calls: what the CPU code launches), and
    ``gpu_like``, the fused scheduler nodes + extern calls (Triton gives each fused node its own
    kernel, where the C++ backend groups the nodes between two extern calls into one function)."""
    import torch._dynamo

    log = log or _say
    out = {"layers": {}}
    t0 = time.perf_counter()
    for L in layer_counts:
        spec = specs("llamagen", [L], tiny=True)[L]  # layers past the first zeroed, as eagerly
        row = {}
        for name, method, n in (("ar", build_method("ar"), ar_tokens),
                                ("eagle", build_method("eagle", tree=TREE), tree_tokens)):
            torch._dynamo.reset()
            t1 = time.perf_counter()
            # the round's graph is the first one compiled (the prefill and the drafter run eagerly):
            # its code is enough, the compile stops there
            try:
                with capture_inductor_code(stop_after=1) as graphs:
                    generate(spec, method, n, True, compile=True, draft_compile=False)
            except Exception as e:  # noqa: BLE001 -- Captured, as dynamo wraps it
                if not graphs or not _caused_by(e, Captured):
                    raise
            counted = [{**count_kernels(g["code"]), "gpu_like": (g["nodes"] or {}).get("kernels"),
                        "fused_nodes": (g["nodes"] or {}).get("fused_nodes"),
                        "extern_kinds": (g["nodes"] or {}).get("extern_kinds")} for g in graphs]
            best = 0 if counted and counted[0]["extern_kinds"] and any("mm" in k for k in counted[0]["extern_kinds"]) \
                else None  # the round inlines the target's forward: its matmuls are there
            if best is None:
                raise RuntimeError(f"compiled {name}: the first graph has no matmul, not the round's")
            row[name] = {"graphs": len(counted), "kernels_per_graph": [g["kernels"] for g in counted],
                         "round": counted[best] if best is not None else None,
                         "compile_seconds": round(time.perf_counter() - t1, 1)}
            log(f"[compiled llamagen tiny {L} layer(s) {name}] {len(counted)} graph(s), wrapper kernels "
                f"{[g['kernels'] for g in counted]}, GPU-like {[g['gpu_like'] for g in counted]}, "
                f"{time.perf_counter() - t1:.1f} s")
        out["layers"][str(L)] = row
    for name in ("ar", "eagle"):
        rounds = {L: out["layers"][str(L)][name]["round"] for L in layer_counts}
        out[name] = linear_fit({L: r["kernels"] for L, r in rounds.items()}, REAL_LAYERS["llamagen"])
        out[name + "_gpu_like"] = linear_fit({L: r["gpu_like"] for L, r in rounds.items()}, REAL_LAYERS["llamagen"])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ------------------------------------------------------------------------------------- output


def checks(entry: dict) -> dict:
    """Pass / fail per budget (``BUDGETS``) for each target of one label's entry."""
    out = {}
    for t, r in entry.get("targets", {}).items():
        f = r.get("full", {})
        c = {"ar_ops_per_token": f.get("ar_ops_per_token"), "ar_casts_per_token": f.get("ar_casts_per_token"),
             "round_in_ar_tokens": f.get("round_in_ar_tokens"),
             "signals_share": max(f.get("signals_share_round") or 0, f.get("signals_share_ar") or 0)
             if f else None}
        comp = entry.get("compiled") if t == "llamagen" else None
        if comp:
            c["compiled_kernels_per_layer"] = max(comp["ar"]["per_layer"], comp["eagle"]["per_layer"])
            c["compiled_kernels_fixed"] = comp["ar"]["fixed"]
        out[t] = {k: {"value": v, "budget": BUDGETS[k], "pass": v is not None and v <= BUDGETS[k]}
                  for k, v in c.items() if v is not None}
    return out


def _fmt(v, nd=1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _mark(entry, t, key) -> str:
    c = entry.get("checks", {}).get(t, {}).get(key)
    return "" if c is None else (" (pass)" if c["pass"] else " (FAIL)")


def _join(pairs, k: int) -> str:
    return ", ".join(f"{name} {n:g}" for name, n in pairs[:k])


NOTES = """## How to read it

- Ops: aten ops that launch a kernel on a GPU (views, allocations and metadata count 0; `F.rms_norm`,
  SDPA and `F.layer_norm`, decomposed on the CPU, count 1). Casts: dtype conversions among them. Host
  reads: reads of tensor values on the host (a sync each on a GPU). Per AR token / per round: the
  steady rounds of one run (rounds 1 .. n - 1 - max_depth; the rounds after draft shallower trees).
- Full depth = fixed + a layer x the real depth, from 1 and 2 layers of one set of weights (layers past
  the first zeroed, so both depths decode the same tokens: the difference is the layers' own ops).
- The EAGLE head is random (decoder layers zeroed by default: the counts are the same, cheaper on the
  CPU); drafts are rarely accepted (tokens a round in the JSON), as with gpu_check's random head. A
  trained head accepts more, which changes the walk's work a round a little.
- Signals: the same run with `distortion=False`; the eager signal sink flushes as on a GPU (its CPU
  setting flushes every tree round), a flush's ops spread over the rounds it holds.
- Lumina: the counted runs end before the first row end (48 tokens a row): the newline entry a row
  adds (once in 48 tokens) is not in the counts.
- Compiled: Inductor's CPU code, tiny widths. Wrapper calls are what the CPU code launches (the C++
  backend groups the loop nests between two extern calls into one function); GPU-like counts one
  kernel per fused scheduler node plus the extern calls, closer to Triton's launches on CUDA. The
  budget is checked on the wrapper calls.
"""


def markdown(results: dict) -> str:
    labels = list(results)
    lines = ["# Op counts: aten ops a GPU launches per AR token and per tree round (counted on the CPU)", "",
             "Written by `benchmarks/op_counts.py` (its docstring states the counting rules). Eager: bf16, "
             "random weights of the real widths, 1 CPU thread, 1 and 2 layers fitted linearly to the real depth; "
             "compiled: Inductor's CPU wrapper code at tiny widths (its fusion differs a little from Triton's "
             "on CUDA). Budgets: eager AR <= 800 ops and <= 150 casts a token at GPT-XL shapes; an EAGLE "
             "`mc_sim_7b_63` round <= 1.4 AR tokens of ops; compiled <= 10 kernels a layer and <= 15 fixed; "
             "the quality signals <= 5% of a round (marked for Lumina-mGPT too).", ""]
    lines += ["| label | commit | torch | date | script seconds |", "|---|---|---|---|---|"]
    for lab in labels:
        e = results[lab]
        lines.append(f"| {lab} | `{e.get('commit')}` | {e.get('torch')} | {e.get('date')} | {_fmt(e.get('seconds'))} |")
    lines.append("")
    targets = sorted({t for e in results.values() for t in e.get("targets", {})}, key=TARGETS.index)
    for t in targets:
        any_e = next(e for e in results.values() if t in e.get("targets", {}))
        tr = any_e["targets"][t]
        lines += [f"## {t}: {tr['shapes'].rsplit(',', 2)[0]}; full depth {tr['real_layers']} layers", "",
                  "| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]

        def row(name, get, key=None, nd=1):
            cells = []
            for lab in labels:
                e = results[lab]
                r = e.get("targets", {}).get(t)
                try:
                    v = get(r, e) if r is not None else None
                except (KeyError, TypeError):
                    v = None
                cells.append(_fmt(v, nd) + (_mark(e, t, key) if key and v is not None else ""))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")

        def split(key):
            return lambda r, e: (f"{r['fits'][key]['per_layer']:.1f} x {r['real_layers']} + "
                                 f"{r['fits'][key]['fixed']:.1f}")

        full = lambda k: lambda r, e: r["full"][k]  # noqa: E731
        row("eager AR ops / token", full("ar_ops_per_token"), "ar_ops_per_token")
        row("  a layer x layers + fixed", split("ar.ops"))
        row("eager AR casts / token", full("ar_casts_per_token"), "ar_casts_per_token")
        row("  a layer x layers + fixed", split("ar.casts"))
        row("eager AR host reads / token", full("ar_host_reads_per_token"), nd=2)
        row(f"EAGLE `{TREE}` round: ops", full("round_ops"))
        row("  a layer x layers + fixed", split("eagle.ops"))
        row("  in AR tokens of ops", full("round_in_ar_tokens"), "round_in_ar_tokens", nd=2)
        row("  target side (verify_round) / drafter / loop, in AR tokens",
            lambda r, e: f"{r['full']['round_target_in_ar_tokens']:.2f} / {r['full']['round_drafter_in_ar_tokens']:.2f}"
                         f" / {r['full']['round_loop_in_ar_tokens']:.2f}")
        row("  casts / host reads a round", lambda r, e: f"{r['full']['round_casts']:.1f} / "
                                                       f"{r['full']['round_host_reads']:.2f}")
        def tokens(r, e):
            g = next(iter(r["layers"].values()))["eagle"]
            k1, k2 = g["steady_rounds"]
            return f"{g['tokens_per_round']:.2f}; {k2 - k1} of {g['rounds']}"

        row("  tokens a round (random head); rounds counted", tokens)
        row("signals' share: AR token / round", lambda r, e: f"{100 * r['full']['signals_share_ar']:.1f}% / "
                                                           f"{100 * r['full']['signals_share_round']:.1f}%"
            + _mark(e, t, "signals_share"))
        row("  signals' ops: a token / a round", lambda r, e: f"{r['full']['signals_ops_per_token']:.1f} / "
                                                            f"{r['full']['signals_ops_per_round']:.1f}")
        if t == "llamagen":
            c = lambda k, q: lambda r, e: e["compiled"][k][q]  # noqa: E731
            row("compiled AR round: kernels a layer (wrapper calls)", c("ar", "per_layer"),
                "compiled_kernels_per_layer")
            row("compiled AR round: fixed kernels (wrapper calls)", c("ar", "fixed"), "compiled_kernels_fixed")
            row("  GPU-like (a kernel per fused node): a layer / fixed",
                lambda r, e: f"{e['compiled']['ar_gpu_like']['per_layer']:.0f} / "
                             f"{e['compiled']['ar_gpu_like']['fixed']:.0f}")
            row("compiled tree round: a layer / fixed (wrapper calls)",
                lambda r, e: f"{e['compiled']['eagle']['per_layer']:.0f} / {e['compiled']['eagle']['fixed']:.0f}")
            row("  GPU-like: a layer / fixed",
                lambda r, e: f"{e['compiled']['eagle_gpu_like']['per_layer']:.0f} / "
                             f"{e['compiled']['eagle_gpu_like']['fixed']:.0f}")
            row("compiled: seconds (4 graphs)", lambda r, e: e["compiled"]["seconds"])
        lines.append("")
        for lab in labels:
            r = results[lab].get("targets", {}).get(t)
            if r is None:
                continue
            b = r["breakdown"]
            lines += [f"### {t}, {lab}: where the ops come from (full-depth counts by coolsd function)", ""]
            for key, what in (("ar", "AR token"), ("eagle", "tree round")):
                lines.append(f"- {what}, a layer ({r['fits'][key + '.ops']['per_layer']:.1f}): "
                             + _join(b[key]["per_layer_sources"], 8))
                lines.append(f"- {what}, fixed ({r['fits'][key + '.ops']['fixed']:.1f}): "
                             + _join(b[key]["fixed_sources"], 12))
                lines.append(f"- {what}, fixed by phase: " + _join(b[key]["fixed_phases"], 8))
                lines.append(f"- {what}, fixed by area: " + _join(b[key].get("fixed_areas", []), 12))
            lines.append("- AR token, a layer by op: " + _join(b["ar"]["per_layer_ops"], 12))
            lines.append("- AR casts, a layer: " + _join(b["ar"]["per_layer_casts"], 8)
                         + "; fixed: " + _join(b["ar"]["fixed_casts"], 8))
            lines.append("")
    return "\n".join(lines) + "\n" + NOTES


def write(out_dir: Path, label: str, entry: dict) -> dict:
    """Merges ``entry`` under ``label`` into ``<out_dir>/op_counts.json`` and rewrites the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "op_counts.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[label] = entry
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(path)
    (out_dir / "op_counts.md").write_text(markdown(results))
    return results


# ------------------------------------------------------------------------------------- driver
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="before", help="the results' key (before, after, ...)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--layers", default="1,2", help="the two layer counts of the linear fit")
    ap.add_argument("--ar-tokens", type=int, default=12, help="AR: the counted run's tokens")
    ap.add_argument("--tree-tokens", type=int, default=None,
                    help="EAGLE: the counted run's tokens, >= the tree's depth + 4 (default: "
                         + ", ".join(f"{t} {n}" for t, n in TREE_TOKENS.items()) + ")")
    ap.add_argument("--random-head", action="store_true",
                    help="keep the EAGLE head's decoder layers random (slower on the CPU; the counts are the same "
                         "up to the acceptance pattern)")
    ap.add_argument("--no-compiled", action="store_true", help="skip the compiled kernel counts")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a smoke run)")
    ap.add_argument("--exact-bf16", action="store_true", help="bf16 matmuls in bf16 while counting (slower)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", "--results", dest="out", type=Path, default=ROOT / "results" / "gpu",
                    help="folder of op_counts.{json,md}")
    a = ap.parse_args(argv)
    a.targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    if not a.targets or any(t not in TARGETS for t in a.targets):
        ap.error(f"--targets: one or more of {', '.join(TARGETS)}")
    a.layers = tuple(int(x) for x in a.layers.split(","))
    if len(a.layers) != 2 or a.layers[1] != a.layers[0] + 1 or a.layers[0] < 1:
        ap.error("--layers: two consecutive layer counts, e.g. 1,2")
    depth = build_method("eagle", tree=TREE).tree.max_depth
    if a.tree_tokens is not None:
        # rounds 1 .. n - 1 - depth draft the full tree: at least 2 of them
        if a.tree_tokens < depth + 4:
            ap.error(f"--tree-tokens: at least {depth + 4} (the tree's depth + 4)")
        a.tree_tokens = {t: a.tree_tokens for t in TARGETS}
    else:
        a.tree_tokens = dict(TREE_TOKENS)
    if a.ar_tokens < 4:
        ap.error("--ar-tokens: at least 4")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    try:
        entry = {"commit": code_commit(ROOT), "code": str(Path(coolsd.__file__).resolve().parent), "torch": torch.__version__,
                 "label": a.label,
                 "date": time.strftime("%Y-%m-%d %H:%M"), "tiny": a.tiny, "fast_bf16_mm": not a.exact_bf16,
                 "tree": TREE, "threads": a.threads, "budgets": BUDGETS, "targets": {}}
        for t in a.targets:
            t1 = time.perf_counter()
            r = eager_target(t, a.layers, tiny=a.tiny, fast_mm=not a.exact_bf16, ar_tokens=a.ar_tokens,
                             tree_tokens=a.tree_tokens[t], zero_head=not a.random_head)
            r["seconds"] = round(time.perf_counter() - t1, 1)
            entry["targets"][t] = r
            f = r["full"]
            print(f"[{t}] full depth: AR {f['ar_ops_per_token']:.0f} ops / token, {f['ar_casts_per_token']:.0f} "
                  f"casts; round {f['round_in_ar_tokens']:.2f} AR tokens; {r['seconds']:.1f} s")
        if not a.no_compiled:
            entry["compiled"] = compiled_counts(a.layers)
            c = entry["compiled"]
            print(f"[compiled] AR round {c['ar']['per_layer']} kernels a layer + {c['ar']['fixed']} fixed; tree round "
                  f"{c['eagle']['per_layer']} + {c['eagle']['fixed']}; {c['seconds']} s")
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        entry["checks"] = checks(entry)
        results = write(a.out, a.label, entry)
        print(f"wrote {a.out / 'op_counts.json'} and op_counts.md ({entry['seconds']} s)")
        return results
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
