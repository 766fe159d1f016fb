"""Emu3-Gen target (``coolsd.models.emu3``) on tiny random-weight models of transformers' own
``Emu3ForConditionalGeneration`` (float64): the adapter's logits against transformers' full
forward of the same sequences without a cache (prefill, token by token, tree rounds in one or two
forwards, commits of different lengths), greedy decoding through our loop against
``Emu3ForConditionalGeneration.generate`` with its CFG (``negative_prompt_ids``) and the model
card's prefix-constrained logits processor, the shared tree-round contract, the VQ decoding, and
strict loading. The tiny model and folder are ``factories.tiny_emu3`` / ``write_emu3_folder``.

Measured max |adapter - transformers' full forward| of the CFG logits over codes (float64, sdpa
unless said; TOL = 1e-10, TOL_EAGER = 1e-5):

    prefill + 16 AR steps, cfg 3 / cfg 1         6e-15 / 3e-15
    tree round (6 nodes, siblings), 1 call       7e-15
    tree round split in 2 calls (pending)        7e-15
    commits of different lengths + tree + AR     6e-15
    eager attention, tree round in 2 calls       7e-6  (its softmax runs in float32)
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coolsd.engine import batch_invariant
from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.trees import build_tree
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.methods import build_method
from coolsd.engine.model_protocol import ARModel
from coolsd.models.emu3 import (Emu3Backbone, Emu3Prompt, Emu3Target, ImageCodes, generate_size, generation_prompt,
                                load_emu3, load_emu3_target)
from coolsd.util.loading import BadInputFile, MissingInputFile
from factories import (EMU3_CODES, EMU3_GRID, EMU3_IMAGE_AREA, EMU3_SPECIAL, EMU3_VOCAB, emu3_vocabulary_map,
                       tiny_emu3, write_emu3_folder)
from protocol_checks import commit_and_continue as continue_after_commits
from protocol_checks import path_to, reused_cache_check, run_tree_round

TOL = 1e-10
TOL_EAGER = 1e-5  # eager attention's softmax runs in float32 even for a float64 model

# ------------------------------------------------------------------------------ tiny Emu3 (factories)
K = EMU3_CODES  # VQ codebook (visual tokens)
GRID = EMU3_GRID  # 4 x 4 image tokens: an end-of-line after tokens 3, 7, 11
N = GRID * GRID
IMAGE_AREA = EMU3_IMAGE_AREA
PAD, BOS, EOS, BOI, EOI, WRAPPER, EOL, EOF = (EMU3_SPECIAL[t] for t in (
    "<|endoftext|>", "<|extra_203|>", "<|extra_204|>", "<|image start|>", "<|image end|>", "<|image token|>",
    "<|extra_200|>", "<|extra_201|>"))
VOCAB = EMU3_VOCAB


# ------------------------------------------------------------------------------ references
MODEL = tiny_emu3()
CODES = ImageCodes(MODEL.config.vocabulary_map, K)
HEADER = [BOI, 9 + K + 1 + 4, 9 + K + 1 + 10, 9 + K + 1 + 4, WRAPPER]  # <|image start|> 4 * 4 <|image token|>
PROMPTS = [Emu3Prompt([BOS, 54, 55, 56, *HEADER], [BOS, 62, 63, 64, *HEADER]),
           Emu3Prompt([BOS, 58, 59, 60, 61, 54, 55, 56, 57, 58, *HEADER], [BOS, 62, 63, 64, *HEADER])]
TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # root + 6 nodes, depth 3


def make_target(model=MODEL, cfg_scale=3.0, **kw) -> Emu3Target:
    return Emu3Target(Emu3Backbone(model), CODES, h_latent=GRID, w_latent=GRID, cfg_scale=cfg_scale, **kw)


def rand_codes(*shape, seed):
    return torch.randint(0, K, shape, generator=torch.Generator().manual_seed(seed))


def full_sequence(prefix, codes) -> tuple[list, list]:
    """Emu3's sequence after ``prefix``: visual ids with an end-of-line after each full row (not
    after the last row); and the index of the entry whose output predicts each next code."""
    seq, out = list(prefix), [len(prefix) - 1]
    for t, c in enumerate(codes):
        seq.append(int(CODES.code_to_bpe[int(c)]))
        if (t + 1) % GRID == 0 and t + 1 < N:
            seq.append(EOL)
        out.append(len(seq) - 1)
    return seq, out


@torch.no_grad()
def reference_logits(model, prompt: Emu3Prompt, codes, cfg_scale):
    """(len(codes) + 1, K) CFG logits over codes from transformers' full forwards without a cache:
    the prompt's and the negative prompt's sequences, each from position 0; row t predicts code t."""
    def run(prefix):
        seq, out = full_sequence(prefix, codes)
        return model(input_ids=torch.tensor([seq])).logits[0, out][:, CODES.code_to_bpe]

    lc = run(prompt.ids)
    if cfg_scale == 1.0:
        return lc
    lu = run(prompt.negative)
    return lu + cfg_scale * (lc - lu)


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol, err


# ------------------------------------------------------------------------------ vocabulary, prompt, size
def test_codes_follow_transformers_vocabulary_mapping_and_sizes_follow_the_processor():
    mapping = MODEL.model.vocabulary_mapping  # transformers' Emu3ImageVocabularyMapping
    assert CODES.code_to_bpe.tolist() == [mapping.img2bpe[c] for c in range(K)] and CODES.eol == mapping.eol_token_id
    assert sorted(CODES.code_to_bpe.tolist()) == mapping.image_tokens  # the prefix processor's visual tokens
    codes = torch.tensor([[3, 31, 0], [12, 12, 7]])
    assert torch.equal(CODES.to_codes(CODES.to_bpe(codes)), codes) and not torch.equal(CODES.to_bpe(codes), codes + 9)
    with pytest.raises(ValueError, match="outside the visual vocabulary"):
        CODES.to_codes(torch.tensor([EOL]))
    vmap = emu3_vocabulary_map()
    with pytest.raises(ValueError, match=r"cover codes 0..31"):
        ImageCodes({k: v for k, v in vmap.items() if k != "<|visual token 000005|>"}, K)
    with pytest.raises(ValueError, match="same id"):
        ImageCodes(dict(vmap, **{"<|visual token 000001|>": vmap["<|visual token 000000|>"]}), K)
    with pytest.raises(ValueError, match="end-of-line"):
        ImageCodes({k: v for k, v in vmap.items() if k != "<|extra_200|>"}, K)
    from transformers import Emu3Processor

    for ratio, area in [("1:1", 518400), ("16:9", 518400), ("4:3", 1024), ("1:1", IMAGE_AREA)]:
        assert generate_size(ratio, area) == Emu3Processor.calculate_generate_size(None, ratio, area, 8), ratio
    assert generate_size("1:1", 518400) == (90, 90) and generate_size("1:1", IMAGE_AREA) == (GRID, GRID)
    with pytest.raises(ValueError, match="ratio must be 'W:H'"):
        generate_size("square", 1024)
    assert generation_prompt("a cat", 90, 90, bos="<s>", boi="<b>", image_wrapper="<w>") == "<s>a cat<b>90*90<w>"
    assert generation_prompt("a cat", 90, 90, bos="<s>", boi="<b>", image_wrapper="<w>", header=False) == "<s>a cat"


# ------------------------------------------------------------------------------ parity with transformers
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_prefill_and_token_by_token_match_transformers_full_forward(cfg_scale):
    """AR over all 16 codes (end-of-lines inserted after 3, 7, 11): every step's CFG logits equal
    transformers' full forwards; the cond half starts at the prompt's length, the uncond half at
    the negative prompt's, and each holds its tokens and 3 end-of-lines."""
    target = make_target(cfg_scale=cfg_scale)
    assert isinstance(target, ARModel) and target.vocab_size == K and target.n_image_tokens == N
    codes = rand_codes(2, N, seed=12)
    out = target.begin(PROMPTS, 2)
    lens = [len(p.ids) for p in PROMPTS] + ([len(p.negative) for p in PROMPTS] if cfg_scale != 1 else [])
    assert target._offset.tolist() == lens and target.cache.length.tolist() == lens
    assert out.logits.shape == (2, 1, K) and out.logits.dtype == torch.float64
    refs = [reference_logits(MODEL, PROMPTS[b], codes[b], cfg_scale) for b in range(2)]
    steps = [out.logits]
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N):
        steps.append(target.forward(codes[:, j : j + 1], torch.full((2, 1), j), one).logits)
        target.commit(None, torch.ones(2, dtype=torch.long))
    logits = torch.cat(steps, 1)
    for b in range(2):
        close(logits[b], refs[b])
    assert target.cache.length.tolist() == [n + N + GRID - 1 for n in lens]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("prefix_len", [3, 6])  # the root at a row end / a depth-1 node at one
