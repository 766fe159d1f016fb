"""Fast checks of the toy VQ tokenizer (tiny untrained configs and a few training steps)."""
import json

import numpy as np
import pytest
import torch

from coolsd.toy.vq import ToyVQ, VQConfig, load_vq, save_vq, train_vq
from coolsd.toy.scenes import render_batch, sample_scenes

TINY = VQConfig(codebook_size=32, codebook_dim=4, channels=8, enc_blocks=1, dec_blocks=1, z_channels=8, train_pool=64)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return ToyVQ(TINY).eval()


@pytest.fixture(scope="module")
def images():
    return render_batch(sample_scenes(5, seed=123))  # (5, 32, 32, 3) uint8


def test_config_and_token_grid():
    cfg = VQConfig()
    assert (cfg.grid, cfg.num_tokens, cfg.codebook_size, cfg.codebook_dim) == (8, 64, 512, 8)
    assert VQConfig.from_json(cfg.to_json()) == cfg
    torch.manual_seed(0)
    m = ToyVQ(cfg).eval()  # the default (untrained) model: 64 tokens per 32x32 image
    tok = m.encode(render_batch(sample_scenes(2, seed=5)))
    assert tok.shape == (2, 64) and tok.dtype == torch.long and int(tok.max()) < 512
    assert m.decode(tok).shape == (2, 3, 32, 32) and m.codebook.shape == (512, 8)
    with pytest.raises(ValueError, match="downsample"):
        VQConfig(downsample=3)
    with pytest.raises(ValueError, match="unknown VQConfig fields"):
        VQConfig.from_json('{"codebook_size": 8, "bogus": 1}')


def test_encode_decode_shapes_dtypes_range(tiny, images):
    tok = tiny.encode(images)
    assert tok.shape == (5, 64) and tok.dtype == torch.long
    assert 0 <= int(tok.min()) and int(tok.max()) < TINY.codebook_size
    # uint8 numpy, uint8 tensor and float (n,3,32,32) in [0,1] inputs agree
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    assert torch.equal(tiny.encode(torch.from_numpy(images)), tok)
    assert torch.equal(tiny.encode(x), tok)
    rec = tiny.decode(tok)
    assert rec.shape == (5, 3, 32, 32) and rec.dtype == torch.float32
    assert float(rec.min()) >= 0 and float(rec.max()) <= 1
    u8 = tiny.decode_uint8(tok)
    assert u8.shape == (5, 32, 32, 3) and u8.dtype == np.uint8
    with pytest.raises(ValueError):
        tiny.decode(torch.full((1, 64), TINY.codebook_size))
    with pytest.raises(ValueError):
        tiny.decode(torch.zeros(1, 63, dtype=torch.long))


def test_codebook_is_l2_normalised_and_tokens_are_nearest(tiny, images):
    cb = tiny.codebook
    assert cb.shape == (TINY.codebook_size, TINY.codebook_dim)
    torch.testing.assert_close(cb.norm(dim=1), torch.ones(TINY.codebook_size))
    tok = tiny.encode(images)
    with torch.no_grad():
        z = tiny._latent(tiny.to_input(images)).reshape(-1, TINY.codebook_dim)  # row-major (n, g, g)
    brute = torch.cdist(z, cb).argmin(1).reshape(5, 64)
    assert torch.equal(tok, brute)


def test_row_major_token_order(tiny, images):
    """Token r*g+c is grid cell (row r, col c), and decode matches LlamaGen's decode_code layout."""
    g, d = TINY.grid, TINY.codebook_dim
    tok = tiny.encode(images)
    x = tiny.to_input(images)
    with torch.no_grad():
        z = torch.nn.functional.normalize(tiny.quant_conv(tiny.encoder(x * 2 - 1)), dim=1)  # (n, d, g, g)
        for r, c in [(0, 1), (1, 0), (g - 1, 2), (3, g - 1)]:
            assert torch.equal(tok[:, r * g + c], torch.cdist(z[:, :, r, c], tiny.codebook).argmin(1))
        zq = tiny.codebook[tok].permute(0, 2, 1).reshape(-1, d, g, g)  # decode_code(tokens, [B, d, g, g])
        ref = (tiny.decoder(tiny.post_quant_conv(zq)) * 0.5 + 0.5).clamp(0, 1)
    torch.testing.assert_close(tiny.decode(tok), ref)


