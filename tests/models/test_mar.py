"""coolsd.models.mar against upstream MAR (github.com/LTH14/mar ``models/mar.py``, ``models/diffloss.py``,
timm 0.9 ``Block``), on tiny float64 models with every parameter random (upstream zero-inits some). Proven:

* ``MAR.conditions`` equals a literal re-implementation of upstream's MAE-style forward (unknown tokens
  DROPPED by gathering, hand-written softmax(q k^T / sqrt(d)) v, mask tokens padded back) for 0, some and
  all known; unknown values are never read (even NaN); ragged rows equal rows alone; NULL_LABEL = fake_latent.
* ``SimpleMLPAdaLN`` equals upstream's DiffLoss MLP (int t and (N,) t), and its sampling-time cache of
  the time embedding follows the weights whichever way they are changed.
* ``load_mar``: "model_ema" preferred over "model", .safetensors, dtype/device, frozen; errors name the
  key / path / source; pickles with foreign classes are refused.
* The released checkpoints' key names and shapes (derived by hand from upstream) and parameter counts
  (closed form, and the paper's 208M / 479M / 943M).
"""
import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from coolsd.models.mar import MAR, MAR_CONFIGS, NULL_LABEL, MARConfig, load_mar
from factories import mar_reference_cfg, tiny_mar_head, tiny_mar_reference

TINY = mar_reference_cfg()  # 16 tokens of 4 dims, 32 wide, 2 + 2 blocks of 4 heads, buffer 4, head 32 x 2
C, NB = TINY.token_dim, TINY.buffer_size


@pytest.fixture(scope="module")
def mar():
    return tiny_mar_reference()


# ---------------------------------------------------------------- upstream, written out literally
def lin(m, x):
    return x @ m.weight.T + m.bias


def ln(m, x):  # upstream: nn.LayerNorm(eps=1e-6) everywhere
    return F.layer_norm(x, x.shape[-1:], m.weight, m.bias, 1e-6)


