"""The LlamaGen the paper ran: ``target.variant`` (padded-text-slot attention,
``upstream`` = LlamaGen's forced diagonal, ``lantern`` = LANTERN's additive mask), loading LANTERN's
HF conversion (``jadohu/LlamaGen-T2I`` layout) beside the official ``.pt``, and the CFG switch
(guidance only for ``cfg_scale > 1``, as upstream's ``generate.py``).

The references are written here, independently of the model code: a float64 forward whose mask is
either upstream's boolean one (causal, text columns by the padding mask, diagonal on) or LANTERN's
additive one, built as ``modeling_llamagen_kv.py`` builds it for a bf16 run (``_make_causal_mask``:
finfo(float32).min on future keys, plus ``_expand_mask``: finfo(bfloat16).min on padded keys).
The HF folder is written here from our weights through the names of LANTERN's modelling code,
spelled out below (not the project's map)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from coolsd.util.loading import BadInputFile, MissingInputFile
from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT, LlamaGenTarget, load_gpt, tiny
import factories
from factories import llamagen_cond, llamagen_variants as make_models, random_ids
from target_contract import TargetContract
from test_llamagen import upstream_rope_table

CFG = tiny()  # dim 64, 2 layers, 4 heads, vocab 64, 8 text slots, caption dim 16, 4x4 grid
T, N = CFG.cls_token_num, CFG.block_size
VALID = [3, 6]  # valid text slots per sample (left padded): 5 and 2 padded slots


# ------------------------------------------------------------------------------ fixtures
# make_models (the same random weights under both variants) comes from factories.py
def make_cond(valid: list[int], dtype=torch.float64, seed: int = 1) -> dict:
    """factories.llamagen_cond, drawn in float32 (as these tests' captions always were)."""
    return llamagen_cond(valid, dtype, seed, draw_dtype=torch.float32)


def tokens_(B: int, n: int = N, seed: int = 2) -> torch.Tensor:
    return random_ids(B, n, high=CFG.vocab_size, seed=seed)


# ------------------------------------------------------------------------------ reference
def upstream_mask(key_ok: torch.Tensor) -> torch.Tensor:
    """(L, L) additive mask of LlamaGen's generate.py: causal * emb_mask columns, diagonal forced on."""
    L = key_ok.shape[0]
    allowed = torch.ones(L, L, dtype=torch.bool).tril() & key_ok[None, :]
    allowed |= torch.eye(L, dtype=torch.bool)
    return torch.zeros(L, L, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


def lantern_mask(key_ok: torch.Tensor) -> torch.Tensor:
    """(L, L) additive mask as LANTERN's LlamaModel builds it for bf16 inputs: the float32 causal
    mask plus the bf16 padding mask (the sum in float32: -inf where both are set)."""
    L = key_ok.shape[0]
    causal = torch.full((L, L), torch.finfo(torch.float32).min)
    idx = torch.arange(L)
    causal.masked_fill_(idx < (idx + 1).view(L, 1), 0)
    inverted = 1.0 - key_ok[None, :].expand(L, L).to(torch.bfloat16)
    expand = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(torch.bfloat16).min)
    return (expand + causal).double()  # bf16 + fp32 -> fp32 as in _prepare_decoder_attention_mask


def rope_table(L: int) -> torch.Tensor:
    """The first L rows of test_llamagen's upstream-built RoPE table (the same tiny config)."""
    return upstream_rope_table()[:L]


@torch.no_grad()
def reference(model, caption, key_mask, tokens, variant) -> torch.Tensor:
    """Hidden states after the final norm (L, dim), float64, of [text slots, tokens] in one pass."""
    sd = {k: v.double() for k, v in model.state_dict().items()}
    H, D, eps = CFG.n_head, CFG.head_dim, CFG.norm_eps
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731

    def rope(x, tab):
        xs = x.reshape(*x.shape[:-1], -1, 2)
        c, s = tab[:, None, :, 0], tab[:, None, :, 1]
        return torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1).flatten(2)

    cap = torch.nn.functional.gelu(caption.double() @ sd["cls_embedding.cap_proj.fc1.weight"].T, approximate="tanh")
    x = torch.cat([cap @ sd["cls_embedding.cap_proj.fc2.weight"].T, sd["tok_embeddings.weight"][tokens]])
    L = x.shape[0]
    key_ok = torch.cat([key_mask, torch.ones(L - T, dtype=torch.bool)])
    add = (lantern_mask if variant == "lantern" else upstream_mask)(key_ok)
    tab = rope_table(L)
    for i in range(CFG.n_layer):
        p = f"layers.{i}."
        q, k, v = (rms(x, sd[p + "attention_norm.weight"]) @ sd[p + "attention.wqkv.weight"].T).split(CFG.dim, -1)
        q, k, v = rope(q.view(L, H, D), tab), rope(k.view(L, H, D), tab), v.view(L, H, D)
        att = (torch.einsum("ihd,jhd->hij", q, k) / D**0.5 + add).softmax(-1)
        x = x + torch.einsum("hij,jhd->ihd", att, v).reshape(L, -1) @ sd[p + "attention.wo.weight"].T
        hn = rms(x, sd[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(hn @ sd[p + "feed_forward.w1.weight"].T)
        x = x + (gate * (hn @ sd[p + "feed_forward.w3.weight"].T)) @ sd[p + "feed_forward.w2.weight"].T
    return rms(x, sd["norm.weight"])


def err(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------ the variant
def test_variant_is_validated_and_defaults_to_upstream():
    assert CFG.variant == "upstream" and replace(CFG, variant="lantern").variant == "lantern"
    with pytest.raises(ValueError, match="'upstream', 'lantern'.*'diagonal'") as e:
        LlamaGenConfig(dim=64, n_layer=1, n_head=4, variant="diagonal")
    assert "\n" not in str(e.value)


def test_without_padding_the_variants_are_identical():
    models, cond = make_models(), make_cond([T, T])
    outs = [LlamaGenTarget(models[v], cfg_scale=3.0, prefill_features="all").begin(cond, 2) for v in models]
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].hidden, outs[1].hidden)
    tok = tokens_(2)
    h = [models[v](cond["caption_embs"], cond["emb_mask"], tok) for v in models]
    assert torch.equal(h[0], h[1])


@pytest.mark.parametrize("variant", ["upstream", "lantern"])
def test_with_padding_only_padded_slots_differ_and_each_matches_its_reference(variant):
    """Prefill (both CFG halves) and training forward of each variant against the independent
    reference with its mask. A real caption's padded slots are zeroed (begin, as upstream and
    LANTERN): zero inputs stay zero in every layer (no biases), so its features agree in both
    variants; the null caption of the uncond half is whole, and there the other variant's
    reference is off exactly at padded slots 1.. (slot 0 sees itself only in both). Valid slots,
    image positions and every logit are the same in both variants."""
    models, cond, tok = make_models(), make_cond(VALID), tokens_(2)
    other = "upstream" if variant == "lantern" else "lantern"
    model = models[variant]
    pre = LlamaGenTarget(model, cfg_scale=3.0, prefill_features="all").begin(cond, 2).hidden  # (B, T, 2, dim)
    null = model.cls_embedding.uncond_embedding
    real = cond["caption_embs"] * cond["emb_mask"][..., None]
    with torch.no_grad():
        forced = {"cond": model(real, cond["emb_mask"], tok),
                  "uncond": model(null.expand(2, -1, -1), cond["emb_mask"], tok)}
    for b, n in enumerate(VALID):
        mask, p = cond["emb_mask"][b], T - n
        for half, cap in ((0, real[b]), (1, null)):
            ref = reference(model, cap, mask, tok[b, : N - 1], variant)
            assert err(forced["cond" if half == 0 else "uncond"][b], ref) < 1e-9
            assert err(pre[b, :, half], ref[:T]) < 1e-9
            wrong = reference(model, cap, mask, tok[b, : N - 1], other)
            assert err(ref[:1], wrong[:1]) < 1e-12 and err(ref[p:], wrong[p:]) < 1e-12
            if half == 0:  # zeroed padded slots: zero features under both masks
                assert err(ref[:p], torch.zeros_like(ref[:p])) == 0 and err(ref, wrong) < 1e-12
            else:  # the padded slots after the first tell the variants apart
                assert err(ref[1:p], wrong[1:p]) > 1e-2
    logits = [LlamaGenTarget(models[v], cfg_scale=3.0).begin(cond, 2).logits for v in (variant, other)]
    assert err(*logits) < 1e-12


@pytest.mark.parametrize("variant", ["upstream", "lantern"])
def test_prefill_and_kv_decode_equal_the_teacher_forced_forward(variant):
    """What decoding hands a drafter (prefill features of every slot, then each decoded token's)
    equals the training forward's features, both CFG halves, padded slots included, in float32."""
    model = make_models(torch.float32)[variant]
    cond, tok = make_cond(VALID, torch.float32), tokens_(2)
    target = LlamaGenTarget(model, cfg_scale=3.0, prefill_features="all")
    steps = [target.begin(cond, 2).hidden]
    one = torch.ones(1, 1, dtype=torch.bool)
    for j in range(N - 1):
        steps.append(target.forward(tok[:, j: j + 1], torch.full((2, 1), j), one).hidden)
        target.commit(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))
    cached = torch.cat(steps, dim=1)  # (B, T + N - 1, 2, dim)
    null = model.cls_embedding.uncond_embedding.expand(2, -1, -1)
    with torch.no_grad():
        forced = [model(cond["caption_embs"] * cond["emb_mask"][..., None], cond["emb_mask"], tok),
                  model(null, cond["emb_mask"], tok)]
    scale = forced[1].abs().max().item()
    for half in (0, 1):
        assert err(cached[:, :, half], forced[half]) < 2e-5 * scale


