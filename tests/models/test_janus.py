"""Janus-Pro target (``coolsd.models.janus``) on a tiny random-weight ``JanusForConditionalGeneration``
of transformers' own classes (``factories.tiny_janus``, float64; text: hidden 32, 2 layers, 4 query /
2 key-value heads, vocab 64; VQ: 32 codes, 4 x 4 image tokens, 8 x 8 px): the adapter's prefill,
decode, tree and commit logits against transformers' own full forward of the same sequences without
a cache (sdpa, and eager attention's additive mask); greedy AR through our loop against
transformers' ``generate(generation_mode="image")`` with CFG; the shared tree round
(tests/protocol_checks.py); batch invariance; the pixels; strict loading.

Measured max |adapter - transformers full forward| over the (CFG-combined) image logits (float64, this
machine; the tests allow ``TOL`` = 1e-9, eager ``TOL_EAGER`` = 1e-5; ``pytest -s`` prints the sdpa ones):

| check                                                        | max abs diff |
|--------------------------------------------------------------|--------------|
| prefill + 15 single-token decodes, cfg 1 (batch 2)           | 8.9e-16      |
| prefill + 15 single-token decodes, cfg 3 (doubled batch 4)   | 0 (equal)    |
| tree of 7 nodes with siblings, one forward                   | 3.6e-15      |
| the same tree level by level (second forward over pending)   | 3.6e-15      |
| per-sample commits of different paths, split tree, chain     | 3.3e-15      |
| eager attention, tree level by level (float32 softmax)       | 7.4e-7       |
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coolsd.engine import batch_invariant
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.trees import build_tree
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.methods import build_method
from coolsd.engine.model_protocol import ARModel
from coolsd.models.janus import JanusTarget, JanusTokens, pixels_uint8, prompt_ids, prompt_text
from factories import (JANUS_CODES as N_CODES, JANUS_SIDE as SIDE, JANUS_TOKENS as TOKENS, tiny_janus,
                       write_janus_folder, write_janus_tokenizer)
from protocol_checks import commit_and_continue as continue_after_commits
from protocol_checks import path_to, reused_cache_check, run_tree_round

TOL = 1e-9
TOL_EAGER = 1e-5  # eager attention's softmax runs in float32 even for a float64 model
N = SIDE * SIDE  # 4 x 4 image tokens
PROMPTS = [[1, 10, 11, 12, 4], [1, 20, 21, 22, 23, 24, 25, 4]]  # BOS .. <begin_of_image>, lengths 5 and 8
TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # root + 6 nodes, depth 3
MAX_DIFF: dict = {}  # check -> measured max abs difference (the docstring's table)


# ------------------------------------------------------------------------------ reference
def close(a, b, tol=TOL, key=None):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    if key:
        MAX_DIFF[key] = max(MAX_DIFF.get(key, 0.0), err)
    assert err <= tol, err


@torch.no_grad()
def reference_logits(model, prompt, codes, cfg_scale):
    """(len(codes) + 1, V) CFG logits from transformers' own full forward (no cache, its causal mask,
    positions 0..): [prompt embeddings, image-token embeddings] for the cond prompt and for
    transformers' unconditional one (pad except BOS / <begin_of_image>); row t predicts code t."""
    codes = torch.as_tensor(codes, dtype=torch.long).view(1, -1)
    uncond = [t if t in (TOKENS.bos, TOKENS.boi) else TOKENS.pad for t in prompt]

    def run(ids):
        text = model.get_input_embeddings()(torch.tensor([ids]))
        image = model.prepare_embeddings_for_image_generation(codes)
        h = model.model.language_model(inputs_embeds=torch.cat([text, image], 1), use_cache=False).last_hidden_state
        return model.model.generation_head(h[0, len(ids) - 1:])

    lc = run(list(prompt))
    if cfg_scale == 1.0:
        return lc
    lu = run(uncond)
    return lu + cfg_scale * (lc - lu)


