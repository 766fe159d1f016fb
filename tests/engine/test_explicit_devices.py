"""Every tensor the decode path makes takes its device from an input tensor (or says ``device="cpu"``
where the work is host-side on purpose), never from an ambient ``torch.device`` context: on CUDA a
factory call that relies on the context makes a CPU tensor wherever the context is missing (the
loop no longer sets one) and inside compiled functions (Dynamo did not apply it there), and a
CPU constant mixed with device tensors fails the first round. Three checks over every registered
discrete method x every discrete target's tiny adapter (one target name per world class: the
classes are what differ) x eager and the compile path:

(a) ``ambient_sites``: the run under ``torch.device("cpu")`` with the context's
    ``__torch_function__`` wrapped to record every factory call whose device the context fills in
    (a ``TorchFunctionMode`` of our own would not see them: a nested ``torch.device`` pushes above
    it); any such call inside ``speculative_generate`` is a site;
(b) the target's models, condition and tables moved to ``meta`` (no memory, no kernels) and one
    round run, the host's reads of meta values stubbed (``meta_reads``): a CPU tensor meeting a
    meta one fails as it would meeting a CUDA one;
(c) every function the compile path compiles traced by Dynamo with ``fullgraph=True`` under an
    ambient ``meta`` device (backend ``eager``: no Inductor on a CPU), so a factory call that takes
    the ambient device makes a meta tensor that meets the CPU inputs while tracing.

The compile path in (a) and (b) runs the compiled code eagerly (``torch.compile`` replaced by the
identity): the static KV cache, in-round signals and full-tree drafting. Methods a target refuses
before anything loads (row-parallel ones on a target without visibility by position, or compiled:
``coolsd.job.config_schema``) are left out. Short runs: the first tokens of two prompts."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import traceback

import pytest
import torch
from torch.utils._device import DeviceContext, _device_constructors

import coolsd.worlds.base as world_base
from coolsd.engine.decoding.rules import Rule
from coolsd.engine.decoding.trees import Tree
from coolsd.engine.methods import method_info
from coolsd.engine.methods.registry import method_names
from coolsd.worlds import load_world, world_class, world_names

META = torch.device("meta")
N_TOKENS = 6  # tokens a short run emits (row-parallel runs: the whole tiny image, they decode whole rows)
SHORT = {"window": 4, "tree_width": 2}  # Jacobi windows and SJD-PAC's tree, where a method has them: small graphs
TORCH_DIR = os.path.dirname(torch.__file__)


def discrete_targets() -> list[str]:
    """One target name per world class that decodes through the loop (``DiscreteWorld``; the first
    registered name) of the package (a world a test included is not one of them)."""
    seen: dict = {}
    for name in world_names():
        if not world_base.TARGETS.entry(name).builtin:
            continue
        cls = world_class(name)
        if issubclass(cls, world_base.DiscreteWorld) and cls not in seen:
            seen[cls] = name
    return sorted(seen.values())


TARGETS = discrete_targets()
COMPILED_TARGETS = [t for t in TARGETS if world_class(t).compiles]
METHODS = [n for n in method_names("discrete") if not n.startswith("_")]


def runs(target: str, method: str, compiled: bool) -> bool:
    """Whether ``target`` runs ``method`` in this mode (else the config check refuses it before loading)."""
    row_parallel = method_info(method).row_parallel
    return not row_parallel or (world_class(target).row_parallel and not compiled)


@pytest.fixture(scope="module")
def loaded(world_overrides, compose):
    """target, compiled -> a freshly loaded tiny world and two of its prompts (the drafted methods
    draft with the target itself where a target ships no drafter)."""
    def load(target: str, compiled: bool):
        extra = ["draft=self"] if target in ("janus_pro", "emu3") else []
        cfg = compose(*world_overrides(target), "dataset.n_prompts=2", *extra, f"compile={str(compiled).lower()}")
        world = load_world(cfg)
        return world, world.prompts(cfg)[:2]

    return load


def build(world, name: str):
    info = method_info(name)
    params = {} if info.row_parallel else {k: v for k, v in SHORT.items() if k in info.params}
    return world.build_method(name, params, "chain", 3)


def short_run(world, method, prompts):
    """A short run of two prompts through the world's own decode path (``generate_tokens``)."""
    n = None if method_info(method.name).row_parallel else N_TOKENS
    return world.generate_tokens(method, prompts, [0, 1], n_tokens=n)


