"""MAR's KL-16 VAE (coolsd.models.kl16_vae): shapes, strict loading, token layout, key names."""
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from coolsd.models.kl16_vae import (SCALE, KLVAE, KLVAEConfig, decode_tokens, encode_tokens, load_kl16,
                                    tokens_from_latents)

# resolution=16 puts the encoder's attention (attn_resolutions=(16,)) on level 0, so it is exercised
TINY = KLVAEConfig(embed_dim=4, z_channels=4, ch=32, ch_mult=(1, 2), num_res_blocks=1, resolution=16)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    vae = KLVAE(TINY).eval()
    with torch.no_grad():  # perturb the GroupNorm affines too, so that a wrong load shows up
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return vae


def test_shapes(tiny):
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    with torch.no_grad():
        mean, logvar = tiny.encode(x)
        assert mean.shape == logvar.shape == (2, 4, 8, 8)  # 16 / 2**(len(ch_mult)-1)
        assert logvar.min() >= -30 and logvar.max() <= 20
        assert tiny.decode(mean).shape == (2, 3, 16, 16)


def _outputs(vae):
    torch.manual_seed(1)
    x, z = torch.rand(1, 3, 16, 16) * 2 - 1, torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        return (*vae.encode(x), vae.decode(z))


def test_load_torch_container_with_loss_keys(tiny, tmp_path):
    sd = dict(tiny.state_dict())
    path = tmp_path / "kl16.ckpt"
    # upstream init_from_ckpt reads ckpt["model"]; LDM-style loss.* entries are dropped
    torch.save({"model": {**sd, "loss.logvar": torch.zeros(())}, "epoch": 3}, path)
    loaded = load_kl16(path, TINY)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    for a, b in zip(_outputs(tiny), _outputs(loaded)):
        assert torch.equal(a, b)


def test_load_safetensors(tiny, tmp_path):
    path = tmp_path / "kl16.safetensors"
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, str(path))
    for a, b in zip(_outputs(tiny), _outputs(load_kl16(path, TINY))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("change", ["missing", "extra", "shape"])
def test_strict_errors_name_the_key(tiny, tmp_path, change):
    sd = dict(tiny.state_dict())
    key = "decoder.mid.attn_1.q.weight"
    if change == "missing":
        del sd[key]
    elif change == "extra":
        key = "decoder.up.0.attn.0.q.weight"
        sd[key] = torch.zeros(32, 32, 1, 1)
    else:
        sd[key] = torch.zeros(1, 1, 1, 1)
    path = tmp_path / "bad.ckpt"
    torch.save({"model": sd}, path)
    with pytest.raises(ValueError) as err:
        load_kl16(path, TINY)
    msg = str(err.value)
    assert key in msg and str(path) in msg and "kl16.ckpt" in msg
    assert {"missing": "missing keys:", "extra": "unexpected keys:", "shape": "wrong shapes:"}[change] in msg


def test_missing_file(tmp_path):
    path = tmp_path / "nowhere" / "kl16.ckpt"
    with pytest.raises(FileNotFoundError, match="nowhere") as err:
        load_kl16(path, TINY)
    assert "pretrained_models/vae/kl16.ckpt" in str(err.value)


def test_not_a_state_dict(tmp_path):
    path = tmp_path / "junk.ckpt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.ckpt"):
        load_kl16(path, TINY)


def test_tokens_from_latents_is_raster_order():
    lat = torch.randn(2, 5, 3, 4)
    tok = tokens_from_latents(lat)
    assert tok.shape == (2, 12, 5)
    for i in range(3):
        for j in range(4):
            assert torch.equal(tok[:, i * 4 + j], lat[:, :, i, j])


def test_token_round_trip(tiny):
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    tok = encode_tokens(tiny, x, sample=False)
    assert tok.shape == (2, 64, 4)
    with torch.no_grad():
        mean, _ = tiny.encode(x)
        ref = (tiny.decode(mean).clamp(-1, 1) + 1) / 2 * 255
    assert torch.allclose(tok, tokens_from_latents(mean) * SCALE)
    img = decode_tokens(tiny, tok, 8, 8)
    assert img.shape == (2, 16, 16, 3) and img.dtype == np.uint8
    assert np.abs(img.astype(np.float32) - ref.permute(0, 2, 3, 1).numpy()).max() <= 0.5 + 1e-3
    sampled = encode_tokens(tiny, x, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == tok.shape and not torch.equal(sampled, tok)
    with pytest.raises(ValueError):
        decode_tokens(tiny, tok, 4, 8)


# Upstream names and shapes for AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4)), derived by hand
# from LTH14/mar models/vae.py (ch=128, num_res_blocks=2, encoder attn at 16 px, double_z).
UPSTREAM_KEYS = {
    "encoder.conv_in.weight": (128, 3, 3, 3),
    "encoder.down.0.block.1.norm1.weight": (128,),
    "encoder.down.1.downsample.conv.weight": (128, 128, 3, 3),
    "encoder.down.2.block.0.nin_shortcut.weight": (256, 128, 1, 1),
    "encoder.down.4.block.0.nin_shortcut.weight": (512, 256, 1, 1),
    "encoder.down.4.attn.1.q.weight": (512, 512, 1, 1),
    "encoder.mid.attn_1.proj_out.weight": (512, 512, 1, 1),
    "encoder.conv_out.weight": (32, 512, 3, 3),
    "quant_conv.weight": (32, 32, 1, 1),
    "post_quant_conv.weight": (16, 16, 1, 1),
    "decoder.conv_in.weight": (512, 16, 3, 3),
    "decoder.mid.attn_1.q.weight": (512, 512, 1, 1),
    "decoder.up.4.block.2.conv1.weight": (512, 512, 3, 3),
    "decoder.up.4.upsample.conv.weight": (512, 512, 3, 3),
    "decoder.up.3.block.0.nin_shortcut.weight": (256, 512, 1, 1),
    "decoder.up.1.block.0.nin_shortcut.weight": (128, 256, 1, 1),
    "decoder.up.0.block.2.conv2.weight": (128, 128, 3, 3),
    "decoder.norm_out.weight": (128,),
    "decoder.conv_out.weight": (3, 128, 3, 3),
}


def test_full_config_upstream_key_names():
    with torch.device("meta"):
        sd = KLVAE(KLVAEConfig()).state_dict()
    for k, shape in UPSTREAM_KEYS.items():
        assert tuple(sd[k].shape) == shape, k
    assert not any("temb_proj" in k or k.startswith("decoder.up.") and ".attn." in k for k in sd)
    assert not any(k.startswith(("encoder.down.4.downsample", "decoder.up.0.upsample")) for k in sd)
    assert not any(k.startswith("encoder.down.") and ".attn." in k and not k.startswith("encoder.down.4.")
                   for k in sd)
    # 312 tensors, 66,456,019 values: 253.5 MiB in fp32, the size util/download.py expects (254 MB)
    assert len(sd) == 312 and sum(v.numel() for v in sd.values()) == 66_456_019