def test_tree_round_matches_transformers_full_forward(split, prefix_len):
    """The shared contract (tests/protocol_checks.py): every root-to-node path of a tree with
    siblings, crossing a row end, in one forward or two (the second over pending entries),
    equals transformers' full forward of that path."""
    target = make_target()
    prefix, tree_tokens = rand_codes(2, prefix_len, seed=3), rand_codes(2, TREE.n_nodes + 1, seed=4)
    logits = run_tree_round(target, PROMPTS, prefix, tree_tokens, TREE, split)
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            ref = reference_logits(MODEL, PROMPTS[b], torch.cat([prefix[b], tree_tokens[b, path_to(TREE, i)]]), 3.0)
            close(logits[b, i], ref[-1])


def test_eager_attention_runs_the_same_tree():
    """With attn_implementation="eager" the adapter passes an additive 4D mask: the same logits up
    to eager attention's float32 softmax (``eager_attention_forward``), whose rounding depends on
    the key set (the cache's span holds masked slots a full forward has not)."""
    model = tiny_emu3(attn="eager")
    target = make_target(model)
    assert target.model.eager
    prefix, tree_tokens = rand_codes(2, 3, seed=3), rand_codes(2, TREE.n_nodes + 1, seed=4)
    logits = run_tree_round(target, PROMPTS, prefix, tree_tokens, TREE, split=True)
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            ref = reference_logits(model, PROMPTS[b], torch.cat([prefix[b], tree_tokens[b, path_to(TREE, i)]]), 3.0)
            close(logits[b, i], ref[-1], tol=TOL_EAGER)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        Emu3Backbone(SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(
            _attn_implementation="flash_attention_2"))))


