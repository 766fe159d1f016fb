"""FID Inception-v3 (coolsd.metrics.inception) and its clean-fid preprocessing
(coolsd.metrics.image_prep), on seeded RANDOM weights: the real weight file is user-supplied
and never needed here. Layout checks pin the module tree to the official file's key/shape list
(weights-inception-2015-12-05-6726825d.pth); numerical agreement with the real weights is
not tested here."""
import hashlib
import os
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

from coolsd.metrics import FeatureExtractor
from coolsd.metrics.fid import fid_from_features
from coolsd.metrics.image_prep import (
    center_crop_offsets,
    center_crop_square,
    clean_resize_299,
    fid_preprocess,
    lantern_transform,
    load_rgb,
)
from coolsd.metrics.inception import (
    WEIGHTS_NAME,
    WEIGHTS_URL,
    BasicConv2d,
    InceptionFeatureExtractor,
    InceptionV3,
    expected_state_shapes,
    load_inception,
)
from tiny_models import random_inception

# sha256 of the sorted lines "<key> <shape>\n" (shape as "(32,3,3,3)" / "(32,)") over the 472 keys
# of torch-fidelity's weights-inception-2015-12-05-6726825d.pth (research notes)
MANIFEST_SHA256 = "044d1c99a02fb12c6e2fa4f727f5c4323e6ecdd65c0329c261869717280e006b"
IMAGE_SIZES = [(300, 400), (256, 256), (427, 640)]  # (H, W): landscape, already 256, portrait


@pytest.fixture(scope="module")
def model():
    return random_inception(0)


@pytest.fixture(scope="module")
def images():
    r = np.random.default_rng(0)
    return [r.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]


@pytest.fixture(scope="module")
def features(model, images):
    """(n, 2048) features, one image per network call (block=1), one image per batch."""
    return InceptionFeatureExtractor(model, batch_size=1, block=1)(images)


def _manifest_lines(state) -> list[str]:
    def shape(t):
        dims = tuple(t.shape)
        return "(" + ",".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
    return sorted(f"{k} {shape(v)}" for k, v in state.items() if not k.endswith("num_batches_tracked"))


def _cheap_state(shapes=None, dtype=torch.float32):
    """A state dict of the right shapes whose tensors are expanded scalars (the file is ~150 kB,
    not 95 MB); value i for the i-th key, so a load can be checked key by key."""
    shapes = expected_state_shapes() if shapes is None else shapes
    return {k: torch.full((), float(i), dtype=dtype).expand(s) for i, (k, s) in enumerate(shapes.items())}


# ---- layout: the official file loads strictly ---------------------------------------------------------
def test_state_dict_manifest_matches_the_official_weight_file(model):
    state = model.state_dict()
    lines = _manifest_lines(state)
    assert len(lines) == 472
    assert hashlib.sha256(("\n".join(lines) + "\n").encode()).hexdigest() == MANIFEST_SHA256
    assert sum(v.numel() for k, v in state.items() if not k.endswith("num_batches_tracked")) == 23_885_392
    assert expected_state_shapes() == {k: tuple(v.shape) for k, v in state.items() if not k.endswith("num_batches_tracked")}
    assert state["fc.weight"].shape == (1008, 2048) and state["Mixed_7c.branch_pool.conv.weight"].shape == (192, 2048, 1, 1)
    convs = [m for m in model.modules() if isinstance(m, BasicConv2d)]
    assert len(convs) == 94
    assert all(c.conv.bias is None and c.bn.eps == 1e-3 for c in convs)


def test_strict_load_of_a_plain_dict_without_num_batches_tracked(tmp_path, model):
    # the official file: a plain dict saved with torch.save, no num_batches_tracked, no _metadata
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    plain = tmp_path / "plain.pth"
    torch.save(state, plain)
    digest = hashlib.sha256(plain.read_bytes()).hexdigest()
    named = tmp_path / f"weights-inception-2015-12-05-{digest[:8]}.pth"  # torch.hub hash-suffix name
    os.replace(plain, named)
    loaded = load_inception(named)
    assert isinstance(loaded, InceptionV3) and not loaded.training
    assert not any(p.requires_grad for p in loaded.parameters())
    got = loaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert all(int(v) == 0 for k, v in got.items() if k.endswith("num_batches_tracked"))
    # a file name claiming another hash: refused, unless the check is off
    wrong = tmp_path / "weights-inception-2015-12-05-00000000.pth"
    os.replace(named, wrong)
    with pytest.raises(ValueError, match="00000000.pth.*SHA-256.*does not start with 00000000"):
        load_inception(wrong)
    assert torch.equal(load_inception(wrong, check_hash=False).fc.weight, state["fc.weight"])