# ------------------------------------------------------------------------------ fix 3: the CFG switch
def test_cfg_scale_at_most_one_runs_unguided():
    """upstream generate.py guides only for cfg_scale > 1.0: a scale of 0.5 gives the cond-only
    logits (no uncond half), equal to cfg_scale=1."""
    model, cond = make_models()["upstream"], make_cond(VALID)
    low, plain = LlamaGenTarget(model, cfg_scale=0.5), LlamaGenTarget(model, cfg_scale=1.0)
    assert not low.guided and LlamaGenTarget(model, cfg_scale=1.5).guided
    a, b = low.begin(cond, 2), plain.begin(cond, 2)
    assert torch.equal(a.logits, b.logits) and a.hidden.dim() == 3
    tok, one = tokens_(2, 1), torch.ones(1, 1, dtype=torch.bool)
    assert torch.equal(low.forward(tok, torch.zeros(2, 1, dtype=torch.long), one).logits,
                       plain.forward(tok, torch.zeros(2, 1, dtype=torch.long), one).logits)


# ------------------------------------------------------------------------------ LANTERN's HF folder
def hf_tensors(model: LlamaGenGPT) -> dict:
    """Our weights under the names of LANTERN's modeling_llamagen_kv.py (LlamaForCausalLM)."""
    sd, d = model.state_dict(), model.config.dim
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["output.weight"],
           "model.cls_embedding.uncond_embedding": sd["cls_embedding.uncond_embedding"],
           "model.cls_embedding.cap_proj.fc1.weight": sd["cls_embedding.cap_proj.fc1.weight"],
           "model.cls_embedding.cap_proj.fc2.weight": sd["cls_embedding.cap_proj.fc2.weight"]}
    for i in range(model.config.n_layer):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = sd[p + "attention.wqkv.weight"].split(d)
        out.update({q + "self_attn.q_proj.weight": wq, q + "self_attn.k_proj.weight": wk,
                    q + "self_attn.v_proj.weight": wv, q + "self_attn.o_proj.weight": sd[p + "attention.wo.weight"],
                    q + "mlp.gate_proj.weight": sd[p + "feed_forward.w1.weight"],
                    q + "mlp.up_proj.weight": sd[p + "feed_forward.w3.weight"],
                    q + "mlp.down_proj.weight": sd[p + "feed_forward.w2.weight"],
                    q + "input_layernorm.weight": sd[p + "attention_norm.weight"],
                    q + "post_attention_layernorm.weight": sd[p + "ffn_norm.weight"]})
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_config(cfg: LlamaGenConfig) -> dict:
    """A config.json as a LlamaConfig with LlamaGen's extra fields saves it (the keys LANTERN reads)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.dim,
            "intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_head, "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
            "block_size": cfg.block_size, "cls_token_num": cfg.cls_token_num, "caption_dim": cfg.caption_dim,
            "rope_base": cfg.rope_base, "input_type": "t2i", "num_classes": 1000, "class_dropout_p": 0.1,
            "tie_word_embeddings": False, "attention_bias": False, "pretraining_tp": 1, "torch_dtype": "float32"}


def write_hf_folder(folder, model, layout: str = "safetensors", tensors=None, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model) if tensors is None else tensors
    (folder / "config.json").write_text(json.dumps(hf_config(model.config) if config is None else config))
    if layout == "safetensors":
        save_file(tensors, str(folder / "model.safetensors"))
    elif layout == "bin":
        torch.save(tensors, folder / "pytorch_model.bin")
    else:  # two safetensors shards and their index, as save_pretrained writes big models
        keys = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
                  "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
        for name, ks in shards.items():
            save_file({k: tensors[k] for k in ks}, str(folder / name))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: name for name, ks in shards.items() for k in ks}}))
    return folder


@pytest.mark.parametrize("layout", ["safetensors", "bin", "sharded"])
def test_hf_folder_loads_the_same_model_as_the_pt(tmp_path, layout):
    model = make_models(torch.float32)["upstream"]
    torch.save({"model": model.state_dict()}, tmp_path / "gpt.pt")
    folder = write_hf_folder(tmp_path / "LlamaGen-T2I", model, layout)
    cfg = replace(CFG, variant="lantern")
    from_pt = load_gpt(tmp_path / "gpt.pt", cfg, dtype=torch.float32)
    from_hf = load_gpt(folder, cfg, dtype=torch.float32)
    assert from_hf.config.variant == "lantern"
    for k, v in from_pt.state_dict().items():
        assert torch.equal(v, from_hf.state_dict()[k]), k
    cond = make_cond(VALID, torch.float32)
    a = LlamaGenTarget(from_pt, cfg_scale=3.0, prefill_features="all").begin(cond, 2)
    b = LlamaGenTarget(from_hf, cfg_scale=3.0, prefill_features="all").begin(cond, 2)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


def test_bad_hf_folder_is_one_line_naming_the_file(tmp_path):
    model = make_models(torch.float32)["upstream"]
    good = hf_tensors(model)

    def fails(name, exc=BadInputFile, **kw):
        folder = write_hf_folder(tmp_path / name, model, **kw)
        with pytest.raises(exc) as e:
            load_gpt(folder, CFG, dtype=torch.float32)
        msg = str(e.value)
        assert "\n" not in msg and str(folder) in msg and "jadohu/LlamaGen-T2I" in msg, msg
        return msg

    missing = {k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"}
    msg = fails("missing", tensors=missing)
    assert "model.safetensors" in msg and "missing keys: model.layers.1.mlp.up_proj.weight" in msg
    msg = fails("extra", tensors={**good, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    assert "unexpected keys: model.layers.0.self_attn.rotary_emb.inv_freq" in msg
    msg = fails("shape", tensors={**good, "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)})
    assert "wrong shapes: model.layers.0.self_attn.k_proj.weight (32, 64) (expected (64, 64))" in msg
    msg = fails("size", config={**hf_config(CFG), "hidden_size": 48})
    assert "config.json does not fit target.gpt_config" in msg and "hidden_size=48 (target.gpt_config has 64)" in msg
    msg = fails("grid", config={**hf_config(CFG), "block_size": 1024, "num_key_value_heads": 1})
    assert "block_size=1024" in msg and "num_key_value_heads=1" in msg
    msg = fails("norest", config={k: v for k, v in hf_config(CFG).items() if k != "rope_base"})
    assert "config.json lacks rope_base" in msg
    folder = write_hf_folder(tmp_path / "noweights", model)
    (folder / "model.safetensors").unlink()
    with pytest.raises(MissingInputFile, match=r"holds none of model\.safetensors\.index\.json, model\.safetensors"):
        load_gpt(folder, CFG)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BadInputFile, match="cannot read .*model.safetensors as LlamaGen HF weights"):
        load_gpt(folder, CFG)


# ------------------------------------------------------------------------------ the world and run identity
def test_world_passes_the_variant_into_the_model_and_the_run_identity(llamagen_files, tmp_path):
    from coolsd.job.config_schema import check_config
    from coolsd.util.errors import ConfigError
    from coolsd.job.generation import run_identity
    from coolsd.util.records import claim_run_dir
    from coolsd.worlds.llamagen import LlamaGenWorld
    from factories import TINY_GPT, compose, llamagen_overrides

    folder = write_hf_folder(tmp_path / "hf", llamagen_files["model"])
    base = [*(o for o in llamagen_overrides(llamagen_files) if not o.startswith("draft.")), "draft=self"]
    lantern_cfg = compose("target=llamagen_xl", *base, "target.variant=lantern", f"target.files.gpt={folder}")
    assert not [m for m in LlamaGenWorld.missing_files(lantern_cfg) if m.startswith("gpt")]
    worlds = {v: LlamaGenWorld.load(c) for v, c in
              (("upstream", compose("target=llamagen_xl", *base)), ("lantern", lantern_cfg))}
    assert worlds["lantern"].gpt.config == LlamaGenConfig(**TINY_GPT, variant="lantern")
    assert worlds["upstream"].gpt.config.variant == "upstream" and "variant" not in worlds["upstream"].settings()
    assert worlds["lantern"].settings()["variant"] == "lantern"
    ids = {v: run_identity(w, {}, seed=0, dataset={"name": "x"}, threads=1) for v, w in worlds.items()}
    claim_run_dir(tmp_path / "run", ids["upstream"])
    with pytest.raises(ConfigError, match="another configuration"):
        claim_run_dir(tmp_path / "run", ids["lantern"])
    (folder / "config.json").unlink()
    assert any("gpt: " in m and "lacks config.json" in m for m in LlamaGenWorld.missing_files(lantern_cfg))
    with pytest.raises(ConfigError, match="target.variant='both' is invalid: valid: upstream, lantern"):
        check_config(compose("target=llamagen_xl", *base, "target.variant=both"), LlamaGenWorld)


# ------------------------------------------------------------------------------ the contract
class TestLlamaGenContract(TargetContract):
    """The world contract (tests/target_contract.py) on tiny LlamaGen files: GPT, VQ, T5 and the
    LANTERN drafter folder."""

    runs = {"llamagen_xl": ["method=coolsd"], "llamagen_xl_512": ["method=eagle", "tree=mc_sim_7b_63"]}
    files_fixture = "llamagen_files"
    files = staticmethod(factories.write_llamagen_files)
    overrides = staticmethod(factories.llamagen_overrides)