KEPT = [path_to(TREE, 6), path_to(TREE, 2)]  # sample 0 keeps 4 entries (j = 3..6), sample 1 keeps 2 (j = 3, 4)


def commit_and_continue(target, rows):
    """For the samples ``rows`` of a fixed batch of 2: a tree round after 3 committed codes (the root
    j = 3 is a row end), commit of each sample's KEPT path (different lengths: the samples' row ends
    now differ), a second tree round in two calls at each sample's own positions, commit of root ->
    node 3, then 3 more codes. Returns the second round's and the last logits and what was fed."""
    return continue_after_commits(target, PROMPTS, rows, KEPT, TREE, rand_codes)


def test_commits_of_different_lengths_then_continue_match_transformers():
    tree_logits, last, seqs, t2, new = commit_and_continue(make_target(), [0, 1])
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            ref = reference_logits(MODEL, PROMPTS[b], torch.cat([seqs[b], t2[b, path_to(TREE, i)]]), 3.0)
            close(tree_logits[b, i], ref[-1])
        ref = reference_logits(MODEL, PROMPTS[b], torch.cat([seqs[b], t2[b, path_to(TREE, 3)], new[b]]), 3.0)
        close(last[b], ref[-3:])


def test_batch_invariant_batch_equals_each_sample_alone_bit_for_bit():
    """Inside ``batch_invariant()`` a batch of 2 runs each sample in its own batch-1 target."""
    with batch_invariant.batch_invariant():
        batched = commit_and_continue(make_target(), [0, 1])
        for b in range(2):
            single = commit_and_continue(make_target(), [b])
            assert torch.equal(single[0][0], batched[0][b]) and torch.equal(single[1][0], batched[1][b])