def test_state_dict_with_metadata_and_num_batches_tracked_also_loads(tmp_path):
    shapes = expected_state_shapes()
    state = OrderedDict(_cheap_state(shapes))
    state._metadata = {"": {"version": 1}, "Conv2d_1a_3x3.bn": {"version": 2}}  # as module.state_dict() makes
    p = tmp_path / "no_nbt_with_metadata.pth"
    torch.save(state, p)
    m = load_inception(p)
    keys = list(shapes)
    for i in (0, 5, len(keys) - 1):
        assert torch.all(m.state_dict()[keys[i]] == float(i))
    with_nbt = {**_cheap_state(shapes), "Mixed_5b.branch1x1.bn.num_batches_tracked": torch.tensor(7)}
    torch.save(with_nbt, p)
    assert int(load_inception(p).Mixed_5b.branch1x1.bn.num_batches_tracked) == 7


def test_missing_weight_file_error_names_file_and_download(tmp_path):
    missing = tmp_path / "nowhere" / "inception.pth"
    with pytest.raises(FileNotFoundError) as e:
        load_inception(missing)
    msg = str(e.value)
    assert str(missing) in msg and WEIGHTS_NAME in msg and WEIGHTS_URL in msg
    assert WEIGHTS_URL.endswith("/" + WEIGHTS_NAME) and WEIGHTS_URL.startswith("https://github.com/toshas/torch-fidelity/")


def test_wrong_weight_files_are_refused(tmp_path):
    shapes = expected_state_shapes()
    good = _cheap_state(shapes)

    def check(name, obj, *patterns):
        p = tmp_path / name
        if isinstance(obj, bytes):
            p.write_bytes(obj)
        else:
            torch.save(obj, p)
        with pytest.raises(ValueError) as e:
            load_inception(p)
        msg = " ".join(str(e.value).split())
        assert name in msg and WEIGHTS_URL in msg
        for pat in patterns:
            assert pat in msg, (pat, msg)

    check("missing.pth", {k: v for k, v in good.items() if k != "Mixed_6c.branch7x7_2.conv.weight"},
          "missing keys: Mixed_6c.branch7x7_2.conv.weight")
    check("extra.pth", {**good, "AuxLogits.fc.weight": torch.zeros(1000, 768)}, "unexpected keys: AuxLogits.fc.weight")
    bad_shape = dict(good, **{"Mixed_5b.branch_pool.conv.weight": torch.zeros(64, 192, 1, 1)})
    check("shape.pth", bad_shape, "mismatched: Mixed_5b.branch_pool.conv.weight (64, 192, 1, 1)", "expected (32, 192, 1, 1)")
    check("int.pth", dict(good, **{"fc.bias": torch.zeros(1008, dtype=torch.int64)}), "mismatched: fc.bias")
    # another model's checkpoint (torchvision-style keys, a toy network): an error, not a partial load
    foreign = {"conv1.weight": torch.zeros(8, 3, 3, 3), "fc.weight": torch.zeros(1000, 2048), "fc.bias": torch.zeros(1000)}
    check("foreign.pth", foreign, "missing keys: Conv2d_1a_3x3.bn.bias", "(470 in all)", "unexpected keys: conv1.weight",
          "mismatched: fc.bias (1000,)")
    check("wrapped.pth", {"state_dict": good}, "does not hold a state dict")
    check("tensor.pth", torch.zeros(3), "does not hold a state dict")
    check("garbage.pth", b"\x00not a torch file" * 20, "not a readable PyTorch weight file")


