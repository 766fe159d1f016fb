"""coolsd.models.harmon against upstream Harmon (github.com/wusize/Harmon at 4eb6087, ``src/models/harmon.py``,
``src/models/mar/``; docs/design/harmon_upstream.md). Proven:

* Upstream parity on ``tests/fixtures/upstream/harmon.safetensors`` (made by ``tools/make_upstream_fixtures.py
  --harmon`` with upstream's code under transformers 4.45.2; tiny random weights, fp32; rows [p7, p3, null,
  null] with prompts right-padded to 7): the file's upstream state dict (tied ``llm.lm_head.weight``
  included) loads with ``load_harmon`` (strict); our key-masked ``conditions`` equals upstream's prefill +
  ``forward_mae_encoder`` (drop, compact, LLM with the prompt cache) + ``forward_mae_decoder`` at the base
  4x4 grid, at 6x6 (bilinear position embeddings) and with nothing known; the DiffLoss head; and
  ``Harmon.sample`` (cfg 3 at 4x4 with one token per iteration, cfg 1 at 6x6 with several) replayed
  through ``conditions`` / ``head`` / ``coolsd.engine.continuous.diffusion.aligned_sample`` with upstream's
  orders and recorded draws: the tokens after every iteration. Tolerances: the file's (2e-5 absolute, at
  output scale ~4) for (a)-(d); 1e-5 relative to the largest token for the samples (a random head's
  epsilon error is amplified ~2e4 by the first step, so the tokens reach ~1e5).
* Key masking equals dropping: rows of one batch with different known sets (0 .. all) and prompt
  lengths equal upstream's MAE form written out with our modules (drop the unknown tokens, compact the
  LLM sequence [prompt | known | buffers] with default causal positions, scatter back), one row at a
  time, at the base grid and at an interpolated one; a row's z ignores unknown token values and
  other rows.
* The null prompt: an all -1 row is the templated "Generate an image." (``null_prompt``), not an
  empty prompt; a missing ``null_prompt`` is an error. ``encode_prompts`` with a word-level
  ``tokenizers.Tokenizer`` and its transformers wrapper.
* The continuous loop runs Harmon unchanged (identical draft and target: prefix mode accepts all
  and reproduces target-only sampling).
* ``load_harmon``: .pth / .safetensors, optional ``llm.lm_head.weight`` / ``mar.class_emb.weight``,
  ignored ``vae.*``; a missing / unexpected key or a wrong shape is one line naming the file and the key.
* The released configs: key and parameter counts; the respaced timesteps equal upstream's
  ``space_timesteps`` for K = 10 and 100.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories import TINY_HARMON_NULL, tiny_harmon
from safetensors import safe_open
from safetensors.torch import save_file

from coolsd.engine.continuous.diffusion import Schedule, aligned_sample
from coolsd.models.harmon import (
    HARMON_CONFIGS,
    HARMON_TEMPLATE,
    NULL_LABEL,
    Harmon,
    HarmonConfig,
    QwenConfig,
    encode_prompts,
    grid_pos_embed,
    load_harmon,
    null_prompt_ids,
    set_null_prompt,
)
from coolsd.models.mar import MARConfig
from coolsd.util.loading import BadInputFile

FIXTURE = Path(__file__).parents[1] / "fixtures" / "upstream" / "harmon.safetensors"
MANIFEST = json.loads((FIXTURE.parent / "MANIFEST.json").read_text())


# ---------------------------------------------------------------- the upstream fixture
def read_fixture():
    groups = {"w": {}, "in": {}, "out": {}}
    with safe_open(str(FIXTURE), framework="pt") as f:
        meta, keys = f.metadata(), f.keys()
        for key in keys:
            prefix, rest = key.split(".", 1)
            groups[prefix][rest] = f.get_tensor(key)
    config = json.loads(meta["config"])
    w = {k: v.float() if v.dtype == torch.float16 else v for k, v in groups["w"].items()}
    tol = float(meta["tolerance"])
    assert MANIFEST["files"][FIXTURE.name]["tolerance_max_abs"] == tol
    return w, groups["in"], groups["out"], config, tol


def fixture_cfg(config, grid: int = 4) -> HarmonConfig:
    q = config["llm"]
    llm = QwenConfig(hidden_size=q["hidden_size"], intermediate_size=q["intermediate_size"],
                     num_layers=q["num_hidden_layers"], num_heads=q["num_attention_heads"],
                     num_kv_heads=q["num_key_value_heads"], vocab_size=q["vocab_size"], rope_theta=q["rope_theta"],
                     rms_norm_eps=q["rms_norm_eps"], max_position_embeddings=q["max_position_embeddings"])
    return HarmonConfig(llm, MARConfig(**config["mar"]), grid=grid)


@pytest.fixture(scope="module")
def upstream():
    return read_fixture()


@pytest.fixture(scope="module")
def fixture_model(upstream, tmp_path_factory):
    """The fixture's weights loaded by ``load_harmon`` from a flat .pth in upstream's layout (lm_head included)."""
    w, inp, _, config, _ = upstream
    assert "llm.lm_head.weight" in w and "mar.class_emb.weight" in w
    path = tmp_path_factory.mktemp("harmon") / "harmon_tiny.pth"
    torch.save(w, path)
    model = load_harmon(path, fixture_cfg(config))
    model.set_null_prompt(inp["null_prompt"])
    return model


def fixture_prompts(inp, ids="ids", mask="prompt_mask", null_rows=True):
    """Upstream's (ids, bool mask) rows as ours: pads -1, the null-prompt rows (the second half) all -1."""
    p = torch.where(inp[mask], inp[ids], NULL_LABEL)
    if null_rows:
        p[len(p) // 2:] = NULL_LABEL
    return p


def assert_close(ours, theirs, tol, what):
    err = (ours.double() - theirs.double()).abs().max().item()
    assert err <= tol, f"{what}: max abs {err:.3g} > {tol:g} (upstream scale {theirs.abs().max().item():.3g})"


@pytest.mark.parametrize("case, grid", [("a", 4), ("b", 6), ("c", 4)])
def test_conditions_match_upstream(upstream, fixture_model, case, grid):
    """(a) 5 of 16 known, (b) 13 of 36 known at 6x6 (resized position embeddings), (c) nothing known."""
    _, inp, out, _, tol = upstream
    known = inp[f"{case}_mask"] == 0  # upstream: 1 = masked (unknown)
    with torch.no_grad():
        z = fixture_model.set_grid(grid).conditions(inp[f"{case}_tokens"], known, fixture_prompts(inp))
    assert_close(z, out[f"{case}_z"], tol, f"z ({case}, {grid}x{grid})")
    # the null rows by their ids, written out, instead of -1: the same
    explicit = fixture_prompts(inp)
    explicit[2:, :5] = inp["null_prompt"]
    with torch.no_grad():
        z2 = fixture_model.conditions(inp[f"{case}_tokens"], known, explicit)
    torch.testing.assert_close(z2, z, rtol=0, atol=1e-6)
    fixture_model.set_grid(4)


def test_head_matches_upstream(upstream, fixture_model):
    _, inp, out, _, tol = upstream
    with torch.no_grad():
        eps, v = fixture_model.head(inp["head_x"], inp["head_t"], inp["head_z"])
    assert_close(torch.cat([eps, v], -1), out["head_out"], tol, "DiffLoss head (eps | v)")


@pytest.mark.parametrize("name", ["e1", "e2"])
def test_sample_replay_matches_upstream(upstream, fixture_model, name):
    """Upstream's ``Harmon.sample`` iteration by iteration: the conditions of the known tokens (both CFG
    branches in one batch: prompts, then all -1), the head chain of each predicted token from upstream's
    draws (row-major ``nonzero`` order of the conditional rows; the k-th ``randn_like`` of a chain drives
    timestep index K-1-k), guided epsilon, temperature on the non-final steps, no final noise."""
    _, inp, out, config, _ = upstream
    sc = config["samples"][name]
    model = fixture_model.set_grid(sc["grid"])
    L, w = sc["grid"] ** 2, sc["cfg"]
    prompts = fixture_prompts(inp, f"{name}_ids", f"{name}_prompt_mask", null_rows=False)
    half = len(prompts) // 2 if w != 1.0 else len(prompts)
    prompts = prompts[:half]
    sched = Schedule.respaced(config["diffusion_steps"])
    tokens = torch.zeros(half, L, 16)
    tol = config["sample_rel_tolerance"] * out[f"{name}_tokens"].abs().max().item()
    offset = 0
    for s in range(sc["num_iter"]):
        known, pred = inp[f"{name}_known"][s], inp[f"{name}_pred"][s]
        assert torch.equal(known, tokens.abs().sum(-1) > 0) and not (known & pred).any()
        with torch.no_grad():
            if w != 1.0:
                zc, zu = model.conditions(torch.cat([tokens, tokens]), torch.cat([known, known]),
                                          torch.cat([prompts, torch.full_like(prompts, NULL_LABEL)])).chunk(2)
            else:
                zc, zu = model.conditions(tokens, known, prompts), None
            b, j = pred.nonzero(as_tuple=True)
            n = len(b)
            noise = inp[f"{name}_init"][offset:offset + n]
            eps = inp[f"{name}_eps"][:, offset:offset + n].flip(0)  # draw order (t = K-1 first) -> index k
            h = aligned_sample(model.head, zc[b, j], noise, eps, sched, z_u=None if zu is None else zu[b, j],
                               cfg=w, tau=sc["temperature"])
        offset += n
        tokens[b, j] = h.x0
        assert_close(tokens, out[f"{name}_steps"][s], tol, f"{name}: tokens after iteration {s}")
    assert offset == len(inp[f"{name}_init"])
    assert_close(tokens, out[f"{name}_tokens"], tol, f"{name}: final tokens")
    fixture_model.set_grid(4)


def test_respaced_timesteps_are_upstreams():
    """``space_timesteps(1000, "K")`` (respace.py:40-62: a float stride accumulated and rounded) equals
    ``Schedule.respaced(K)`` (linspace rounded) for the fixture's K and the released K = 100."""
    for K in (10, 100):
        cur, stride, steps = 0.0, 999 / (K - 1), []
        for _ in range(K):
            steps.append(round(cur))
            cur += stride
        assert Schedule.respaced(K).timesteps.tolist() == sorted(set(steps))


# ---------------------------------------------------------------- key masking = dropping
def dropped_conditions(m: Harmon, tokens, known, prompt):
    """Upstream's MAE form for ONE row (note 1.2), with our modules: the unknown tokens dropped before the
    encoder, the LLM on the compacted [valid prompt | known tokens in raster order | buffers] with its
    default causal mask and positions 0.., the buffers back to the front, mask tokens scattered back."""
    cfg, mar = m.config, m.mar
    nb, base, g, L = cfg.mar.buffer_size, cfg.base_grid, cfg.grid, cfg.seq_len
    p = prompt[prompt >= 0]
    if len(p) == 0:
        p = m.null_prompt
    keep = torch.cat([torch.arange(nb), nb + known.nonzero().squeeze(1)])
    x = torch.cat([mar.fake_latent.expand(nb, -1), mar.z_proj(tokens)])
    x = mar.z_proj_ln(x + grid_pos_embed(mar.encoder_pos_embed_learned, nb, base, g)[0])[keep][None]
    for blk in mar.encoder_blocks:
        x = blk(x)
    x_enc = mar.encoder_norm(x)
    h = m.proj_in(x_enc)
    seq = torch.cat([m.qwen.embed_tokens(p)[None], h[:, nb:], h[:, :nb]], 1)
    z_llm = m.qwen(inputs_embeds=seq, use_cache=False).last_hidden_state[:, len(p):]
    x_enc = x_enc + m.proj_out(torch.cat([z_llm[:, -nb:], z_llm[:, :-nb]], 1))
    full = mar.mask_token.expand(1, nb + L, -1).clone()
    full[:, keep] = mar.decoder_embed(x_enc)
    x = full + grid_pos_embed(mar.decoder_pos_embed_learned, nb, base, g)
    for blk in mar.decoder_blocks:
        x = blk(x)
    return (mar.decoder_norm(x)[:, nb:] + grid_pos_embed(mar.diffusion_pos_embed_learned, 0, base, g))[0]


@pytest.mark.parametrize("grid", [4, 6])
def test_key_masking_equals_dropping_on_ragged_rows(grid):
    m = tiny_harmon(seed=1, grid=grid)
    L, C = m.config.seq_len, m.config.token_dim
    g = torch.Generator().manual_seed(3)
    counts = [0, 1, L // 2, L - 1, L]
    B = len(counts)
    tokens = torch.randn(B, L, C, generator=g, dtype=torch.float64)
    known = torch.zeros(B, L, dtype=torch.bool)
    for b, n in enumerate(counts):
        known[b, torch.randperm(L, generator=g)[:n]] = True
    prompts = torch.full((B, 6), NULL_LABEL)
    for b, n in enumerate([6, 1, 0, 3, 4]):  # row 2: the null prompt
        prompts[b, :n] = torch.randint(0, 64, (n,), generator=g)
    with torch.no_grad():
        z = m.conditions(tokens, known, prompts)
        for b in range(B):
            torch.testing.assert_close(z[b], dropped_conditions(m, tokens[b], known[b], prompts[b]), rtol=0,
                                       atol=1e-12, msg=f"row {b} ({counts[b]} known)")  # measured 2e-15
        # a row's z ignores its unknown token values and the other rows
        other = torch.where(known.unsqueeze(-1), tokens, 7.0 + tokens.flip(0))
        torch.testing.assert_close(m.conditions(other, known, prompts), z, rtol=0, atol=1e-12)
        torch.testing.assert_close(m.conditions(tokens[3:4], known[3:4], prompts[3:4])[0], z[3], rtol=0, atol=1e-12)
    # qualitatively different: more known tokens change z, so does the prompt
    assert (z[3] - z[4]).abs().max() > 1e-3
    with torch.no_grad():
        z_p = m.conditions(tokens[3:4], known[3:4], prompts[0:1])
    assert (z_p[0] - z[3]).abs().max() > 1e-3


def test_a_row_does_not_depend_on_the_other_prompts_under_batch_invariant():
    """Inside batch_invariant() a row's conditions equal the row alone bit for bit, whatever the length
    of the other prompts in its batch (their pads are dropped per row); outside it they agree only to
    rounding (the softmax over the pads' masked keys rounds differently; 7e-7 on the machine this was
    written on, where running the LLM over the padded rows under the flag fails the first assertion)."""
    from coolsd.engine.batch_invariant import batch_invariant

    m = tiny_harmon(seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, m.config.seq_len, m.config.token_dim, generator=g)
    known = torch.rand(2, m.config.seq_len, generator=g) < 0.5
    short = torch.tensor([[3, 4, 5, 6, 7]])
    longer = torch.randint(0, 64, (1, 45), generator=g)
    batch = torch.cat([torch.nn.functional.pad(short, (0, 40), value=NULL_LABEL), longer])
    with torch.no_grad():
        with batch_invariant():
            alone, both = m.conditions(tokens[:1], known[:1], short), m.conditions(tokens, known, batch)
            null_alone = m.conditions(tokens[1:], known[1:], torch.full((1, 2), NULL_LABEL))
            null_both = m.conditions(tokens, known, torch.cat([longer, torch.full((1, 45), NULL_LABEL)]))
        plain_alone, plain_both = m.conditions(tokens[:1], known[:1], short), m.conditions(tokens, known, batch)
    assert torch.equal(alone[0], both[0]) and torch.equal(null_alone[0], null_both[1])
    torch.testing.assert_close(plain_alone[0], plain_both[0], rtol=0, atol=1e-5)  # equal bits only by chance


# ---------------------------------------------------------------- prompts
def word_tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["<unk>", "user", "assistant", "Generate", "an", "image", ":", ".", "a", "red", "cat"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return tok, {**vocab, "<|im_start|>": tok.token_to_id("<|im_start|>"), "<|im_end|>": tok.token_to_id("<|im_end|>")}


def test_encode_prompts_uses_the_template_and_pads_with_minus_one():
    from transformers import PreTrainedTokenizerFast

    tok, v = word_tokenizer()
    assert HARMON_TEMPLATE == "<|im_start|>user\n{input}<|im_end|>\n<|im_start|>assistant\n"
    head, tail = [v["<|im_start|>"], v["user"], v["Generate"], v["an"], v["image"]], \
        [v["<|im_end|>"], v["<|im_start|>"], v["assistant"]]
    want0 = head + [v[":"], v["a"], v["red"], v["cat"]] + tail
    want1 = head + [v[":"], v["cat"]] + tail
    for t in (tok, PreTrainedTokenizerFast(tokenizer_object=tok)):
        ids = encode_prompts(t, ["a red cat", "cat"])
        assert ids.dtype == torch.long and ids.shape == (2, len(want0))
        assert ids[0].tolist() == want0 and ids[1].tolist() == want1 + [NULL_LABEL] * 2
        assert null_prompt_ids(t).tolist() == head + [v["."]] + tail  # "Generate an image." (text2image.py:14)


def test_null_rows_are_the_null_prompt():
    tok, _ = word_tokenizer()
    m = tiny_harmon(seed=2)
    set_null_prompt(m, tok)
    null = null_prompt_ids(tok)
    assert torch.equal(m.null_prompt, null) and "null_prompt" not in m.state_dict()
    L, C = m.config.seq_len, m.config.token_dim
    tokens = torch.randn(2, L, C, dtype=torch.float64)
    known = torch.rand(2, L) < 0.5
    prompts = encode_prompts(tok, ["a red cat", "a cat"])
    rows = torch.cat([prompts, torch.full_like(prompts, NULL_LABEL)])
    with torch.no_grad():
        z = m.conditions(torch.cat([tokens, tokens]), torch.cat([known, known]), rows)
        explicit = m.conditions(tokens, known, null[None].expand(2, -1))
        empty_like = m.conditions(tokens, known, prompts[:, :1])  # an (almost) empty prompt is something else
    torch.testing.assert_close(z[2:], explicit, rtol=0, atol=1e-6)
    assert (z[2:] - z[:2]).abs().max() > 1e-3 and (empty_like - explicit).abs().max() > 1e-3
    m.null_prompt = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match="null_prompt is not set"):
        m.conditions(tokens, known, torch.full((2, 3), NULL_LABEL))
    with torch.no_grad():
        m.conditions(tokens, known, prompts)  # conditional rows need no null prompt
    with pytest.raises(ValueError, match="non-empty"):
        m.set_null_prompt([])


# ---------------------------------------------------------------- the continuous loop
def test_the_continuous_loop_runs_harmon_unchanged():
    from coolsd.engine.batch_invariant import batch_invariant
    from coolsd.engine.continuous.generate import HeadConfig, ar_generate, cspd_generate

    m = tiny_harmon(seed=4, dtype=torch.float32)
    prompts = torch.tensor([[3, 4, 5, 6], [7, 8, NULL_LABEL, NULL_LABEL]])
    hc = HeadConfig(steps=3, cfg=2.0)
    with batch_invariant():  # target rows in other batch shapes than the draft's: the same rounding on any CPU
        ref = ar_generate(m, prompts, [0, 1], hc, final_noise=True)
        res = cspd_generate(m, m, prompts, [0, 1], hc, gamma=3, mode="exact", verify="prefix", prefill=0.0)
    assert ref.tokens.shape == (2, m.config.seq_len, m.config.token_dim) and torch.isfinite(ref.tokens).all()
    torch.testing.assert_close(res.tokens, ref.tokens, rtol=0, atol=1e-5)
    assert all(c["accepted"] == c["verified"] for c in res.counters)


# ---------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def official():
    """A tiny model's weights in upstream's file layout: its state dict plus the tied lm_head."""
    sd = dict(tiny_harmon(seed=6, dtype=torch.float32).state_dict())
    sd["llm.lm_head.weight"] = sd["llm.model.embed_tokens.weight"]
    return sd


def tiny_cfg():
    return tiny_harmon(dtype=torch.float32).config


def test_load_harmon_formats(tmp_path, official):
    ref = tiny_harmon(seed=6, dtype=torch.float32)
    torch.save(official, tmp_path / "flat.pth")
    no_optional = {k: v for k, v in official.items() if k not in ("llm.lm_head.weight", "mar.class_emb.weight")}
    torch.save(no_optional, tmp_path / "bare.pth")
    hf = {k: v.contiguous().clone() for k, v in official.items()}
    hf["vae.decoder.conv_in.weight"] = torch.zeros(8, 16, 3, 3)  # the HF safetensors carry the VAE: ignored
    save_file(hf, str(tmp_path / "model.safetensors"))
    tok, _ = word_tokenizer()
    for name in ("flat.pth", "bare.pth", "model.safetensors"):
        m = load_harmon(tmp_path / name, tiny_cfg(), dtype=torch.float64, grid=6, tokenizer=tok)
        assert m.config.grid == 6 and m.config.seq_len == 36 and not m.training
        assert m.proj_out[2].weight.dtype == torch.float64 and not m.proj_out[2].weight.requires_grad
        assert torch.equal(m.null_prompt, null_prompt_ids(tok))
        for k, v in ref.state_dict().items():
            want = torch.zeros_like(v) if name == "bare.pth" and k == "mar.class_emb.weight" else v
            assert torch.equal(m.state_dict()[k], want.double()), (name, k)
        # RoPE's non-persistent inv_freq is rebuilt (meta construction leaves it empty)
        assert torch.equal(m.qwen.rotary_emb.inv_freq, ref.qwen.rotary_emb.inv_freq.double())
        x = torch.randn(1, 36, 4, dtype=torch.float64)
        known = torch.rand(1, 36) < 0.3
        with torch.no_grad():
            torch.testing.assert_close(m.conditions(x, known, torch.tensor([[1, 2, 3]])),
                                       ref.double().set_grid(6).conditions(x, known, torch.tensor([[1, 2, 3]])))
        ref.float().set_grid(4)


def one_line_error(path, cfg) -> str:
    with pytest.raises(BadInputFile) as e:
        load_harmon(path, cfg)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "wusize/Harmon" in msg, msg
    return msg


@pytest.mark.parametrize("case, expect", [
    ("missing", r"missing keys: mar\.decoder_blocks\.0\.mlp\.fc2\.weight"),
    ("unexpected", r"unexpected keys: proj_mid\.0\.weight"),
    ("shape", r"wrong shapes: proj_in\.0\.weight \(32, 20\) \(expected \(32, 24\)\)"),
    ("lm_head", r"wrong shapes: llm\.lm_head\.weight \(60, 32\) \(expected \(64, 32\)\)"),
    ("class_emb", r"wrong shapes: mar\.class_emb\.weight \(9, 24\) \(expected \(10, 24\)\)"),
    ("bare_qwen", r"missing keys: llm\.model\.embed_tokens\.weight.*unexpected keys: lm_head\.weight, model\.embed"),
])
def test_bad_checkpoints_are_one_line_errors_naming_the_key(tmp_path, official, case, expect):
    import re

    sd = dict(official)
    if case == "missing":
        del sd["mar.decoder_blocks.0.mlp.fc2.weight"]
    elif case == "unexpected":
        sd["proj_mid.0.weight"] = torch.zeros(2, 2)
    elif case == "shape":
        sd["proj_in.0.weight"] = sd["proj_in.0.weight"][:, :20]
    elif case == "lm_head":
        sd["llm.lm_head.weight"] = sd["llm.lm_head.weight"][:60]
    elif case == "class_emb":
        sd["mar.class_emb.weight"] = sd["mar.class_emb.weight"][:9]
    elif case == "bare_qwen":  # a Qwen2ForCausalLM file's keys, not under llm.
        sd = {k.removeprefix("llm."): v for k, v in sd.items()}
    path = tmp_path / f"{case}.pth"
    torch.save(sd, path)
    assert re.search(expect, one_line_error(path, tiny_cfg()))


def test_a_missing_file_says_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="wusize/harmon"):
        load_harmon(tmp_path / "harmon_0.5b.pth", tiny_cfg())


# ---------------------------------------------------------------- the released configs
@pytest.mark.parametrize("name, keys, params, widths", [
    ("harmon_0_5b", 662, 704_942_880, (896, 768, 768, 1024, 6)),
    ("harmon_1_5b", 950, 2_494_774_048, (1536, 1280, 1280, 1536, 12)),
])
def test_released_configs(name, keys, params, widths):
    """Keys: Qwen2Model (290 / 338; + the tied lm_head in the files) + LTH14 MAR (364 / 604) + 8 projection
    keys. Parameters: Qwen2.5-{0.5,1.5}B (494.0M / 1543.7M, embeddings once) + MAR-{B,H} + proj_in / proj_out."""
    cfg = HARMON_CONFIGS[name]
    with torch.device("meta"):
        m = Harmon(cfg)
    assert len(m.state_dict()) == keys and sum(p.numel() for p in m.parameters()) == params
    assert (cfg.llm.hidden_size, cfg.mar.encoder_dim, cfg.mar.decoder_dim, cfg.mar.head_width,
            cfg.mar.head_depth) == widths
    assert (cfg.grid, cfg.seq_len, cfg.image_size, cfg.base_grid, cfg.token_dim, cfg.mar.buffer_size) == \
        (32, 1024, 512, 16, 16, 64)
    hf = cfg.llm.to_hf()
    assert (hf.vocab_size, hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.tie_word_embeddings,
            hf._attn_implementation) == (151936, 1e6, 1e-6, True, "sdpa")
    assert m.mar.encoder_pos_embed_learned.shape == (1, 256 + 64, cfg.mar.encoder_dim)  # 16x16 + buffers
    assert TINY_HARMON_NULL  # the factory's null prompt is set on every tiny model
