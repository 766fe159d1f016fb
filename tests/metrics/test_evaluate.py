"""Metrics of a run from its records and images (coolsd.cli.evaluate): CLIP score, FID against cached
COCO reference statistics, ImageReward through its worker process, on tiny random models of the
real classes and a stand-in ImageReward package; and the errors before any work."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coolsd.cli.evaluate import evaluate_run, main
from coolsd.metrics.image_metrics import ClipMetric, FidMetric, WorkerMetric
from coolsd.metrics.clip_score import ClipScorer
from coolsd.metrics.fid import feature_statistics, frechet_distance
from coolsd.metrics.image_reward import ImageRewardScorer
from coolsd.metrics.inception import InceptionFeatureExtractor
from coolsd.metrics.reference import coco_image_files, reference_statistics
from coolsd.util.records import RecordWriter
from coolsd.util.errors import ConfigError
from tiny_models import MomentFeatures, random_inception, write_tiny_clip

ROOT = Path(__file__).resolve().parents[2]
CAPTIONS = ["a red cat sits on the mat.", "the dog", "a cat, a dog, a mat", "red"]


def _run(root, n=4, methods=("ar", "coolsd")):
    r = np.random.default_rng(0)
    w = RecordWriter(root)
    for i in range(n):
        for m in methods:
            w.append({"method": m, "prompt_index": i, "caption": CAPTIONS[i % len(CAPTIONS)], "seed": i},
                     r.integers(0, 256, (40, 48, 3), dtype=np.uint8), f"{m}/{i:05d}.png")
    return root


def _coco(root, ids=(139, 285, 632, 724, 776)):
    root.mkdir()
    r = np.random.default_rng(1)
    for k, i in enumerate(ids):
        Image.fromarray(r.integers(0, 256, (50 + 10 * k, 64, 3), dtype=np.uint8)).save(root / f"{i:012d}.jpg")
    return root


@pytest.fixture(scope="module")
def inception():
    return InceptionFeatureExtractor(random_inception(0), batch_size=8, block=4)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def clip(clip_dir):
    return ClipScorer.from_pretrained(clip_dir)


FAKE_IR = '''
import numpy as np
import torch
from PIL import Image


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(2, 1)

    def score(self, prompt, image):
        return float(np.asarray(Image.open(image)).mean() / 255 + len(prompt) / 100 + self.head.bias.item())


def load(name, device="cpu", download_root=None, med_config=None):
    model = Model()
    model.load_state_dict(torch.load(name, weights_only=True), strict=False)
    return model
'''


@pytest.fixture
def fake_image_reward(tmp_path):
    pkg = tmp_path / "fake_site" / "ImageReward"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_IR))
    ckpt, med = tmp_path / "ImageReward.pt", tmp_path / "med_config.json"
    torch.save({"head.weight": torch.ones(1, 2), "head.bias": torch.tensor([0.5])}, ckpt)
    med.write_text("{}")
    return {"checkpoint": ckpt, "med_config": med, "env": {"PYTHONPATH": str(pkg.parent)}}


def test_metrics_of_a_run_equal_direct_computation(tmp_path, clip):
    inception = MomentFeatures()  # any extractor plugs in; the Inception path is in the cache test
    run = _run(tmp_path / "run")
    files = coco_image_files(_coco(tmp_path / "val2017"))
    ref = reference_statistics(files, inception, tmp_path / "cache", "w0")
    out = evaluate_run(run, {"clip_score": ClipMetric(clip), "fid": FidMetric(inception, ref, 50)})
    for tag in ("ar", "coolsd"):
        paths = [run / "images" / tag / f"{i:05d}.png" for i in range(4)]
        imgs = [np.asarray(Image.open(p)) for p in paths]
        want_clip = clip.score(imgs, CAPTIONS)
        got = out["per_method"][tag]
        assert got["clip_score"]["mean"] == pytest.approx(want_clip.mean(), abs=1e-12)
        assert out["per_sample"][tag]["clip_score"] == pytest.approx(want_clip.tolist(), abs=1e-12)
        ref_feats = inception([np.asarray(Image.open(f).convert("RGB")) for f in files])
        want_fid = frechet_distance(*feature_statistics(inception(imgs)), *feature_statistics(ref_feats))
        assert got["fid"]["fid"] == pytest.approx(want_fid, rel=1e-6) and got["fid"]["n_ref"] == 5
        assert got["fid"]["lo"] < got["fid"]["hi"]


def test_reference_statistics_are_cached_per_image_set(tmp_path, inception, monkeypatch):
    files = coco_image_files(_coco(tmp_path / "val2017"))
    first = reference_statistics(files, inception, tmp_path / "cache", "w0")
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    import coolsd.metrics.reference as reference

    monkeypatch.setattr(reference, "image_statistics", lambda *a, **k: pytest.fail("recomputed a cached set"))
    again = reference_statistics(files, inception, tmp_path / "cache", "w0")
    assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    monkeypatch.undo()
    reference_statistics(files[:4], inception, tmp_path / "cache", "w0")  # another set: a new entry
    reference_statistics(files, inception, tmp_path / "cache", "w1")  # other weights: a new entry
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 3
    with pytest.raises(FileNotFoundError, match=r"1 of 2 COCO images are missing .*000000000001\.jpg.*val2017\.zip"):
        coco_image_files(tmp_path / "val2017", [139, 1])


def test_image_reward_scores_through_the_worker(tmp_path, fake_image_reward):
    run = _run(tmp_path / "run")
    ir = ImageRewardScorer(fake_image_reward["checkpoint"], fake_image_reward["med_config"], python=sys.executable,
                           env=fake_image_reward["env"])
    out = evaluate_run(run, {"image_reward": WorkerMetric(ir)})
    for tag in ("ar", "coolsd"):
        want = [np.asarray(Image.open(run / "images" / tag / f"{i:05d}.png")).mean() / 255 + len(CAPTIONS[i]) / 100 + 0.5
                for i in range(4)]
        assert out["per_sample"][tag]["image_reward"] == pytest.approx(want, abs=1e-9)
        assert out["per_method"][tag]["image_reward"]["mean"] == pytest.approx(np.mean(want))


def test_image_reward_errors_before_work(tmp_path, fake_image_reward):
    f = fake_image_reward
    with pytest.raises(FileNotFoundError, match=r"ImageReward checkpoint file .*nope\.pt not found.*THUDM/ImageReward"):
        ImageRewardScorer(tmp_path / "nope.pt", f["med_config"], env=f["env"])
    with pytest.raises(RuntimeError, match="cannot import the ImageReward package.*separate environment"):
        ImageRewardScorer(f["checkpoint"], f["med_config"], python=sys.executable, env={"PYTHONPATH": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="interpreter .*no_python does not exist"):
        ImageRewardScorer(f["checkpoint"], f["med_config"], python=tmp_path / "no_python", env=f["env"])
    torch.save({"other.weight": torch.ones(3)}, tmp_path / "wrong.pt")
    ir = ImageRewardScorer(tmp_path / "wrong.pt", f["med_config"], python=sys.executable, env=f["env"])
    run = _run(tmp_path / "run", n=1)
    with pytest.raises(RuntimeError, match=r"not an ImageReward checkpoint: it lacks 2 parameters \(head\.bias, head\.weight\)"):
        evaluate_run(run, {"image_reward": WorkerMetric(ir)})


def test_cli_checks_inputs_before_work(tmp_path, capsys, fake_image_reward, monkeypatch):
    run = _run(tmp_path / "run", n=2)
    with pytest.raises(ConfigError, match="unknown metric"):
        main([str(run), "--metrics", "clip_score,is"])
    with pytest.raises(FileNotFoundError, match=r"CLIP model folder: .*no_clip does not exist \(set --clip /path"):
        main([str(run), "--metrics", "clip_score", "--clip", str(tmp_path / "no_clip")])
    with pytest.raises(FileNotFoundError, match=r"COCO val2017 images: .*none does not exist .*--coco-images.*val2017\.zip"):
        main([str(run), "--metrics", "fid", "--coco-images", str(tmp_path / "none")])
    with pytest.raises(FileNotFoundError, match=r"run folder: .*empty does not exist"):
        main([str(tmp_path / "empty"), "--metrics", "fid"])
    monkeypatch.setenv("PYTHONPATH", fake_image_reward["env"]["PYTHONPATH"])
    ir = ["--metrics", "image_reward", "--ir-checkpoint", str(fake_image_reward["checkpoint"]),
          "--ir-med-config", str(fake_image_reward["med_config"]), "--ir-python", sys.executable]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no records"):
        main([str(tmp_path / "empty"), *ir])
    (run / "images" / "ar" / "00001.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"run images: .*1 of its 4 records point to images that are missing "
                                                r"or unreadable \(images/ar/00001\.png .*does not match its records"):
        main([str(run), *ir])
    assert not (run / "metrics.json").exists()


def test_missing_images_are_listed_with_the_other_missing_inputs_before_any_work(tmp_path, clip_dir):
    """A run folder whose PNGs are gone is refused in the one list of missing inputs (with a
    missing COCO folder beside it), not on the first image once the networks are loaded; from the
    command line: exit status 2, a short list on stderr, no traceback, no metrics.json."""
    run = _run(tmp_path / "run", n=3)
    for name in ("ar/00001.png", "coolsd/00002.png"):
        (run / "images" / name).unlink()
    with pytest.raises(FileNotFoundError) as e:
        main([str(run), "--metrics", "clip_score,fid", "--clip", str(clip_dir), "--coco-images",
              str(tmp_path / "no_coco")])
    msg = str(e.value)
    assert "COCO val2017 images: " in msg and "no_coco does not exist" in msg
    assert ("run images: " in msg and "2 of its 6 records point to images that are missing or unreadable "
            "(images/ar/00001.png (method 'ar', prompt 1): missing; images/coolsd/00002.png (method 'coolsd', "
            "prompt 2): missing)" in msg)
    env = {k: v for k, v in os.environ.items() if k not in ("COOLSD_VERBOSE", "HYDRA_FULL_ERROR")}
    proc = subprocess.run([sys.executable, "-m", "coolsd.cli.evaluate", str(run), "--metrics", "clip_score",
                           "--clip", str(clip_dir)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines[0] == "error: python -m coolsd.cli.evaluate cannot run: missing files" and len(lines) == 2, lines
    assert lines[1].startswith(f"  run images: {run}: 2 of its 6 records") and len(lines[1]) < 500
    assert not (run / "metrics.json").exists()


def test_a_corrupted_record_file_is_named_with_its_line_before_any_work(tmp_path, clip_dir):
    run = _run(tmp_path / "run", n=2)
    path = run / "samples.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1][:30], *lines[2:]]) + "\n")
    with pytest.raises(FileNotFoundError, match=rf"run records: {path} line 2 of 4 is not JSON .*corrupted.*delete "
                                                r"that line"):
        main([str(run), "--metrics", "clip_score", "--clip", str(clip_dir)])
    assert not (run / "metrics.json").exists()


def test_cli_writes_metrics_json(tmp_path, fake_image_reward, monkeypatch):
    run = _run(tmp_path / "run", n=2)
    monkeypatch.setenv("PYTHONPATH", fake_image_reward["env"]["PYTHONPATH"])
    main([str(run), "--metrics", "image_reward", "--ir-checkpoint", str(fake_image_reward["checkpoint"]),
          "--ir-med-config", str(fake_image_reward["med_config"]), "--ir-python", sys.executable])
    m = json.loads((run / "metrics.json").read_text())
    assert set(m["per_method"]) == {"ar", "coolsd"} and m["per_method"]["ar"]["n"] == 2
    assert "image_reward" in m["per_method"]["coolsd"] and m["protocol"]["metrics"] == ["image_reward"]
    want = "cuda" if torch.cuda.is_available() else "cpu"  # the default device, recorded with its precision
    assert m["protocol"]["device"] == want and m["protocol"]["numerics"].startswith(want + "|float32|")