# ---- architecture ----------------------------------------------------------------------------------------
def test_stage_shapes_and_forward(model):
    x = torch.rand(1, 3, 299, 299, generator=torch.Generator().manual_seed(1)) * 255
    with torch.inference_mode():
        stages = model.forward_stages(x)
        pool3 = model(x)
    want = {"Conv2d_1a_3x3": (32, 149), "Conv2d_2a_3x3": (32, 147), "Conv2d_2b_3x3": (64, 147), "MaxPool_1": (64, 73),
            "Conv2d_3b_1x1": (80, 73), "Conv2d_4a_3x3": (192, 71), "MaxPool_2": (192, 35), "Mixed_5b": (256, 35),
            "Mixed_5c": (288, 35), "Mixed_5d": (288, 35), "Mixed_6a": (768, 17), "Mixed_6b": (768, 17),
            "Mixed_6c": (768, 17), "Mixed_6d": (768, 17), "Mixed_6e": (768, 17), "Mixed_7a": (1280, 8),
            "Mixed_7b": (2048, 8), "Mixed_7c": (2048, 8)}
    assert list(stages) == [*want, "pool3"]
    for k, (c, s) in want.items():
        assert tuple(stages[k].shape) == (1, c, s, s), k
    assert pool3.shape == (1, 2048) and pool3.dtype == torch.float32
    assert torch.equal(pool3, stages["pool3"])
    assert torch.allclose(pool3, stages["Mixed_7c"].mean((2, 3)), atol=1e-6)
    assert pool3.min() >= 0 and pool3.std() > 0.1  # post-ReLU average; the random init keeps a signal
    assert model.logits(pool3).shape == (1, 1008)
    # normalisation (x - 128) / 128 happens inside: the first conv sees it
    conv = model.Conv2d_1a_3x3
    assert torch.allclose(stages["Conv2d_1a_3x3"], conv((x - 128) / 128), atol=1e-5)
    assert torch.equal(InceptionV3.normalize(torch.tensor([0.0, 128.0, 255.0])), torch.tensor([-1.0, 0.0, 127 / 128]))
    with pytest.raises(ValueError, match="299"):
        model(torch.zeros(1, 3, 256, 256))
    with pytest.raises(ValueError, match="floating"):
        model(torch.zeros(1, 3, 299, 299, dtype=torch.uint8))


def test_basic_conv2d_eval_formula():
    torch.manual_seed(0)
    b = BasicConv2d(4, 6, (1, 3), padding=(0, 1)).eval()
    with torch.no_grad():
        b.bn.weight.uniform_(0.5, 2)
        b.bn.bias.uniform_(-1, 1)
        b.bn.running_mean.uniform_(-1, 1)
        b.bn.running_var.uniform_(1e-4, 1e-2)  # small variances: eps 1e-3 visibly matters
    x = torch.randn(2, 4, 5, 7)
    z = F.conv2d(x, b.conv.weight, padding=(0, 1))
    s = (b.bn.running_var + 1e-3).rsqrt()[:, None, None]
    ref = torch.relu((z - b.bn.running_mean[:, None, None]) * s * b.bn.weight[:, None, None] + b.bn.bias[:, None, None])
    with torch.no_grad():
        y = b(x)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    s5 = (b.bn.running_var + 1e-5).rsqrt()[:, None, None]
    wrong_eps = torch.relu((z - b.bn.running_mean[:, None, None]) * s5 * b.bn.weight[:, None, None] + b.bn.bias[:, None, None])
    assert not torch.allclose(y, wrong_eps, atol=1e-3)
    assert b.conv.bias is None and b.bn.eps == 1e-3


def _pool_branch(block, x):
    """The pool branch's output channels (the last ones of every Inception block)."""
    with torch.no_grad():
        return block(x)[:, -block.branch_pool.conv.out_channels:]


