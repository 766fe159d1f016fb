"""Where and at what precision the metric networks run (coolsd.metrics.numerics): the default
device of ``python -m coolsd.cli.evaluate`` follows CUDA's availability and a missing CUDA is refused
before any work; every metric network runs with TF32 off whatever the caller set; the FID
reference cache is keyed by device type and precision, so statistics made under one are never
read under another."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

import coolsd.metrics.numerics as numerics
import coolsd.metrics.reference as reference
from coolsd.util.errors import ConfigError
from coolsd.cli.evaluate import main
from coolsd.metrics import FeatureExtractor
from coolsd.metrics.inception import InceptionFeatureExtractor
from coolsd.metrics.reference import coco_image_files, reference_statistics
from coolsd.util.records import RecordWriter
from tiny_models import MomentFeatures, write_tiny_clip
from test_eval_protocols import _coco  # noqa: E402  (the same random COCO folder)

IEEE = "float32_matmul_precision=highest,cudnn.allow_tf32=False"


def _run(root, n=2):
    r = np.random.default_rng(0)
    w = RecordWriter(root)
    for i in range(n):
        w.append({"method": "ar", "prompt_index": i, "caption": "a red cat", "seed": i},
                 r.integers(0, 256, (40, 48, 3), dtype=np.uint8), f"ar/{i:05d}.png")
    return root


@pytest.fixture
def tf32_on():
    """The caller's settings with TF32 on for matmuls and cuDNN (what a generation run may set),
    restored afterwards."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    yield "float32_matmul_precision=high,cudnn.allow_tf32=True"
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


# ---- device ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuda, want", [(True, "metrics on cuda (default: CUDA is available)"),
                                        (False, "metrics on cpu (default: no CUDA on this machine)")])
def test_default_device_is_cuda_when_available_and_is_printed(tmp_path, monkeypatch, capsys, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert numerics.default_device() == ("cuda" if cuda else "cpu")
    run = _run(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="COCO val2017 images"):  # stops at the input check, before work
        main([str(run), "--metrics", "fid", "--coco-images", str(tmp_path / "none")])
    assert want in capsys.readouterr().out


def test_cuda_without_cuda_is_refused_before_any_input_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match=rf"^--device {device} but CUDA is not available on this machine "
                                              r"\(torch.cuda.is_available\(\) is False\); pass --device cpu"):
            main([str(tmp_path / "no_run"), "--metrics", "fid", "--device", device])  # no run folder: not read yet
    with pytest.raises(ConfigError, match="--device 'gpu' is not a torch device: valid: cpu, cuda, cuda:N"):
        main([str(tmp_path / "no_run"), "--device", "gpu"])
    assert numerics.check_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line_on_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "coolsd.cli.evaluate", str(tmp_path / "run"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --device cuda but CUDA is not available on this machine (torch.cuda.is_available() is False); "
        "pass --device cpu, or leave --device out (default: cuda when available, else cpu)"]


# ---- precision ---------------------------------------------------------------------------------
def test_ieee_fp32_turns_tf32_off_inside_and_restores_the_callers_settings(tf32_on):
    assert numerics.fp32_settings() == tf32_on
    with numerics.ieee_fp32():
        assert numerics.fp32_settings() == IEEE
        with numerics.ieee_fp32():
            pass
        assert numerics.fp32_settings() == IEEE  # nested: the inner exit restores the outer's state
    assert numerics.fp32_settings() == tf32_on
    with pytest.raises(KeyError), numerics.ieee_fp32():
        raise KeyError("x")
    assert numerics.fp32_settings() == tf32_on
    assert numerics.metric_precision() == "float32|" + IEEE
    assert numerics.metric_numerics("cuda:0") == "cuda|float32|" + IEEE  # the type only: no CUDA needed


class _SettingsSpy(torch.nn.Module):
    """A stand-in network recording the precision settings in effect when it runs."""

    def __init__(self, dim):
        super().__init__()
        self.dim, self.seen = dim, []
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        self.seen.append(numerics.fp32_settings())
        return torch.zeros(len(x), self.dim)


