"""Inception-v3 pool3 features for FID, under the clean-fid protocol (our own implementation).

The network is the 2015-12-05 TensorFlow Inception graph (the one behind every published
FID) with the module tree and parameter names of torch-fidelity's port, so its weight file
``weights-inception-2015-12-05-6726825d.pth`` (a plain ``dict[str, Tensor]``, 472 keys,
23,885,392 float32 values, no ``num_batches_tracked``) loads with ``strict=True``:

* 94 ``BasicConv2d`` blocks ``<prefix>.conv`` (Conv2d, no bias) + ``<prefix>.bn`` (BatchNorm2d,
  eps = 1e-3, running statistics only: the module is used in eval mode) + ReLU;
* ``Conv2d_1a_3x3`` ... ``Conv2d_4a_3x3``, ``Mixed_5b`` ... ``Mixed_7c`` and ``fc`` (2048 -> 1008
  logits; loaded for completeness, unused by FID);
* TensorFlow quirks kept: every average pool excludes the zero padding from its mean
  (``count_include_pad=False``), and ``Mixed_7c``'s pool branch is a 3x3 stride-1 *max* pool.

Input convention (clean-fid "clean" mode, which is what LANTERN / COOL-SD report): float
(N, 3, 299, 299) in [0, 255], normalised inside ``forward`` as ``(x - 128) / 128``; output the
(N, 2048) pool3 features (global average of ``Mixed_7c``). Resizing is NOT done here: the
images are prepared by ``coolsd.metrics.image_prep.fid_preprocess`` (LANTERN's centre crop +
LANCZOS 256, then clean-fid's per-channel PIL float bicubic resize to 299; docs/methods.md#6-evaluation-protocol).

    model = load_inception("weights-inception-2015-12-05-6726825d.pth")
    ext = InceptionFeatureExtractor(model, device="cuda")
    feats = ext(list_of_uint8_hwc_images)       # (n, 2048) float64 (float32 values)
    fid = fid_from_features(feats_generated, feats_reference)

Weights are never downloaded: the user supplies the file (see ``WEIGHTS_URL``).

Two FID recipes share this network (``FID_RECIPES``; the protocols of ``python -m coolsd.cli.evaluate
--protocol`` pick one, ``coolsd.metrics.protocols``):

* ``clean_fid`` (LANTERN / COOL-SD, clean-fid ``mode="clean"``): LANTERN's centre crop + LANCZOS
  256, clean-fid's per-channel PIL float bicubic 299 (antialiased), ``(v - 128) / 128``, the TF
  2015-12-05 weights (clean-fid ships them as the TorchScript ``inception-2015-12-05.pt``; we
  load torch-fidelity's port of the same graph, ``WEIGHTS_NAME``).
* ``pytorch_fid`` (SJD / MC-SJD / GSD, ``pytorch_fid.calculate_fid_given_paths``): no crop, torch bilinear
  299 without antialiasing (``image_prep.pytorch_fid_preprocess``), ``2 (v / 255) - 1``, and
  pytorch-fid's weight file ``PT_WEIGHTS_NAME`` (same module tree and key names, torchvision's
  Inception3 with the FID blocks; its name carries the same ``6726825d`` hash prefix as
  torch-fidelity's file, so it is most likely the same tensors; not checked here, no download).
  torch-fidelity's own path (uint8 input, a TF1-style bilinear resize) is a third variant, not
  implemented: none of the papers compared here used it.

Why ours and not a library's network (torch 2.13 CPU, where PyPI's torchvision does not import):
``pytorch_fid.inception`` builds on ``torchvision.models.inception_v3`` and imports torchvision
at module import; ``import torch_fidelity`` runs its ``__init__``, which imports
``feature_extractor_clip`` and so torchvision (0.4.0), and with torch-fidelity installed
torchmetrics' ``image.fid`` (and with it ``multimodal.clip_score``) stops importing too;
clean-fid's network is TorchScript (``cleanfid.inception_torchscript``, torchvision-free) but
clean-fid requires torchvision as a distribution and ``torch.jit.load`` runs code from the file
(not a weights-only load); its ``InceptionV3W`` on a TorchScript of our random network gives our
features bit for bit (tests/cli/test_eval_protocols.py, where clean-fid is installed with --no-deps). The Fréchet distance itself is ``coolsd.metrics.fid`` (pytorch-fid's
formula; torchmetrics' ``FrechetInceptionDistance`` agrees with it, tests/cli/test_eval_protocols.py).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.metrics import FeatureExtractor
from coolsd.metrics.image_prep import INCEPTION_SIZE, fid_preprocess, pytorch_fid_preprocess
from coolsd.metrics.numerics import ieee_fp32
from coolsd.util.loading import BadInputFile, MissingInputFile, torch_load
from coolsd.util.records import sha256_file

WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/" + WEIGHTS_NAME
PT_WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"  # pytorch-fid's FID_WEIGHTS_URL
PT_WEIGHTS_URL = "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/" + PT_WEIGHTS_NAME
FEATURE_DIM = 2048
BN_EPS = 1e-3
_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$")  # torch.hub convention: "<name>-<sha256 prefix>.<ext>"


# ---- building blocks ---------------------------------------------------------------------------
class BasicConv2d(nn.Module):
    """conv (no bias) -> BatchNorm (eps 1e-3) -> ReLU. In eval mode:
    ``relu((conv(x) - running_mean) / sqrt(running_var + 1e-3) * bn.weight + bn.bias)``."""

    def __init__(self, c_in: int, c_out: int, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(c_out, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_tf() -> nn.AvgPool2d:
    """3x3 stride-1 'SAME' average pool as TensorFlow computes it: padded cells are not counted."""
    return nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """Mixed_5b/5c/5d (35x35): [1x1 64 | 1x1 48 -> 5x5 64 | 1x1 64 -> 3x3 96 -> 3x3 96 | avgpool -> 1x1 pool]."""

    def __init__(self, c_in: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(c_in, 64, 1)
        self.branch5x5_1 = BasicConv2d(c_in, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(c_in, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.pool = _avg_pool_tf()
        self.branch_pool = BasicConv2d(c_in, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch1x1(x)
        b = self.branch5x5_2(self.branch5x5_1(x))
        c = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        d = self.branch_pool(self.pool(x))
        return torch.cat([a, b, c, d], 1)


class InceptionB(nn.Module):
    """Mixed_6a (35 -> 17): [3x3/2 384 | 1x1 64 -> 3x3 96 -> 3x3/2 96 | maxpool 3/2]."""

    def __init__(self, c_in: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(c_in, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(c_in, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch3x3(x)
        b = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([a, b, self.pool(x)], 1)


class InceptionC(nn.Module):
    """Mixed_6b..6e (17x17, factorised 7x7): [1x1 192 | 1x1 c7 -> 1x7 -> 7x1 192 |
    1x1 c7 -> 7x1 -> 1x7 -> 7x1 -> 1x7 192 | avgpool -> 1x1 192]."""

    def __init__(self, c_in: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(c_in, 192, 1)
        self.branch7x7_1 = BasicConv2d(c_in, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(c_in, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.pool = _avg_pool_tf()
        self.branch_pool = BasicConv2d(c_in, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch1x1(x)
        b = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        c = self.branch7x7dbl_1(x)
        for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            c = layer(c)
        d = self.branch_pool(self.pool(x))
        return torch.cat([a, b, c, d], 1)


class InceptionD(nn.Module):
    """Mixed_7a (17 -> 8): [1x1 192 -> 3x3/2 320 | 1x1 192 -> 1x7 -> 7x1 -> 3x3/2 192 | maxpool 3/2]."""

    def __init__(self, c_in: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(c_in, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(c_in, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)
        self.pool = nn.MaxPool2d(3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch3x3_2(self.branch3x3_1(x))
        b = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([a, b, self.pool(x)], 1)


class InceptionE(nn.Module):
    """Mixed_7b / 7c (8x8): [1x1 320 | 1x1 384 -> (1x3 384, 3x1 384) | 1x1 448 -> 3x3 384 ->
    (1x3 384, 3x1 384) | pool -> 1x1 192] = 2048 channels. ``pool`` is "avg" (TF-style,
    padding excluded) for Mixed_7b and "max" (3x3 stride 1 pad 1) for Mixed_7c, as in the
    TensorFlow graph."""

    def __init__(self, c_in: int, pool: str):
        super().__init__()
        self.branch1x1 = BasicConv2d(c_in, 320, 1)
        self.branch3x3_1 = BasicConv2d(c_in, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(c_in, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        if pool == "avg":
            self.pool = _avg_pool_tf()
        elif pool == "max":
            self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        else:
            raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")
        self.branch_pool = BasicConv2d(c_in, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.branch1x1(x)
        b = self.branch3x3_1(x)
        b = torch.cat([self.branch3x3_2a(b), self.branch3x3_2b(b)], 1)
        c = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        c = torch.cat([self.branch3x3dbl_3a(c), self.branch3x3dbl_3b(c)], 1)
        d = self.branch_pool(self.pool(x))
        return torch.cat([a, b, c, d], 1)


# ---- the network ------------------------------------------------------------------------------------
class InceptionV3(nn.Module):
    """The FID Inception-v3 (TF 2015-12-05 graph), torch-fidelity parameter names.

    ``forward(x)``: float (N, 3, 299, 299) in [0, 255] -> (N, 2048) float32 pool3 features.
    Stage sizes at 299: 149, 147, 147, 73 (MaxPool_1), 73, 71, 35 (MaxPool_2), 35 (Mixed_5*),
    17 (Mixed_6*), 8 (Mixed_7*), then a global average -> 2048. Use in eval mode (BatchNorm
    running statistics); ``load_inception`` returns it so.
    """

    STAGES = ("Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1", "Conv2d_3b_1x1", "Conv2d_4a_3x3",
              "MaxPool_2", "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
              "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c")

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.MaxPool_1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.MaxPool_2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, pool="avg")
        self.Mixed_7c = InceptionE(2048, pool="max")
        self.fc = nn.Linear(FEATURE_DIM, 1008)

    @staticmethod
    def normalize(x: torch.Tensor) -> torch.Tensor:
        """[0, 255] -> [-1, 1 - 1/128]: ``(x - 128) / 128`` (clean-fid / torch-fidelity)."""
        return (x - 128) / 128

    def _check_input(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[1] != 3 or tuple(x.shape[-2:]) != (INCEPTION_SIZE, INCEPTION_SIZE):
            raise ValueError(f"InceptionV3 expects float (N, 3, {INCEPTION_SIZE}, {INCEPTION_SIZE}) in [0, 255] "
                             f"(resize with coolsd.metrics.image_prep.fid_preprocess), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"InceptionV3 expects a floating-point input in [0, 255], got {x.dtype}")

    @staticmethod
    def _pool3(h: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(h, 1).flatten(1).float()  # global average of Mixed_7c's 8x8 map

    def forward_stages(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every stage's output (keys ``STAGES``) plus ``"pool3"`` (N, 2048) float32."""
        self._check_input(x)
        h = self.normalize(x.float())
        out = {}
        for name in self.STAGES:
            h = getattr(self, name)(h)
            out[name] = h
        out["pool3"] = self._pool3(h)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float (N, 3, 299, 299) in [0, 255] -> (N, 2048) float32 pool3 features."""
        self._check_input(x)
        return self.features(self.normalize(x.float()))

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """(N, 2048) float32 pool3 features of an input already normalised to about [-1, 1]
        (``INPUT_NORMS``: clean-fid's ``(v - 128) / 128`` or pytorch-fid's ``2x - 1``)."""
        self._check_input(h)
        h = h.float()
        for name in self.STAGES:
            h = getattr(self, name)(h)
        return self._pool3(h)

    def logits(self, pool3: torch.Tensor) -> torch.Tensor:
        """The 1008-way classifier on pool3 features (Inception score; not used by FID)."""
        return self.fc(pool3)


# ---- weights --------------------------------------------------------------------------------------
def default_inception_path(weights_name: str = WEIGHTS_NAME) -> Path:
    """``$TORCH_HOME/hub/checkpoints/<weights_name>`` (where torch-fidelity / torchmetrics, and for
    ``PT_WEIGHTS_NAME`` pytorch-fid, cache it; ``TORCH_HOME`` defaults to ~/.cache/torch)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / weights_name