def rand_codes(*shape, seed):
    return torch.randint(0, N_CODES, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    yield tiny_janus()
    if MAX_DIFF:  # the docstring's table, shown with pytest -s
        print("\nmax abs diff vs transformers' full forward:", {k: f"{v:.1e}" for k, v in MAX_DIFF.items()})


def make_target(model, cfg_scale=3.0, **kw) -> JanusTarget:
    return JanusTarget(model, cfg_scale=cfg_scale, tokens=TOKENS, **kw)


# ------------------------------------------------------------------------------ prompts
def test_prompt_template_unconditional_prompt_and_refusals(model, tmp_path):
    """Upstream's SFT template (empty system prompt, stripped caption) + <begin_of_image>; the
    unconditional prompt keeps BOS and <begin_of_image> only; a prompt not ending in
    <begin_of_image> is refused in one line."""
    from tokenizers import Tokenizer

    assert prompt_text("  a cat ") == "<|User|>: a cat\n\n<|Assistant|>:<begin_of_image>"
    tok = Tokenizer.from_file(str(write_janus_tokenizer(tmp_path / "tokenizer.json")))
    assert JanusTokens.from_tokenizer(tok) == TOKENS
    ids = prompt_ids(lambda s: tok.encode(s, add_special_tokens=False).ids, "red circle", TOKENS.bos)
    v = tok.get_vocab()
    assert ids == [1, 6, 8, v["red"], v["circle"], 7, 8, 4]
    target = make_target(model)
    assert isinstance(target, ARModel) and target.vocab_size == N_CODES and target.n_image_tokens == N
    assert target.unconditional(ids) == [1, 2, 2, 2, 2, 2, 2, 4]
    with pytest.raises(ValueError, match="must end with <begin_of_image> .id 4.: build it with"):
        target.begin([[1, 10, 11]], 1)
    with pytest.raises(ValueError, match="ids in \\[0, 64\\)"):
        target.begin([[1, 99, 4]], 1)
    from tokenizers import models

    with pytest.raises(ValueError, match="lacks Janus's tokens"):
        JanusTokens.from_tokenizer(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))


# ------------------------------------------------------------------------------ logits parity
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_prefill_and_token_by_token_decode_match_the_full_forward(model, cfg_scale):
    """begin (prompts of lengths 5 and 8, CFG halves in one doubled batch) and 16 single-token
    forwards + commits equal transformers' full forward of each prompt alone."""
    target = make_target(model, cfg_scale=cfg_scale)
    codes = rand_codes(2, N, seed=12)
    out = target.begin(PROMPTS, 2)
    assert out.logits.shape == (2, 1, N_CODES) and out.logits.dtype == torch.float64
    assert out.hidden.shape == ((2, 1, 2, 32) if cfg_scale != 1.0 else (2, 1, 32))
    refs = [reference_logits(model, PROMPTS[b], codes[b], cfg_scale) for b in range(2)]
    key = f"decode cfg {cfg_scale:g}"
    for b in range(2):
        close(out.logits[b, 0], refs[b][0], key=key)
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N - 1):
        step = target.forward(codes[:, j : j + 1], torch.full((2, 1), j), one)
        for b in range(2):
            close(step.logits[b, 0], refs[b][j + 1], key=key)
        target.commit(None, torch.ones(2, dtype=torch.long))
    assert target.cache.length.tolist()[:2] == [5 + N - 1, 8 + N - 1]
    if cfg_scale != 1.0:  # the unconditional half: same lengths, same positions
        assert target.cache.length.tolist()[2:] == [5 + N - 1, 8 + N - 1]


