"""CLIP score (LANTERN protocol): preprocessing, the prefix splice, cosine scores, and
``ClipScorer`` on a tiny random CLIPModel + a tiny BPE tokenizer written to tmp_path (offline)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from coolsd.metrics.clip_score import (
    CLIP_HF_REPO,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ClipScorer,
    clip_image_preprocess,
    clip_score_summary,
    clip_scores_from_embeddings,
    splice_prefix,
    tensor2pil_roundtrip,
)
from coolsd.metrics.image_prep import lantern_transform
from tiny_models import write_tiny_clip

CAPTIONS = ["a red cat sits on the mat.", "the dog", "a cat, a dog, a mat", "red", "the dog sits on a red mat"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def scorer(clip_dir):
    return ClipScorer.from_pretrained(clip_dir, batch_size=3)


@pytest.fixture(scope="module")
def images():
    r = np.random.default_rng(0)
    base = r.integers(0, 256, size=(len(CAPTIONS), 6, 5, 3))  # blocky content, upsampled to 48x40
    imgs = np.repeat(np.repeat(base, 8, axis=1), 8, axis=2) + r.integers(-20, 21, size=(len(CAPTIONS), 48, 40, 3))
    return np.clip(imgs, 0, 255).astype(np.uint8)


def _torch_normalise(arr_uint8_hwc):
    """torchvision ToTensor + Normalize(OpenAI mean/std), with torch ops."""
    x = torch.from_numpy(np.array(arr_uint8_hwc)).permute(2, 0, 1).float().div(255)
    mean = torch.tensor(OPENAI_CLIP_MEAN, dtype=torch.float32)[:, None, None]
    std = torch.tensor(OPENAI_CLIP_STD, dtype=torch.float32)[:, None, None]
    return x.sub(mean).div(std).numpy()


# ---- image preprocessing ------------------------------------------------------------------
def test_tensor2pil_roundtrip_matches_torch_and_shifts_1_to_63():
    v = np.arange(256, dtype=np.uint8)
    x = torch.from_numpy(v).float().div(255)  # ToTensor
    x = (x - 0.5) / 0.5  # Normalize(0.5, 0.5)
    ref = ((x + 1.0) * 127.5).clamp(0.0, 255.0).to(torch.uint8).numpy()  # tensor2pil
    out = tensor2pil_roundtrip(v)
    np.testing.assert_array_equal(out, ref)
    shifted = np.flatnonzero(out != v)
    np.testing.assert_array_equal(shifted, np.arange(1, 64))
    np.testing.assert_array_equal(out[1:64], v[1:64] - 1)
    with pytest.raises(ValueError):
        tensor2pil_roundtrip(v.astype(np.float32))


def test_clip_preprocess_equals_direct_formula_with_half_even_crop():
    r = np.random.default_rng(1)
    img = r.integers(0, 256, size=(52, 40, 3), dtype=np.uint8)  # (H, W): short side 40 -> 32, long int(32*52/40)=41
    out = clip_image_preprocess(img, size=32, lantern_roundtrip=False)
    assert out.dtype == np.float32 and out.shape == (3, 32, 32)
    lo = (0 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    hi = (1 - np.array(OPENAI_CLIP_MEAN)) / np.array(OPENAI_CLIP_STD)
    assert np.all(out.min(axis=(1, 2)) >= lo - 1e-6) and np.all(out.max(axis=(1, 2)) <= hi + 1e-6)
    resized = np.asarray(Image.fromarray(img).resize((32, 41), Image.Resampling.BICUBIC))
    top = 4  # round((41 - 32) / 2) = round(4.5) = 4 (half to even; floor(x + 0.5) would give 5)
    np.testing.assert_array_equal(out, _torch_normalise(resized[top:top + 32]))
    # no resize needed (short side == size): only the crop, (39 - 32) / 2 = 3.5 -> 4 (HF's floor gives 3)
    img2 = r.integers(0, 256, size=(32, 39, 3), dtype=np.uint8)
    np.testing.assert_array_equal(clip_image_preprocess(img2, 32, lantern_roundtrip=False),
                                  _torch_normalise(img2[:, 4:36]))
    # square 256 -> 224: a plain bicubic resize
    img3 = r.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    ref3 = _torch_normalise(np.asarray(Image.fromarray(img3).resize((224, 224), Image.Resampling.BICUBIC)))
    np.testing.assert_array_equal(clip_image_preprocess(img3, lantern_roundtrip=False), ref3)
    for bad in (img.astype(np.float32), img[..., :2], img[0]):
        with pytest.raises(ValueError):
            clip_image_preprocess(bad, 32)


def test_clip_preprocess_lantern_prestep():
    r = np.random.default_rng(2)
    img = r.integers(0, 256, size=(40, 61, 3), dtype=np.uint8)  # (H, W) = (40, 61): crop left round(10.5) = 10
    out = clip_image_preprocess(img, size=32)  # lantern_roundtrip=True is the default
    crop = Image.fromarray(img[:, 10:50]).resize((256, 256), Image.Resampling.LANCZOS)
    pre = tensor2pil_roundtrip(np.asarray(crop))
    np.testing.assert_array_equal(lantern_transform(img), np.asarray(crop))
    ref = _torch_normalise(np.asarray(Image.fromarray(pre).resize((32, 32), Image.Resampling.BICUBIC)))
    np.testing.assert_array_equal(out, ref)
    assert not np.array_equal(out, clip_image_preprocess(img, size=32, lantern_roundtrip=False))


def test_clip_preprocess_matches_hf_pil_processor_when_crop_offsets_agree():
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    proc = cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    r = np.random.default_rng(3)
    img = r.integers(0, 256, size=(45, 36, 3), dtype=np.uint8)  # -> 32 x 40: excess 8, offsets agree
    hf = np.asarray(proc(images=[img], return_tensors="np")["pixel_values"][0])
    np.testing.assert_allclose(clip_image_preprocess(img, 32, lantern_roundtrip=False), hf, atol=1e-6, rtol=0)


# ---- the prefix splice ----------------------------------------------------------------------
SOT, EOT = 49406, 49407


def test_splice_prefix_short_caption():
    assert splice_prefix([SOT, 320, 1929, EOT], [320, 1125, 42748], SOT, EOT) == [SOT, 320, 1125, 42748, 320, 1929, EOT]
    assert splice_prefix([SOT, EOT], [7, 8, 9], SOT, EOT) == [SOT, 7, 8, 9, EOT]
    assert splice_prefix([SOT, 5, EOT], [], SOT, EOT) == [SOT, 5, EOT]
    with pytest.raises(ValueError):
        splice_prefix([5, EOT], [7, 8, 9], SOT, EOT)


def test_splice_prefix_truncation_forces_eot_at_76():
    prefix = [7, 8, 9]
    fits = [SOT] + list(range(100, 172)) + [EOT]  # 74 tokens -> exactly 77, ends in its own EOT
    out = splice_prefix(fits, prefix, SOT, EOT)
    assert len(out) == 77 and out == [SOT] + prefix + fits[1:]
    long_ids = [SOT] + list(range(100, 200)) + [EOT]  # 102 tokens, not pre-truncated
    out = splice_prefix(long_ids, prefix, SOT, EOT)
    assert len(out) == 77 and out[76] == EOT
    assert out[:76] == [SOT] + prefix + list(range(100, 172))
    pre_cut = long_ids[:76] + [EOT]  # what clip.tokenize(truncate=True) hands over
    assert splice_prefix(pre_cut, prefix, SOT, EOT) == out
    # LANTERN's `last_cols[last_cols > 0] = EOT`: a token id 0 at position 76 stays (literal quirk)
    zero_at_76 = [SOT] + list(range(100, 172)) + [0, 5, EOT]
    assert splice_prefix(zero_at_76, prefix, SOT, EOT)[76] == 0
    assert splice_prefix([SOT, 1, 2, 3, EOT], prefix, SOT, EOT, max_len=6) == [SOT, 7, 8, 9, 1, EOT]


def test_tokenize_splices_the_literal_three_token_prefix(scorer):
    tok = scorer.tokenizer
    ids = lambda s: tok(s)["input_ids"]  # noqa: E731
    assert scorer.prefix_ids == ids("A photo depicts ")[1:4] == tok.convert_tokens_to_ids(["a</w>", "photo</w>", "depicts</w>"])
    rows = scorer.tokenize(["a red cat sits on the mat.", "cat " * 100])
    assert rows.shape == (2, 77) and rows.dtype == torch.long
    short = [scorer.sot] + scorer.prefix_ids + ids("a red cat sits on the mat.")[1:]
    assert rows[0, :len(short)].tolist() == short and not rows[0, len(short):].any()
    cat = tok.convert_tokens_to_ids("cat</w>")
    assert rows[1, :4].tolist() == [scorer.sot] + scorer.prefix_ids
    assert rows[1, 4:76].tolist() == [cat] * 72 and rows[1, 76].item() == scorer.eot
    no_prefix = ClipScorer(scorer.model, tok, prefix=None)
    assert no_prefix.tokenize(["the dog"])[0, :4].tolist() == ids("the dog")


# ---- scores -------------------------------------------------------------------------------
def test_clip_scores_from_embeddings_against_numpy_and_torch():
    r = np.random.default_rng(4)
    a, b = r.normal(size=(7, 16)), r.normal(size=(7, 16)) * 3
    ref = np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    np.testing.assert_allclose(clip_scores_from_embeddings(a, b), ref, rtol=1e-12, atol=1e-15)
    ta, tb = torch.from_numpy(a).float(), torch.from_numpy(b).float()
    np.testing.assert_allclose(clip_scores_from_embeddings(ta, tb), F.cosine_similarity(ta, tb, dim=1).numpy(), atol=1e-6)
    np.testing.assert_allclose(clip_scores_from_embeddings(a, a), 1.0, rtol=1e-12)
    np.testing.assert_allclose(clip_scores_from_embeddings(a, -a), -1.0, rtol=1e-12)  # raw: no clipping at 0
    a[0] = 0
    assert clip_scores_from_embeddings(a, b)[0] == 0.0
    with pytest.raises(ValueError):
        clip_scores_from_embeddings(a, b[:3])
    s = clip_score_summary(ref)
    assert s["mean"] == pytest.approx(ref.mean()) and s["n"] == 7 and s["lo"] < s["mean"] < s["hi"]


def test_scores_equal_model_cosine_computed_directly(scorer, images):
    model = scorer.model
    px = torch.from_numpy(np.stack([clip_image_preprocess(im, 32) for im in images]))
    tokens = scorer.tokenize(CAPTIONS)
    with torch.no_grad():
        img_e = model.visual_projection(model.vision_model(pixel_values=px).pooler_output)
        txt_e = model.text_projection(model.text_model(input_ids=tokens).pooler_output)
        out = model(input_ids=tokens, pixel_values=px)
    ref = F.cosine_similarity(img_e, txt_e, dim=1).numpy()
    got = scorer.score(images, CAPTIONS)
    assert got.shape == (len(CAPTIONS),) and got.dtype == np.float64
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got, (out.image_embeds * out.text_embeds).sum(1).numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(scorer.embed_images(images), img_e.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(scorer.embed_texts(CAPTIONS), txt_e.numpy(), atol=1e-6, rtol=0)
    assert not scorer.model.training
    # pooling sits on the EOT: trailing padding does not change the text embedding
    with torch.no_grad():
        short = model.text_projection(model.text_model(input_ids=tokens[:, :20]).pooler_output)
    np.testing.assert_allclose(short.numpy(), txt_e.numpy(), atol=1e-5, rtol=0)


def test_batch_size_independence_and_determinism(scorer, images):
    full = scorer.score(images, CAPTIONS, batch_size=len(CAPTIONS))
    one = scorer.score(images, CAPTIONS, batch_size=1)
    np.testing.assert_allclose(one, full, atol=1e-5, rtol=0)
    np.testing.assert_allclose(scorer.score(images, CAPTIONS), full, atol=1e-5, rtol=0)  # batch_size=3: 3 + 2
    np.testing.assert_array_equal(scorer.score(images, CAPTIONS, batch_size=1), one)
    # a list of HWC arrays (sizes may differ) and a torch tensor are accepted too
    np.testing.assert_array_equal(scorer.score(list(images), CAPTIONS, batch_size=1), one)
    np.testing.assert_array_equal(scorer.score(torch.from_numpy(images), CAPTIONS, batch_size=1), one)


def test_score_is_the_diagonal_of_the_cosine_matrix(scorer, images):
    ie, te = scorer.embed_images(images), scorer.embed_texts(CAPTIONS)
    assert ie.shape == te.shape == (len(CAPTIONS), 16) and ie.dtype == np.float32
    ie64, te64 = ie.astype(np.float64), te.astype(np.float64)
    m = (ie64 / np.linalg.norm(ie64, axis=1, keepdims=True)) @ (te64 / np.linalg.norm(te64, axis=1, keepdims=True)).T
    np.testing.assert_allclose(scorer.score(images, CAPTIONS), np.diag(m), atol=1e-6, rtol=0)
    perm = [2, 0, 4, 1, 3]
    np.testing.assert_allclose(scorer.score(images, [CAPTIONS[j] for j in perm]), m[np.arange(5), perm], atol=1e-6, rtol=0)
    assert np.ptp(m) > 1e-3  # the random model does separate pairs
    assert scorer.score(np.zeros((0, 8, 8, 3), np.uint8), []).shape == (0,)
    assert scorer.embed_texts([]).shape == (0, 16)
    with pytest.raises(ValueError):
        scorer.score(images, CAPTIONS[:3])
    with pytest.raises(ValueError):
        scorer.embed_images(images.astype(np.float32))


def test_missing_folder_or_files_give_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        ClipScorer.from_pretrained(tmp_path / "no_such_clip")
    msg = str(e.value)
    assert "no_such_clip" in msg and CLIP_HF_REPO in msg
    for f in ("config.json", "model.safetensors", "pytorch_model.bin", "vocab.json", "merges.txt"):
        assert f in msg
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"lacks model\.safetensors or pytorch_model\.bin, vocab\.json, merges\.txt"):
        ClipScorer.from_pretrained(partial)


def test_hf_cache_layout_resolves_to_the_snapshot(clip_dir, tmp_path):
    cache = tmp_path / "models--openai--clip-vit-base-patch32"
    (cache / "refs").mkdir(parents=True)
    (cache / "snapshots").mkdir()
    (cache / "snapshots" / "abc123").symlink_to(clip_dir, target_is_directory=True)
    (cache / "refs" / "main").write_text("abc123")
    s = ClipScorer.from_pretrained(cache)
    assert s.source.endswith("abc123") and s.embed_dim == 16 and s.image_size == 32
