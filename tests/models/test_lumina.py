"""Lumina-mGPT (Chameleon) target on tiny random-weight models of the real classes (float64):
the backbone against an independent reference built from the checkpoint-layout state dict, the
strict checkpoint loader, the Chameleon VQGAN decoder, the image vocabulary mapping, and the
``LuminaTarget`` adapter (structural tokens inserted by the adapter, CFG halves with different
contexts and positions, tree-masked KV cache, speculative decoding)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.engine.decoding.trees import build_tree
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.engine.methods import build_method
from coolsd.models.chameleon import CHAMELEON_7B, ChameleonConfig, ChameleonLM
from coolsd.models.chameleon_vq import CHAMELEON_VQGAN, ChameleonVQ, load_vqgan
from coolsd.models.kv_cache import KVCache
from coolsd.models.lumina import ImageVocab, LuminaTarget, LuminaTokens, prompt_ids, prompt_text
from coolsd.engine.model_protocol import ARModel
from factories import (LUMINA_LATENT, N_CODES, VMAP, code_name, lumina_cfg, lumina_vq_cfg, make_lm, make_vq,
                       official_state_dict, random_ids, vqgan_ckpt_dict)
from protocol_checks import commit_and_continue as continue_after_commits
from protocol_checks import path_to, reused_cache_check, run_tree_round

TOL = 1e-6
CFG = lumina_cfg()  # hidden 32, 2 layers, 4 heads (head_dim 8), intermediate 64, vocab 64
H, D = CFG.num_heads, CFG.head_dim


# ------------------------------------------------------------------------------ reference
def _rms(x, w, eps=CFG.rms_norm_eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat([-x2, x1], -1)


@torch.no_grad()
def reference_hidden(sd: dict, ids: torch.Tensor, positions=None, cfg: ChameleonConfig = CFG):
    """Independent full causal forward of ONE sequence (L,) from a checkpoint-layout state dict
    (upstream ChameleonDecoderLayer / ChameleonAttention / ChameleonLayerNorm / RoPE as HF's
    LlamaRotaryEmbedding + rotate_half). Returns hidden after the final norm, (L, d)."""
    nh, hd = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    L = ids.shape[0]
    pos = torch.arange(L, dtype=torch.float64) if positions is None else positions.double()
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).double() / hd))
    emb = torch.cat([torch.outer(pos, inv)] * 2, -1)  # (L, hd)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        xn = _rms(x, sd[p + "input_layernorm.weight"])
        q = (xn @ sd[p + "self_attn.q_proj.weight"].T).view(L, nh, hd)
        k = (xn @ sd[p + "self_attn.k_proj.weight"].T).view(L, nh, hd)
        v = (xn @ sd[p + "self_attn.v_proj.weight"].T).view(L, nh, hd)
        q = F.layer_norm(q, (hd,), eps=1e-5) * sd[p + "self_attn.q_norm.weight"] + sd[p + "self_attn.q_norm.bias"]
        k = F.layer_norm(k, (hd,), eps=1e-5) * sd[p + "self_attn.k_norm.weight"] + sd[p + "self_attn.k_norm.bias"]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scores = torch.einsum("ihd,jhd->hij", q, k) / hd**0.5
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hij,jhd->ihd", att, v).reshape(L, -1) @ sd[p + "self_attn.o_proj.weight"].T
        hn = _rms(x, sd[p + "post_attention_layernorm.weight"])
        ff = F.silu(hn @ sd[p + "mlp.gate_proj.weight"].T) * (hn @ sd[p + "mlp.up_proj.weight"].T)
        x = x + ff @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["model.norm.weight"])


def close(a, b, tol=TOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= tol, err


TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # root + 6 nodes, depth 3


def rand_ids(*shape, seed=2, high=CFG.vocab_size):
    return random_ids(*shape, high=high, seed=seed)


# ------------------------------------------------------------------------------ backbone
def test_config_7b_and_plain_forward_matches_reference():
    c = CHAMELEON_7B
    assert (c.num_layers, c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size, c.vocab_size) == (
        32, 4096, 32, 128, 11008, 65536)
    assert (c.rms_norm_eps, c.rope_theta) == (1e-5, 10000.0)
    model = make_lm()
    ids = rand_ids(2, 9)
    hidden = model(ids)
    sd = model.state_dict()
    for b in range(2):
        close(hidden[b], reference_hidden(sd, ids[b]))
    # logical positions with a gap (RoPE is relative: only gaps matter) change the output
    pos = torch.arange(9) + 3 * (torch.arange(9) >= 4)
    close(model(ids[:1], pos[None])[0], reference_hidden(sd, ids[0], pos))
    assert (model(ids[:1], pos[None]) - hidden[:1]).abs().max() > 1e-3


def test_backbone_tree_and_commit_with_kv_cache_match_full_forward():
    """KVCache path: a 4-token prefix committed, TREE forwarded in two calls (level split, so the
    second call has pending entries), every node's hidden equals the full forward of its
    root-to-node path; then commit one path and continue two tokens: equal to the full forward."""
    model = make_lm()
    sd = model.state_dict()
    B, n = 2, 4
    prefix, tree_ids, new = rand_ids(B, n, seed=3), rand_ids(B, TREE.n_nodes + 1, seed=4), rand_ids(B, 2, seed=5)
    cache = KVCache(CFG.num_layers, B, H, D, 8, torch.float64)  # small: forces growth
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    model.run(model.embed(prefix), torch.arange(n).expand(B, n), cache, causal)
    cache.commit(torch.arange(n).expand(B, n), torch.full((B,), n))
    pos = n + TREE.depth.expand(B, -1)
    a = int((TREE.depth <= 1).sum())
    h1 = model.run(model.embed(tree_ids[:, :a]), pos[:, :a], cache, TREE.ancestors[:a, :a])
    h2 = model.run(model.embed(tree_ids[:, a:]), pos[:, a:], cache, TREE.ancestors[a:])
    hidden = torch.cat([h1, h2], 1)
    for b in range(B):
        for i in range(TREE.n_nodes + 1):
            ref = reference_hidden(sd, torch.cat([prefix[b], tree_ids[b, path_to(TREE, i)]]))
            close(hidden[b, i], ref[-1])
    kept = [path_to(TREE, 6), path_to(TREE, 1)]
    keep = torch.zeros(B, 4, dtype=torch.long)
    for b, p in enumerate(kept):
        keep[b, : len(p)] = torch.tensor(p)
    n_keep = torch.tensor([len(p) for p in kept])
    cache.commit(keep, n_keep)
    out = model.run(model.embed(new), (n + n_keep)[:, None] + torch.arange(2), cache,
                    torch.ones(2, 2, dtype=torch.bool).tril())
    for b in range(B):
        ref = reference_hidden(sd, torch.cat([prefix[b], tree_ids[b, kept[b]], new[b]]))
        close(out[b], ref[-2:])


# ------------------------------------------------------------------------------ checkpoint
def test_official_layout_round_trips_through_the_loader_and_files(tmp_path):
    """A state dict in Lumina's layout ([1, head_dim] q/k norms, ``model.vqmodel.*`` present)
    loads strictly; written as two safetensors shards + index it loads through the file loader;
    both give the reference model's outputs (reference computed from the official dict)."""
    from safetensors.torch import save_file

    from coolsd.models.chameleon import load_chameleon

    src = make_lm(seed=1)
    sd = official_state_dict(src)
    ids = rand_ids(1, 7)
    ref = reference_hidden(sd, ids[0])
    m1 = ChameleonLM(CFG).double()
    m1.load_checkpoint(sd)
    close(m1(ids)[0], ref)
    key = "model.layers.1.self_attn.k_norm.bias"
    assert torch.equal(m1.state_dict()[key][3], sd[key][0])  # (1, d) broadcast to every head
    # sharded folder in the HF layout
    keys = list(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in shards.items():
        save_file({k: sd[k].contiguous() for k in ks}, str(tmp_path / name))
    import json
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: name for name, ks in shards.items() for k in ks}}))
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": CFG.hidden_size, "num_hidden_layers": CFG.num_layers, "num_attention_heads": CFG.num_heads,
        "num_key_value_heads": CFG.num_heads, "intermediate_size": CFG.intermediate_size,
        "vocab_size": CFG.vocab_size, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "swin_norm": False, "model_parallel_size": 1}))
    m2, hf = load_chameleon(tmp_path, dtype=torch.float64)
    close(m2(ids)[0], ref)
    assert hf["num_hidden_layers"] == CFG.num_layers
    # transformers' layout ([num_heads, head_dim]) loads too
    m3 = ChameleonLM(CFG).double()
    m3.load_checkpoint(src.state_dict())
    close(m3(ids)[0], src(ids)[0], tol=0)