def expected_state_shapes() -> dict[str, tuple[int, ...]]:
    """key -> shape of the weight file (472 keys; BatchNorm's ``num_batches_tracked`` excluded)."""
    with torch.device("meta"):
        model = InceptionV3()
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def _summarise(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_inception(path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                   check_hash: bool = True, weights_name: str = WEIGHTS_NAME,
                   weights_url: str = WEIGHTS_URL) -> InceptionV3:
    """Strictly load torch-fidelity's Inception weights (``WEIGHTS_NAME``; or pytorch-fid's
    ``PT_WEIGHTS_NAME`` with ``weights_name`` / ``weights_url``, same keys) into ``InceptionV3``.

    ``path`` defaults to ``default_inception_path()``; nothing is downloaded. Checks, in order:
    the file exists (FileNotFoundError naming it, the expected file name and ``WEIGHTS_URL``);
    it unpickles with ``torch.load(weights_only=True)`` into a dict of tensors; its keys and
    shapes equal the model's (ValueError naming missing / unexpected / mismatched keys: a
    checkpoint for another model is an error, never a partial load); if the file name carries a
    torch.hub hash suffix (``-6726825d.pth``), the file's SHA-256 starts with it. A missing
    ``num_batches_tracked`` (the official file has none) is filled with 0. Returns the model in
    eval mode with ``requires_grad`` off.
    """

    path = os.fspath(default_inception_path(weights_name) if path is None else path)
    if not os.path.isfile(path):
        raise MissingInputFile(f"Inception weights not found: {path}. FID needs {weights_name} "
                               f"(download it from {weights_url} and pass its path, "
                               f"or place it at {default_inception_path(weights_name)}).")
    state = torch_load(path, f"the FID Inception-v3 weights {weights_name}", weights_url)
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise BadInputFile(f"{path} does not hold a state dict (dict of str -> Tensor) but a {type(state).__name__}; "
                         f"expected {weights_name} from {weights_url}")
    expected = expected_state_shapes()
    given = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    missing = expected.keys() - given.keys()
    unexpected = (given.keys() - expected.keys()) | {k for k in state.keys() - given.keys()
                                                     if k.rsplit(".", 1)[0] + ".weight" not in expected}
    mismatched = {k: (tuple(given[k].shape), expected[k]) for k in expected.keys() & given.keys()
                  if tuple(given[k].shape) != expected[k] or not given[k].is_floating_point()}
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing keys: {_summarise(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_summarise(unexpected)}")
        if mismatched:
            bad = sorted(mismatched)[:8]
            parts.append("mismatched: " + ", ".join(
                f"{k} {tuple(given[k].shape)} {given[k].dtype} (expected {mismatched[k][1]} float)" for k in bad)
                + (f", ... ({len(mismatched)} in all)" if len(mismatched) > 8 else ""))
        raise BadInputFile(f"{path} is not the FID Inception-v3 weight file {weights_name} ({'; '.join(parts)}); "
                         f"download it from {weights_url}")
    if check_hash:
        m = _HASH_IN_NAME.search(os.path.basename(path))
        if m is not None:
            digest = sha256_file(path)
            if not digest.startswith(m.group(1)):
                raise BadInputFile(f"{path}: SHA-256 {digest[:16]}... does not start with {m.group(1)} as its file name "
                                 f"says (corrupted or modified file?); re-download it from {weights_url}")
    state = dict(state)  # a plain dict: no _metadata, so no version-dependent BatchNorm handling
    for k in expected:
        if k.endswith(".bn.running_var"):
            state.setdefault(k[: -len("running_var")] + "num_batches_tracked", torch.tensor(0, dtype=torch.long))
    model = InceptionV3()
    model.load_state_dict(state, strict=True)
    model.requires_grad_(False)
    return model.to(device).eval()


# ---- feature extractor ------------------------------------------------------------------------------
def _as_image_list(images) -> Sequence:
    """A uint8 (n, H, W, 3) array / tensor, or a sequence of (H, W, 3) uint8 arrays / tensors /
    PIL images (sizes may differ)."""
    if isinstance(images, torch.Tensor):
        images = images.detach().cpu().numpy()
    if isinstance(images, np.ndarray) and images.ndim != 4:
        raise ValueError(f"images must be (n, H, W, 3) uint8 or a sequence of (H, W, 3) uint8 images, got shape {images.shape}")
    return images


def _as_uint8_hwc(img) -> np.ndarray:
    if hasattr(img, "convert") and hasattr(img, "size"):  # PIL image: clean-fid reads with .convert('RGB')
        img = np.asarray(img.convert("RGB"))
    elif isinstance(img, torch.Tensor):
        img = img.detach().cpu().numpy()
    img = np.asarray(img)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"FID images must be uint8 (H, W, 3) (decoded PNG/JPEG pixels), got {img.dtype} {img.shape}")
    return img


# the network's input normalisation per protocol (the preprocessing's output range -> about [-1, 1])
INPUT_NORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "clean_fid": InceptionV3.normalize,  # [0, 255] -> (v - 128) / 128 (clean-fid, torch-fidelity)
    "pytorch_fid": lambda x: 2 * x - 1,  # [0, 1] -> 2x - 1 (pytorch_fid.inception.InceptionV3, normalize_input)
}