@contextlib.contextmanager
def compile_path(mode: str):
    """``torch.compile`` as the check needs it: the identity (``"eager"``: the compile path's code
    run eagerly), or Dynamo with ``fullgraph=True`` and backend ``eager`` whose every top-level call
    runs under an ambient ``meta`` device (``"traced"``); a compiled function called inside another
    one's trace is traced inline, as Dynamo does with the real thing."""
    real = torch.compile

    def fake(fn, **kw):
        if mode == "eager":
            return fn
        compiled = real(fn, backend="eager", fullgraph=True, dynamic=False)

        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            with torch.device(META):
                return compiled(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", fake)
        yield


# ------------------------------------------------------------------------------- (a) ambient sites
def _caller() -> str:
    """file:line function of the innermost frame outside torch's own package."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(TORCH_DIR):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"


@contextlib.contextmanager
def ambient_sites():
    """Yields a set that fills with "file:line function factory" for every factory call whose device
    an ambient ``torch.device`` context fills in, while ``speculative_generate`` runs (model
    loading and prompt encoding before it are not the decode path), the loop run under
    ``torch.device("cpu")``."""
    sites: set = set()
    active = [False]
    real_fn, real_generate = DeviceContext.__torch_function__, world_base.speculative_generate

    def torch_function(self, func, types, args=(), kwargs=None):
        if active[0] and func in _device_constructors() and (kwargs or {}).get("device") is None:
            sites.add(f"{_caller()} torch.{func.__name__}")
        return real_fn(self, func, types, args, kwargs)

    def generate(*args, **kwargs):
        active[0] = True
        try:
            with torch.device("cpu"):
                return real_generate(*args, **kwargs)
        finally:
            active[0] = False

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeviceContext, "__torch_function__", torch_function)
        mp.setattr(world_base, "speculative_generate", generate)
        yield sites


@pytest.mark.parametrize("target,compiled", [(t, False) for t in TARGETS] + [(t, True) for t in COMPILED_TARGETS],
                         ids=[f"{t}-eager" for t in TARGETS] + [f"{t}-compile" for t in COMPILED_TARGETS])
def test_no_factory_call_takes_the_ambient_device(loaded, target, compiled):
    with compile_path("eager"):
        world, prompts = loaded(target, compiled)
        found = {}
        for name in METHODS:
            if runs(target, name, compiled):
                with ambient_sites() as sites:
                    short_run(world, build(world, name), prompts)
                for s in sites:
                    found.setdefault(s, []).append(name)
    assert not found, f"{len(found)} factory calls take the ambient device:\n" + "\n".join(
        f"  {s}  ({', '.join(m)})" for s, m in sorted(found.items()))


def test_the_audit_sees_a_factory_call_that_takes_the_ambient_device():
    """A negative control: a site inside ``speculative_generate`` is found, an explicit one is not."""
    def generate():
        torch.zeros(2, device="cpu")
        return torch.arange(3)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(world_base, "speculative_generate", generate)
        with ambient_sites() as sites:
            world_base.speculative_generate()
    assert len(sites) == 1 and next(iter(sites)).endswith("generate torch.arange")


# ------------------------------------------------------------------------------- (b) the meta device
def to_meta(obj, seen=None, depth: int = 0):
    """``obj`` with every tensor and module reachable from it (attributes of the package's (and
    this file's) objects, containers) moved to ``meta``, in place where it can be; trees and rules are left
    where they are (the loop moves them: what is tested)."""
    seen = {} if seen is None else seen  # id -> the object's moved self (a tensor shared by two owners moves once)
    if id(obj) in seen:
        return seen[id(obj)]
    if depth > 6 or isinstance(obj, (Tree, Rule, type)):
        return obj
    seen[id(obj)] = obj
    if isinstance(obj, torch.Tensor):
        seen[id(obj)] = moved = obj.to(META)
        return moved
    if isinstance(obj, torch.nn.Module):
        obj.to(META)
        for k, v in list(vars(obj).items()):  # plain tensor attributes (tables beside the parameters)
            if isinstance(v, torch.Tensor):
                setattr(obj, k, to_meta(v, seen, depth + 1))
        return obj
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = to_meta(obj[k], seen, depth + 1)
    elif isinstance(obj, list):
        obj[:] = [to_meta(v, seen, depth + 1) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_meta(v, seen, depth + 1) for v in obj)
    elif type(obj).__module__.startswith(("coolsd", __name__)) and hasattr(obj, "__dict__"):
        for k, v in list(vars(obj).items()):
            moved = to_meta(v, seen, depth + 1)
            if moved is not v:
                object.__setattr__(obj, k, moved)
    return obj


@contextlib.contextmanager
def meta_reads():
    """The host's reads of meta tensors stubbed: zeros (``tolist``, ``item``, ``int``, ...), False,
    an empty ``nonzero`` and a zero CPU copy (``cpu``). The loop's round read then says 'done':
    one round runs."""
    T = torch.Tensor

    def stub(real, fake):
        return lambda self, *a, **k: fake(self) if self.device.type == "meta" else real(self, *a, **k)

    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype, device="cpu")  # noqa: E731
    fakes = {"tolist": lambda t: zeros(t).tolist(), "item": lambda t: 0, "__bool__": lambda t: False,
             "__int__": lambda t: 0, "__float__": lambda t: 0.0, "__index__": lambda t: 0, "cpu": zeros,
             "nonzero": lambda t: torch.zeros(0, t.dim(), dtype=torch.long, device=META)}
    with pytest.MonkeyPatch.context() as mp:
        for name, fake in fakes.items():
            mp.setattr(T, name, stub(getattr(T, name), fake))
        mp.setattr(torch, "nonzero", lambda t, *a, **k: t.nonzero(*a, **k))
        yield


@pytest.mark.parametrize("target,compiled", [(t, False) for t in TARGETS] + [(t, True) for t in COMPILED_TARGETS],
                         ids=[f"{t}-eager" for t in TARGETS] + [f"{t}-compile" for t in COMPILED_TARGETS])
def test_a_first_round_on_the_meta_device_meets_no_cpu_tensor(loaded, target, compiled):
    failures = []
    with compile_path("eager"):
        world, prompts = loaded(target, compiled)  # fresh: moved to meta below
        methods = [build(world, name) for name in METHODS if runs(target, name, compiled)]
        if any(m.drafter == "model" for m in methods):
            world.drafter()
        world.neighbours  # noqa: B018  (LANTERN's tables, made where the codebook is)
        to_meta(world)
        assert torch.device(world.target.device) == META
        for method in methods:
            name = method.name
            try:
                with meta_reads():
                    short_run(world, method, prompts)
            except (RuntimeError, NotImplementedError) as e:
                failures.append(f"{name}: {str(e).splitlines()[0]} (at {_where(e)})")
    assert not failures, "\n".join(failures)


def _where(e: BaseException) -> str:
    """The innermost frames of the package in an exception's traceback."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}coolsd{os.sep}" in f.filename]
    return ", ".join(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in frames[-2:])


# ------------------------------------------------------------------------------- (c) Dynamo under meta
@pytest.mark.parametrize("target", [t for t in COMPILED_TARGETS if t != "toy"])
def test_every_compiled_function_traces_under_an_ambient_meta_device(loaded, target):
    """(c) on the tiny LlamaGen and Lumina-mGPT targets (the toy world runs LlamaGen's classes,
    LlamaGenTarget and EagleDrafter, on larger weights: tracing them again would add a minute)."""
    import torch._dynamo

    torch._dynamo.reset()  # this test's graphs only: every method recompiles the round it runs
    failures = []
    with compile_path("traced"):
        world, prompts = loaded(target, True)
        for name in METHODS:
            if runs(target, name, True):
                try:
                    short_run(world, build(world, name), prompts)
                except Exception as e:  # noqa: BLE001  (Dynamo's errors have many types)
                    # Dynamo names the traced user code's frames in its message ("from user code: File ...")
                    user = re.findall(r'File "([^"]*coolsd[^"]*)", line (\d+), in (\w+)', str(e))
                    at = ", ".join(f"{os.path.relpath(f)}:{n} {fn}" for f, n, fn in user[-2:]) or _where(e)
                    failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160]} (at {at})")
    torch._dynamo.reset()
    assert not failures, "\n".join(failures)


def test_the_trace_fails_on_a_factory_call_that_takes_the_ambient_device():
    """A negative control: under the traced compile path, a function making a tensor without a
    device fails to trace; with the input's device it traces."""
    def bad(x):
        return x + torch.arange(x.shape[0])

    def good(x):
        return x + torch.arange(x.shape[0], device=x.device)

    with compile_path("traced"):
        with pytest.raises(Exception, match="device"):
            torch.compile(bad)(torch.zeros(3))
        assert torch.compile(good)(torch.zeros(3)).tolist() == [0.0, 1.0, 2.0]


def test_the_meta_run_fails_on_a_cpu_constant():
    """A negative control: a CPU tensor meeting a meta one raises, and the walker moves nested state."""
    @dataclasses.dataclass
    class Holder:
        table: dict

    h = to_meta(Holder({"x": [torch.zeros(2)]}))
    assert h.table["x"][0].device == META
    with pytest.raises(RuntimeError, match="device"):
        h.table["x"][0] + torch.zeros(2)