def ref_block(blk, x, heads):  # timm Block: pre-norm attention + MLP, exact GELU, no layer scale
    B, N, D = x.shape
    q, k, v = lin(blk.attn.qkv, ln(blk.norm1, x)).reshape(B, N, 3, heads, D // heads).permute(2, 0, 3, 1, 4)
    attn = ((q @ k.transpose(-2, -1)) * (D // heads) ** -0.5).softmax(dim=-1)
    x = x + lin(blk.attn.proj, (attn @ v).transpose(1, 2).reshape(B, N, D))
    return x + lin(blk.mlp.fc2, F.gelu(lin(blk.mlp.fc1, ln(blk.norm2, x))))


def ref_conditions(m, tokens, known, labels):
    """forward_mae_encoder + forward_mae_decoder with upstream's mask (1 = unknown); same count per row."""
    B, L, _ = tokens.shape
    ce = torch.stack([m.fake_latent[0] if int(y) == NULL_LABEL else m.class_emb.weight[int(y)] for y in labels])
    mask = (~known).to(tokens.dtype)
    x = lin(m.z_proj, tokens)
    x = torch.cat([torch.zeros(B, NB, x.shape[-1], dtype=x.dtype), x], dim=1)
    mask_with_buffer = torch.cat([torch.zeros(B, NB, dtype=mask.dtype), mask], dim=1)
    x[:, :NB] = ce.unsqueeze(1)
    x = ln(m.z_proj_ln, x + m.encoder_pos_embed_learned)
    x = x[(1 - mask_with_buffer).nonzero(as_tuple=True)].reshape(B, -1, x.shape[-1])  # dropping
    for blk in m.encoder_blocks:
        x = ref_block(blk, x, m.config.encoder_heads)
    x = lin(m.decoder_embed, ln(m.encoder_norm, x))
    pad = m.mask_token.repeat(B, NB + L, 1).clone()
    pad[(1 - mask_with_buffer).nonzero(as_tuple=True)] = x.reshape(-1, x.shape[-1])
    x = pad + m.decoder_pos_embed_learned
    for blk in m.decoder_blocks:
        x = ref_block(blk, x, m.config.decoder_heads)
    return ln(m.decoder_norm, x)[:, NB:] + m.diffusion_pos_embed_learned


def ref_head(net, x, t, c):
    t = torch.full((x.shape[0],), t) if isinstance(t, int) else t
    freqs = torch.exp(-math.log(10000) * torch.arange(0, 128, dtype=torch.float32) / 128)
    args = t[:, None].float() * freqs[None]
    t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(x.dtype)
    y = lin(net.time_embed.mlp[2], F.silu(lin(net.time_embed.mlp[0], t_freq))) + lin(net.cond_embed, c)
    h = lin(net.input_proj, x)
    for b in net.res_blocks:
        shift, scale, gate = lin(b.adaLN_modulation[1], F.silu(y)).chunk(3, dim=-1)
        mod = ln(b.in_ln, h) * (1 + scale) + shift
        h = h + gate * lin(b.mlp[2], F.silu(lin(b.mlp[0], mod)))
    shift, scale = lin(net.final_layer.adaLN_modulation[1], F.silu(y)).chunk(2, dim=-1)
    out = lin(net.final_layer.linear, F.layer_norm(h, h.shape[-1:], eps=1e-6) * (1 + scale) + shift)
    return out[:, :C], out[:, C:]


def random_known(counts, seed):  # row b knows counts[b] random positions
    rank = torch.rand(len(counts), TINY.seq_len, generator=torch.Generator().manual_seed(seed)).argsort(-1).argsort(-1)
    return rank < torch.tensor(counts).unsqueeze(-1)


def inputs(B, seed=0):
    return torch.randn(B, TINY.seq_len, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------- conditions
@pytest.mark.parametrize("n_known", [0, 1, 7, 15, 16])
def test_conditions_equal_upstream_mae_forward(mar, n_known):
    tokens, known = inputs(3, n_known), random_known([n_known] * 3, n_known)
    labels = torch.tensor([2, NULL_LABEL, 9])
    with torch.no_grad():
        z = mar.conditions(tokens, known, labels)
        assert z.shape == (3, TINY.seq_len, TINY.decoder_dim)
        torch.testing.assert_close(z, ref_conditions(mar, tokens, known, labels), atol=1e-10, rtol=0)


def test_unknown_values_are_never_read(mar):
    tokens, known = inputs(2), random_known([5, 11], 1)
    labels = torch.tensor([1, 4])
    other = torch.where(known.unsqueeze(-1), tokens, 1e3 * inputs(2, seed=7))
    poison = torch.where(known.unsqueeze(-1), tokens, torch.full_like(tokens, float("nan")))
    with torch.no_grad():
        z = mar.conditions(tokens, known, labels)
        assert torch.equal(z, mar.conditions(other, known, labels))
        assert torch.equal(z, mar.conditions(poison, known, labels))
        assert not torch.equal(z, mar.conditions(tokens + 1, known, labels))  # known values are read


def test_ragged_batch_equals_rows_alone(mar):
    tokens, known = inputs(4, 3), random_known([0, 3, 9, 16], 3)
    labels = torch.tensor([0, NULL_LABEL, 5, 7])
    with torch.no_grad():
        z = mar.conditions(tokens, known, labels)
        for b in range(4):
            alone = mar.conditions(tokens[b:b + 1], known[b:b + 1], labels[b:b + 1])
            torch.testing.assert_close(z[b:b + 1], alone, atol=1e-12, rtol=0)
            torch.testing.assert_close(alone, ref_conditions(mar, tokens[b:b + 1], known[b:b + 1], labels[b:b + 1]),
                                       atol=1e-10, rtol=0)


def test_null_label_selects_fake_latent():
    m = tiny_mar_reference(seed=4)
    tokens, known = inputs(1, 5).expand(3, -1, -1), random_known([6], 5).expand(3, -1)
    labels = torch.tensor([NULL_LABEL, 3, 4])
    with torch.no_grad():
        z = m.conditions(tokens, known, labels)
        assert not torch.allclose(z[0], z[1]) and not torch.allclose(z[0], z[2])
        m.fake_latent.copy_(m.class_emb.weight[3:4])
        z = m.conditions(tokens, known, labels)
    torch.testing.assert_close(z[0], z[1], atol=1e-12, rtol=0)
    assert not torch.allclose(z[0], z[2])


# ---------------------------------------------------------------- DiffLoss head
@pytest.fixture
def head():
    return tiny_mar_head(seed=2)


def head_inputs(N=5):
    g = torch.Generator().manual_seed(11)
    return (torch.randn(N, C, generator=g, dtype=torch.float64),
            torch.randn(N, TINY.decoder_dim, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("t", [0, 7, 999, torch.tensor([0, 1, 250, 500, 999])])
def test_head_equals_upstream_simple_mlp_adaln(head, t, grad):
    x, c = head_inputs()
    with torch.set_grad_enabled(grad):
        eps, v = head(x, t, c)
        want = ref_head(head, x, t, c)
    assert eps.shape == v.shape == (5, C)
    torch.testing.assert_close((eps, v), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("modify", [
    pytest.param(lambda w: torch.no_grad()(w.mul_)(2), id="no_grad-mul_"),
    pytest.param(lambda w: w.data.mul_(2), id="data.mul_"),
    pytest.param(lambda w: setattr(w, "data", w.data * 2), id="data="),
])
def test_time_embedding_cache_follows_weights(head, modify):
    x, c = head_inputs()
    with torch.no_grad():
        before = head(x, 42, c)[0]
        modify(head.time_embed.mlp[0].weight)
        after = head(x, 42, c)[0]
        want = ref_head(head, x, 42, c)[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, want, atol=1e-10, rtol=0)


# ---------------------------------------------------------------- loading
class NotAllowed:  # not on torch.load's weights_only allow-list
    pass


def _sd(seed):
    return {k: v.clone() for k, v in tiny_mar_reference(seed, dtype=torch.float32).state_dict().items()}


def test_load_mar(tmp_path):
    sd, sd_other = _sd(1), _sd(2)
    path = tmp_path / "checkpoint-last.pth"
    torch.save({"model": sd_other, "model_ema": sd, "optimizer": {}, "epoch": 3,
                "args": argparse.Namespace(model="mar_tiny")}, path)
    m = load_mar(path, TINY, dtype=torch.float64)
    assert not m.training and not any(p.requires_grad for p in m.parameters()) and m.state_dict().keys() == sd.keys()
    for k, v in m.state_dict().items():
        assert v.dtype == torch.float64 and v.device.type == "cpu" and torch.equal(v, sd[k].double()), k
    assert all(p.device.type == "meta" for p in load_mar(path, TINY, device="meta").parameters())
    from safetensors.torch import save_file
    save_file(sd, tmp_path / "mar.safetensors")
    m = load_mar(tmp_path / "mar.safetensors", TINY)
    assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())
    torch.save({"model": sd_other, "epoch": 1}, tmp_path / "only_model.pth")
    m = load_mar(tmp_path / "only_model.pth", TINY)
    assert all(torch.equal(v, sd_other[k]) for k, v in m.state_dict().items())


def test_load_mar_errors(tmp_path):
    sd = _sd(1)

    def load(state, name="bad.pth"):
        torch.save(state, tmp_path / name)
        return load_mar(tmp_path / name, TINY)

    with pytest.raises(ValueError, match=r"diffloss\.net\.res_blocks\.1\.in_ln\.weight") as e:
        load({"model_ema": {k: v for k, v in sd.items() if k != "diffloss.net.res_blocks.1.in_ln.weight"}})
    assert str(tmp_path / "bad.pth") in str(e.value) and "missing keys" in str(e.value)
    with pytest.raises(ValueError, match=r"unexpected.*encoder_blocks\.7\.norm1\.weight"):
        load({"model_ema": {**sd, "encoder_blocks.7.norm1.weight": torch.ones(32)}})
    with pytest.raises(ValueError, match=r"wrong shapes: z_proj\.weight"):
        load({"model_ema": {**sd, "z_proj.weight": torch.zeros(32, 5)}})
    bigger = MARConfig(**{**TINY.__dict__, "encoder_dim": 48, "decoder_dim": 48})
    with pytest.raises(ValueError, match=r"wrong shapes: .*class_emb\.weight \(10, 48\) \(expected \(10, 32\)\)"):
        load({"model_ema": MAR(bigger).state_dict()})
    with pytest.raises(ValueError, match="missing keys"):  # a bad "model_ema" never falls back to "model"
        load({"model_ema": {k: v for k, v in sd.items() if k != "mask_token"}, "model": sd})
    with pytest.raises(FileNotFoundError) as e:
        load_mar(tmp_path / "nowhere" / "checkpoint-last.pth", TINY)
    assert str(tmp_path / "nowhere" / "checkpoint-last.pth") in str(e.value) and "LTH14/mar" in str(e.value)
    with pytest.raises(ValueError, match="not a readable PyTorch weight file"):
        load({"model_ema": sd, "args": NotAllowed()})


# ---------------------------------------------------------------- the released architectures
BASE_KEYS = {  # derived by hand from upstream mar_base (768 wide, 12+12 blocks, diffloss 6 x 1024)
    "class_emb.weight": (1000, 768), "fake_latent": (1, 768), "z_proj.weight": (768, 16), "z_proj.bias": (768,),
    "z_proj_ln.weight": (768,), "encoder_pos_embed_learned": (1, 320, 768), "encoder_blocks.0.norm1.weight": (768,),
    "encoder_blocks.0.attn.qkv.weight": (2304, 768), "encoder_blocks.0.attn.qkv.bias": (2304,),
    "encoder_blocks.0.attn.proj.weight": (768, 768), "encoder_blocks.11.mlp.fc1.weight": (3072, 768),
    "encoder_blocks.11.mlp.fc2.weight": (768, 3072), "encoder_norm.bias": (768,), "decoder_embed.weight": (768, 768),
    "mask_token": (1, 1, 768), "decoder_pos_embed_learned": (1, 320, 768), "decoder_blocks.11.norm2.bias": (768,),
    "decoder_norm.weight": (768,), "diffusion_pos_embed_learned": (1, 256, 768),
    "diffloss.net.time_embed.mlp.0.weight": (1024, 256), "diffloss.net.time_embed.mlp.2.weight": (1024, 1024),
    "diffloss.net.cond_embed.weight": (1024, 768), "diffloss.net.input_proj.weight": (1024, 16),
    "diffloss.net.res_blocks.5.in_ln.weight": (1024,), "diffloss.net.res_blocks.5.mlp.2.weight": (1024, 1024),
    "diffloss.net.res_blocks.5.adaLN_modulation.1.weight": (3072, 1024),
    "diffloss.net.final_layer.adaLN_modulation.1.weight": (2048, 1024),
    "diffloss.net.final_layer.linear.weight": (32, 1024), "diffloss.net.final_layer.linear.bias": (32,),
}
ABSENT = ["encoder_blocks.12.norm1.weight", "decoder_blocks.12.norm1.weight", "diffloss.net.res_blocks.6.in_ln.weight",
          "diffloss.net.final_layer.norm_final.weight", "encoder_blocks.0.attn.q_norm.weight",
          "encoder_blocks.0.ls1.gamma"]  # no deeper blocks; no affine final norm, qk-norm or layer scale


def upstream_param_count(cfg):
    E, Dd, W, S, n = cfg.encoder_dim, cfg.decoder_dim, cfg.head_width, cfg.seq_len, cfg.seq_len + cfg.buffer_size
    block = lambda d: 12 * d * d + 13 * d  # 2 LN, qkv, proj, fc1, fc2 (mlp_ratio 4)
    trunk = (1000 * E + E + 17 * E + 2 * E + n * E + cfg.encoder_depth * block(E) + 2 * E
             + E * Dd + Dd + Dd + n * Dd + cfg.decoder_depth * block(Dd) + 2 * Dd + S * Dd)
    head = (256 * W + W + W * W + W + Dd * W + W + 16 * W + W + cfg.head_depth * (5 * W * W + 7 * W)
            + W * 32 + 32 + 2 * W * W + 2 * W)
    return trunk + head


@pytest.mark.parametrize("name,paper", [("mar_base", 208e6), ("mar_large", 479e6), ("mar_huge", 943e6)])
def test_released_architectures(name, paper):
    cfg = MAR_CONFIGS[name]
    with torch.device("meta"):
        m = MAR(cfg)
    sd, n = m.state_dict(), sum(p.numel() for p in m.parameters())
    print(f"{name}: {n:,} parameters (paper {paper / 1e6:.0f}M)")
    assert len(sd) == len(list(m.parameters()))  # no buffers, like upstream
    assert n == upstream_param_count(cfg) and abs(n / paper - 1) < 0.05
    assert (cfg.seq_len, cfg.token_dim, cfg.buffer_size, cfg.n_classes) == (256, 16, 64, 1000)
    if name == "mar_base":
        assert {k: tuple(sd[k].shape) for k in BASE_KEYS} == BASE_KEYS
        assert not any(k in sd for k in ABSENT)
    want = {"mar_base": (768, 12, 12, 6, 1024), "mar_large": (1024, 16, 16, 8, 1280),
            "mar_huge": (1280, 20, 16, 12, 1536)}[name]
    assert (cfg.encoder_dim, cfg.encoder_depth, cfg.encoder_heads, cfg.head_depth, cfg.head_width) == want
    assert (cfg.decoder_dim, cfg.decoder_depth, cfg.decoder_heads) == want[:3]
    assert len(m.encoder_blocks) == len(m.decoder_blocks) == want[1] and len(m.head.res_blocks) == want[3]
