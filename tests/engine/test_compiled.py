"""The compiled decode path (``compile=true``, coolsd.engine.compiled).

* compiled forwards of the LlamaGen target and the EAGLE-1 drafter (prefill, AR step, tree step,
  commits in between, CFG) equal the eager ones within fp32 tolerance;
* in fp64 a compiled speculative generation (LlamaGen, Lumina-mGPT) emits the eager run's tokens (the fused kernels'
  rounding, ~1e-15, moves no sampled token) and compiles nothing on a second run;
* the job: zero graphs compiled after its warm-up, counted in the summary; clear errors for
  targets without a compiled path and for compile together with batch invariance.

Compiling costs seconds per graph on a CPU, so the tests use tiny models and few shapes.
"""
from __future__ import annotations

import json

import pytest
import torch

import factories
from coolsd.engine.compiled import compile_count
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.trees import make_tree
from coolsd.models.eagle.model import EagleDrafter, EagleHead
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.host_reads import count_host_reads
from coolsd.engine.methods import build_method
from coolsd.models.llamagen import LlamaGenTarget

TREE = make_tree("chain", 3)


def _rounds(target, drafter, cond, B: int) -> list[torch.Tensor]:
    """Prefill, an AR step, a committed chain step, a drafter context forward and a level forward:
    every output, in order."""
    outs = []
    pre = target.begin(cond, B)
    outs += [pre.logits, pre.hidden]
    n = TREE.n_nodes + 1
    tok = torch.arange(B * n).reshape(B, n) % target.vocab_size
    s = target.forward(tok[:, :1], torch.zeros(B, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    outs += [s.logits, s.hidden]
    target.commit(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, dtype=torch.long))
    s = target.forward(tok, 1 + TREE.depth.expand(B, n), TREE.ancestors)
    outs += [s.logits, s.hidden]
    target.commit(torch.arange(n).expand(B, n), torch.tensor([2, 3][:B] + [1] * (B - 2)))
    drafter.begin(cond, B, pre)
    d = drafter.forward(tok, TREE.depth.expand(B, n), torch.ones(n, n, dtype=torch.bool).tril(), s.hidden)
    outs += [d.logits, d.hidden]
    drafter.commit(torch.arange(n).expand(B, n), torch.full((B,), n))
    d = drafter.forward(tok[:, :1], torch.full((B, 1), n), torch.ones(1, 1, dtype=torch.bool), s.hidden[:, :1])
    outs += [d.logits, d.hidden]
    return outs


@torch.no_grad()
def test_compiled_forwards_equal_eager_fp32():
    gpt = factories.engine_model(0).float()
    head = EagleHead.from_target(gpt, seed=3)
    cond = {k: v.float() if v.is_floating_point() else v for k, v in factories.engine_cond([3, 8]).items()}
    results = []
    for compile in (False, True):
        target = LlamaGenTarget(gpt, cfg_scale=3.0, compile=compile)
        drafter = EagleDrafter.for_target(head, target, compile=compile)
        results.append(_rounds(target, drafter, cond, 2))
    for eager, compiled in zip(*results):
        scale = eager.abs().max()
        assert (compiled - eager).abs().max() <= 1e-5 * scale + 1e-6, float((compiled - eager).abs().max())


METHODS = {"ar": {}, "eagle": {"tree": "chain", "draft_length": 3},
           "coolsd": {"tree": "chain", "draft_length": 3, "delta": 2.0}, "sjd": {"window": 4}}


def check_compiled_generation(make, method, cond) -> None:
    """``make(compile) -> (target, model drafter)``: in fp64 the compiled generation emits the eager
    run's tokens and rounds, a second compiled run (new target and drafter objects, same shapes)
    compiles no graph, and it stays within the compiled path's sync budget (docs/gpu.md): one host
    read a round, plus a run's fixed set-up and end."""
    sampling = SamplingConfig()

    def generate(compile: bool):
        target, model_drafter = make(compile)
        drafter = build_drafter(method, model_drafter, sampling, target.vocab_size)
        return speculative_generate(target, target.n_image_tokens, PerSampleRNG([5, 6]), rule=method.rule,
                                    drafter=drafter, tree=method.tree, sampling=sampling, cond=cond, batch_size=2)

    eager = generate(False)
    compiled = generate(True)
    assert torch.equal(eager.tokens, compiled.tokens)
    assert eager.round_lengths == compiled.round_lengths
    n = compile_count()
    with count_host_reads(lifts=False) as reads:
        again = generate(True)
    assert compile_count() == n
    assert torch.equal(again.tokens, eager.tokens)
    rounds = max(len(r) for r in again.round_lengths)
    assert reads.count <= rounds + 6, (rounds, reads.count, reads.by_kind)


@pytest.mark.parametrize("name", list(METHODS))
@torch.no_grad()
def test_compiled_generation_equals_eager_fp64_and_compiles_once(name):
    gpt = factories.engine_model(1)
    head = EagleHead.from_target(gpt, seed=3)

    def make(compile: bool):
        target = LlamaGenTarget(gpt, cfg_scale=3.0, compile=compile)
        return target, EagleDrafter.for_target(head, target, compile=compile)

    check_compiled_generation(make, build_method(name, **METHODS[name]), factories.engine_cond([3, 8]))


LUMINA_METHODS = {"eagle": {"tree": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]}, "sjd": {"window": 4}}


