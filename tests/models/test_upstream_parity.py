"""Parity of our model classes with the UPSTREAM implementations, on golden fixtures.

``tests/fixtures/upstream/*.safetensors`` were made by ``tools/make_upstream_fixtures.py`` with the
upstream classes at the commits in ``MANIFEST.json`` (tiny random weights, fp32): upstream's
weights (``w.``), inputs (``in.``) and outputs (``out.``). These tests load the weights into OUR
classes strictly, run the same inputs through our inference path and assert fp32 agreement within
the per-model tolerance stated below (and in the manifest). No upstream code runs here.

Tolerances (max abs difference, fp32, at the output scale each fixture records; measured on an
AMD EPYC CPU at generation time in brackets): LlamaGen GPT 2e-4 at logit scale 45 (5e-5), VQ-16
decoder 2e-5 (3e-6), LANTERN's LlamaGen 2e-4 (4e-6), LANTERN's EAGLE heads 1e-4 / 2e-5 (1e-6),
Lumina-mGPT image logits with CFG 5e-5 (1e-5), transformers' Chameleon 2e-5 (3e-6), Chameleon
VQGAN 1e-5 (1.3e-6), MAR conditions and DiffLoss head 2e-5 (2e-6), KL-16 decoder 2e-5 (2e-6), T5
features 2e-5 (1.4e-6; the generator's transformers 4.45 vs ours), caption cleaning exact.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from coolsd.models.eagle.model import EagleConfig, EagleDrafter, EagleHead
from coolsd.models.eagle.lumina import LuminaEagleConfig, LuminaEagleHead
from coolsd.models.chameleon import ChameleonConfig, ChameleonLM
from coolsd.models.chameleon_vq import ChameleonVQ, VQConfig as ChameleonVQConfig
from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT, LlamaGenTarget
from coolsd.models.llamagen_vq import LlamaGenVQ, VQConfig
from coolsd.models.lumina import ImageVocab, LuminaTarget, LuminaTokens
from coolsd.engine.model_protocol import StepOut
from protocol_checks import run_tree_round

FIXTURES = Path(__file__).parents[1] / "fixtures" / "upstream"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())


class Fixture(SimpleNamespace):
    """One fixture file: ``w`` / ``inp`` / ``out`` dicts of tensors, ``config`` and ``tol``."""


def load_fixture(name: str) -> Fixture:
    path = FIXTURES / f"{name}.safetensors"
    groups = {"w": {}, "in": {}, "out": {}}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        for key in f.keys():
            prefix, rest = key.split(".", 1)
            t = f.get_tensor(key)
            # weights are stored as fp16 where that is lossless (the generator rounds them before the
            # upstream run); the models are fp32
            groups[prefix][rest] = t.float() if prefix == "w" and t.dtype == torch.float16 else t
    for key in [k for k in groups["w"] if k.endswith(".rows")]:  # vocabulary matrices stored by live rows
        base = key[: -len(".rows")]
        rows, index = groups["w"].pop(key), groups["w"].pop(base + ".index")
        dense = torch.zeros(json.loads(meta["config"])["vocab_size"], rows.shape[1], dtype=rows.dtype)
        dense[index] = rows
        groups["w"][base] = dense
    tol = float(meta["tolerance"])
    assert MANIFEST["files"][path.name]["tolerance_max_abs"] == tol, f"{path.name}: manifest and file disagree"
    return Fixture(w=groups["w"], inp=groups["in"], out=groups["out"], config=json.loads(meta["config"]), tol=tol)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.double() - b.double()).abs().max().item()


def assert_close(ours: torch.Tensor, upstream: torch.Tensor, tol: float, what: str) -> None:
    err = max_abs(ours, upstream)
    assert err <= tol, f"{what}: max abs {err:.3g} > {tol:g} (upstream scale {upstream.abs().max().item():.3g})"


# ------------------------------------------------------------------------------------ LlamaGen GPT
def llamagen_config(c: dict, **extra) -> LlamaGenConfig:
    keys = ("dim", "n_layer", "n_head", "vocab_size", "cls_token_num", "caption_dim", "block_size", "norm_eps",
            "rope_base", "multiple_of")
    return LlamaGenConfig(**{k: c[k] for k in keys}, **extra)


def gpt_from_fixture(fx: Fixture, **extra) -> LlamaGenGPT:
    model = LlamaGenGPT(llamagen_config(fx.config, **extra)).eval()
    model.load_state_dict(fx.w, strict=True)  # upstream gpt.py's keys, 1:1
    return model


def gpt_cond(fx: Fixture) -> dict:
    return {"caption_embs": fx.inp["caption"], "emb_mask": fx.inp["emb_mask"].bool()}


@pytest.fixture(scope="module")
def gpt() -> Fixture:
    return load_fixture("llamagen_gpt_t2i")


@pytest.mark.parametrize("cfg_scale", [7.5, 1.0])
def test_llamagen_gpt_prefill_and_kv_decode_match_upstream(gpt, cfg_scale):
    """Upstream generate(): prefill with left-padded captions (5 / 120 / 1 valid slots) then one
    KV-cache decode step per forced token; logits entry k predicts image token k."""
    model = gpt_from_fixture(gpt)
    target = LlamaGenTarget(model, cfg_scale=cfg_scale)
    tokens = gpt.inp["tokens"]
    B, N = tokens.shape
    want = gpt.out[f"decode_logits_cfg{cfg_scale:g}"]
    got = [target.begin(gpt_cond(gpt), B).logits[:, 0]]
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N - 1):
        got.append(target.forward(tokens[:, j:j + 1], torch.full((B, 1), j), one).logits[:, 0])
        target.commit(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, dtype=torch.long))
    got = torch.stack(got, 1)
    assert_close(got[:, :1], want[:, :1], gpt.tol, f"prefill logits, cfg {cfg_scale}")
    assert_close(got, want, gpt.tol, f"KV-cache decode logits, cfg {cfg_scale}")
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def tree_from_parents(parents: torch.Tensor) -> SimpleNamespace:
    """depth (n,) and ancestors (n, n) bool (ancestor-or-self) of a parent list (-1 = root)."""
    n = parents.numel()
    anc = torch.zeros(n, n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = int(parents[j])
        depth[i] = int(anc[i].sum()) - 1
    return SimpleNamespace(depth=depth, ancestors=anc)


@pytest.mark.parametrize("split", [False, True])
def test_llamagen_gpt_tree_verification_matches_upstream_branches(gpt, split):
    """One tree forward (9 nodes, depth 4, after a committed 3-token prefix; in one call or level
    by level) gives at each node the logits upstream's sequential decode gives on that branch."""
    model = gpt_from_fixture(gpt)
    target = LlamaGenTarget(model, cfg_scale=7.5)
    tree = tree_from_parents(gpt.inp["tree_parents"])
    got = run_tree_round(target, gpt_cond(gpt), gpt.inp["tree_prefix"], gpt.inp["tree_tokens"], tree, split)
    assert_close(got, gpt.out["tree_logits_cfg7.5"], gpt.tol, f"tree logits (split={split})")


