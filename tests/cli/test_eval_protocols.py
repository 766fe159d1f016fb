"""The two evaluation protocols (``python -m coolsd.cli.evaluate --protocol lantern|sjd``):
library-vs-ours agreement on random weights, both presets end to end on a finished run folder with
tiny random metric weights, and their input checks. Nothing is downloaded: every weight file is
built here (a tiny random CLIPModel, a random-weight FID Inception-v3 saved as a state dict)."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from coolsd.cli.evaluate import main
from coolsd.metrics.clip_score import ClipScorer
from coolsd.metrics.clip_torchmetrics import TorchmetricsClipScorer, sjd_clip_image
from coolsd.metrics.fid import feature_statistics, fid_from_features, frechet_distance
from coolsd.metrics.image_prep import clean_resize_299, pytorch_fid_preprocess
from coolsd.metrics.inception import InceptionFeatureExtractor, InceptionV3, load_inception
from coolsd.util.records import RecordWriter
from coolsd.util.errors import ConfigError
from tiny_models import random_inception, write_tiny_clip

CAPTIONS = ["a red cat sits on the mat.", "the dog", "a cat, a dog, a mat"]
ENV = ("CLIP_DIR", "CLIP_B16_DIR", "INCEPTION_WEIGHTS", "PT_INCEPTION_WEIGHTS", "COCO_VAL_IMAGES")


def _processor_config(d, size=32):
    """The preprocessor_config.json a HF CLIP snapshot carries (CLIPProcessor needs it)."""
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return _processor_config(write_tiny_clip(tmp_path_factory.mktemp("tiny_clip")))


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory):
    """Random FID Inception weights in the layout both weight files share (no hash in the name)."""
    p = tmp_path_factory.mktemp("inception") / "inception_random.pth"
    torch.save(random_inception(0).state_dict(), p)
    return p


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # no cached Inception weights
    monkeypatch.setattr(InceptionFeatureExtractor, "block", 4)  # 3 images a set: one network call each


def _run(root, captions=CAPTIONS, methods=("ar",), shape=(40, 48, 3)):
    r = np.random.default_rng(0)
    w = RecordWriter(root)
    for i, c in enumerate(captions):
        for m in methods:
            w.append({"method": m, "prompt_index": i, "caption": c, "seed": i},
                     r.integers(0, 256, shape, dtype=np.uint8), f"{m}/{i:05d}.png")
    return root


def _coco(root, ids=(139, 285, 632)):
    root.mkdir()
    r = np.random.default_rng(1)
    for k, i in enumerate(ids):
        Image.fromarray(r.integers(0, 256, (50 + 10 * k, 64, 3), dtype=np.uint8)).save(root / f"{i:012d}.jpg")
    return root


def _pngs(run, tag="ar", n=len(CAPTIONS)):
    return [np.asarray(Image.open(run / "images" / tag / f"{i:05d}.png").convert("RGB")) for i in range(n)]


# ---- agreement: library vs our hand-written code, same random weights --------------------------------
def test_torchmetrics_clipscore_equals_our_cosine_x100_where_the_preprocessing_agrees(clip_dir):
    """torchmetrics CLIPScore (the sjd scorer, without its 299 resize) against our LANTERN scorer with
    the LANTERN-only steps off (no prefix, no uint8 round trip): on square images (where HF's floor crop
    offsets and OpenAI's rounded ones coincide) and captions under 77 tokens the per-pair scores are
    100 x our cosines to 1e-4 (float32 embeddings); a single batched CLIPScore's compute() is
    max(mean, 0) of them. What remains different between the protocols is their preprocessing and
    scale, not the cosine."""
    from torchmetrics.multimodal import CLIPScore

    tm = TorchmetricsClipScorer.from_pretrained(clip_dir, resize=None)
    ours = ClipScorer.from_pretrained(clip_dir, prefix=None, lantern_roundtrip=False)
    r = np.random.default_rng(0)
    imgs = [r.integers(0, 256, (s, s, 3), dtype=np.uint8) for s in (32, 40, 64, 48)]
    caps = CAPTIONS + ["red"]
    lib, mine = tm.score(imgs, caps), 100 * ours.score(imgs, caps)
    print(f"\ntorchmetrics CLIPScore per pair {np.round(lib, 5).tolist()}\nours x100 {np.round(mine, 5).tolist()}\n"
          f"max |diff| {np.abs(lib - mine).max():.2e}")
    np.testing.assert_allclose(lib, mine, atol=1e-4, rtol=0)
    assert np.ptp(lib) > 1  # the pairs really differ: agreement is not a constant
    batched = CLIPScore(model_name_or_path=lambda: (tm.metric.model, tm.metric.processor))
    batched.update([torch.from_numpy(im).permute(2, 0, 1) for im in imgs], caps)
    assert float(batched.compute()) == pytest.approx(max(lib.mean(), 0), abs=1e-4)
    # the LANTERN protocol's own steps change the number: the comparison above is not vacuous
    lantern = ClipScorer.from_pretrained(clip_dir)
    assert np.abs(100 * lantern.score(imgs, caps) - lib).max() > 1e-2


def test_torchmetrics_fid_equals_our_frechet_distance_on_the_same_features():
    """torchmetrics FrechetInceptionDistance (its statistics and eigvals-based distance, float64) fed
    fixed features through a custom feature module, against ``coolsd.metrics.fid`` (pytorch-fid's
    formula: np.cov statistics, scipy sqrtm): equal to 1e-9 relative."""
    from torchmetrics.image.fid import FrechetInceptionDistance

    class Identity(torch.nn.Module):
        num_features = 12

        def forward(self, x):
            return x.flatten(1).double()

    r = np.random.default_rng(0)
    real, fake = r.normal(size=(40, 12)), r.normal(0.3, 1.2, size=(50, 12))
    m = FrechetInceptionDistance(feature=Identity(), normalize=True, input_img_size=(3, 2, 2))
    m.set_dtype(torch.float64)
    m.update(torch.from_numpy(real).reshape(40, 3, 2, 2), real=True)
    m.update(torch.from_numpy(fake).reshape(50, 3, 2, 2), real=False)
    lib, ours = float(m.compute()), fid_from_features(fake, real)
    print(f"\ntorchmetrics FID {lib!r}  ours {ours!r}  rel diff {abs(lib - ours) / ours:.1e}")
    assert lib == pytest.approx(ours, rel=1e-9) and ours > 0.5


def test_clean_fid_resize_equals_ours_bit_for_bit():
    """clean-fid's own "clean" resizer (cleanfid.resize imports without torchvision) against
    ``clean_resize_299``; runs where clean-fid is installed (pip install --no-deps clean-fid)."""
    resize = pytest.importorskip("cleanfid.resize")
    fn = resize.build_resizer("clean")
    r = np.random.default_rng(0)
    for shape in ((256, 256, 3), (40, 48, 3), (427, 640, 3)):
        img = r.integers(0, 256, shape, dtype=np.uint8)
        np.testing.assert_array_equal(fn(img), clean_resize_299(img))


def test_clean_fid_torchscript_wrapper_equals_our_lantern_features(tmp_path):
    """clean-fid's "clean" feature path (``cleanfid.inception_torchscript.InceptionV3W``: (x - 128) / 128
    then ``base.layers``) on a TorchScript of the same random network, against our lantern extractor on
    the same prepared 299 images: equal to float32 rounding. Runs where clean-fid is installed."""
    ts = pytest.importorskip("cleanfid.inception_torchscript")
    model = random_inception(3)

    class Layers(torch.nn.Module):  # the normalised-input network, as clean-fid's archive exposes it
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net.features(x)

    class Base(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = Layers()

        def forward(self, x):
            return self.layers(x)

    x = torch.from_numpy(np.random.default_rng(4).uniform(0, 255, (2, 3, 299, 299)).astype(np.float32))
    torch.jit.trace(Base(), (x[:1] - 128) / 128).save(str(tmp_path / "inception-2015-12-05.pt"))
    lib = ts.InceptionV3W(str(tmp_path), download=False).eval()
    with torch.inference_mode():
        got = lib(x).double().numpy()
    ours = InceptionFeatureExtractor(model, block=1).features_of_prepared(x)
    print(f"\nclean-fid InceptionV3W vs ours: max |diff| {np.abs(got - ours).max():.2e} (features ~{np.abs(ours).mean():.2f})")
    np.testing.assert_allclose(got, ours, rtol=1e-4, atol=1e-5)


def test_pytorch_fid_protocol_differs_from_clean_fid_as_documented(inception_file):
    """The sjd features are the network on 2 (v / 255) - 1 of the bilinear-299 image (checked on a
    299x299 image, where the resize is the identity), and differ from the lantern features of the
    same image and weights (another resize and normalisation)."""
    img = np.random.default_rng(2).integers(0, 256, (299, 299, 3), dtype=np.uint8)
    np.testing.assert_allclose(pytorch_fid_preprocess(img), img.transpose(2, 0, 1) / 255.0, atol=1e-6)
    sjd = InceptionFeatureExtractor.from_file(inception_file, block=1, recipe="pytorch_fid")
    lantern = InceptionFeatureExtractor.from_file(inception_file, block=1)
    x = torch.from_numpy(img.transpose(2, 0, 1).astype(np.float32))[None]
    with torch.inference_mode():
        want = sjd.model.features(x / 127.5 - 1).double().numpy()
    got = sjd([img])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert sjd.protocol == "pytorch_fid_bilinear299" and lantern.protocol.startswith("lantern_crop")
    assert np.abs(lantern([img]) - got).max() > 1e-3


# ---- both presets end to end --------------------------------------------------------------------
@pytest.fixture
def narrow_pool3(monkeypatch):
    """FID on the first 16 of the 2048 pool3 channels: the network, weight file, preprocessing and
    protocol wiring stay real, but the Fréchet distance's 2048x2048 sqrtm (about 50 s on this 2-core
    machine) becomes 16x16. Both the CLI and the checks below see the same 16 channels."""
    monkeypatch.setattr(InceptionV3, "_pool3", staticmethod(lambda h: F.adaptive_avg_pool2d(h[:, :16], 1).flatten(1).float()))
    monkeypatch.setattr(InceptionFeatureExtractor, "feature_dim", 16)


def test_both_protocols_evaluate_a_finished_run_folder(tmp_path, clip_dir, inception_file, clean_env, narrow_pool3):
    run, coco = _run(tmp_path / "run"), _coco(tmp_path / "val2017")
    common = [str(run), "--metrics", "clip_score,fid", "--inception", str(inception_file), "--coco-images", str(coco),
              "--cache-dir", str(tmp_path / "cache"), "--fid-resamples", "20", "--clip", str(clip_dir)]
    out = {p: main([*common, "--protocol", p]) for p in ("lantern", "sjd")}
    m = json.loads((run / "metrics.json").read_text())  # the last run's file: sjd
    assert m["protocol"]["name"] == "sjd" and "pytorch-fid" in m["protocol"]["fid"]
    assert m["per_method"]["ar"]["fid"]["protocol"] == "sjd" and m["per_method"]["ar"]["clip_score"]["protocol"] == "sjd"
    imgs, refs = _pngs(run), [np.asarray(Image.open(f).convert("RGB")) for f in sorted(coco.glob("*.jpg"))]

    lan = out["lantern"]["per_method"]["ar"]
    want = ClipScorer.from_pretrained(clip_dir).score(imgs, CAPTIONS)  # raw cosine, prefix spliced
    assert lan["clip_score"]["mean"] == pytest.approx(want.mean(), abs=1e-9) and lan["clip_score"]["protocol"] == "lantern"
    ext = InceptionFeatureExtractor(load_inception(inception_file), block=4)
    assert lan["fid"]["fid"] == pytest.approx(frechet_distance(*feature_statistics(ext(imgs)),
                                                                *feature_statistics(ext(refs))), rel=1e-6)

    sjd = out["sjd"]["per_method"]["ar"]
    from torchmetrics.multimodal import CLIPScore

    tm = TorchmetricsClipScorer.from_pretrained(clip_dir)
    one = CLIPScore(model_name_or_path=lambda: (tm.metric.model, tm.metric.processor))
    one.update(torch.stack([sjd_clip_image(im) for im in imgs]), CAPTIONS)  # the SJD script's call, one batch
    assert sjd["clip_score"]["torchmetrics_value"] == pytest.approx(float(one.compute()), abs=1e-4)
    assert out["sjd"]["per_sample"]["ar"]["clip_score"] == pytest.approx(tm.score(imgs, CAPTIONS).tolist(), abs=1e-9)

    model = load_inception(inception_file)

    def pt_features(images):  # pytorch-fid's chain written out: ToTensor, bilinear 299, 2x - 1, pool3
        with torch.inference_mode():
            return np.concatenate([model.features(2 * torch.from_numpy(pytorch_fid_preprocess(im))[None] - 1).double()
                                   .numpy() for im in images])
    want_fid = frechet_distance(*feature_statistics(pt_features(imgs)), *feature_statistics(pt_features(refs)))
    assert sjd["fid"]["fid"] == pytest.approx(want_fid, rel=1e-5)
    assert abs(sjd["fid"]["fid"] - lan["fid"]["fid"]) > 1e-3 * lan["fid"]["fid"]  # different protocols, numbers
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2  # one reference cache entry per protocol
    from coolsd.cli.evaluate import evaluate_run
    from coolsd.metrics.image_metrics import ClipMetric, FidMetric

    with pytest.raises(ValueError, match="the clip_score scorer computes the 'sjd' protocol, not 'lantern'"):
        evaluate_run(run, {"clip_score": ClipMetric(tm)})  # a number is never labelled with another protocol
    with pytest.raises(ValueError, match="the fid scorer computes the 'lantern' protocol, not 'sjd'"):
        evaluate_run(run, {"fid": FidMetric(ext, (None, None, 0))}, protocol="sjd")


def test_sjd_on_partiprompts_scores_clip_against_the_tsv(tmp_path, clip_dir, clean_env, capsys):
    tsv = tmp_path / "PartiPrompts.tsv"
    tsv.write_text("Prompt\tCategory\tChallenge\tNote\n" + "".join(f"{c}\tAnimals\tBasic\t\n" for c in CAPTIONS))
    run = _run(tmp_path / "run")
    res = main([str(run), "--protocol", "sjd", "--parti-tsv", str(tsv), "--metrics", "clip_score", "--clip", str(clip_dir)])
    assert res["protocol"]["prompts"].startswith("PartiPrompts") and "fid" not in res["per_method"]["ar"]
    assert res["per_method"]["ar"]["clip_score"]["n"] == len(CAPTIONS)
    tsv.write_text("Prompt\tCategory\n" + "".join(f"{c} x\tAnimals\n" for c in CAPTIONS))
    with pytest.raises(ValueError, match=r"record ar/0 has caption 'a red cat sits on the mat\.' but the TSV's prompt 0"):
        main([str(run), "--protocol", "sjd", "--parti-tsv", str(tsv), "--metrics", "clip_score", "--clip", str(clip_dir)])
    with pytest.raises(ConfigError, match="no FID on PartiPrompts"):
        main([str(run), "--protocol", "sjd", "--parti-tsv", str(tsv)])


# ---- inputs checked up front, per protocol ----------------------------------------------------------
def test_missing_weights_are_listed_per_protocol(tmp_path, clean_env):
    from coolsd.util.loading import InputFileError

    run = _run(tmp_path / "run")
    (tmp_path / "b32").mkdir()
    lantern_clip = write_tiny_clip(tmp_path / "b32")  # no preprocessor_config.json: not enough for sjd
    with pytest.raises(InputFileError) as e:
        main([str(run), "--protocol", "sjd", "--clip", str(lantern_clip)])
    msg = str(e.value)
    for line in (f"CLIP ViT-B/16 model folder: {lantern_clip} lacks preprocessor_config.json (set --clip /path or $CLIP_B16_DIR)",
                 "pytorch-fid Inception weights: ", "pt_inception-2015-12-05-6726825d.pth does not exist "
                 "(set --inception /path or $PT_INCEPTION_WEIGHTS) -- https://github.com/mseitzer/pytorch-fid/",
                 "COCO val2017 images: not set (set --coco-images /path or $COCO_VAL_IMAGES)"):
        assert line in msg, (line, msg)
    with pytest.raises(InputFileError) as e:
        main([str(run), "--protocol", "lantern"])
    msg = str(e.value)
    assert ("CLIP model folder: hf://openai/clip-vit-base-patch32 is not in the Hugging Face cache" in msg
            and "run `python -m coolsd.cli.download metrics=clip_score,fid` (or set --clip /path or $CLIP_DIR)" in msg)
    assert "weights-inception-2015-12-05-6726825d.pth does not exist (set --inception /path or $INCEPTION_WEIGHTS)" in msg
    assert "B/16" not in msg and "PT_INCEPTION" not in msg
    with pytest.raises(InputFileError, match=r"PartiPrompts TSV: .*nope\.tsv does not exist \(set --parti-tsv /path\)"):
        main([str(run), "--protocol", "sjd", "--parti-tsv", str(tmp_path / "nope.tsv"), "--metrics", "clip_score",
              "--clip", str(lantern_clip)])
    assert not (run / "metrics.json").exists()


def test_bad_protocol_values_are_one_line_errors(tmp_path, clean_env):
    run = _run(tmp_path / "run")
    for argv, match in ((["--protocol", "clean"], r"^unknown --protocol 'clean'; valid: lantern, sjd$"),
                        (["--protocol", "lantern", "--parti-tsv", "p.tsv"], r"^--parti-tsv is a prompt set of --protocol sjd")):
        with pytest.raises(ConfigError) as e:
            main([str(run), *argv])
        assert "\n" not in str(e.value)
        assert __import__("re").search(match, str(e.value)), e.value