# ------------------------------------------------------------------------------ greedy against generate
def prefix_allowed_tokens_fn(height, width):
    """The model card's ``prefix_allowed_tokens_fn`` (transformers docs, model_doc/emu3.md) on the
    tiny vocabulary: visual tokens inside a row, the end-of-line after each row, then eof, eoi, eos."""
    visual = MODEL.model.vocabulary_mapping.image_tokens

    def fn(batch_id, input_ids):
        position = torch.nonzero(input_ids == WRAPPER, as_tuple=True)[0][0]
        offset = input_ids.shape[0] - position
        if offset % (width + 1) == 0:
            return (EOL,)
        if offset == (width + 1) * height + 1:
            return (EOF,)
        if offset == (width + 1) * height + 2:
            return (EOI,)
        if offset == (width + 1) * height + 3:
            return (EOS,)
        if offset > (width + 1) * height + 3:
            return (PAD,)
        return visual

    return fn


def test_greedy_loop_equals_transformers_generate_with_cfg_and_prefix_constraint():
    """Greedy AR through ``speculative_generate`` (batch 2, prompts of different lengths) gives,
    code for code, what ``Emu3ForConditionalGeneration.generate`` gives each prompt alone with
    greedy decoding, ``guidance_scale=3`` and ``negative_prompt_ids`` (its
    ``UnbatchedClassifierFreeGuidanceLogitsProcessor``) and the model card's prefix-constrained
    processor: its image rows (an end-of-line after each, forced) without the end-of-lines."""
    greedy = SamplingConfig(top_k=1)
    with batch_invariant.batch_invariant():  # our batch of two prompts, each computed as alone: vs batch-1 generates
        ours = speculative_generate(make_target(), N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2,
                                    sampling=greedy)
    for b, p in enumerate(PROMPTS):
        ids, neg = torch.tensor([p.ids]), torch.tensor([p.negative])
        out = MODEL.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=(GRID + 1) * GRID,
                             do_sample=False, guidance_scale=3.0, negative_prompt_ids=neg,
                             negative_prompt_attention_mask=torch.ones_like(neg),
                             prefix_allowed_tokens_fn=prefix_allowed_tokens_fn(GRID, GRID),
                             pad_token_id=PAD, eos_token_id=EOS)
        rows = out[0, ids.shape[1]:].view(GRID, GRID + 1)
        assert (rows[:, -1] == EOL).all()
        assert CODES.to_codes(rows[:, :GRID].flatten()).tolist() == ours.tokens[b].tolist()
    assert len(set(ours.tokens.flatten().tolist())) > 4  # not a degenerate constant image


def test_greedy_self_drafted_eagle_equals_greedy_ar():
    """The target drafting for itself on a chain: every draft accepted, long commits across row
    ends, the plain greedy codes."""
    greedy = SamplingConfig(temperature=0.0)
    plain = speculative_generate(make_target(), N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2, sampling=greedy)
    m = build_method("eagle", tree="chain", draft_length=5)
    drafter = build_drafter(m, make_target(), greedy, K)
    spec = speculative_generate(make_target(), N, PerSampleRNG([0, 1]), rule=m.rule, drafter=drafter, tree=m.tree,
                                cond=PROMPTS, batch_size=2, sampling=greedy)
    assert torch.equal(plain.tokens, spec.tokens)
    assert all(sum(r) == N - 1 for r in spec.round_lengths) and max(max(r) for r in spec.round_lengths) == 6