@pytest.mark.parametrize("split", [False, True])
def test_tree_round_matches_path_forwards(model, split):
    """The shared tree round (tests/protocol_checks.py): prefill, commit a prefix, a tree with
    siblings in one forward or level by level (pending entries): every node's logits are those of
    its root-to-node path under the full forward."""
    target = make_target(model)
    prefix, tree_tokens = rand_codes(2, 3, seed=3), rand_codes(2, TREE.n_nodes + 1, seed=4)
    logits = run_tree_round(target, PROMPTS, prefix, tree_tokens, TREE, split)
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            ref = reference_logits(model, PROMPTS[b], torch.cat([prefix[b], tree_tokens[b, path_to(TREE, i)]]), 3.0)
            close(logits[b, i], ref[-1], key="tree, two forwards" if split else "tree, one forward")


def test_eager_attention_runs_the_same_tree():
    """With attn_implementation="eager" the tree mask goes in additive (``run_tree_masked``; eager
    attention adds its mask, so a boolean one would let every query see every slot): the same
    logits up to eager attention's float32 softmax."""
    eager = tiny_janus(attn="eager")
    assert eager.model.language_model.config._attn_implementation == "eager"
    target = make_target(eager)
    prefix, tree_tokens = rand_codes(2, 3, seed=3), rand_codes(2, TREE.n_nodes + 1, seed=4)
    logits = run_tree_round(target, PROMPTS, prefix, tree_tokens, TREE, split=True)
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            ref = reference_logits(eager, PROMPTS[b], torch.cat([prefix[b], tree_tokens[b, path_to(TREE, i)]]), 3.0)
            close(logits[b, i], ref[-1], tol=TOL_EAGER)


KEPT = [path_to(TREE, 6), path_to(TREE, 2)]  # sample 0 keeps 4 entries, sample 1 keeps 2


def commit_and_continue(target, rows):
    """For the samples ``rows`` of a batch of 2: a tree round after 3 committed codes, commit of each
    sample's KEPT path (different lengths), a second tree round in two calls at each sample's own
    positions, commit of root -> node 3, then a chain of 3. Returns the second round's and the last
    logits, the committed code sequences, the second tree's and the chain's tokens."""
    return continue_after_commits(target, PROMPTS, rows, KEPT, TREE, rand_codes)


def test_commits_of_different_lengths_then_continue_match_the_full_forward(model):
    target = make_target(model)
    tree_logits, last, seqs, t2, new = commit_and_continue(target, [0, 1])
    key = "commits, split tree, chain"
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            ref = reference_logits(model, PROMPTS[b], torch.cat([seqs[b], t2[b, path_to(TREE, i)]]), 3.0)
            close(tree_logits[b, i], ref[-1], key=key)
        ref = reference_logits(model, PROMPTS[b], torch.cat([seqs[b], t2[b, path_to(TREE, 3)], new[b]]), 3.0)
        close(last[b], ref[-3:], key=key)
    # a batch equals its samples alone (to rounding), and bit for bit under batch_invariant()
    for b in range(2):
        single = commit_and_continue(make_target(model), [b])
        close(single[0][0], tree_logits[b])
        close(single[1][0], last[b])
    with batch_invariant.batch_invariant():
        inv = commit_and_continue(make_target(model), [0, 1])
        alone = [commit_and_continue(make_target(model), [b]) for b in range(2)]
    for b in range(2):
        assert torch.equal(inv[0][b], alone[b][0][0]) and torch.equal(inv[1][b], alone[b][1][0])