@pytest.mark.parametrize("name", list(LUMINA_METHODS))
@torch.no_grad()
def test_lumina_compiled_generation_equals_eager_fp64_and_compiles_once(name):
    """Lumina-mGPT's compiled path (every token with a row-end slot, ``coolsd.models.row_ends``; the
    EAGLE drafter's passes from the entry count) on the tiny 4 x 4 grid, whose rows end inside every
    tree (compiled AR on Lumina: tests/benchmarks/test_gpu_check.py)."""
    from coolsd.models.eagle.lumina import LuminaEagleDrafter, LuminaEagleHead
    from coolsd.models.lumina import ImageVocab, LuminaTarget, LuminaTokens

    model = factories.make_lm()
    head = LuminaEagleHead.from_target(model, seed=3).eval()
    tokens = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)
    side = factories.LUMINA_LATENT

    def make(compile: bool):
        target = LuminaTarget(model, ImageVocab(factories.VMAP), h_latent=side, w_latent=side, cfg_scale=3.0,
                              tokens=tokens, prefill_features="all", compile=compile)
        return target, LuminaEagleDrafter.for_target(head, target, compile=compile)

    prompts = [[0, 30, 31, 32, 26], [0, 40, 41, 42, 43, 44, 45, 46, 47, 26]]
    check_compiled_generation(make, build_method(name, **LUMINA_METHODS[name]), prompts)


def test_job_counts_compilations_after_warmup(tmp_path, world_overrides, dynamo_only):
    """The job around compiled graphs (Dynamo's, ``dynamo_only``: what a graph count sees)."""
    from coolsd.job.generation import run_job

    cfg = factories.compose(*world_overrides("llamagen_xl"), "method=coolsd", "tree.draft_length=2",
                            "dataset.n_prompts=3", "batch_size=2", "compile=true")
    summary = run_job(cfg, tmp_path / "run")
    assert summary["compiled"] is True
    # the warm-up ran batch 2 and the last batch's size 1: nothing compiled while timing
    assert summary["compile"]["graphs_compiled_after_warmup"] == 0
    assert summary["compile"]["warmup_s"] > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all("compilations" in r for r in records)
    # a compiled run never resumes into an eager run's folder (compile is part of the run identity)
    eager = factories.compose(*world_overrides("llamagen_xl"), "method=coolsd", "tree.draft_length=2",
                              "dataset.n_prompts=3", "batch_size=2")
    with pytest.raises(Exception, match="(?i)differ|another|mismatch|identity"):
        run_job(eager, tmp_path / "run")


@pytest.mark.parametrize("extra, message", [
    (["target=mar_h", "method=cspd"], "compile=true is not implemented for target=mar_h"),
    (["deterministic.batch_invariant=true"], "exclude each other"),
])
def test_compile_refused_before_loading(tmp_path, extra, message):
    from coolsd.job.generation import run_job

    cfg = factories.compose("compile=true", *extra)
    with pytest.raises(ValueError, match=message):
        run_job(cfg, tmp_path / "run")


@torch.no_grad()
def test_every_input_a_compiled_graph_mutates_has_a_static_address(monkeypatch):
    """CUDA graphs (``reduce-overhead``) capture a graph only if every input it mutates is static
    (a parameter, a buffer, or marked with ``torch._dynamo.mark_static_address``), else torch
    skips them ("mutated inputs"). Read from the compiled graphs' metadata on the CPU: the round
    (KV cache, the loop's buffers) and the drafter's expansion (its own cache), after an image
    decoded with the same buffers before (addresses reused across images)."""
    import inspect

    import torch._dynamo
    from torch._inductor import config as inductor_config
    from torch._inductor import output_code

    graphs = []
    init = output_code.CompiledFxGraph.__init__
    names = list(inspect.signature(init).parameters)[1:]

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        bound = {**dict(zip(names, args)), **kwargs}
        graphs.append((set(self.mutated_input_idxs), set(bound["static_input_idxs"] or ()),
                       [getattr(n, "name", str(n)) for n in self.mutated_inputs]))

    monkeypatch.setattr(output_code.CompiledFxGraph, "__init__", spy)
    # compile here, not from the disk cache (inductor's own patch: monkeypatch's undo would delete the key)
    with inductor_config.patch(fx_graph_cache=False):
        _decode_two_images()
    assert graphs, "nothing was compiled"
    bad = [(sorted(m - s), names) for m, s, names in graphs if m - s]
    assert not bad, f"compiled graphs mutate inputs without a static address: {bad}"


def _decode_two_images():
    torch._dynamo.reset()
    gpt = factories.engine_model(1)
    head = EagleHead.from_target(gpt, seed=3)
    cond = factories.engine_cond([3, 8])
    method = build_method("eagle", **METHODS["eagle"])
    target = LlamaGenTarget(gpt, cfg_scale=3.0, compile=True)
    drafter = build_drafter(method, EagleDrafter.for_target(head, target, compile=True), SamplingConfig(),
                            target.vocab_size)
    for seeds in ([5, 6], [7, 8]):  # the second image reuses the first one's buffers
        speculative_generate(target, target.n_image_tokens, PerSampleRNG(seeds), rule=method.rule, drafter=drafter,
                             tree=method.tree, sampling=SamplingConfig(), cond=cond, batch_size=2)