# ------------------------------------------------------------------------------ decoding, loading
def test_decode_is_transformers_decode_image_tokens():
    """``decode_raw(codes)`` equals ``Emu3ForConditionalGeneration.decode_image_tokens`` of the
    generated id sequence (rows with their end-of-lines, then eof, eoi, eos); ``decode`` maps it
    to [0, 1] by the image processor's mean / std."""
    target = make_target()
    codes = rand_codes(2, N, seed=1)
    seq = torch.cat([CODES.to_bpe(codes).view(2, GRID, GRID), torch.full((2, GRID, 1), EOL)], 2).view(2, -1)
    seq = torch.cat([seq, torch.tensor([[EOF, EOI, EOS]] * 2)], 1)
    ref = MODEL.decode_image_tokens(image_tokens=seq, height=GRID, width=GRID)
    raw = target.decode_raw(codes)
    assert raw.shape == (2, 3, 2 * GRID, 2 * GRID) and raw.dtype == torch.float32
    close(raw.double(), ref.double(), tol=1e-6)  # decode_raw hands float32 pixels
    img = target.decode(codes)
    assert float(img.min()) >= 0 and float(img.max()) <= 1
    close(img.double(), (ref.double() * 0.5 + 0.5).clamp(0, 1), tol=1e-6)


def test_loading_from_a_folder_is_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    d = write_emu3_folder(tmp_path / "emu3", seed=2)
    target = load_emu3_target(d, h_latent=GRID, w_latent=GRID, cfg_scale=3.0, dtype=torch.float64)
    ref_model = tiny_emu3(2, dtype=torch.float32).double()  # the folder holds float32 weights
    out = target.begin(PROMPTS, 2)
    for b in range(2):
        close(out.logits[b, 0], reference_logits(ref_model, PROMPTS[b], [], 3.0)[0])
    sd = load_file(str(d / "model.safetensors"))
    dropped = next(k for k in sd if "layers.1.mlp.up_proj" in k)
    save_file({k: v for k, v in sd.items() if k != dropped}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(BadInputFile, match=r"does not fit Emu3ForConditionalGeneration \(missing keys \(1\)"):
        load_emu3(d, dtype=torch.float32)
    (d / "config.json").unlink()
    with pytest.raises(MissingInputFile, match="lacks config.json.*BAAI/Emu3-Gen-hf"):
        load_emu3(d)


def test_bad_conditions_are_one_line_errors():
    target = make_target()
    with pytest.raises(ValueError, match="cond must be 2 Emu3Prompt"):
        target.begin(PROMPTS[:1], 2)
    with pytest.raises(ValueError, match="negative prompt ids must be a non-empty"):
        target.begin([Emu3Prompt(PROMPTS[0].ids, [])], 1)
    with pytest.raises(ValueError, match=r"prompt ids must be a non-empty sequence of ids in \[0, 80\)"):
        target.begin([Emu3Prompt([BOS, VOCAB], PROMPTS[0].negative)], 1)
    make_target(cfg_scale=1.0).begin([Emu3Prompt(PROMPTS[0].ids, [])], 1)  # unguided: no negative needed
    with pytest.raises(RuntimeError, match="call begin"):
        make_target().forward(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                              torch.ones(1, 1, dtype=torch.bool))


def test_reused_cache_holds_a_longer_prompt():
    """As ``test_lumina``'s: a reused cache decodes a longer prompt as a fresh target does."""
    short = Emu3Prompt([BOS, 54, *HEADER], [BOS, 62, *HEADER])
    long = Emu3Prompt([BOS, *range(54, 62), *range(54, 62), *HEADER], [BOS, 62, 63, 64, *HEADER])
    diff = reused_cache_check(lambda: make_target(cache_headroom=8), short, long, GRID * GRID, K)
    assert diff <= 1e-5, diff