# ------------------------------------------------------------------------------ greedy generation
def test_greedy_ar_through_the_loop_equals_transformers_generate(model):
    """Greedy AR through ``speculative_generate`` (batch of prompts of different lengths) equals
    transformers' ``generate(generation_mode="image", do_sample=False)`` with the same CFG, each
    prompt alone and a batch of two prompts of equal length (no padding: transformers' batched
    image generation counts left pads in the positions); greedy speculative decoding (the target
    drafting for itself, and SJD) gives the same tokens."""
    from transformers import GenerationConfig

    greedy = SamplingConfig(temperature=0.0)
    gen = GenerationConfig(bos_token_id=TOKENS.bos, pad_token_id=TOKENS.pad, eos_token_id=3, do_sample=False,
                           guidance_scale=3.0, generation_kwargs={"boi_token_id": TOKENS.boi})
    with batch_invariant.batch_invariant():  # our batch of two prompts, each computed as alone: compared with batch-1 generates
        ours = speculative_generate(make_target(model), N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2,
                                    sampling=greedy)
    for b, p in enumerate(PROMPTS):
        ids = torch.tensor([p])
        theirs = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen,
                                generation_mode="image")
        assert torch.equal(ours.tokens[b], theirs[0]), (ours.tokens[b], theirs[0])
    assert len(set(ours.tokens[0].tolist())) > 3  # not a constant sequence
    same = [PROMPTS[0], [1, 30, 31, 32, 4]]
    ids = torch.tensor(same)
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, generation_mode="image")
    ours2 = speculative_generate(make_target(model), N, PerSampleRNG([0, 1]), cond=same, batch_size=2, sampling=greedy)
    assert torch.equal(ours2.tokens, theirs) and torch.equal(ours2.tokens[0], ours.tokens[0])
    for name, tree, drafter_model in (("eagle", "chain", make_target(model)), ("sjd", "chain", None)):
        m = build_method(name, tree=tree, draft_length=4 if name == "eagle" else None)
        drafter = build_drafter(m, drafter_model, greedy, N_CODES, grid_width=SIDE)
        spec = speculative_generate(make_target(model), N, PerSampleRNG([0, 1]), rule=m.rule, drafter=drafter,
                                    tree=m.tree, cond=PROMPTS, batch_size=2, sampling=greedy)
        assert torch.equal(spec.tokens, ours.tokens), name
        assert all(sum(r) == N - 1 for r in spec.round_lengths)
        if name == "eagle":
            assert max(max(r) for r in spec.round_lengths) == 5  # every self-draft accepted



# ------------------------------------------------------------------------------ row-parallel decoding
def _zipar_forwards(target, steps, codes, by_position=True) -> torch.Tensor:
    """ZipAR's forwards (``zipar_schedule``) of fixed codes, each committed whole: logits (B, E, V)
    of every fed entry in feed order."""
    B = codes.shape[0]
    target.begin(PROMPTS, B)
    outs = []
    for s in steps:
        m = len(s.fed)
        attend = torch.tensor([[b <= a for b in s.positions] for a in s.positions])
        pos = torch.tensor(s.positions).expand(B, m)
        kw = {"by_position": True} if by_position else {}
        outs.append(target.forward(codes[:, list(s.fed)], pos, attend, **kw).logits)
        target.commit(torch.arange(m).expand(B, m), torch.full((B,), m))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("w", [1, 2])
def test_row_parallel_forwards_see_by_position(model, w):
    """``forward(by_position=True)`` (the KV cache's visibility by position, through TreeCache): the
    ZipAR schedule's forwards, committed one by one, give the logits of ONE tree-masked forward over
    every fed entry under ``coolsd.engine.rows.visibility`` (what each query sees, stated
    independently), for prompts of different lengths; every committed entry seen (no by_position)
    does not; under batch_invariant each sample equals itself alone, bit for bit."""
    from coolsd.engine.rows import visibility, zipar_schedule

    steps = zipar_schedule(SIDE, SIDE, w)
    codes = rand_codes(2, N, seed=3)
    fed = [f for s in steps for f in s.fed]
    target = make_target(model)
    target.begin(PROMPTS, 2)
    pos = torch.tensor([p for s in steps for p in s.positions]).expand(2, -1)
    ref = target.forward(codes[:, fed], pos, visibility(steps)).logits
    got = _zipar_forwards(make_target(model), steps, codes)
    close(got, ref, key=f"row-parallel by position, window {w}")
    plain = _zipar_forwards(make_target(model), steps, codes, by_position=False)
    assert (plain - ref).abs().max() > 1e-3
    with batch_invariant.batch_invariant():
        inv = _zipar_forwards(make_target(model), steps, codes)
    close(inv, got)