def test_decode_is_deterministic_and_forward_losses(tiny, images):
    tok = tiny.encode(images)
    assert torch.equal(tiny.decode(tok), tiny.decode(tok))
    out = tiny(images)
    assert out["recon"].shape == (5, 3, 32, 32)
    assert torch.equal(out["tokens"], tok)
    for k in ("loss", "recon_loss", "codebook_loss", "commit_loss", "norm_loss"):
        assert out[k].ndim == 0 and torch.isfinite(out[k])
    # straight-through: the encoder receives gradient from the reconstruction loss
    tiny.zero_grad()
    out["recon_loss"].backward()
    assert tiny.encoder.conv_in.weight.grad.abs().sum() > 0
    tiny.zero_grad()


def test_save_load_roundtrip_exact(tiny, images, tmp_path):
    p = tmp_path / "vq.safetensors"
    save_vq(tiny, p)
    m = load_vq(p)
    assert m.cfg == TINY
    sd0, sd1 = tiny.state_dict(), m.state_dict()
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    tok = tiny.encode(images)
    assert torch.equal(m.encode(images), tok)
    assert torch.equal(m.decode(tok), tiny.decode(tok))


def test_load_errors_name_file_and_rebuild(tiny, tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="nope.safetensors.*make toy-assets"):
        load_vq(missing)
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt.safetensors.*make toy-assets"):
        load_vq(bad)

    from safetensors.torch import save_file

    meta = {"format": "coolsd.toy.vq", "config": TINY.to_json()}
    sd = {k: v.contiguous() for k, v in tiny.state_dict().items()}
    extra = tmp_path / "extra.safetensors"
    save_file({**sd, "bogus.weight": torch.zeros(1)}, str(extra), metadata=meta)
    with pytest.raises(ValueError, match="extra.safetensors.*bogus.weight"):
        load_vq(extra)
    short = tmp_path / "short.safetensors"
    save_file({k: v for k, v in sd.items() if k != "embedding.weight"}, str(short), metadata=meta)
    with pytest.raises(ValueError, match="short.safetensors.*embedding.weight"):
        load_vq(short)
    nometa = tmp_path / "nometa.safetensors"
    save_file(sd, str(nometa))
    with pytest.raises(ValueError, match="nometa.safetensors.*make toy-assets"):
        load_vq(nometa)
    wrongcfg = tmp_path / "wrongcfg.safetensors"
    other = json.loads(TINY.to_json()) | {"codebook_size": 16}
    save_file(sd, str(wrongcfg), metadata={"format": "coolsd.toy.vq", "config": json.dumps(other)})
    with pytest.raises(ValueError, match="wrongcfg.safetensors"):
        load_vq(wrongcfg)


def test_train_vq_deterministic_and_reports_metrics():
    cfg = VQConfig(**{**json.loads(TINY.to_json()), "restart_every": 2, "warmup_steps": 2})
    kw = dict(steps=4, batch_size=4, seed=7, log=None, eval_images=8)
    m1, met1 = train_vq(cfg, **kw)
    m2, met2 = train_vq(cfg, **kw)
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    for k in ("heldout_mae", "heldout_mse", "codebook_usage", "perplexity", "reencode_agreement", "train_seconds"):
        assert k in met1 and np.isfinite(met1[k])
    assert met1["heldout_mae"] == met2["heldout_mae"]
    assert 0 < met1["codebook_usage"] <= 1 and 1 <= met1["perplexity"] <= TINY.codebook_size
    m3, _ = train_vq(cfg, **{**kw, "seed": 8})
    assert not torch.equal(m3.embedding.weight, m1.embedding.weight)


def test_dead_code_restart_only_touches_dead_codes():
    from coolsd.toy.vq import _restart_dead_codes

    torch.manual_seed(0)
    m = ToyVQ(TINY)
    before = m.embedding.weight.detach().clone()
    counts = torch.ones(TINY.codebook_size, dtype=torch.long)
    counts[[3, 7]] = 0
    z = torch.nn.functional.normalize(torch.randn(2, 8, 8, TINY.codebook_dim), dim=-1)
    n = _restart_dead_codes(m, counts, z, torch.Generator().manual_seed(0))
    after = m.embedding.weight.detach()
    assert n == 2
    changed = (after != before).any(1).nonzero().flatten().tolist()
    assert changed == [3, 7]
    torch.testing.assert_close(after[[3, 7]].norm(dim=1), torch.ones(2))
    # the new codes sit near (noisy copies of) encoder outputs
    assert torch.cdist(after[[3, 7]], z.reshape(-1, TINY.codebook_dim)).amin(1).max() < 0.1