# recipe -> how its FID features are made (see the module docstring); ``label``: what the
# extractor's ``protocol`` attribute (and every FID number made with it) says
FID_RECIPES = {
    "clean_fid": {"preprocess": fid_preprocess, "input_norm": "clean_fid", "weights_name": WEIGHTS_NAME,
                  "weights_url": WEIGHTS_URL, "label": "lantern_crop_lanczos256+clean_fid_bicubic299"},
    "pytorch_fid": {"preprocess": pytorch_fid_preprocess, "input_norm": "pytorch_fid", "weights_name": PT_WEIGHTS_NAME,
                    "weights_url": PT_WEIGHTS_URL, "label": "pytorch_fid_bilinear299"},
}


class InceptionFeatureExtractor(FeatureExtractor):
    """Inception-v3 pool3 features under the clean-fid protocol: (n, 2048) float64 (float32 values).

    Images: uint8 (n, H, W, 3) or a sequence of uint8 (H, W, 3) images of any (mixed) sizes, or
    PIL images (converted to RGB). Each image is prepared on the CPU by ``preprocess`` (default
    ``fid_preprocess``: LANTERN centre crop + LANCZOS 256, then clean-fid's float bicubic 299)
    and the network runs on blocks of exactly ``block`` images (the last one zero-padded), so an
    image's features are bit-identical whatever ``batch_size`` is and wherever it sits in the
    input (see ``FeatureExtractor``). Float images are refused: the protocol starts from uint8
    pixels (generated images are quantised as the saved PNGs are). The network runs with TF32 off
    (``coolsd.metrics.numerics.ieee_fp32``: cuDNN's convolutions would use it by default), so
    CUDA features agree with CPU features to float32 rounding; ``numerics`` names the device
    type and that precision for the reference cache key.
    """

    name = "inception_v3_pool3"
    feature_dim = FEATURE_DIM
    block = 32

    def __init__(self, model: InceptionV3, batch_size: int = 64, device: str | torch.device | None = None,
                 block: int | None = None, preprocess: Callable[[np.ndarray], np.ndarray] = fid_preprocess,
                 input_norm: str = "clean_fid"):
        device = next(model.parameters()).device if device is None else device
        super().__init__(batch_size, device)
        if block is not None:
            if block < 1:
                raise ValueError(f"block must be >= 1, got {block}")
            self.block = int(block)
        if input_norm not in INPUT_NORMS:
            raise ValueError(f"input_norm must be one of {sorted(INPUT_NORMS)}, got {input_norm!r}")
        self.model = model.to(self.device).eval()
        self.preprocess = preprocess
        self.input_norm = input_norm
        known = {(v["preprocess"], v["input_norm"]): v["label"] for v in FID_RECIPES.values()}
        self.protocol = known.get((preprocess, input_norm),
                                  f"{getattr(preprocess, '__name__', repr(preprocess))}+{input_norm}")

    @classmethod
    def from_file(cls, path: str | os.PathLike | None = None, batch_size: int = 64,
                  device: str | torch.device = "cpu", recipe: str = "clean_fid", **kw) -> "InceptionFeatureExtractor":
        """The extractor of ``FID_RECIPES[recipe]`` (its preprocessing, normalisation and
        weight file name in errors) with the weights at ``path``."""
        p = FID_RECIPES[recipe]
        model = load_inception(path, device, weights_name=p["weights_name"], weights_url=p["weights_url"])
        return cls(model, batch_size, device, preprocess=p["preprocess"], input_norm=p["input_norm"], **kw)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:  # float (block, 3, 299, 299), the preprocessing's range
        if self.input_norm == "clean_fid":
            return self.model(x)  # [0, 255], normalised inside forward
        return self.model.features(INPUT_NORMS[self.input_norm](x))

    def prepare(self, images) -> torch.Tensor:
        """float32 (n, 3, 299, 299) (in [0, 255] for clean-fid, [0, 1] for pytorch-fid): ``preprocess``
        applied to each image."""
        images = _as_image_list(images)
        out = np.empty((len(images), 3, INCEPTION_SIZE, INCEPTION_SIZE), np.float32)
        for i in range(len(images)):
            out[i] = self.preprocess(_as_uint8_hwc(images[i]))
        return torch.from_numpy(out)

    def features_of_prepared(self, x: torch.Tensor) -> np.ndarray:
        """(n, 2048) float64 features of already prepared float (n, 3, 299, 299) images (``prepare``)."""
        n = len(x)
        parts = []
        with torch.inference_mode(), ieee_fp32():  # TF32 off: features agree with the CPU's (numerics)
            for b in range(0, n, self.block):
                chunk = x[b:b + self.block].to(self.device, torch.float32)
                m = len(chunk)
                if m < self.block:
                    chunk = torch.cat([chunk, chunk.new_zeros((self.block - m, *chunk.shape[1:]))])
                parts.append(self._forward(chunk)[:m].cpu())
        if not parts:
            return np.zeros((0, self.feature_dim))
        return torch.cat(parts).double().numpy()

    def __call__(self, images, batch_size: int | None = None) -> np.ndarray:
        images = _as_image_list(images)
        n = len(images)
        bs = self.batch_size if batch_size is None else batch_size
        bs = -(-max(bs, 1) // self.block) * self.block  # a multiple of block: blocks never straddle batches
        parts = [self.features_of_prepared(self.prepare(images[s:s + bs])) for s in range(0, n, bs)]
        return np.concatenate(parts) if parts else np.zeros((0, self.feature_dim))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, protocol={self.protocol!r}, block={self.block}, "
                f"batch_size={self.batch_size}, device={self.device})")