@pytest.mark.parametrize("method", ["zipar", "pjd"])
def test_row_parallel_methods_run_through_the_loop(model, method):
    """ZipAR and PJD through ``speculative_generate`` on Janus (batch of prompts of different lengths):
    every code drawn, ZipAR in its documented 2 W + (H - 2) w forwards, PJD in fewer than AR's."""
    m = build_method(method, **({"window": 2} if method == "zipar" else {"start": 2}))
    drafter = build_drafter(m, None, SamplingConfig(), N_CODES, grid_width=SIDE)
    res = speculative_generate(make_target(model), N, PerSampleRNG([0, 1]), drafter=drafter, cond=PROMPTS,
                               batch_size=2, sampling=SamplingConfig())
    assert res.tokens.shape == (2, N) and int(res.tokens.min()) >= 0 and int(res.tokens.max()) < N_CODES
    forwards = list(res.target_forwards)
    if method == "zipar":
        assert forwards == [2 * SIDE + (SIDE - 2) * 2] * 2
    else:
        assert all(f < N for f in forwards)


# ------------------------------------------------------------------------------ pixels and files
def test_decode_is_the_vq_decoder_and_pixels_truncate_as_upstream(model):
    target = make_target(model)
    codes = rand_codes(2, N, seed=1)
    raw = target.decode_raw(codes)
    ref = model.decode_image_tokens(codes).permute(0, 3, 1, 2)  # transformers' own (B, H, W, 3)
    assert raw.shape == (2, 3, 8, 8) and torch.equal(raw, ref)
    img = target.decode(codes)
    assert float(img.min()) >= 0 and float(img.max()) <= 1 and float((img == 1).float().mean()) > 0  # clamp acts
    u8 = pixels_uint8(torch.tensor([0.0, -0.0039, 0.9999, 1.5, -2.0, 0.5]).view(1, 1, 1, 6).expand(1, 3, 1, 6))
    x = np.array([0.0, -0.0039, 0.9999, 1.5, -2.0, 0.5], dtype=np.float32)
    assert u8[0, 0, :, 0].tolist() == np.clip((x + 1) / 2 * 255, 0, 255).astype(np.uint8).tolist()
    assert u8[0, 0, :, 0].tolist() == [127, 127, 254, 255, 0, 191]
    assert target.codebook().shape == (N_CODES, 8)
    assert torch.allclose(target.codebook().norm(dim=-1), torch.ones(N_CODES))


def test_loading_is_strict_and_gives_the_saved_model(tmp_path):
    from safetensors.torch import load_file, save_file

    from coolsd.models.janus import check_generation_config, load_janus

    d = write_janus_folder(tmp_path / "janus", seed=2, dtype=torch.float64)
    loaded = load_janus(d, dtype=torch.float64)
    src = tiny_janus(2)
    target, ref = make_target(loaded), make_target(src)
    a, b = target.begin(PROMPTS, 2), ref.begin(PROMPTS, 2)
    assert torch.equal(a.logits, b.logits)
    check_generation_config(d, TOKENS)
    with pytest.raises(ValueError, match="pad_token_id 2 is not the tokenizer's 7"):
        check_generation_config(d, JanusTokens(bos=1, pad=7, boi=4))
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.generation_head.vision_head.bias"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not fit JanusForConditionalGeneration .*vision_head.bias"):
        load_janus(d, dtype=torch.float64)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_janus(d)


def test_reused_cache_holds_a_longer_prompt(model):
    """As ``test_lumina``'s: a reused cache decodes a longer prompt as a fresh target does."""
    long = [1, *range(10, 30), 4]
    diff = reused_cache_check(lambda: make_target(model, cache_headroom=8), [1, 10, 4], long, N, N_CODES)
    assert diff <= 1e-9, diff