def test_every_metric_network_runs_with_tf32_off(tmp_path, tf32_on, monkeypatch):
    spy = _SettingsSpy(2048)
    spy.features = spy.forward
    imgs = [np.zeros((40, 48, 3), np.uint8), np.full((30, 30, 3), 200, np.uint8)]
    InceptionFeatureExtractor(spy, block=2)(imgs)  # FID, lantern: the clean-fid normalisation inside forward
    InceptionFeatureExtractor(spy, block=2, input_norm="pytorch_fid").features_of_prepared(
        torch.zeros(2, 3, 299, 299))  # FID, sjd: the network's features() on 2x - 1

    class Toy(FeatureExtractor):  # the toy metrics' extractor path (FeatureExtractor._run)
        name, feature_dim, block = "toy", 3, 2

        def _forward(self, x):
            return spy(x)[:, :3]

    Toy()(np.zeros((3, 8, 8, 3), np.uint8))
    assert len(spy.seen) == 4 and set(spy.seen) == {IEEE}

    from coolsd.metrics.clip_score import ClipScorer
    from coolsd.metrics.clip_torchmetrics import TorchmetricsClipScorer
    from transformers import CLIPImageProcessor

    (tmp_path / "clip").mkdir()
    d = write_tiny_clip(tmp_path / "clip")
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(str(d))
    for scorer in (ClipScorer.from_pretrained(d), TorchmetricsClipScorer.from_pretrained(d)):
        model = scorer.model if isinstance(scorer, ClipScorer) else scorer.metric.model.clip
        seen = []
        for what in ("get_image_features", "get_text_features"):
            def record(*a, _f=getattr(model, what), **k):
                seen.append(numerics.fp32_settings())
                return _f(*a, **k)

            monkeypatch.setattr(model, what, record)
        scorer.score(imgs, ["a red cat", "the dog"])
        assert seen and set(seen) == {IEEE}, type(scorer).__name__
    assert numerics.fp32_settings() == tf32_on  # and the caller's settings are back


FAKE_IR = '''
import torch


class Model(torch.nn.Module):
    def score(self, prompt, image):  # 1 where TF32 is on for cuBLAS or cuDNN, else 0
        return float(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)


def load(name, device="cpu", download_root=None, med_config=None):
    return Model()
'''


def test_image_reward_worker_runs_with_tf32_off(tmp_path):
    from coolsd.metrics.image_reward import ImageRewardScorer

    pkg = tmp_path / "site" / "ImageReward"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_IR))
    ckpt, med = tmp_path / "ImageReward.pt", tmp_path / "med_config.json"
    torch.save({}, ckpt)
    med.write_text("{}")
    run = _run(tmp_path / "run", n=1)
    ir = ImageRewardScorer(ckpt, med, python=sys.executable, env={"PYTHONPATH": str(pkg.parent)})
    assert ir.score([run / "images" / "ar" / "00000.png"], ["a red cat"]).tolist() == [0.0]


# ---- the reference cache key -------------------------------------------------------------------
class _OnDevice(MomentFeatures):
    """Moment features claiming to run on ``device`` (only its type enters the key)."""

    def __init__(self, device):
        self.device = torch.device(device)


def test_reference_cache_is_keyed_by_device_type(tmp_path, monkeypatch):
    files = coco_image_files(_coco(tmp_path / "val2017"))
    cache = tmp_path / "cache"
    computed = []
    real = reference.image_statistics
    monkeypatch.setattr(reference, "image_statistics", lambda *a, **k: computed.append(a[1].device) or real(*a, **k))
    cpu, gpu = _OnDevice("cpu"), _OnDevice("cuda:0")
    assert reference.reference_key(files, cpu, "w0") != reference.reference_key(files, gpu, "w0")
    first = reference_statistics(files, cpu, cache, "w0")
    reference_statistics(files, gpu, cache, "w0")  # a CPU entry is not read on the GPU
    reference_statistics(files, cpu, cache, "w0")  # ... but is read again on the CPU
    reference_statistics(files, _OnDevice("cuda:1"), cache, "w0")  # the type counts, not the index
    assert [d.type for d in computed] == ["cpu", "cuda"]
    names = sorted(p.name for p in cache.glob("*.npz"))
    assert len(names) == 2 and "_cpu_3_" in names[0] and "_cuda_3_" in names[1]
    z = np.load(cache / names[0])
    assert str(z["numerics"]) == "cpu|float32|" + IEEE and np.array_equal(z["mu"], first[0])


def test_reference_cache_is_keyed_by_precision(tmp_path, monkeypatch):
    files = coco_image_files(_coco(tmp_path / "val2017"))
    cache = tmp_path / "cache"
    ext = _OnDevice("cpu")
    reference_statistics(files, ext, cache, "w0")
    ieee_key = reference.reference_key(files, ext, "w0")
    monkeypatch.setattr(numerics, "fp32_settings", lambda: "float32_matmul_precision=high,cudnn.allow_tf32=True")
    assert reference.reference_key(files, ext, "w0") != ieee_key  # a precision with TF32 on: another key
    computed = []
    real = reference.image_statistics
    monkeypatch.setattr(reference, "image_statistics", lambda *a, **k: computed.append(1) or real(*a, **k))
    reference_statistics(files, ext, cache, "w0")  # not read from the IEEE entry
    assert computed == [1] and len(list(cache.glob("*.npz"))) == 2


def test_reference_key_does_not_depend_on_the_callers_tf32(tmp_path, tf32_on):
    """The network always runs under ieee_fp32, so the caller's own TF32 setting computes the
    same features and must find the same entry."""
    files = coco_image_files(_coco(tmp_path / "val2017"))
    ext = InceptionFeatureExtractor(_SettingsSpy(2048), block=2)
    assert ext.numerics == "cpu|float32|" + IEEE
    with_tf32 = reference.reference_key(files, ext, "w0")
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    assert reference.reference_key(files, ext, "w0") == with_tf32