def test_average_pools_exclude_padding_and_mixed_7c_pool_is_max(model):
    g = torch.Generator().manual_seed(2)
    for name, (c, s) in {"Mixed_5b": (192, 35), "Mixed_6b": (768, 17), "Mixed_7b": (1280, 8), "Mixed_7c": (2048, 8)}.items():
        block = getattr(model, name)
        x = torch.rand(1, c, s, s, generator=g)
        got = _pool_branch(block, x)
        avg_tf = F.avg_pool2d(x, 3, 1, 1, count_include_pad=False)
        avg_pad = F.avg_pool2d(x, 3, 1, 1, count_include_pad=True)
        with torch.no_grad():
            if name == "Mixed_7c":  # the TF graph's quirk: a max pool before the last pool branch
                assert isinstance(block.pool, nn.MaxPool2d)
                assert torch.allclose(got, block.branch_pool(F.max_pool2d(x, 3, 1, 1)), atol=1e-5)
                assert not torch.allclose(got, block.branch_pool(avg_tf), atol=1e-2)
            else:
                assert isinstance(block.pool, nn.AvgPool2d) and block.pool.count_include_pad is False
                assert torch.allclose(got, block.branch_pool(avg_tf), atol=1e-5), name
                assert not torch.allclose(got, block.branch_pool(avg_pad), atol=1e-2), name
                # constant input: padding excluded -> the border average equals the centre's
                const = _pool_branch(block, torch.full((1, c, s, s), 0.7))
                assert torch.allclose(const, const[:, :, s // 2:s // 2 + 1, s // 2:s // 2 + 1].expand_as(const), atol=1e-5)


# ---- the feature extractor -------------------------------------------------------------------------------
def test_extractor_is_batch_size_independent_and_deterministic(model, images, features):
    ext = InceptionFeatureExtractor(model, block=1)
    assert isinstance(ext, FeatureExtractor) and ext.feature_dim == 2048 and ext.name == "inception_v3_pool3"
    assert features.shape == (3, 2048) and features.dtype == np.float64
    assert np.array_equal(features, features.astype(np.float32))  # float32 network values
    assert np.all(features >= 0) and features.std(0).mean() > 0.1
    assert np.array_equal(ext(images, batch_size=2), features)
    assert np.array_equal(ext(images[1:2]), features[1:2])  # position in the input does not matter
    batched = InceptionFeatureExtractor(model, block=3)(images)  # one network call on all three
    np.testing.assert_allclose(batched, features, atol=1e-5, rtol=0)
    assert not np.allclose(features[0], features[1], atol=1e-3)  # different images, different features
    # inputs: a stacked uint8 array, tensors, PIL images and a list give the same prepared pixels
    same = [images[1], images[1]]
    prepared = ext.prepare(same)
    assert prepared.shape == (2, 3, 299, 299) and prepared.dtype == torch.float32
    assert torch.equal(ext.prepare(np.stack(same)), prepared)
    assert torch.equal(ext.prepare(torch.from_numpy(np.stack(same))), prepared)
    assert torch.equal(ext.prepare([Image.fromarray(a) for a in same]), prepared)
    assert torch.equal(prepared[0], torch.from_numpy(fid_preprocess(images[1])))
    assert ext(images[:0]).shape == (0, 2048)


def test_fid_of_a_feature_set_with_itself_is_zero(model, images, features):
    again = InceptionFeatureExtractor(model, batch_size=3, block=1)(images[::-1])[::-1]
    assert np.array_equal(again, features)
    # 3 images give a rank-2 covariance: FID over the 2 highest-variance units (full-rank there;
    # sqrtm of a 2048-d rank-2 product would be slow and ill-conditioned)
    idx = np.argsort(features.var(0))[-2:]
    assert features[:, idx].var(0).min() > 1e-4
    assert abs(fid_from_features(features[:, idx], again[:, idx])) < 1e-9
    assert fid_from_features(features[:, idx], features[:, idx] + 1.0) == pytest.approx(2.0, rel=1e-9)


def test_extractor_input_validation(model):
    ext = InceptionFeatureExtractor(model, block=1)
    with pytest.raises(ValueError, match="uint8"):
        ext.prepare([np.zeros((32, 32, 3), np.float32)])
    with pytest.raises(ValueError, match="uint8"):
        ext.prepare([np.zeros((32, 32, 4), np.uint8)])
    with pytest.raises(ValueError, match="shape"):
        ext.prepare(np.zeros((32, 32, 3), np.uint8))  # one image, not a batch
    with pytest.raises(ValueError, match="block"):
        InceptionFeatureExtractor(model, block=0)
    assert "lantern" in repr(ext) and ext.block == 1
    assert InceptionFeatureExtractor(model).block == 32


# ---- preprocessing -------------------------------------------------------------------------------------
@pytest.mark.parametrize("wh, left, top", [((500, 375), 62, 0), ((640, 425), 108, 0), ((640, 427), 106, 0),
                                           ((427, 640), 0, 106), ((640, 480), 80, 0), ((300, 300), 0, 0),
                                           ((301, 300), 0, 0), ((303, 300), 2, 0)])
def test_center_crop_rounds_half_to_even(wh, left, top):
    w, h = wh
    s = min(w, h)
    assert center_crop_offsets(w, h) == (left, top, s)
    yy, xx = np.mgrid[:h, :w]
    arr = np.stack([xx % 256, yy % 256, (xx // 256) * 16 + yy // 256], -1).astype(np.uint8)
    crop = np.asarray(center_crop_square(Image.fromarray(arr)))
    assert crop.shape == (s, s, 3)
    assert np.array_equal(crop, arr[top:top + s, left:left + s])


def test_lantern_transform():
    r = np.random.default_rng(3)
    img = r.integers(0, 256, (427, 640, 3), dtype=np.uint8)
    out = lantern_transform(img)
    assert out.shape == (256, 256, 3) and out.dtype == np.uint8
    ref = np.asarray(Image.fromarray(img[:, 106:106 + 427]).resize((256, 256), Image.Resampling.LANCZOS))
    assert np.array_equal(out, ref)
    assert not np.array_equal(out, np.asarray(Image.fromarray(img[:, 107:107 + 427]).resize((256, 256), Image.Resampling.LANCZOS)))
    sq = r.integers(0, 256, (256, 256, 3), dtype=np.uint8)
    assert np.array_equal(lantern_transform(sq), sq)  # already 256x256: unchanged
    assert np.array_equal(lantern_transform(img), out)  # deterministic
    with pytest.raises(ValueError):
        lantern_transform(img.astype(np.float32))
    with pytest.raises(ValueError):
        lantern_transform(img[:, :, 0])


def _direct_f_resize(ch: np.ndarray) -> np.ndarray:
    """Independent route to a PIL 'F' image: raw little-endian float32 bytes."""
    h, w = ch.shape
    im = Image.frombytes("F", (w, h), np.ascontiguousarray(ch, dtype="<f4").tobytes())
    return np.asarray(im.resize((299, 299), Image.Resampling.BICUBIC), dtype=np.float32)


def test_clean_resize_299_is_per_channel_float_bicubic_clipped():
    r = np.random.default_rng(4)
    img = r.integers(0, 256, (256, 256, 3), dtype=np.uint8)
    out = clean_resize_299(img)
    assert out.shape == (299, 299, 3) and out.dtype == np.float32
    raw = np.stack([_direct_f_resize(img[:, :, c].astype(np.float32)) for c in range(3)], -1)
    assert raw.min() < 0 and raw.max() > 255  # bicubic overshoots on noise ...
    assert np.array_equal(out, raw.clip(0, 255))  # ... and clean-fid clips, without rounding
    assert out.min() == 0 and out.max() == 255 and np.any(out != np.round(out))
    quantised = np.asarray(Image.fromarray(img).resize((299, 299), Image.Resampling.BICUBIC)).astype(np.float32)
    assert np.abs(out - quantised).max() > 1  # not the same as bicubic on the uint8 image
    assert np.array_equal(clean_resize_299(img.astype(np.float64)), out)  # float input: same pixels
    small = r.uniform(0, 255, (40, 70, 3)).astype(np.float32)  # upscaling, non-square
    ref = np.stack([_direct_f_resize(small[:, :, c]) for c in range(3)], -1).clip(0, 255)
    assert np.array_equal(clean_resize_299(small), ref)
    with pytest.raises(ValueError):
        clean_resize_299(img[:, :, :2])


def test_fid_preprocess_composes_crop_lanczos_and_clean_resize(tmp_path):
    r = np.random.default_rng(5)
    img = r.integers(0, 256, (375, 500, 3), dtype=np.uint8)
    x = fid_preprocess(img)
    assert x.shape == (3, 299, 299) and x.dtype == np.float32 and x.flags.c_contiguous
    assert x.min() >= 0 and x.max() <= 255
    assert np.array_equal(x, clean_resize_299(lantern_transform(img)).transpose(2, 0, 1))
    # load_rgb: greyscale files become 3 equal channels (PIL convert("RGB"), as clean-fid reads)
    grey = r.integers(0, 256, (20, 30), dtype=np.uint8)
    Image.fromarray(grey, "L").save(tmp_path / "grey.png")
    rgb = load_rgb(tmp_path / "grey.png")
    assert rgb.shape == (20, 30, 3) and rgb.dtype == np.uint8
    assert all(np.array_equal(rgb[:, :, c], grey) for c in range(3))