def test_loader_errors_name_the_problem(tmp_path):
    from coolsd.models.chameleon import load_chameleon

    model = ChameleonLM(CFG).double()
    sd = official_state_dict(make_lm())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): model.layers.1.mlp.up_proj.weight"):
        model.load_checkpoint(bad)
    bad = dict(sd, **{"model.layers.2.mlp.up_proj.weight": sd["model.layers.1.mlp.up_proj.weight"]})
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): model.layers.2.mlp.up_proj.weight"):
        model.load_checkpoint(bad)
    bad = dict(sd, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(2, D, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"wrong shapes.*q_norm.weight: checkpoint \(2, 8\), model \(4, 8\)"):
        model.load_checkpoint(bad)
    bad = dict(sd, **{"lm_head.weight": torch.zeros(CFG.vocab_size + 1, CFG.hidden_size, dtype=torch.float64)})
    with pytest.raises(ValueError, match="lm_head.weight: checkpoint"):
        model.load_checkpoint(bad)
    # a checkpoint of another model (LlamaGen's layout) is an error, never garbage
    from coolsd.models.llamagen import LlamaGenGPT, tiny as llamagen_tiny

    with pytest.raises(ValueError, match="(?s)missing keys .*unexpected keys"):
        model.load_checkpoint(LlamaGenGPT(llamagen_tiny()).state_dict())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing written
    with pytest.raises(FileNotFoundError, match="huggingface.co/Alpha-VLLM/Lumina-mGPT-7B-768"):
        load_chameleon(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_chameleon(tmp_path)
    with pytest.raises(ValueError, match="unsupported Chameleon config"):
        ChameleonConfig.from_hf({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
                                 "num_key_value_heads": 2, "intermediate_size": 8, "vocab_size": 64})


# ------------------------------------------------------------------------------ VQGAN decoder

VQ_CFG = lumina_vq_cfg()  # 16 codes x 8 dims, ch 32, ch_mult (1, 1, 2): f = 4


def _gn(x, sd, p):
    return F.group_norm(x, 32, sd[p + ".weight"], sd[p + ".bias"], eps=1e-6)


def _conv(x, sd, p, pad):
    return F.conv2d(x, sd[p + ".weight"], sd[p + ".bias"], padding=pad)


def _res(x, sd, p):
    h = _conv(F.silu(_gn(x, sd, p + ".norm1")), sd, p + ".conv1", 1)
    h = _conv(F.silu(_gn(h, sd, p + ".norm2")), sd, p + ".conv2", 1)
    if p + ".nin_shortcut.weight" in sd:
        x = _conv(x, sd, p + ".nin_shortcut", 0)
    return x + h


def _attn(x, sd, p):
    h = _gn(x, sd, p + ".norm")
    B, C, Hh, W = x.shape
    q, k, v = (_conv(h, sd, f"{p}.{n}", 0).reshape(B, C, -1) for n in "qkv")
    w = (torch.einsum("bci,bcj->bij", q, k) * C**-0.5).softmax(-1)
    return x + _conv(torch.einsum("bij,bcj->bci", w, v).reshape(B, C, Hh, W), sd, p + ".proj_out", 0)


def reference_decode(sd, codes, h, w):
    """taming VQModel.decode(get_codebook_entry(codes)) from the state dict, then upstream's
    clamp to [-1, 1], mapped to [0, 1]."""
    z = sd["quantize.embedding.weight"][codes].view(codes.shape[0], h, w, -1).permute(0, 3, 1, 2)
    x = _conv(z, sd, "post_quant_conv", 0)
    x = _conv(x, sd, "decoder.conv_in", 1)
    x = _res(x, sd, "decoder.mid.block_1")
    x = _attn(x, sd, "decoder.mid.attn_1")
    x = _res(x, sd, "decoder.mid.block_2")
    n_levels = len(VQ_CFG.ch_mult)
    for i in reversed(range(n_levels)):
        for j in range(VQ_CFG.num_res_blocks + 1):
            x = _res(x, sd, f"decoder.up.{i}.block.{j}")
        if i:
            x = _conv(F.interpolate(x, scale_factor=2.0, mode="nearest"), sd, f"decoder.up.{i}.upsample.conv", 1)
    x = _conv(F.silu(_gn(x, sd, "decoder.norm_out")), sd, "decoder.conv_out", 1)
    return (x.clamp(-1, 1) + 1) / 2


def test_vq_decoder_shape_range_and_reference():
    vq = make_vq()
    codes = torch.randint(0, VQ_CFG.n_embed, (2, 4 * 6), generator=torch.Generator().manual_seed(0))
    img = vq.decode_codes(codes, 4, 6)
    assert img.shape == (2, 3, 16, 24) and img.dtype == torch.float32
    assert float(img.min()) >= 0.0 and float(img.max()) <= 1.0
    assert float((img == 0).float().mean()) > 0.01 and float((img == 1).float().mean()) > 0.01  # clamp acts
    ref = reference_decode(vq.state_dict(), codes, 4, 6)
    close(img.double(), ref, tol=1e-5)
    assert vq.codebook.shape == (VQ_CFG.n_embed, VQ_CFG.embed_dim)
    from coolsd.engine.decoding.lantern import neighbours_from_codebook

    assert neighbours_from_codebook(vq.codebook.detach()).shape[0] == VQ_CFG.n_embed
    assert CHAMELEON_VQGAN.downsample == 16 and CHAMELEON_VQGAN.n_embed == 8192 and CHAMELEON_VQGAN.embed_dim == 256
    with pytest.raises(ValueError, match="codes"):
        vq.decode_codes(codes, 4, 5)


def test_vqgan_checkpoint_strict_loading(tmp_path):
    src = make_vq(seed=3)
    ckpt = vqgan_ckpt_dict(src)
    path = tmp_path / "vqgan.ckpt"
    torch.save(ckpt, path)
    vq = load_vqgan(path, VQ_CFG, dtype=torch.float64)
    codes = torch.arange(16).view(1, 16)
    close(vq.decode_codes(codes, 4, 4), src.decode_codes(codes, 4, 4), tol=0)
    fresh = ChameleonVQ(VQ_CFG).double()
    bad = {"state_dict": dict(ckpt["state_dict"])}
    del bad["state_dict"]["decoder.up.1.upsample.conv.bias"]
    with pytest.raises(ValueError, match=r"missing keys \(1\): decoder.up.1.upsample.conv.bias"):
        fresh.load_state(bad)
    bad = {"state_dict": dict(ckpt["state_dict"], **{"decoder.up.9.block.0.conv1.weight": torch.zeros(1)})}
    with pytest.raises(ValueError, match=r"unexpected keys \(1\): decoder.up.9.block.0.conv1.weight"):
        fresh.load_state(bad)
    bad = {"state_dict": dict(ckpt["state_dict"], **{"quantize.embedding.weight": torch.zeros(8192, 256)})}
    with pytest.raises(ValueError, match=r"wrong shapes.*quantize.embedding.weight: checkpoint \(8192, 256\)"):
        fresh.load_state(bad)
    with pytest.raises(ValueError, match="state dict of tensors"):
        fresh.load_state({"state_dict": {"decoder.conv_in.weight": "x"}})
    with pytest.raises(FileNotFoundError, match="Anole-7b-v0.1"):
        load_vqgan(tmp_path / "missing.ckpt", VQ_CFG)


# ------------------------------------------------------------------------------ Lumina target

HL = WL = LUMINA_LATENT  # 4 x 4 latent grid: 16 image tokens, a newline after tokens 3, 7, 11
N = HL * WL  # N_CODES (16 image codes) from factories.py
TOKENS = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)


VOCAB = ImageVocab(VMAP)
PROMPTS = [[0, 30, 31, 32, 26], [0, 40, 41, 42, 43, 44, 45, 46, 47, 26]]  # BOS .. sep, lengths 5 and 10
STRUCT = [21, 25, 25]  # <racm3:break>, 23 + 2 grids, 23 + 2 grids


def make_target(model=None, cfg_scale=3.0, **kw) -> LuminaTarget:
    return LuminaTarget(model if model is not None else make_lm(), VOCAB, h_latent=HL, w_latent=WL,
                        cfg_scale=cfg_scale, tokens=TOKENS, **kw)


def full_sequence(prefix: list, codes) -> tuple[list, list]:
    """Lumina's token sequence after ``prefix``: image BPE ids with a newline after each full row
    (not after the last row); and the index of the entry whose output predicts each next code
    (the prefix's last entry predicts code 0; a row end's newline predicts the next row)."""
    seq, out = list(prefix), [len(prefix) - 1]
    for t, c in enumerate(codes):
        seq.append(int(VOCAB.code_to_bpe[int(c)]))
        if (t + 1) % WL == 0 and t + 1 < N:
            seq.append(TOKENS.newline)
        out.append(len(seq) - 1)
    return seq, out


def reference_logits(model, prompt, codes, cfg_scale):
    """(len(codes) + 1, N_CODES) CFG logits over codes from independent full forwards (of a
    model, or of a checkpoint-layout state dict): the cond
    sequence [prompt, structural, image+newlines] and the uncond one [structural, image+newlines],
    each from position 0; row t predicts code t."""
    sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    rows = VOCAB.code_to_bpe

    def run(prefix):
        seq, out = full_sequence(prefix, codes)
        h = reference_hidden(sd, torch.tensor(seq))
        return h[out] @ sd["lm_head.weight"][rows].T, h[out]

    lc, hc = run(list(prompt) + STRUCT)
    if cfg_scale == 1.0:
        return lc, hc
    lu, _ = run(STRUCT)
    return lu + cfg_scale * (lc - lu), hc


def cond_half(hidden):
    return hidden[:, :, 0] if hidden.dim() == 4 else hidden


def rand_codes(*shape, seed):
    return rand_ids(*shape, seed=seed, high=N_CODES)


def test_vocabulary_mapping_tokens_and_prompt():
    assert VOCAB.n_codes == N_CODES
    for c in range(N_CODES):
        assert int(VOCAB.code_to_bpe[c]) == VMAP[code_name(c)]
    assert int(VOCAB.code_to_bpe[12]) == VMAP["IMGIMGBCZ"]  # "BC" = digits 1, 2
    codes = torch.tensor([[3, 15, 0], [12, 12, 7]])
    assert torch.equal(VOCAB.to_codes(VOCAB.to_bpe(codes)), codes)
    assert not torch.equal(VOCAB.to_bpe(codes), codes + 4)  # the synthetic map is shuffled
    with pytest.raises(ValueError, match="outside the image vocabulary"):
        VOCAB.to_codes(torch.tensor([21]))
    with pytest.raises(ValueError, match="cover codes 0..15"):
        ImageVocab({k: v for k, v in VMAP.items() if k != code_name(5)}, n_codes=16)
    with pytest.raises(ValueError, match="not IMGIMG"):
        ImageVocab(dict(VMAP, IMGIMGxZ=60))
    with pytest.raises(ValueError, match="same BPE id"):
        ImageVocab(dict(VMAP, **{code_name(1): VMAP[code_name(0)]}))
    assert ImageVocab.from_hf_config({"vocabulary_map": VMAP}).n_codes == N_CODES
    # structural ids resolved by name; the defaults are the real Chameleon ids
    assert LuminaTokens.from_vocabulary_map(VMAP) == TOKENS
    assert TOKENS.grid_token(2, VMAP) == 25
    real = LuminaTokens()
    assert (real.image_start, real.image_end, real.newline, real.grid_base + 24, real.sep) == (
        8197, 8196, 8803, 8828, 8710)
    # prompt template (generate_examples/generate.py + Conversation): BOS + text + sep
    assert prompt_text("a cat", 768, 768) == (
        "Generate an image of 768x768 according to the following prompt:\na cat<reserved08706>")
    ids = prompt_ids(lambda s: [len(s)], "a cat", 768, 768, bos_id=0)
    assert ids == [0, len(prompt_text("a cat", 768, 768))]


def test_begin_cfg_halves_lengths_positions_and_prefill_logits():
    """(g) The cond half holds [prompt, 21, 25, 25] from position 0, the uncond half [21, 25, 25]
    from position 0 (per-sample committed lengths); image token j then sits at offset + j + j//4."""
    model = make_lm()
    target = make_target(model)
    assert isinstance(target, ARModel) and target.vocab_size == N_CODES and target.n_image_tokens == N
    seen = []
    run = model.run
    model.run = lambda h, pos, cache, att, valid=None: (seen.append(pos.clone()), run(h, pos, cache, att, valid))[1]
    out = target.begin(PROMPTS, 2)
    assert target.cache.length.tolist() == [8, 13, 3, 3]  # cond: 5 + 3, 10 + 3; uncond: 3, 3
    assert target._offset.tolist() == [8, 13, 3, 3]
    assert out.logits.shape == (2, 1, N_CODES) and out.logits.dtype == torch.float64
    assert out.hidden.shape == (2, 1, 2, CFG.hidden_size)
    for b in range(2):
        lr, hr = reference_logits(model, PROMPTS[b], [], 3.0)
        close(out.logits[b, 0], lr[0])
        close(cond_half(out.hidden)[b, 0], hr[0])
    # one forward of image tokens 2..5 (after two committed): 3 is a row end -> one newline slot
    codes = rand_codes(2, 6, seed=11)
    target.forward(codes[:, :2], torch.arange(2).expand(2, 2), torch.ones(2, 2, dtype=torch.bool).tril())
    target.commit(torch.arange(2).expand(2, 2), torch.full((2,), 2))
    seen.clear()
    target.forward(codes[:, 2:], torch.arange(2, 6).expand(2, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    (pos,) = seen
    rel = torch.tensor([2, 3, 5, 6, 4])  # tokens j = 2, 3, 4, 5 (j + j // 4), then 3's newline
    assert pos.tolist() == [(8 + rel).tolist(), (13 + rel).tolist(), (3 + rel).tolist(), (3 + rel).tolist()]
    target.commit(torch.arange(4).expand(2, 4), torch.full((2,), 4))
    assert target.cache.length.tolist() == [8 + 7, 13 + 7, 3 + 7, 3 + 7]  # 6 tokens + 1 newline
    model.run = run


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_token_by_token_matches_full_forward(cfg_scale):
    """AR over all 16 tokens (newlines inserted after 3, 7, 11) equals the full forwards."""
    model = make_lm()
    target = make_target(model, cfg_scale=cfg_scale)
    codes = rand_codes(2, N, seed=12)
    out = target.begin(PROMPTS, 2)
    refs = [reference_logits(model, PROMPTS[b], codes[b], cfg_scale) for b in range(2)]
    for b in range(2):
        close(out.logits[b, 0], refs[b][0][0])
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N):
        step = target.forward(codes[:, j: j + 1], torch.full((2, 1), j), one)
        for b, (lr, hr) in enumerate(refs):
            close(step.logits[b, 0], lr[j + 1])
            close(cond_half(step.hidden)[b, 0], hr[j + 1])
        target.commit(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    assert target.cache.length.tolist()[:2] == [8 + N + 3, 13 + N + 3]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("prefix_len,headroom", [(3, 128), (6, 0)])  # root at a row end / depth 1 at one
def test_tree_forward_matches_path_forward(split, prefix_len, headroom):
    """(a) Every root-to-node path of a tree crossing a row end equals the full forward."""
    model = make_lm()
    target = make_target(model, cache_headroom=headroom)
    prefix, tree_tokens = rand_codes(2, prefix_len, seed=3), rand_codes(2, TREE.n_nodes + 1, seed=4)
    logits = run_tree_round(target, PROMPTS, prefix, tree_tokens, TREE, split)
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            lr, _ = reference_logits(model, PROMPTS[b], torch.cat([prefix[b], tree_tokens[b, path_to(TREE, i)]]), 3.0)
            close(logits[b, i], lr[-1])


KEPT = [path_to(TREE, 6), path_to(TREE, 2)]  # sample 0 keeps 4 entries (j = 3..6), sample 1 keeps 2 (j = 3, 4)


def commit_and_continue(target, rows):
    """For the samples ``rows`` of a fixed batch of 2: a tree round after 3 committed codes (root
    j = 3 is a row end), commit of each sample's KEPT path (different lengths: the samples' row
    ends now differ), a second tree round in two calls at each sample's own positions, commit of
    root -> node 3, then 3 more tokens. Returns the second round's and the last logits, and the
    committed code sequences."""
    return continue_after_commits(target, PROMPTS, rows, KEPT, TREE, rand_codes)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compile-path"])
def test_commit_then_continue_matches_full_forward(compile, monkeypatch):
    """(b) Commits of different lengths per sample (keeping the newlines after kept row ends),
    then a split tree round and a chain, all equal to full forwards. ``compile-path``: the compiled
    path run eagerly (``torch.compile`` left out): a static cache, every token with a row-end slot."""
    import coolsd.models.row_ends

    monkeypatch.setattr(coolsd.models.row_ends, "compile_step", lambda fn, device: fn)
    model = make_lm()
    target = make_target(model, compile=compile)
    assert target.cache is None and target.compiled == compile
    tree_logits, last, seqs, t2, new = commit_and_continue(target, [0, 1])
    for b in range(2):
        for i in range(TREE.n_nodes + 1):
            lr, _ = reference_logits(model, PROMPTS[b], torch.cat([seqs[b], t2[b, path_to(TREE, i)]]), 3.0)
            close(tree_logits[b, i], lr[-1])
        lr, _ = reference_logits(model, PROMPTS[b], torch.cat([seqs[b], t2[b, path_to(TREE, 3)], new[b]]), 3.0)
        close(last[b], lr[-3:])


def test_batch_equals_single_runs():
    model = make_lm()
    batched = commit_and_continue(make_target(model), [0, 1])
    for b in range(2):
        single = commit_and_continue(make_target(model), [b])
        close(single[0][0], batched[0][b])
        close(single[1][0], batched[1][b])


@pytest.mark.parametrize("drafter_kind,tree", [("other", "mc_sim_7b_63"), ("self", "chain")])
def test_greedy_speculative_equals_greedy_ar(drafter_kind, tree):
    """(d) Through ``speculative_generate`` with EAGLE verification: another tiny LuminaTarget
    as drafter (rejections) on the mc_sim_7b_63 tree, or the target itself on a chain (every
    draft accepted: long commits across row ends); both give the plain greedy sequence, which
    is the reference argmax of the full forward."""
    model = make_lm()
    greedy = SamplingConfig(temperature=0.0)
    plain = speculative_generate(make_target(model), N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2,
                                 sampling=greedy)
    m = build_method("eagle", tree=tree, draft_length=5 if tree == "chain" else None)
    draft_model = make_target(model) if drafter_kind == "self" else make_target(make_lm(seed=5), cfg_scale=1.0)
    drafter = build_drafter(m, draft_model, greedy, N_CODES)
    spec = speculative_generate(make_target(model), N, PerSampleRNG([0, 1]), rule=m.rule, drafter=drafter,
                                tree=m.tree, cond=PROMPTS, batch_size=2, sampling=greedy)
    assert torch.equal(plain.tokens, spec.tokens)
    assert all(sum(r) == N - 1 for r in spec.round_lengths)
    if drafter_kind == "self":
        assert max(max(r) for r in spec.round_lengths) == 6
    else:
        assert max(max(r) for r in spec.round_lengths) > 1  # some drafts accepted
    for b in range(2):
        lr, _ = reference_logits(model, PROMPTS[b], plain.tokens[b], 3.0)
        assert torch.equal(lr[:N].argmax(-1), plain.tokens[b])


def test_decode_and_full_loading_from_files(tmp_path):
    """The target decodes through the VQ; ``load_lumina_target`` wires config.json (with its
    vocabulary_map), the shards and vqgan.ckpt, checking the structural ids by name."""
    import json

    from safetensors.torch import save_file

    from coolsd.models.lumina import load_lumina_target

    official = official_state_dict(make_lm(seed=2))
    save_file({k: v.contiguous() for k, v in official.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": CFG.hidden_size, "num_hidden_layers": CFG.num_layers, "num_attention_heads": CFG.num_heads,
        "num_key_value_heads": CFG.num_heads, "intermediate_size": CFG.intermediate_size,
        "vocab_size": CFG.vocab_size, "vocabulary_map": VMAP}))
    vq = make_vq(seed=1)
    torch.save(vqgan_ckpt_dict(vq), tmp_path / "vqgan.ckpt")
    target = load_lumina_target(tmp_path, tmp_path / "vqgan.ckpt", h_latent=HL, w_latent=WL, cfg_scale=3.0,
                                dtype=torch.float64, vq_config=VQ_CFG)
    assert target.tokens == TOKENS
    out = target.begin(PROMPTS, 2)
    for b in range(2):
        lr, _ = reference_logits(official, PROMPTS[b], [], 3.0)
        close(out.logits[b, 0], lr[0])
    codes = rand_codes(2, N, seed=1)
    img = target.decode(codes)
    assert img.shape == (2, 3, 16, 16) and float(img.min()) >= 0 and float(img.max()) <= 1
    close(img.double(), reference_decode(vq.state_dict(), codes, HL, WL), tol=1e-5)
    with pytest.raises(RuntimeError, match="without a VQ decoder"):
        make_target().decode(codes)


def test_reused_cache_holds_a_longer_prompt():
    """A target begun on a short prompt, then on a longer one its cache still holds, decodes the
    longer one as a fresh target does (the host bound of the committed length is the new prompt's):
    a bound kept from the short prompt put the last tokens' logits 16 off."""
    long = [0, *range(30, 50), 26]
    diff = reused_cache_check(lambda: make_target(make_lm(), cache_headroom=8), [0, 30, 26], long, N, N)
    assert diff <= 1e-5, diff
