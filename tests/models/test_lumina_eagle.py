"""Lumina-mGPT EAGLE-1 drafter (coolsd.models.eagle.lumina): LANTERN's state-dict layout, the
adapter against an independent full-sequence reference (text prefix, CFG halves with their own
positions, newline entries, chunked context, tree level, commit), lossless greedy speculative
decoding, structural tokens never drafted, strict loading and the variant record, training
(float64, tiny random models)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from coolsd.engine.decoding.rng import PerSampleRNG
from coolsd.models.eagle.lumina import (LUMINA_MGPT_DRAFTER, LuminaEagleConfig, LuminaEagleDrafter, LuminaEagleHead,
                                          load_lumina_eagle_head, save_lumina_drafter)
from coolsd.models.eagle.training_lumina import lumina_loss, lumina_sequences
from coolsd.engine.drafting import SamplingConfig, build_drafter
from coolsd.engine.loop import speculative_generate
from coolsd.util.loading import BadInputFile, MissingInputFile
from coolsd.engine.methods import build_method
from coolsd.models.lumina import ImageVocab, LuminaTarget, LuminaTokens
from factories import VMAP, make_lm

HL = WL = 4  # 16 image tokens, newlines after tokens 3, 7, 11
N = HL * WL
TOKENS = LuminaTokens(image_start=21, image_end=20, newline=22, grid_base=23, sep=26)
VOCAB = ImageVocab(VMAP)
STRUCT = [21, 25, 25]
PROMPTS = [[0, 30, 31, 32, 26], [0, 40, 41, 42, 43, 44, 45, 46, 47, 26]]
TOL = 1e-9


def target(model, cfg_scale=3.0, **kw):
    return LuminaTarget(model, VOCAB, h_latent=HL, w_latent=WL, cfg_scale=cfg_scale, tokens=TOKENS, **kw)


def make_head(model, seed=3):
    head = LuminaEagleHead.from_target(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial norms (LANTERN's q/k norms: one (1, head_dim) affine)
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            elif name.endswith("norm.bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return head.eval()


def test_lantern_config_and_state_dict_layout():
    cfg = LuminaEagleConfig.from_lantern({  # LANTERN's data/configs/lumina_mgpt_config.json (fields it sets)
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
        "num_hidden_layers": 1, "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "rope_scaling": None, "vocab_size": 65536, "attention_bias": False, "mlp_bias": False, "dropout": 0.05,
        "model_parallel_size": 1, "swin_norm": False})
    assert cfg == LUMINA_MGPT_DRAFTER and LuminaEagleConfig.from_lantern(cfg.to_lantern_json()) == cfg
    with pytest.raises(ValueError, match="model_parallel_size"):
        LuminaEagleConfig.from_lantern({**cfg.to_lantern_json(), "model_parallel_size": 2})
    small = LuminaEagleConfig(hidden_size=16, num_attention_heads=2, intermediate_size=24, vocab_size=40)
    shapes = {k: tuple(v.shape) for k, v in LuminaEagleHead(small).state_dict().items()}
    assert shapes == {  # cnets_lumina_mgpt.Model: layer 0 keeps input_layernorm; q/k norms [mp=1, head_dim]
        "embed_tokens.weight": (40, 16), "fc.weight": (16, 32), "fc.bias": (16,),
        **{f"layers.0.self_attn.{p}_proj.weight": (16, 16) for p in "qkvo"},
        **{f"layers.0.self_attn.{p}_norm.{w}": (1, 8) for p in "qk" for w in ("weight", "bias")},
        "layers.0.mlp.gate_proj.weight": (24, 16), "layers.0.mlp.up_proj.weight": (24, 16),
        "layers.0.mlp.down_proj.weight": (16, 24),
        "layers.0.input_layernorm.weight": (16,), "layers.0.post_attention_layernorm.weight": (16,)}
    assert not LuminaEagleHead(small).embed_tokens.weight.requires_grad


def test_head_matches_an_independent_chameleon_layer():
    """fc(cat(emb, f)) then pre-norm attention with per-head LayerNorm (eps 1e-5, one shared affine)
    and rotate_half RoPE, SwiGLU, no final norm (LANTERN's ChameleonDecoderLayer)."""
    head = make_head(make_lm()).double()
    sd, c = head.state_dict(), head.config
    g = torch.Generator().manual_seed(0)
    ids, f = torch.randint(0, 64, (1, 7), generator=g), torch.randn(1, 7, c.hidden_size, generator=g, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 5, 6, 7, 9]])
    x = torch.cat([sd["embed_tokens.weight"][ids], f], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    rms = lambda z, w: z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w  # noqa: E731
    p = "layers.0."
    h = rms(x, sd[p + "input_layernorm.weight"])
    Hh, D = c.num_attention_heads, c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos[0, :, None].double() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = lambda z: torch.cat([-z[..., D // 2:], z[..., : D // 2]], -1)  # noqa: E731

    def qk(w, n):
        z = (h @ sd[p + f"self_attn.{w}_proj.weight"].T)[0].view(7, Hh, D)
        z = torch.nn.functional.layer_norm(z, (D,), eps=1e-5) * sd[p + f"self_attn.{n}.weight"] + sd[p + f"self_attn.{n}.bias"]
        return z * cos + rot(z) * sin

    q, k = qk("q", "q_norm"), qk("k", "k_norm")
    v = (h @ sd[p + "self_attn.v_proj.weight"].T)[0].view(7, Hh, D)
    a = (q.transpose(0, 1) @ k.transpose(0, 1).transpose(1, 2)) / D**0.5
    a = a.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    att = (a @ v.transpose(0, 1)).transpose(0, 1).reshape(7, -1) @ sd[p + "self_attn.o_proj.weight"].T
    x = x[0] + att
    n = rms(x, sd[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(n @ sd[p + "mlp.gate_proj.weight"].T) * (n @ sd[p + "mlp.up_proj.weight"].T))
    ref = x + mlp @ sd[p + "mlp.down_proj.weight"].T
    assert torch.allclose(head(ids, f, pos)[0], ref, atol=TOL)


# ------------------------------------------------------------------------------ reference of the adapter
def image_seq(codes):
    out = []
    for j, c in enumerate(codes.tolist()):
        out.append(int(VOCAB.code_to_bpe[c]))
        if (j + 1) % WL == 0 and j + 1 < N:
            out.append(TOKENS.newline)
    return out


def reference_node_logits(model, head, prompt, codes, cfg_scale):
    """(len(codes), n_codes) drafter logits at every image node from plain full forwards of the
    LANTERN-layout sequence: entry i = (s_{i+1}, f_i), f = the target's full-forward features,
    except a newline entry, whose feature is the head's own output at its row-end entry."""
    W = model.lm_head.weight[VOCAB.code_to_bpe]

    def half(prefix):
        s = list(prefix) + image_seq(codes)
        h = model(torch.tensor([s]))[0]
        ids, feats = torch.tensor(s[1:]), h[:-1].clone()
        pos = torch.arange(len(s) - 1)
        for i in range(len(ids)):
            if int(ids[i]) == TOKENS.newline:
                feats[i] = head(ids[None, :i], feats[None, :i], pos[None, :i])[0, i - 1]
        out = head(ids[None], feats[None], pos[None])[0]
        first = len(prefix) - 1  # entry (x_0, f[w-grid])
        node = [first + j + j // WL + (1 if (j + 1) % WL == 0 and j + 1 < N else 0) for j in range(len(codes))]
        return out[node] @ W.T

    lc = half(prompt + STRUCT)
    return lc if cfg_scale == 1.0 else half(STRUCT) + cfg_scale * (lc - half(STRUCT))


@pytest.mark.parametrize("cfg_scale,compile", [(3.0, False), (1.0, False), (3.0, True)],
                         ids=["cfg3", "cfg1", "cfg3-compile"])
def test_drafter_context_tree_and_commit_match_the_full_sequence_reference(cfg_scale, compile):
    """compile: the drafter's compiled path run eagerly (static cache, newline passes by entry count)."""
    model = make_lm()
    head = make_head(model).double()
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (2, N), generator=g)
    t = target(model, cfg_scale, prefill_features="all")
    pre = t.begin(PROMPTS, 2)
    tout = t.forward(codes[:, :9], torch.arange(9).expand(2, 9), torch.ones(9, 9, dtype=torch.bool).tril())
    # feature of entry j: the target's at node j-1 (node -1: the prefill's last slot)
    feats = torch.cat([pre.hidden[:, -1:], tout.hidden[:, :8]], 1)
    d = LuminaEagleDrafter.for_target(head, t, compile=compile)
    assert d.vocab_size == 16  # codes only: structural tokens are never drafted
    d.begin(PROMPTS, 2, context=pre)
    # verified context crossing the row end at token 3 in ONE forward (runs in passes), keep 5 of 6
    ctx = d.forward(codes[:, :6], torch.arange(6).expand(2, 6), torch.ones(6, 6, dtype=torch.bool).tril(), feats[:, :6])
    d.commit(torch.arange(6).expand(2, 6), torch.tensor([5, 5]))
    ref = [reference_node_logits(model, head, PROMPTS[b], codes[b], cfg_scale) for b in range(2)]
    for b in range(2):
        assert torch.allclose(ctx.logits[b], ref[b][:6], atol=TOL)
    # then tokens 5, 6 and a tree level of three siblings at the row end j = 7 (the features are
    # opaque to the adapter: fed the target's at node 6 here, so the reference applies)
    step = d.forward(codes[:, 5:7], torch.arange(5, 7).expand(2, 2), torch.ones(2, 2, dtype=torch.bool).tril(),
                     feats[:, 5:7])
    sib = torch.stack([codes[:, 7], (codes[:, 7] + 1) % 16, (codes[:, 7] + 2) % 16], 1)
    attend = torch.zeros(3, 5, dtype=torch.bool)
    attend[:, :2] = True
    attend[:, 2:] = torch.eye(3, dtype=torch.bool)
    hid = feats[:, 7:8].expand(*((2, 3, 2, -1) if cfg_scale != 1.0 else (2, 3, -1)))
    lvl = d.forward(sib, torch.full((2, 3), 7), attend, hid)
    for b in range(2):
        assert torch.allclose(step.logits[b], ref[b][5:7], atol=TOL)
        for r in range(3):
            alt = codes[b].clone()
            alt[7] = sib[b, r]
            assert torch.allclose(lvl.logits[b, r], reference_node_logits(model, head, PROMPTS[b], alt, cfg_scale)[7],
                                  atol=TOL)


def test_a_context_over_two_row_ends_in_one_forward_matches_the_reference(monkeypatch):
    """Six verified tokens j = 3..8 in one forward: j = 8 attends the row ends 3 and 7, so its
    output needs the newline of 7, whose input needs the newline of 3 (three passes). Positions
    that do not step by one along the chain are refused under COOLSD_CHECKS=1."""
    model = make_lm()
    head = make_head(model).double()
    codes = torch.randint(0, 16, (2, N), generator=torch.Generator().manual_seed(5))
    t = target(model, 3.0, prefill_features="all")
    pre = t.begin(PROMPTS, 2)
    tout = t.forward(codes[:, :9], torch.arange(9).expand(2, 9), torch.ones(9, 9, dtype=torch.bool).tril())
    feats = torch.cat([pre.hidden[:, -1:], tout.hidden[:, :8]], 1)
    d = LuminaEagleDrafter.for_target(head, t)
    d.begin(PROMPTS, 2, context=pre)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    d.forward(codes[:, :3], torch.arange(3).expand(2, 3), causal[:3, :3], feats[:, :3])
    d.commit(None, torch.tensor([3, 3]))
    ctx = d.forward(codes[:, 3:9], torch.arange(3, 9).expand(2, 6), causal, feats[:, 3:9])
    for b in range(2):
        assert torch.allclose(ctx.logits[b], reference_node_logits(model, head, PROMPTS[b], codes[b], 3.0)[3:9],
                              atol=TOL)
    d.commit(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("COOLSD_CHECKS", "1")
    with pytest.raises(ValueError, match="step by one"):  # j = 8 would attend row ends 3 and 7 in a 3-chain
        d.forward(codes[:, 3:6], torch.tensor([3, 7, 8]).expand(2, 3), causal[:3, :3], feats[:, 3:6])


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "chain"])
def test_greedy_speculative_with_the_lumina_drafter_equals_greedy_ar(tree):
    """Lossless: EAGLE verification with the drafter (a head trained a few steps on the target's
    own samples, so drafts are accepted, also across row ends) gives the plain greedy tokens."""
    model = make_lm()
    greedy = SamplingConfig(temperature=0.0)
    plain = speculative_generate(target(model), N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2, sampling=greedy)
    head = trained_head(model)
    m = build_method("eagle", tree=tree, draft_length=5 if tree == "chain" else None)
    t = target(model, prefill_features="all")
    drafter = build_drafter(m, LuminaEagleDrafter.for_target(head, t), greedy, 16)
    spec = speculative_generate(t, N, PerSampleRNG([0, 1]), rule=m.rule, drafter=drafter, tree=m.tree, cond=PROMPTS,
                                batch_size=2, sampling=greedy)
    assert torch.equal(plain.tokens, spec.tokens)
    assert all(sum(r) == N - 1 for r in spec.round_lengths) and max(max(r) for r in spec.round_lengths) > 1


_HEAD = {}


def trained_head(model):
    """A head trained 40 steps on teacher-forced features of greedy target samples (cached)."""
    if "h" not in _HEAD:
        from coolsd.models.eagle.training import train_eagle

        t = target(model)
        greedy = speculative_generate(t, N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2,
                                      sampling=SamplingConfig(temperature=0.0)).tokens
        batch = lumina_sequences(t, PROMPTS, greedy)
        head = make_head(model).double()
        train_eagle(head, model.lm_head.weight, [batch], 40, lr=3e-3, noise_std=0.0, loss_fn=lumina_loss)
        _HEAD["h"] = head.eval()
    return _HEAD["h"]


def test_training_sequences_match_the_target_features_and_loss_falls():
    model = make_lm()
    t = target(model, prefill_features="all")
    codes = torch.randint(0, 16, (2, N), generator=torch.Generator().manual_seed(4))
    batch = lumina_sequences(t, PROMPTS, codes)
    pre = t.begin(PROMPTS, 2)
    out = t.forward(codes, torch.arange(N).expand(2, N), torch.ones(N, N, dtype=torch.bool).tril())
    for b in range(2):  # cond row b: the entry (x_j, f) carries the feature the target hands the drafter
        L = int(batch.valid[b].sum())
        first = L - (N + HL - 1)  # entry of x_0
        assert int(batch.ids[b, first]) == int(VOCAB.code_to_bpe[codes[b, 0]])
        assert torch.allclose(batch.features[b, first], pre.hidden[b, -1, 0], atol=1e-9)
        assert torch.allclose(batch.features[b, first + 5], out.hidden[b, 3, 0], atol=1e-9)  # after row end 3: NL's
        assert int(batch.ids[b, first + 4]) == TOKENS.newline and not batch.loss_mask[b, : first - 3].any()
        u = 2 + b  # uncond row: from (h-grid, f[break]) at position 0
        assert int(batch.ids[u, 0]) == 25 and batch.loss_mask[u, : int(batch.valid[u].sum())].all()
        assert torch.allclose(batch.features[u, 2], pre.hidden[b, -1, 1], atol=1e-9)
    head = make_head(model).double()
    first, _ = lumina_loss(head, model.lm_head.weight, batch)
    trained = trained_head(model)
    assert lumina_loss(trained, model.lm_head.weight, lumina_sequences(t, PROMPTS, speculative_generate(
        target(model), N, PerSampleRNG([0, 1]), cond=PROMPTS, batch_size=2,
        sampling=SamplingConfig(temperature=0.0)).tokens))[0] < first


def test_strict_loading_errors_and_variant_record(tmp_path):
    model = make_lm()
    t = target(model)
    head = make_head(model).double()
    out = save_lumina_drafter(head, tmp_path / "d", {"steps": 0}, target_variant="upstream")
    loaded = load_lumina_eagle_head(out, t)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in head.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_lumina_eagle_head(out, t, variant="upstream")
    with pytest.warns(UserWarning, match="variant 'upstream'.*variant 'lantern'"):
        load_lumina_eagle_head(out, t, variant="lantern")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["target_variant"]  # a released folder: no record, no warning
    (out / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_lumina_eagle_head(out, t, variant="lantern")
    # LANTERN's pytorch_model.bin with a module. prefix and saved rotary buffers loads strictly
    sd = {f"module.{k}": v for k, v in head.state_dict().items()}
    sd["module.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    (out / "model.safetensors").unlink()
    torch.save(sd, out / "pytorch_model.bin")
    assert torch.equal(load_lumina_eagle_head(out, t).fc.weight, head.fc.weight)
    del sd["module.fc.bias"]
    torch.save(sd, out / "pytorch_model.bin")
    with pytest.raises(BadInputFile, match=r"pytorch_model.bin.*missing keys: fc.bias.*jadohu/LANTERN issue #1"):
        load_lumina_eagle_head(out, t)
    (out / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(BadInputFile, match="drafter of another target"):
        load_lumina_eagle_head(out, t)
    with pytest.raises(MissingInputFile, match="needs config.json and pytorch_model.bin"):
        load_lumina_eagle_head(tmp_path, t)


def test_batch_invariant_mode_gives_each_sample_its_alone_tokens():
    """Under coolsd.engine.batch_invariant the target and the drafter run each sample alone (the target's
    shared newline slots depend on the other samples' row ends): tokens, round lengths and the target's
    per-token NLL (its logits, bit for bit) of a batch of 2 equal each prompt's batch-1 run (fp32)."""
    from coolsd.engine.batch_invariant import batch_invariant

    model = make_lm().float()
    head = make_head(model).float()
    m = build_method("eagle", tree="mc_sim_7b_63")
    samp = SamplingConfig(temperature=1.0)

    def run(prompts, seeds):
        t = target(model, prefill_features="all")
        d = build_drafter(m, LuminaEagleDrafter.for_target(head, t), samp, 16)
        return speculative_generate(t, N, PerSampleRNG(seeds), rule=m.rule, drafter=d, tree=m.tree, cond=prompts,
                                    batch_size=len(seeds), sampling=samp, distortion=True)

    with batch_invariant():
        both = run(PROMPTS, [0, 1])
        alone = [run(PROMPTS[b : b + 1], [b]) for b in range(2)]
    for b in range(2):
        assert torch.equal(both.tokens[b], alone[b].tokens[0]) and both.round_lengths[b] == alone[b].round_lengths[0]
        assert torch.equal(both.token_nll[b], alone[b].token_nll[0])
    assert both.round_lengths[0] != both.round_lengths[1]  # the samples diverge: row ends at different columns


def test_batch_invariant_drafter_logits_equal_alone_bit_for_bit():
    """The drafter alone: samples at different positions (row ends in different columns) give the
    batch-1 logits exactly."""
    from coolsd.engine.batch_invariant import batch_invariant

    model = make_lm().float()
    head = make_head(model).float()
    codes = torch.randint(0, 16, (2, N), generator=torch.Generator().manual_seed(1))
    C = 5
    pos = torch.stack([torch.arange(3, 3 + C), torch.arange(1, 1 + C)])  # row ends at j = 3, 7 / j = 3
    tok = torch.stack([codes[0, 3 : 3 + C], codes[1, 1 : 1 + C]])

    def drive(idx):
        t = target(model, 3.0, prefill_features="all")
        pre = t.begin([PROMPTS[i] for i in idx], len(idx))
        feats = torch.randn(2, C, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(2))[idx]
        d = LuminaEagleDrafter.for_target(head, t)
        d.begin([PROMPTS[i] for i in idx], len(idx), context=pre)
        n = len(idx)
        d.forward(codes[idx, :3], torch.arange(3).expand(n, 3), torch.ones(3, 3, dtype=torch.bool).tril(),
                  feats[:, :3])
        d.commit(torch.arange(3).expand(n, 3), torch.tensor([3, 1])[idx])
        return d.forward(tok[idx], pos[idx], torch.ones(C, C, dtype=torch.bool).tril(), feats).logits

    with batch_invariant():
        both = drive([0, 1])
        for b in range(2):
            assert torch.equal(both[b], drive([b])[0])
