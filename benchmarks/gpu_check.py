"""One prepared device check: every registered discrete method for one image on LlamaGen-XL and
Lumina-mGPT (random weights of the real shapes; Lumina-mGPT with fewer layers, said in the output),
eager and compiled, plus MAR-H with CSpD (MAR-B drafting), through the production loops. It asserts
that no run fails, that the rounds stay within the sync budget (host reads a round: <= 2 eager,
<= 1 compiled; no tensor lifted from Python data in an eager round), that compiling skips no CUDA graph
(``cudagraph_skips == 0``) and compiles nothing after its warm-up, and that compiled tokens equal
eager ones where float order is unchanged (fp64 on the CPU; on a GPU in bf16 the agreement is
reported); it records AR per-token time against the bandwidth bound, a round's cost in AR steps
and peak memory into ``<out>.json`` and ``<out>.md``.

    python benchmarks/gpu_check.py                          # CUDA, bf16, real shapes -> results/gpu/check.{json,md}
    python benchmarks/gpu_check.py --tiny --device cpu      # tiny fp64 models on the CPU (the tests run it)
    python benchmarks/gpu_check.py --targets llamagen --modes eager --methods ar,eagle
    python benchmarks/gpu_check.py --budget-s 300           # stop adding runs after 300 s (skips recorded)

Every run decodes the first ``--tokens`` tokens (default 128, whole rows) of one image; an eager
run is preceded by an untimed short run of its own method, and each target's first eager run by an
untimed AR run of the whole length (the first H200 run timed first uses 2-8x slower than later
ones). Order of work (a budget cut drops the tail): AR and EAGLE eagerly on both targets, AR compiled and
MAR's pair first; then the other methods eagerly; then EAGLE compiled; then the other methods compiled. Each run's failure is
caught and recorded; the script exits non-zero with one line listing the failed assertions, after
writing the results. Host reads are counted by ``coolsd.engine.host_reads`` in extra runs (eager: the
rounds a run of 2a tokens adds over one of a tokens, a = ``--count-tokens``; compiled: one full run,
reads <= rounds + a fixed set-up), never in the timed ones; on CUDA the same runs also count the
syncs ``torch.cuda.set_sync_debug_mode("warn")`` reports. With ``--tiny`` only AR and EAGLE are
compiled by default and the tree is a chain of 3 (Inductor on a CPU takes tens of seconds a graph,
minutes for a 25-node tree's drafting).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.util
import inspect
import json
import math
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coolsd.engine.compiled import compile_count  # noqa: E402
from coolsd.engine.continuous.generate import HeadConfig  # noqa: E402
from coolsd.engine.decoding.lantern import NEIGHBOURS_KEPT, CodebookNeighbours  # noqa: E402
from coolsd.engine.decoding.rng import PerSampleRNG  # noqa: E402
from coolsd.engine.drafting import SamplingConfig, build_drafter  # noqa: E402
from coolsd.engine.host_reads import count_host_reads  # noqa: E402
from coolsd.engine.loop import speculative_generate  # noqa: E402
from coolsd.engine.methods import build_method  # noqa: E402
from coolsd.engine.methods.registry import method_names  # noqa: E402
from coolsd.engine.timing import device_sync, hardware_name  # noqa: E402
from coolsd.util.fingerprint import code_commit  # noqa: E402


def _load_gpu_benchmark():
    """benchmarks/gpu.py as a module (its bandwidth table), whatever the caller's sys.path."""
    spec = importlib.util.spec_from_file_location("coolsd_gpu_benchmark", Path(__file__).with_name("gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bandwidth_of = _load_gpu_benchmark().bandwidth_of

TARGETS = ("llamagen", "lumina", "mar")
MODES = ("eager", "compiled")
EAGER_READS = 2  # host reads a round, eager: the loop's status read plus at most one an adapter needs
COMPILED_READS = 1  # host reads a round, compiled: the loop's status read
# a compiled run's fixed set-up and end (prefill check, result lists), whatever its length
COMPILED_SETUP_READS = 6
MIN_EXTRA_ROUNDS = 5  # fewer extra rounds cannot tell a per-round cost from set-up
# eager: a KV cache reads its true committed length when its host bound (which grows by the keep
# columns a commit) would outgrow the buffer (KVCache._true_max): every few dozen rounds of a tree
# on Lumina's drafter, so a counted window may hold a few beyond its rounds' budget
OCCASIONAL_READS = 2
FIRST = ("ar", "eagle")  # run first (eagerly) on every target: what a budget cut keeps
CFG_SCALE = 3.0
# an eager run's untimed warm-up of its own method: on the first H200 run (torch 2.11), the first
# timed run of a drafted method cost 4-8x its later rounds (EAGLE 325 ms a round, COOL-SD with the
# same drafter and tree 65 ms), so every eager method runs this many tokens first
WARMUP_TOKENS = 16


def discrete_methods() -> list[str]:
    return [n for n in method_names("discrete") if not n.startswith("_")]


HOST_DRIVEN = ("pjd",)  # its schedule follows acceptances read on the host every forward (docs/methods.md 8.2)
ROWS_AFTER = ("rows", "pjd")  # drafter kinds whose signals come after the timed decode (coolsd.engine.rows._result)


def runs_on(target: str, method: str) -> bool:
    """Whether the check runs ``method`` on ``target``: row-parallel methods only where the target's
    forward sees by position (the LlamaGen class; Lumina-mGPT has no such forward yet)."""
    from coolsd.engine.methods import method_info

    return target == "llamagen" or not method_info(method).row_parallel


# ------------------------------------------------------------------------------------------ targets
@dataclasses.dataclass
class Discrete:
    """A discrete target's fixed parts; ``target(compile)`` and ``draft_model(target, compile)``
    make fresh objects per run (a compiled run reuses the graphs of an earlier one)."""

    name: str
    shapes: str
    target: Callable[[bool], Any]
    draft_model: Callable[[Any, bool], Any]
    cond: Any
    sampling: SamplingConfig
    neighbours: CodebookNeighbours
    n_tokens: int
    grid_width: int
    compiles: bool
    compile_note: str
    models: list  # resident modules (their weights count in a run's peak memory)
    bound_model: Any  # the target model whose weights one AR step reads


def _bytes(*modules) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _codebook(n: int, dim: int, dev, normalise: bool) -> CodebookNeighbours:
    g = torch.Generator().manual_seed(5)
    cb = torch.randn(n, dim, generator=g, dtype=torch.float64)
    if normalise:
        cb = torch.nn.functional.normalize(cb, dim=-1)
    nb = CodebookNeighbours(cb.float().to(dev))
    nb.columns(NEIGHBOURS_KEPT)  # sorted once here, not inside a timed LANTERN run
    return nb


def llamagen(a, dev, dtype) -> Discrete:
    from coolsd.models.eagle.model import EagleDrafter, EagleHead
    from coolsd.models.llamagen import GPT_XL, LlamaGenGPT, LlamaGenTarget, tiny

    cfg = tiny(block_size=64) if a.tiny else GPT_XL
    torch.manual_seed(0)
    with torch.device(dev):
        gpt = LlamaGenGPT(cfg, **({"init_std": 0.2} if a.tiny else {}))
    gpt = gpt.to(dtype).eval().requires_grad_(False)
    head = EagleHead.from_target(gpt, seed=0).to(dev, dtype).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    cond = {"caption_embs": torch.randn(1, cfg.cls_token_num, cfg.caption_dim, generator=g).to(dev, dtype),
            "emb_mask": torch.ones(1, cfg.cls_token_num, dtype=torch.bool, device=dev)}
    cond["emb_mask"][0, : cfg.cls_token_num // 3] = False  # a left-padded caption
    # LlamaGenWorld's wiring: LANTERN's drafters prefill every text slot's feature
    return Discrete(
        "llamagen", f"LlamaGen {'tiny' if a.tiny else 'GPT-XL'}: dim {cfg.dim}, {cfg.n_layer} layers, "
                    f"vocab {cfg.vocab_size}, {cfg.block_size} image tokens; EAGLE-1 head (random weights)",
        lambda compile: LlamaGenTarget(gpt, cfg_scale=CFG_SCALE, prefill_features="all", compile=compile),
        lambda t, compile: EagleDrafter.for_target(head, t, text_prefix=True, compile=compile),
        cond, SamplingConfig(temperature=1.0, top_k=min(2000, cfg.vocab_size), top_p=1.0),
        _codebook(cfg.vocab_size, 8, dev, normalise=True),  # VQ-16: 8-dim L2-normalised codes
        cfg.block_size, math.isqrt(cfg.block_size), True, "", [gpt, head], gpt)


def _image_vocab(n_codes: int, first_id: int):
    """An ``ImageVocab`` with codes 0..n-1 on BPE ids first_id.. (Chameleon's layout: 4..8195)."""
    from coolsd.models.lumina import ImageVocab

    name = lambda c: "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(c)) + "Z"  # noqa: E731
    return ImageVocab({name(c): first_id + c for c in range(n_codes)}, n_codes)


def lumina(a, dev, dtype) -> Discrete:
    from coolsd.models.chameleon import CHAMELEON_7B, ChameleonLM, tiny
    from coolsd.models.eagle.lumina import LuminaEagleDrafter, LuminaEagleHead
    from coolsd.models.lumina import LuminaTarget, LuminaTokens

    if a.tiny:
        cfg, latent, n_codes, code_dim = tiny(), 8, 16, 8
        tokens = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)
        prompt = [0, 30, 31, 32, 33, 26]
    else:
        cfg = dataclasses.replace(CHAMELEON_7B, num_layers=a.lumina_layers)
        latent, n_codes, code_dim = 48, 8192, 256  # 768 px; Chameleon's VQGAN: 8192 codes of 256 dims
        tokens = LuminaTokens()
        prompt = [0] + list(range(10000, 10040)) + [tokens.sep]  # BOS, 40 text ids, end of turn
    torch.manual_seed(0)
    with torch.device(dev):
        model = ChameleonLM(cfg, init_std=0.3 if a.tiny else 0.02)
    model = model.to(dtype).eval().requires_grad_(False)
    vocab = _image_vocab(n_codes, 4)
    head = LuminaEagleHead.from_target(model, seed=3).eval().requires_grad_(False)
    compiles = "compile" in inspect.signature(LuminaTarget).parameters
    kw = lambda compile: {"compile": compile} if compiles else {}  # noqa: E731
    layers = f"{cfg.num_layers} of Chameleon-7B's {CHAMELEON_7B.num_layers} layers" if not a.tiny else \
        f"tiny: hidden {cfg.hidden_size}, {cfg.num_layers} layers"
    return Discrete(
        "lumina", f"Lumina-mGPT ({layers}; hidden {cfg.hidden_size}, vocab {cfg.vocab_size}), "
                  f"{latent}x{latent} image tokens + row ends, {n_codes} codes; LANTERN EAGLE-1 head (random weights)",
        lambda compile: LuminaTarget(model, vocab, h_latent=latent, w_latent=latent, cfg_scale=CFG_SCALE,
                                     tokens=tokens, prefill_features="all", **kw(compile)),
        lambda t, compile: LuminaEagleDrafter.for_target(head, t, **kw(compile)),
        [prompt], SamplingConfig(temperature=1.0, top_k=min(2000, n_codes), top_p=1.0),
        _codebook(n_codes, code_dim, dev, normalise=False),
        latent * latent, latent, compiles,
        "" if compiles else "no compiled path: LuminaTarget takes no compile argument", [model, head], model)


def mar(a, dev):
    """(target, draft, HeadConfig, description) of MAR-H with MAR-B drafting (float32 as
    conf/target/mar_h.yaml; tiny: float64)."""
    from coolsd.models.mar import MAR, MAR_CONFIGS, MARConfig

    if a.tiny:
        t_cfg = MARConfig(seq_len=16, token_dim=4, encoder_dim=32, encoder_depth=2, encoder_heads=4, decoder_dim=32,
                          decoder_depth=2, decoder_heads=4, buffer_size=4, n_classes=10, head_width=32, head_depth=2)
        d_cfg = dataclasses.replace(t_cfg, encoder_depth=1, decoder_depth=1, head_depth=1)
        hc, dtype = HeadConfig(steps=8, cfg=3.0, cfg_schedule="linear"), torch.float64
    else:  # conf/target/mar_h.yaml's head settings
        t_cfg, d_cfg = MAR_CONFIGS["mar_huge"], MAR_CONFIGS["mar_base"]
        hc, dtype = HeadConfig(steps=a.mar_steps, cfg=3.2, cfg_schedule="linear"), torch.float32

    def make(cfg, seed):
        torch.manual_seed(seed)
        with torch.device(dev):
            m = MAR(cfg)
        with torch.no_grad():  # upstream zero-inits the head's modulations and output: random instead
            for mod in m.head.modules():
                if isinstance(mod, torch.nn.Linear) and not mod.weight.any():
                    mod.weight.normal_(std=0.02)
        return m.to(dtype).eval().requires_grad_(False)

    shapes = (f"{'MAR tiny' if a.tiny else 'MAR-H'} target, {'MAR tiny' if a.tiny else 'MAR-B'} draft "
              f"({t_cfg.seq_len} tokens of {t_cfg.token_dim} dims, {hc.steps} head steps, "
              f"CFG {hc.cfg} {hc.cfg_schedule}, "
              f"{str(dtype).replace('torch.', '')}; random weights)")
    return make(t_cfg, 0), make(d_cfg, 1), hc, shapes


# ------------------------------------------------------------------------------------------ counting
@contextlib.contextmanager
def counted(dev, compiled: bool):
    """Host reads (``coolsd.engine.host_reads``) and, on CUDA, the syncs the sync debug mode reports.
    Compiled code refuses to run under the lift-counting dispatch mode: compiled runs count reads only."""
    box = {"syncs": None}
    with contextlib.ExitStack() as stack:
        caught = None
        if dev.type == "cuda":
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            stack.callback(torch.cuda.set_sync_debug_mode, 0)
        reads = stack.enter_context(count_host_reads(lifts=not compiled))
        try:
            yield reads, box
        finally:
            if caught is not None:
                box["syncs"] = sum("synchroniz" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------ one run
class Check:
    """Runs, failures and skips of the whole check."""

    def __init__(self, a, dev, dtype):
        self.a, self.dev, self.dtype = a, dev, dtype
        self.sync = device_sync(dev)
        self.t0 = time.perf_counter()
        self.failures: list[str] = []
        self.skipped: list[str] = []
        self.longest: dict = {}  # (target, mode) -> the longest item so far (the budget guard's estimate)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fail(self, msg: str) -> None:
        self.failures.append(msg)

    def over_budget(self, key) -> bool:
        """Past the budget, or the next item of this kind would likely end past it."""
        return self.elapsed() + self.longest.get(key, 0.0) > self.a.budget_s

    def memory_start(self) -> Optional[int]:
        if self.dev.type != "cuda":
            return None
        torch.cuda.synchronize(self.dev)
        torch.cuda.reset_peak_memory_stats(self.dev)
        return torch.cuda.memory_allocated(self.dev)

    def memory_extra(self, start: Optional[int]) -> Optional[int]:
        return None if start is None else torch.cuda.max_memory_allocated(self.dev) - start


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def generate(ck: Check, spec: Discrete, method, compile: bool, n: int):
    """One image (batch 1, seed 0) of ``n`` tokens through ``speculative_generate``, fresh target
    and drafter objects."""
    t = spec.target(compile)
    d = build_drafter(method, spec.draft_model(t, compile) if method.drafter == "model" else None, spec.sampling,
                      t.vocab_size, grid_width=spec.grid_width)
    with torch.no_grad():
        return speculative_generate(t, n, PerSampleRNG([0]), rule=method.rule, drafter=d, tree=method.tree,
                                    sampling=spec.sampling, cond=spec.cond, batch_size=1, sync=ck.sync,
                                    distortion=not ck.a.no_signals)


def whole_rows(spec: Discrete, tokens: int) -> int:
    """At most ``tokens`` tokens of the spec's run (at least one row), in whole image rows."""
    return max(1, min(spec.n_tokens, tokens) // spec.grid_width) * spec.grid_width


def capped(spec, tokens: Optional[int]):
    """A discrete target's spec decoding at most ``tokens`` tokens a run, whole image rows: the
    first rows of its image (``--tokens``)."""
    if tokens is None or not isinstance(spec, Discrete):
        return spec
    return dataclasses.replace(spec, n_tokens=whole_rows(spec, tokens))


def build(spec: Discrete, name: str, a):
    tree_kw = {"tree": a.tree, **({"draft_length": a.draft_length} if a.tree == "chain" else {})}
    return build_method(name, neighbours=spec.neighbours, **tree_kw)


def discrete_run(ck: Check, spec: Discrete, mode: str, name: str) -> dict:
    """One method on one target in one mode: (compiled: a warm-up run that compiles, then) the timed
    run, then the counted run(s). Raises on any error (recorded by the caller)."""
    a, dev, compile = ck.a, ck.dev, mode == "compiled"
    method = build(spec, name, a)
    N = spec.n_tokens
    row: dict = {"method": name, "mode": mode, "drafter": method.drafter}
    if name in HOST_DRIVEN and not compile:
        row["known_over_budget"] = True  # its reads and lifts are recorded, not held to the budget
    mem0 = ck.memory_start()
    skips0, n0 = cudagraph_skips(), compile_count()
    if compile:
        t0 = time.perf_counter()
        generate(ck, spec, method, True, N)
        row["compile_s"] = time.perf_counter() - t0
        row["graphs_compiled_in_warmup"] = compile_count() - n0
    else:  # the method's own first launches, allocations and shapes (its drafter's, its rule's): untimed
        generate(ck, spec, method, False, whole_rows(spec, WARMUP_TOKENS))
    n1 = compile_count()
    res = generate(ck, spec, method, compile, N)
    row["graphs_compiled_after_warmup"] = compile_count() - n1 if compile else None
    row["cudagraph_skips"] = cudagraph_skips() - skips0 if compile and dev.type == "cuda" else None
    row["peak_memory_bytes"] = None if mem0 is None else _bytes(*spec.models) + ck.memory_extra(mem0)
    rounds = len(res.round_lengths[0])
    row.update(seconds=res.seconds, rounds=rounds, tokens_per_round=res.accepted_length(0),
               seconds_per_round=res.seconds / max(rounds, 1), seconds_per_token=res.seconds / N,
               target_forwards=res.target_forwards[0], draft_forwards=res.draft_forwards)
    # the quality signals' own time inside ``seconds`` (eager: DeferredSignals' device time; compiled
    # rounds compute them inline, not timed apart; row-parallel runs: after ``seconds``, not in it)
    sig = res.extra.get("signal_s")
    inside = sig is not None and not compile and method.drafter not in ROWS_AFTER
    row.update(signal_s=sig, signal_share=sig / res.seconds if inside and res.seconds > 0 else None)
    row["tokens"] = res.tokens[0].cpu()
    try:  # a counting run's failure keeps the timed run's numbers
        row.update(count_reads(ck, spec, method, compile))
    except Exception as e:  # noqa: BLE001
        row.update(count_error=one_line(e), count_traceback=traceback.format_exc(limit=12))
    return row


def count_reads(ck: Check, spec: Discrete, method, compile: bool) -> dict:
    """Host reads (and CUDA syncs) a round. Eager: what the rounds of a 2a-token run add over an
    a-token one (set-up and end cost the same at both lengths). Compiled: a full run (its shapes:
    a shorter one would compile new graphs), allowed one read a round plus a fixed set-up."""
    N = spec.n_tokens
    if compile:
        n0, skips0 = compile_count(), cudagraph_skips()
        with counted(ck.dev, True) as (reads, box):
            res = generate(ck, spec, method, True, N)
        r = len(res.round_lengths[0])
        # the counter's dispatch mode may change how CUDA graphs replay: recorded apart, not asserted
        return {"count_runs": [N], "graphs_compiled_in_count_run": compile_count() - n0,
                "cudagraph_skips_in_count_run": cudagraph_skips() - skips0 if ck.dev.type == "cuda" else None,
                "extra_rounds": r, "host_reads": reads.count, "lifted": None,
                "host_reads_per_round": reads.count / max(r, 1), "lifted_per_round": None,
                "syncs": box["syncs"], "syncs_per_round": None if box["syncs"] is None else box["syncs"] / max(r, 1),
                "reads_where": sorted({w for _, w in reads.where})[:40]}
    half = min(N // 2, ck.a.count_tokens)
    if method.drafter in ROWS_AFTER:  # row-parallel schedules decode whole image rows
        half = whole_rows(spec, half)
    got = []
    for n in (half, 2 * half):
        with counted(ck.dev, False) as (reads, box):
            res = generate(ck, spec, method, False, n)
        got.append((len(res.round_lengths[0]), reads, box["syncs"]))
    (r0, a0, s0), (r1, a1, s1) = got
    dr = r1 - r0
    per = lambda x: x / dr if dr > 0 else None  # noqa: E731
    return {"count_runs": [half, 2 * half], "extra_rounds": dr, "host_reads": a1.count - a0.count,
            "lifted": a1.lifted - a0.lifted, "host_reads_per_round": per(a1.count - a0.count),
            "lifted_per_round": per(a1.lifted - a0.lifted), "syncs": None if s1 is None else s1 - s0,
            "syncs_per_round": None if s1 is None else per(s1 - s0),
            "reads_where": sorted({w for _, w in a1.where})[:40]}


def check_row(ck: Check, tname: str, row: dict) -> None:
    """The sync budget, the CUDA graphs and recompilation of one finished run."""
    tag = f"{tname}/{row['method']}/{row['mode']}"
    compile = row["mode"] == "compiled"
    if compile:
        late = row["graphs_compiled_after_warmup"]
        if late:
            ck.fail(f"{tag}: {late} graphs compiled after the warm-up")
        if row["cudagraph_skips"]:
            ck.fail(f"{tag}: cudagraph_skips = {row['cudagraph_skips']}")
    if "count_error" in row:
        ck.fail(f"{tag}: the counted run failed: {row['count_error']}")
        return
    if compile:
        r = row["extra_rounds"]
        if row["host_reads"] > COMPILED_READS * r + COMPILED_SETUP_READS:
            ck.fail(f"{tag}: {row['host_reads']} host reads in {r} rounds (budget {COMPILED_READS}/round + "
                    f"{COMPILED_SETUP_READS}; where: the JSON's reads_where)")
        if row["syncs"] is not None and row["syncs"] > COMPILED_READS * r + COMPILED_SETUP_READS:
            ck.fail(f"{tag}: {row['syncs']} CUDA syncs in {r} rounds (budget {COMPILED_READS}/round + set-up)")
        if row["graphs_compiled_in_count_run"]:
            ck.fail(f"{tag}: {row['graphs_compiled_in_count_run']} graphs compiled in the counted run")
        return
    dr = row["extra_rounds"]
    if dr < MIN_EXTRA_ROUNDS:
        ck.fail(f"{tag}: only {dr} extra rounds between the counted runs (raise --count-tokens)")
        return
    if row.get("known_over_budget"):  # outside the sync budget by design (HOST_DRIVEN); its reads stay in the JSON
        return
    if row["host_reads"] > EAGER_READS * dr + OCCASIONAL_READS:
        ck.fail(f"{tag}: {row['host_reads']} host reads in {dr} rounds (budget {EAGER_READS}/round + "
                f"{OCCASIONAL_READS} occasional; where: the JSON's reads_where)")
    if row["lifted"] > 0:
        ck.fail(f"{tag}: {row['lifted']} tensors lifted from Python data in {dr} rounds (budget 0)")
    if row["syncs"] is not None and row["syncs"] > EAGER_READS * dr + OCCASIONAL_READS:
        ck.fail(f"{tag}: {row['syncs']} CUDA syncs in {dr} rounds (budget {EAGER_READS}/round + "
                f"{OCCASIONAL_READS} occasional)")


def mar_run(ck: Check, models, name: str) -> dict:
    """MAR's target alone (``ar``) or CSpD, one image, timed; host reads counted only on --tiny
    (no budget: the continuous loop verifies on the host by design)."""
    target, draft, hc, _ = models
    method = build_method(name, family="continuous")
    labels = torch.tensor([1 if ck.a.tiny else 207])
    mem0 = ck.memory_start()
    ck.sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        res = method.generate(target, draft, labels, [0], hc)
    ck.sync()
    s = time.perf_counter() - t0
    c = res.counters[0]
    L = res.tokens.shape[1]
    row = {"method": name, "mode": "eager", "seconds": s, "rounds": c["target_forwards"],
           "tokens_per_round": L / c["target_forwards"], "seconds_per_round": s / c["target_forwards"],
           "seconds_per_token": s / L, "target_forwards": c["target_forwards"], "draft_forwards": c["draft_forwards"],
           "acceptance_rate": res.acceptance_rate(0), "finite": bool(torch.isfinite(res.tokens).all()),
           "peak_memory_bytes": None if mem0 is None else _bytes(target, draft) + ck.memory_extra(mem0)}
    if ck.a.tiny:
        with torch.no_grad(), counted(ck.dev, False) as (reads, _):
            method.generate(target, draft, labels, [0], hc)
        row.update(host_reads=reads.count, lifted=reads.lifted, host_reads_per_round=reads.count / c["target_forwards"],
                   lifted_per_round=reads.lifted / c["target_forwards"])
    if not row["finite"]:
        ck.fail(f"mar/{name}: non-finite tokens")
    return row


# ------------------------------------------------------------------------------------------ driver
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32", "float64"],
                    help="discrete targets' dtype (default: bfloat16; --tiny: float64); MAR: float32 (tiny: float64)")
    ap.add_argument("--tiny", action="store_true", help="tiny random models (a smoke run on any machine)")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--methods", default=None, help="discrete methods (default: every registered one)")
    ap.add_argument("--compiled-methods", default=None,
                    help="methods run compiled (default: --methods; with --tiny: ar,eagle)")
    ap.add_argument("--tree", default=None,
                    help="a named tree, or chain with --draft-length (default: mc_sim_7b_63; --tiny: chain)")
    ap.add_argument("--draft-length", type=int, default=None, help="the chain's length (default 4; --tiny: 3)")
    ap.add_argument("--lumina-layers", type=int, default=8, help="Chameleon-7B layers kept (of 32)")
    ap.add_argument("--mar-steps", type=int, default=100, help="MAR's diffusion head steps (MAR's evaluation: 100)")
    ap.add_argument("--tokens", type=int, default=128,
                    help="tokens a run decodes at most, in whole image rows (default 128: the first 8 rows of "
                         "LlamaGen-XL's 16 x 16, 2 of Lumina-mGPT's 48-wide rows); the per-token and per-round "
                         "costs are what the check measures, and whole 2,304-token Lumina images would not fit "
                         "the budget")
    ap.add_argument("--count-tokens", type=int, default=48,
                    help="eager host reads: the rounds of a 2a-token run over an a-token one (a <= half the image)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new run once past this (skips recorded)")
    ap.add_argument("--no-signals", action="store_true", help="skip the per-token quality signals")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="peak memory bandwidth (default: by GPU name)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: 1 on the CPU)")
    ap.add_argument("--out", type=Path, default=None,
                    help="writes <out>.json and <out>.md (default results/gpu/check; --tiny: results/gpu/check_tiny)")
    a = ap.parse_args(argv)

    def listed(value, valid, flag):
        items = [s.strip() for s in value.split(",") if s.strip()]
        bad = [s for s in items if s not in valid]
        if bad or not items:
            ap.error(f"{flag}: unknown {', '.join(bad) or '(empty)'}; valid: {', '.join(valid)}")
        return items

    a.targets = listed(a.targets, TARGETS, "--targets")
    a.modes = listed(a.modes, MODES, "--modes")
    a.methods = listed(a.methods, discrete_methods(), "--methods") if a.methods else discrete_methods()
    default_compiled = [m for m in a.methods if m in FIRST] if a.tiny else a.methods
    a.compiled_methods = listed(a.compiled_methods, discrete_methods(), "--compiled-methods") \
        if a.compiled_methods else default_compiled
    a.dtype = a.dtype or ("float64" if a.tiny else "bfloat16")
    a.tree = a.tree or ("chain" if a.tiny else "mc_sim_7b_63")  # a CPU compiles a chain's graphs in seconds
    a.draft_length = a.draft_length if a.draft_length is not None else 3 if a.tiny else 4
    try:
        dev = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device {a.device!r} is not a device (cuda, cuda:0, cpu)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (a CPU smoke run: --tiny --device cpu)")
    if a.lumina_layers < 1 or a.mar_steps < 2 or a.count_tokens < 1 or a.budget_s < 0 or a.draft_length < 1 \
            or (a.tokens is not None and a.tokens < 1):
        ap.error("--lumina-layers, --count-tokens, --tokens and --draft-length must be >= 1, --mar-steps >= 2, "
                 "--budget-s >= 0")
    try:
        build_method("eagle", tree=a.tree, **({"draft_length": a.draft_length} if a.tree == "chain" else {}))
    except ValueError as e:
        ap.error(f"--tree {a.tree}: {e}")
    a.out = a.out or ROOT / "results" / "gpu" / ("check_tiny" if a.tiny else "check")
    return a, dev




def tier(mode: str, method: str) -> int:
    """The order of work: eager AR and EAGLE, compiled AR (the round's graphs) and MAR; every other
    method eagerly (each may fail on a device in its own way); compiled EAGLE (its drafting graph
    takes minutes to compile with a 25-node tree); the other methods compiled."""
    if mode == "eager":
        return 0 if method in FIRST else 1
    return 0 if method == "ar" else 2 if method == "eagle" else 3


def plan(a) -> list[tuple[str, str, str]]:
    """(target, mode, method) in the order of work (``tier``), the given order within a tier."""
    items = []
    for t in a.targets:
        if t == "mar":
            items += [(0, t, "eager", m) for m in ("ar", "cspd")]
            continue
        for mode in a.modes:
            items += [(tier(mode, m), t, mode, m) for m in (a.methods if mode == "eager" else a.compiled_methods)
                      if runs_on(t, m)]
    return [x[1:] for x in sorted(items, key=lambda x: x[0])]  # sorted is stable


def main(argv=None) -> dict:
    a, dev = parse(argv)
    threads = torch.get_num_threads()
    if dev.type == "cpu" or a.threads:
        torch.set_num_threads(a.threads or 1)
    try:
        return _check(a, dev)
    finally:
        torch.set_num_threads(threads)  # a caller's setting (the tests import main)


def _check(a, dev) -> dict:
    dtype = getattr(torch, a.dtype)
    ck = Check(a, dev, dtype)
    gpu = hardware_name(dev)
    bw = a.bandwidth_gbs or (bandwidth_of(gpu) if dev.type == "cuda" else None)
    out: dict = {"device": gpu, "device_type": dev.type, "torch": torch.__version__, "commit": code_commit(ROOT),
                 "dtype": a.dtype, "tiny": a.tiny, "bandwidth_gbs": bw, "tree": a.tree, "tokens_cap": a.tokens,
                 "draft_length": a.draft_length if a.tree == "chain" else None, "budget_s": a.budget_s,
                 "quality_signals": not a.no_signals, "count_tokens": a.count_tokens,
                 "compiled_methods": a.compiled_methods if "compiled" in a.modes else [],
                 "budget": {"eager_reads_per_round": EAGER_READS, "compiled_reads_per_round": COMPILED_READS,
                            "compiled_setup_reads": COMPILED_SETUP_READS,
                            "eager_occasional_reads": OCCASIONAL_READS},
                 "targets": {}}
    print(f"gpu_check: {gpu}, torch {torch.__version__}, {a.dtype}, targets {','.join(a.targets)}, "
          f"modes {','.join(a.modes)}, budget {a.budget_s:.0f} s", flush=True)
    if a.tiny and "compiled" in a.modes:
        print(f"gpu_check: --tiny compiles only {','.join(a.compiled_methods) or 'nothing'} "
              f"(Inductor on a CPU: tens of seconds a graph)", flush=True)
    specs: dict = {}
    builders = {"llamagen": lambda: llamagen(a, dev, dtype), "lumina": lambda: lumina(a, dev, dtype),
                "mar": lambda: mar(a, dev)}
    warm: set = set()
    for tname, mode, name in plan(a):
        key = (tname, mode)
        tout = out["targets"].setdefault(tname, {"runs": []})
        tag = f"{tname}/{name}/{mode}"
        if ck.over_budget(key):
            ck.skipped.append(tag)
            tout["runs"].append({"method": name, "mode": mode, "status": "skipped", "error": "time budget"})
            print(f"[{ck.elapsed():6.1f}s] {tag}: skipped (budget {a.budget_s:.0f} s)", flush=True)
            continue
        if tname not in specs:
            try:
                specs[tname] = capped(builders[tname](), a.tokens)
                tout.update(describe(specs[tname], tname, bw, a.tiny))
                print(f"gpu_check: {tname}: {tout['shapes']}", flush=True)
            except Exception as e:  # noqa: BLE001  (a target that cannot be built fails its runs, not the check)
                specs[tname] = e
                ck.fail(f"{tname}: could not be built: {one_line(e)}")
                tout["error"] = one_line(e)
                tout["traceback"] = traceback.format_exc(limit=8)
        spec = specs[tname]
        if isinstance(spec, Exception):
            tout["runs"].append({"method": name, "mode": mode, "status": "failed", "error": "target not built"})
            continue
        if tname != "mar" and mode == "compiled" and not spec.compiles:
            tout["runs"].append({"method": name, "mode": mode, "status": "n/a", "error": spec.compile_note})
            print(f"[{ck.elapsed():6.1f}s] {tag}: n/a ({spec.compile_note})", flush=True)
            continue
        t0, before = time.perf_counter(), len(ck.failures)
        try:
            if tname == "mar":
                row = mar_run(ck, spec, name)
            else:
                if key not in warm and mode == "eager":  # first launches, allocator, kernels' autotuning: untimed,
                    # over the whole run length (an eager KV cache meets every attention length once)
                    generate(ck, spec, build(spec, "ar", a), False, spec.n_tokens)
                    warm.add(key)
                row = discrete_run(ck, spec, mode, name)
                check_row(ck, tname, row)
            row["failed_checks"] = ck.failures[before:]
            row["status"] = "check failed" if row["failed_checks"] else "ok"
        except Exception as e:  # noqa: BLE001  (one failing method must not hide the others)
            row = {"method": name, "mode": mode, "status": "failed", "error": one_line(e),
                   "traceback": traceback.format_exc(limit=12)}
            ck.fail(f"{tag}: {one_line(e)}")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        row["wall_s"] = time.perf_counter() - t0
        ck.longest[key] = max(ck.longest.get(key, 0.0), row["wall_s"])
        tout["runs"].append(row)
        print(f"[{ck.elapsed():6.1f}s] {tag}: {progress(row)}", flush=True)
        snapshot = copy.deepcopy(out)
        finish(ck, snapshot, done=False)
        write(snapshot, a.out)
    finish(ck, out)
    write(out, a.out)
    out["written"] = [str(_suffixed(a.out, ".json")), str(_suffixed(a.out, ".md"))]
    return out


def one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def read_bytes(model) -> int:
    """Bytes one AR step reads: every weight but the input embedding tables (a step reads B rows)."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in emb)


def describe(spec, tname: str, bw, tiny: bool) -> dict:
    if tname == "mar":
        target, draft, hc, shapes = spec
        return {"shapes": shapes, "params": sum(p.numel() for p in target.parameters()),
                "weight_bytes": _bytes(target), "resident_bytes": _bytes(target, draft),
                "image_tokens": target.config.seq_len, "bandwidth_bound_s_per_token": None,
                "bound_note": f"not applicable: a step runs the backbone once and the head {hc.steps} times"}
    wb = read_bytes(spec.bound_model)
    d = {"shapes": spec.shapes, "params": sum(p.numel() for p in spec.bound_model.parameters()),
         "weight_bytes": _bytes(spec.bound_model), "bytes_read_per_step": wb, "resident_bytes": _bytes(*spec.models),
         "tokens_per_run": spec.n_tokens, "bandwidth_bound_s_per_token": wb / (bw * 1e9) if bw else None,
         **({"compiled": spec.compile_note} if spec.compile_note else {})}
    layers = spec.bound_model.model.layers if tname == "lumina" else None
    if layers is not None and not tiny and bw:  # the bound of all 32 layers, for reference
        from coolsd.models.chameleon import CHAMELEON_7B

        full = wb + (CHAMELEON_7B.num_layers - len(layers)) * _bytes(layers[0])
        d["full_depth_bound_s_per_token"] = full / (bw * 1e9)
    return d


def progress(row: dict) -> str:
    if "seconds" not in row:
        return f"{row['status'].upper()} {row.get('error', '')}"
    reads = row.get("host_reads_per_round")
    return (f"{row['status']}, {row['tokens_per_round']:.2f} tokens/round, {row['seconds']:.2f} s"
            + (f", reads {reads:.2f}/round" if reads is not None else "")
            + (f", compile {row['compile_s']:.1f} s" if row.get("compile_s") is not None else ""))


def finish(ck: Check, out: dict, done: bool = True) -> None:
    """Round costs in AR steps, AR against the bound, compiled-vs-eager tokens, totals (on a copy
    while the check runs: ``done`` False)."""
    exact_order = ck.dtype == torch.float64 and ck.dev.type == "cpu"
    failures = list(ck.failures)
    for tname, tout in out["targets"].items():
        runs = tout["runs"]
        ok = {(r["method"], r["mode"]): r for r in runs if "seconds" in r}  # ran (its checks may have failed)
        bound = tout.get("bandwidth_bound_s_per_token")
        tout["ar"] = {}
        for mode in MODES:
            ar = ok.get(("ar", mode))
            if ar is None:
                continue
            tout["ar"][mode] = {"seconds_per_token": ar["seconds_per_token"],
                                "seconds_per_round": ar["seconds_per_round"],
                                "over_bound": ar["seconds_per_token"] / bound if bound else None}
        for r in runs:
            ar = tout["ar"].get(r["mode"])
            if "seconds" in r:
                r["round_in_ar_steps"] = r["seconds_per_round"] / ar["seconds_per_round"] if ar else None
        for (m, mode), r in ok.items():
            if mode != "compiled" or (m, "eager") not in ok:
                continue
            e, c = ok[(m, "eager")]["tokens"], r["tokens"]
            same = e == c
            r["token_agreement"] = float(same.double().mean())
            diff = (~same).nonzero()
            r["first_divergence"] = int(diff[0, 0]) if len(diff) else None
            if exact_order and not bool(same.all()):
                failures.append(f"{tname}/{m}: compiled tokens differ from eager in fp64 on the CPU "
                                f"(first at token {r['first_divergence']})")
        peaks = [r["peak_memory_bytes"] for r in runs if r.get("peak_memory_bytes") is not None]
        tout["peak_memory_bytes"] = max(peaks) if peaks else None
        for r in runs:
            r.pop("tokens", None)
    skips = [r["cudagraph_skips"] for t in out["targets"].values() for r in t["runs"]
             if r.get("cudagraph_skips") is not None]
    out["cudagraph_skips"] = sum(skips) if ck.dev.type == "cuda" and skips else None
    out["cudagraph_skips_note"] = None if ck.dev.type == "cuda" else "not applicable (CUDA graphs run on CUDA only)"
    out["skipped"] = ck.skipped
    out["failures"] = failures
    out["elapsed_s"] = ck.elapsed()
    out["complete"] = done  # False: written while running (a killed check leaves its last snapshot)
    out["assertions"] = "no run failed; eager reads <= 2 a round (+ 2 occasional) and no lift; " \
                        "compiled reads <= 1 a round + set-up; " \
                        "no graph compiled after warm-up; cudagraph_skips == 0 (CUDA); compiled tokens == eager (fp64 CPU)"


def _suffixed(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _size(b) -> str:
    if b is None:
        return "-"
    return f"{b / 2**30:.2f} GiB" if b >= 2**27 else f"{b / 2**20:.2f} MiB"


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def _cell(text) -> str:
    return str(text).replace("|", "/")


def write(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _suffixed(path, ".json").write_text(json.dumps(out, indent=1, default=str))
    gib = lambda b: None if b is None else b / 2**30  # noqa: E731
    tree = out["tree"] + (f" (draft length {out['draft_length']})" if out["draft_length"] else "")
    skips = out["cudagraph_skips"] if out["cudagraph_skips"] is not None else \
        out["cudagraph_skips_note"] or "none compiled"
    lines = [f"# Device check: {out['device']} ({out['device_type']}), {out['dtype']}"
             + (", tiny models" if out["tiny"] else ""), "",
             f"- torch {out['torch']}; commit {out['commit'] or 'unknown'}; tree {tree}; "
             f"quality signals {'on' if out['quality_signals'] else 'off'}",
             f"- bandwidth {out['bandwidth_gbs'] or 'unknown'} GB/s; cudagraph_skips: {skips}",
             f"- {out['elapsed_s']:.0f} s of a {out['budget_s']:.0f} s budget; "
             f"skipped: {', '.join(out['skipped']) or 'none'}",
             f"- checks: {out['assertions']}",
             "- result: " + ("" if out["complete"] else "(still running) ")
             + ("FAILED: " + "; ".join(out["failures"]) if out["failures"] else "all checks passed")]
    for tname, t in out["targets"].items():
        lines += ["", f"## {tname}", "", f"- {t.get('shapes', t.get('error', ''))}"
                  + (f"; {t['tokens_per_run']} tokens a run" if t.get("tokens_per_run") else "")]
        if t.get("compiled"):
            lines.append(f"- compiled: {t['compiled']}")
        if t.get("weight_bytes") is not None:
            bound, full = t.get("bandwidth_bound_s_per_token"), t.get("full_depth_bound_s_per_token")
            lines.append(f"- weights {_size(t['weight_bytes'])}; bandwidth bound "
                         + (f"{bound * 1e3:.3f} ms/token (weights but the input embedding / peak bandwidth)" if bound
                            else t.get("bound_note") or "unknown (no GPU bandwidth)")
                         + (f"; all 32 layers: {full * 1e3:.3f} ms/token" if full else "")
                         + f"; peak memory {_size(t.get('peak_memory_bytes'))}")
        if tname == "mar":
            lines.append("- no sync budget: the continuous loop verifies on the host by design (reads counted on --tiny)")
        for mode, ar in t.get("ar", {}).items():
            lines.append(f"- AR {mode}: {ar['seconds_per_token'] * 1e3:.2f} ms/token"
                         + (f" = {ar['over_bound']:.2f}x the bandwidth bound" if ar["over_bound"] else ""))
        lines += ["", "| method | mode | status | tokens/round | host reads/round | lifted/round | syncs/round | "
                      "round, AR steps | signals | s | compile s | peak GiB | compiled = eager |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["runs"]:
            if "seconds" not in r:
                lines.append(f"| {r['method']} | {r['mode']} | {r['status']}: {_cell(r.get('error', ''))} "
                             + "| " * 10 + "|")
                continue
            agree = r.get("token_agreement")
            cells = [r["method"], r["mode"], r["status"], _fmt(r["tokens_per_round"]), _fmt(r.get("host_reads_per_round")),
                     _fmt(r.get("lifted_per_round")), _fmt(r.get("syncs_per_round")), _fmt(r.get("round_in_ar_steps")),
                     _fmt(None if r.get("signal_share") is None else 100 * r["signal_share"], ".1f") + "%"
                     * (r.get("signal_share") is not None), _fmt(r["seconds"], ".3f"), _fmt(r.get("compile_s"), ".1f"), _fmt(gib(r.get("peak_memory_bytes"))),
                     "-" if agree is None else f"{agree:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Host reads, lifts and syncs: eager, per extra round of a longer counted run; compiled, per round "
                  "of a full counted run (set-up included). Round, AR steps: a round's time over an AR step's "
                  "(same target and mode). Signals: the quality signals' share of an eager run's time (compiled "
                  "rounds compute them inline). compiled = eager: the fraction of equal tokens. Random weights: "
                  "accepted lengths mean nothing, costs are real."]
    _suffixed(path, ".md").write_text("\n".join(lines) + "\n")


def cli(argv=None) -> int:
    out = main(argv)
    if out["failures"]:
        print(f"gpu_check: FAILED ({len(out['failures'])}): " + "; ".join(out["failures"]), file=sys.stderr)
        return 1
    print(f"gpu_check: all checks passed in {out['elapsed_s']:.0f} s -> {', '.join(out['written'])}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