# ------------------------------------------------------------------------------------ VQ-16
def test_llamagen_vq_decode_matches_upstream():
    fx = load_fixture("llamagen_vq")
    c = fx.config
    ours = LlamaGenVQ(VQConfig(codebook_size=c["codebook_size"], codebook_dim=c["codebook_dim"], ch=c["ch"],
                               ch_mult=tuple(c["ch_mult"]), z_channels=c["z_channels"],
                               num_res_blocks=c["num_res_blocks"])).eval()
    # the fixture holds the decode path (decoder, post_quant_conv, codebook); each loads strictly
    for name in ("decoder", "post_quant_conv"):
        getattr(ours, name).load_state_dict({k[len(name) + 1:]: v for k, v in fx.w.items() if k.startswith(name + ".")},
                                            strict=True)
    ours.quantize.embedding.load_state_dict({"weight": fx.w["quantize.embedding.weight"]}, strict=True)
    assert len(fx.w) == len(ours.decoder.state_dict()) + len(ours.post_quant_conv.state_dict()) + 1
    for grid in ("4x4", "5x5"):
        got = ours.decode_code(fx.inp[f"codes_{grid}"])
        assert_close(got, fx.out[f"decoded_{grid}"], fx.tol, f"VQ decode {grid}")


# ------------------------------------------------------------------------------------ LANTERN LlamaGen
def lantern_to_ours(sd: dict, n_layer: int) -> dict:
    """LANTERN's HF-style LlamaGen keys -> our (upstream LlamaGen) keys: q/k/v fused into wqkv."""
    out = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
        "cls_embedding.uncond_embedding": sd["model.cls_embedding.uncond_embedding"],
        "cls_embedding.cap_proj.fc1.weight": sd["model.cls_embedding.cap_proj.fc1.weight"],
        "cls_embedding.cap_proj.fc2.weight": sd["model.cls_embedding.cap_proj.fc2.weight"],
    }
    for i in range(n_layer):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat(
            [sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[f"layers.{i}.attention.wo.weight"] = sd[p + "self_attn.o_proj.weight"]
        for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[f"layers.{i}.feed_forward.{ours}.weight"] = sd[p + f"mlp.{theirs}.weight"]
        out[f"layers.{i}.attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
    # every LANTERN tensor is used exactly once (q, k, v fused: 2 fewer keys per layer)
    assert len(out) == len(sd) - 2 * n_layer, f"unmapped LANTERN keys: {len(sd) - 2 * n_layer - len(out)}"
    return out


@pytest.fixture(scope="module")
def lantern() -> Fixture:
    return load_fixture("lantern_llamagen")


def lantern_model(fx: Fixture, **extra) -> LlamaGenGPT:
    model = LlamaGenGPT(llamagen_config(fx.config, **extra)).eval()
    model.load_state_dict(lantern_to_ours(fx.w, fx.config["n_layer"]), strict=True)
    return model


def lantern_prefill(fx: Fixture, **extra) -> torch.Tensor:
    """Our prefill (CFG, prefill_features="all") on LANTERN's weights: hidden of every text slot,
    (2B, T, H) in LANTERN's row order [cond; uncond]."""
    target = LlamaGenTarget(lantern_model(fx, **extra), cfg_scale=7.5, prefill_features="all")
    B = fx.inp["caption"].shape[0]
    hidden = target.begin({"caption_embs": fx.inp["caption"], "emb_mask": fx.inp["emb_mask"].bool()}, B).hidden
    return torch.cat([hidden[:, :, 0], hidden[:, :, 1]])


def lantern_full(fx: Fixture, **extra) -> tuple[torch.Tensor, LlamaGenGPT]:
    """Our teacher-forced forward of [text, x_0 .. x_{N-2}] for both CFG rows: hidden (2B, T+N-1, H)."""
    model = lantern_model(fx, **extra)
    caption = torch.cat([fx.inp["caption"], model.cls_embedding.uncond_embedding.expand_as(fx.inp["caption"])])
    mask = torch.cat([fx.inp["emb_mask"]] * 2).bool()
    with torch.no_grad():
        return model(caption, mask, torch.cat([fx.inp["tokens"]] * 2)), model


def lantern_valid_rows(fx: Fixture, full: bool = False) -> torch.Tensor:
    mask = torch.cat([fx.inp["emb_mask"]] * 2).bool()
    if full:
        n_img = fx.inp["tokens"].shape[1] - 1
        mask = torch.cat([mask, torch.ones(mask.shape[0], n_img, dtype=torch.bool)], 1)
    return mask


def test_lantern_llamagen_valid_slots_and_image_logits_match_ours(lantern):
    """What every variant shares (default config): the hidden state of every VALID text slot,
    and the teacher-forced hidden states and logits of every image position (image tokens never
    see padded slots), against LANTERN's HF-style model on its weights."""
    got = lantern_prefill(lantern)
    valid = lantern_valid_rows(lantern)
    assert_close(got[valid], lantern.out["prefill_hidden"][valid], lantern.tol, "LANTERN prefill hidden, valid slots")
    hidden, model = lantern_full(lantern)
    ok = lantern_valid_rows(lantern, full=True)
    assert_close(hidden[ok], lantern.out["full_hidden"][ok], lantern.tol, "LANTERN teacher-forced hidden, valid rows")
    T = lantern.config["cls_token_num"]
    assert_close(model.logits(hidden[:, T - 1:]), lantern.out["full_logits_image"], lantern.tol,
                 "LANTERN teacher-forced image logits")


def test_lantern_fixture_passes_with_variant_lantern(lantern):
    """variant="lantern" reproduces LANTERN's run (its bf16 mask constants) at EVERY text slot,
    padded ones included, in the prefill and in the teacher-forced sequence its drafter-training
    features come from (generate_train_data.py)."""
    assert_close(lantern_prefill(lantern, variant="lantern"), lantern.out["prefill_hidden"], lantern.tol,
                 "prefill hidden of every text slot, variant=lantern")
    hidden, _ = lantern_full(lantern, variant="lantern")
    B = lantern.inp["caption"].shape[0]
    # cond rows only: generate_train_data.py runs the caption rows; for the uncond rows our training
    # forward zeroes the padded slots of the caption it is given (uncond_embedding too), LANTERN's does not
    assert_close(hidden[:B], lantern.out["full_hidden"][:B], lantern.tol, "teacher-forced hidden, variant=lantern")


def test_lantern_fixture_fails_with_variant_upstream(lantern):
    """LANTERN's mask has no diagonal for padded slots: upstream's behaviour (a padded slot sees
    itself only) must NOT reproduce LANTERN's prefill features. The difference is in the padded
    slots of the UNCOND rows (uncond_embedding is not zeroed there); valid slots agree."""
    got, want = lantern_prefill(lantern, variant="upstream"), lantern.out["prefill_hidden"]
    valid = lantern_valid_rows(lantern)
    B = lantern.inp["caption"].shape[0]
    with pytest.raises(AssertionError, match="max abs"):
        assert_close(got, want, lantern.tol, "prefill hidden of every text slot, variant=upstream")
    assert max_abs(got[B:][~valid[B:]], want[B:][~valid[B:]]) > 0.1  # O(1) features; the tolerance is 2e-4
    assert_close(got[valid], want[valid], lantern.tol, "valid slots, variant=upstream")


def test_variants_coincide_on_zero_padded_caption_rows(lantern):
    """Pinned finding: where the padded caption slots are ZERO (the cond rows, as sample_t2i.py and
    LANTERN's generate_train_data.py build them), a padded slot's embedding, query, key and value are
    all zero (no biases), so both variants give exactly LANTERN's features there, padded slots
    included; the variants only differ where a padded slot holds a nonzero embedding (CFG's uncond rows)."""
    B = lantern.inp["caption"].shape[0]
    for variant in ("upstream", "lantern"):
        hidden, _ = lantern_full(lantern, variant=variant)
        assert_close(hidden[:B], lantern.out["full_hidden"][:B], lantern.tol, f"cond rows, variant={variant}")
        assert_close(lantern_prefill(lantern, variant=variant)[:B], lantern.out["prefill_hidden"][:B], lantern.tol,
                     f"cond prefill rows, variant={variant}")


def test_lantern_plain_fp32_mask_is_not_the_lantern_variant(lantern):
    """Documented limit of variant="lantern": it reproduces LANTERN's bf16 runs. A plain fp32 run
    of LANTERN's code (both mask minima equal) lets a padded slot average later VALID slots too
    (non-causal); the fixture keeps that run to show the difference is in padded rows only."""
    got = lantern_prefill(lantern, variant="lantern")
    want = lantern.out["prefill_hidden_fp32mask"]
    valid = lantern_valid_rows(lantern)
    assert_close(got[valid], want[valid], lantern.tol, "valid slots, plain fp32 LANTERN run")
    assert max_abs(got[~valid], want[~valid]) > 0.1


# ------------------------------------------------------------------------------------ LANTERN EAGLE head
def test_lantern_eagle_head_matches_upstream():
    """cnets_llamagen.Model whole-sequence forward: 119 text slots (zero rotation) then image
    entries on the 16x16 grid; our positions are image-token indices, negative for text slots."""
    fx = load_fixture("lantern_eagle_llamagen")
    c = fx.config
    head = EagleHead(EagleConfig(hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
                                 intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
                                 rms_norm_eps=c["rms_norm_eps"], bias=c["bias"],
                                 num_hidden_layers=c["num_hidden_layers"], block_size=c["block_size"])).eval()
    head.load_lantern(fx.w)
    ids, feats = fx.inp["input_ids"], fx.inp["features"]
    B, L = ids.shape
    positions = (torch.arange(L) - c["n_text"]).expand(B, L)
    with torch.no_grad():
        hidden = head(ids, feats, positions)
    assert_close(hidden, fx.out["hidden"], fx.tol, "EAGLE head hidden")
    assert_close(hidden @ fx.inp["lm_head"].T, fx.out["logits"], fx.tol, "EAGLE head logits")
    # the drafter wrapper: text prefix from begin()'s context (119 slots, zero rotation, token 0), then
    # the entry (x_0, feature of the last slot) at position 0, both CFG halves, combined as LANTERN
    drafter = EagleDrafter(head, fx.inp["lm_head"], cfg_scale=7.5, text_prefix=True)
    f = fx.inp["cfg_features"]  # rows [cond x B; uncond x B]
    ctx = torch.stack([f[:B], f[B:]], dim=2)  # (B, 120, 2, H) as a guided target hands it over
    drafter.begin(None, B, StepOut(logits=None, hidden=ctx))
    root = drafter.forward(fx.inp["x0"][:, None], torch.zeros(B, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                           ctx[:, -1:]).logits[:, 0]
    assert_close(root, fx.out["root_logits_cfg7.5"], fx.tol, "EAGLE drafter root logits, CFG 7.5")


# ------------------------------------------------------------------------------------ Lumina-mGPT / Chameleon
def chameleon_config(c: dict) -> ChameleonConfig:
    keys = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta")
    return ChameleonConfig(**{k: c[k] for k in keys})


def image_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


@pytest.fixture(scope="module")
def lumina() -> Fixture:
    return load_fixture("lumina_chameleon")


@pytest.mark.parametrize("cfg_scale", [3.0, 1.0])
def test_lumina_image_logits_with_cfg_and_row_ends_match_upstream(lumina, cfg_scale):
    """Lumina's vendored Chameleon (q/k norms (1, head_dim), broadcast to every head by our loader)
    under Lumina's CFG logits processor, one token per step: our LuminaTarget's logits over image
    codes for all 16 tokens of a 4x4 latent, two prompts of different lengths batched, the newline
    after each row inserted by the adapter (the row end's logits are its newline's)."""
    c = lumina.config
    model = ChameleonLM(chameleon_config(c)).eval()
    assert lumina.w["model.layers.0.self_attn.q_norm.weight"].shape == (1, c["hidden_size"] // c["num_heads"])
    model.load_checkpoint(lumina.w)
    vocab = ImageVocab({image_name(k): int(v) for k, v in enumerate(lumina.inp["code_to_bpe"])})
    tokens = LuminaTokens()
    assert (tokens.image_start, tokens.newline, tokens.grid_base) == (c["image_start"], c["newline"], c["grid_base"])
    target = LuminaTarget(model, vocab, h_latent=c["h_latent"], w_latent=c["w_latent"], cfg_scale=cfg_scale, tokens=tokens)
    codes = lumina.inp["codes"]
    B, N = codes.shape
    got = [target.begin([lumina.inp["prompt_0"], lumina.inp["prompt_1"]], B).logits[:, 0]]
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N - 1):
        got.append(target.forward(codes[:, j:j + 1], torch.full((B, 1), j), one).logits[:, 0])
        target.commit(torch.zeros(B, 1, dtype=torch.long), torch.ones(B, dtype=torch.long))
    got = torch.stack(got, 1)
    want = lumina.out["image_logits_cfg3" if cfg_scale != 1 else "image_logits_cond"]
    assert_close(got, want, lumina.tol, f"Lumina image logits, cfg {cfg_scale}")
    # the fixture is guided: CFG changes the logits far beyond the tolerance
    assert max_abs(lumina.out["image_logits_cfg3"], lumina.out["image_logits_cond"]) > 1.0


@pytest.mark.parametrize("split", [False, True])
def test_lumina_tree_crossing_a_row_end_matches_upstream_branches(lumina, split):
    """A 9-node depth-4 tree after 2 committed image tokens (positions 2..6 of a 4-wide grid: the
    row end at position 3 is inside the tree, its newline inserted by the adapter), in one forward or
    level by level: each node's CFG logits equal upstream's sequential generation on that branch."""
    c = lumina.config
    model = ChameleonLM(chameleon_config(c)).eval()
    model.load_checkpoint(lumina.w)
    vocab = ImageVocab({image_name(k): int(v) for k, v in enumerate(lumina.inp["code_to_bpe"])})
    target = LuminaTarget(model, vocab, h_latent=c["h_latent"], w_latent=c["w_latent"], cfg_scale=c["cfg_scale"])
    tree = tree_from_parents(lumina.inp["tree_parents"])
    cond = [lumina.inp["prompt_0"], lumina.inp["prompt_1"]]
    got = run_tree_round(target, cond, lumina.inp["tree_prefix"], lumina.inp["tree_codes"], tree, split)
    assert_close(got, lumina.out["tree_logits_cfg3"], lumina.tol, f"Lumina tree logits (split={split})")


def test_hf_chameleon_per_head_qk_norm_matches_transformers():
    """transformers' ChameleonForConditionalGeneration layout: q/k norms (num_heads, head_dim), a
    distinct affine per head; plain causal forward, hidden after the final norm and logits."""
    fx = load_fixture("hf_chameleon")
    model = ChameleonLM(chameleon_config(fx.config)).eval()
    assert fx.w["model.layers.0.self_attn.k_norm.weight"].shape == (fx.config["num_heads"], 16)
    model.load_checkpoint(fx.w)
    with torch.no_grad():
        hidden = model(fx.inp["input_ids"])
    assert_close(hidden, fx.out["hidden"], fx.tol, "Chameleon hidden")
    assert_close(model.logits(hidden), fx.out["logits"], fx.tol, "Chameleon logits")


def test_chameleon_vqgan_decode_matches_upstream():
    """Lumina's chameleon_vae_ori decode (taming VQModel, unnormalised codebook) on a non-square
    4x6 grid; ours returns (clamp(x, -1, 1) + 1) / 2, upstream's image_tokenizer then truncates
    x * 255 to uint8 (the pixel conversion itself lives in the Lumina world)."""
    fx = load_fixture("chameleon_vqgan")
    c = fx.config
    vq = ChameleonVQ(ChameleonVQConfig(n_embed=c["n_embed"], embed_dim=c["embed_dim"], ch=c["ch"],
                                       ch_mult=tuple(c["ch_mult"]), num_res_blocks=c["num_res_blocks"],
                                       z_channels=c["z_channels"], resolution=c["resolution"])).eval()
    vq.load_state(fx.w)
    got = vq.decode_codes(fx.inp["codes"], c["h"], c["w"])
    want = (fx.out["decoded"].clamp(-1, 1) + 1) / 2
    assert_close(got, want, fx.tol, "VQGAN decode")
    # upstream's uint8 pixels are the TRUNCATION of x * 255 (off by one only where our float is within
    # rounding of an integer), not its rounding (which would differ in about half the values)
    hwc = got.permute(0, 2, 3, 1) * 255
    want_px = fx.out["pixels_uint8"].int()
    assert (hwc.to(torch.uint8).int() - want_px).abs().max() <= 1
    assert (hwc.to(torch.uint8).int() == want_px).float().mean() > 0.995
    assert (hwc.round().int() == want_px).float().mean() < 0.75


# ------------------------------------------------------------------------------------ T5 caption path
def test_t5_caption_cleaning_matches_upstream_exactly():
    """LlamaGen's T5Embedder.text_preprocessing (two passes of the PixArt cleaner) on PartiPrompts,
    500 COCO captions and edge cases (HTML, URLs, unicode, hashtags, long runs)."""
    from coolsd.models.caption_clean import preprocess_caption

    data = json.loads((FIXTURES / "t5_captions.json").read_text())
    assert len(data["captions"]) > 2000
    bad = [(c, w, preprocess_caption(c)) for c, w in zip(data["captions"], data["cleaned"]) if preprocess_caption(c) != w]
    assert not bad, f"{len(bad)} captions differ, first: {bad[0]!r}"


def test_t5_features_and_left_padding_match_upstream():
    """T5Embedder.get_text_embeddings (tiny random T5 encoder, the fixture's word-level tokenizer)
    and sample_t2i.py's left padding: our T5CaptionEncoder gives the same (caption_embs, emb_mask)."""
    from transformers import AutoTokenizer, T5Config, T5EncoderModel

    from coolsd.models.t5_text import T5CaptionEncoder

    fx = load_fixture("t5_features")
    conf = {k: v for k, v in fx.config.items() if k not in ("max_length", "transformers_version")}
    model = T5EncoderModel(T5Config(**conf)).eval()
    missing, unexpected = model.load_state_dict(fx.w, strict=False)
    assert not unexpected and set(missing) <= {"encoder.embed_tokens.weight"}, (missing, unexpected)
    assert torch.equal(model.encoder.embed_tokens.weight, fx.w["shared.weight"])  # tied
    tok = AutoTokenizer.from_pretrained(str(FIXTURES / "t5_tokenizer"), local_files_only=True)
    captions = json.loads((FIXTURES / "t5_captions.json").read_text())["captions"]
    texts = [captions[i] for i in fx.inp["text_index"].tolist()]
    out = T5CaptionEncoder(model, tok, max_length=fx.config["max_length"]).encode(texts)
    assert torch.equal(out["emb_mask"], fx.out["emb_mask"].bool())
    n_valid = fx.out["emb_mask"].sum(1)
    assert int(n_valid.min()) == 1 and int(n_valid.max()) == fx.config["max_length"]  # "</s>" only .. truncated
    assert_close(out["caption_embs"], fx.out["caption_embs"], fx.tol, "T5 caption features (left padded)")


# ------------------------------------------------------------------------------------ MAR / KL-16
def test_mar_conditions_and_diffloss_head_match_upstream():
    """MAR forward_mae_encoder + forward_mae_decoder (5 known of 16 tokens; labels 3, 7 and the
    unconditional fake_latent) against our MAR.conditions; SimpleMLPAdaLN against our head."""
    from coolsd.models.mar import MAR, MARConfig

    fx = load_fixture("mar")
    model = MAR(MARConfig(**fx.config)).eval()
    model.load_state_dict(fx.w, strict=True)
    with torch.no_grad():
        z = model.conditions(fx.inp["tokens"], fx.inp["mask"] == 0, fx.inp["labels"])
        eps, v = model.head(fx.inp["head_x"], fx.inp["head_t"], fx.inp["head_z"])
    assert_close(z, fx.out["z"], fx.tol, "MAR conditions z")
    assert_close(torch.cat([eps, v], -1), fx.out["head_out"], fx.tol, "DiffLoss head (eps, v)")


def test_kl16_decoder_matches_upstream():
    from coolsd.models.kl16_vae import KLVAE, KLVAEConfig

    fx = load_fixture("kl16_vae")
    c = fx.config
    vae = KLVAE(KLVAEConfig(embed_dim=c["embed_dim"], ch=c["ch"], ch_mult=tuple(c["ch_mult"]),
                            num_res_blocks=c["num_res_blocks"], z_channels=c["z_channels"],
                            resolution=c["resolution"])).eval()
    for name in ("decoder", "post_quant_conv"):  # the fixture holds the decode side; each loads strictly
        getattr(vae, name).load_state_dict({k[len(name) + 1:]: v for k, v in fx.w.items() if k.startswith(name + ".")},
                                           strict=True)
    for grid in ("4x4", "3x5"):
        with torch.no_grad():
            got = vae.decode(fx.inp[f"latents_{grid}"])
        assert_close(got, fx.out[f"decoded_{grid}"], fx.tol, f"KL-16 decode {grid}")


# ------------------------------------------------------------------------------------ LANTERN EAGLE head, Lumina
def test_lantern_eagle_head_for_lumina_matches_upstream():
    """cnets_lumina_mgpt.Model whole-sequence forward (layer 0 keeps input_layernorm; q/k norms
    (1, head_dim) shared by the heads; 1D RoPE at positions 0..L-1), LANTERN's keys, strict."""
    fx = load_fixture("lantern_eagle_lumina")
    c = fx.config
    head = LuminaEagleHead(LuminaEagleConfig(**c)).eval()
    head.load_state_dict(LuminaEagleHead.lantern_state(fx.w), strict=True)
    ids, feats = fx.inp["input_ids"], fx.inp["features"]
    B, L = ids.shape
    with torch.no_grad():
        hidden = head(ids, feats, torch.arange(L).expand(B, L))
    assert_close(hidden, fx.out["hidden"], fx.tol, "Lumina EAGLE head hidden")
