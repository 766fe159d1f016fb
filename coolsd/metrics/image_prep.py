"""Image preprocessing for FID under the clean-fid protocol, as LANTERN / COOL-SD run it.

docs/methods.md#6-evaluation-protocol: both image sets (the 5,000 COCO val2017 images and the generated PNGs) are
centre-cropped to the short side and LANCZOS-resized to 256x256. That is LANTERN's
``custom_image_tranform`` for ``cleanfid.fid.compute_fid(..., mode="clean")``; clean-fid then
resizes the 256x256 uint8 image to 299x299 with its "clean" resizer (PIL bicubic on each channel
as a 32-bit float 'F' image, clipped to [0, 255], not re-quantised) and feeds the float pixels
in [0, 255] to Inception (which normalises ``(x - 128) / 128``; ``coolsd.metrics.inception``).
Per image:

    np.asarray(Image.open(path).convert("RGB"))    # load_rgb: uint8 (H, W, 3)
    -> lantern_transform                           # uint8 (256, 256, 3)
    -> clean_resize_299                            # float32 (299, 299, 3) in [0, 255]
    -> transpose to (3, 299, 299)                  # fid_preprocess does all of this after loading

All functions are pure and deterministic (PIL resampling is exact integer/float arithmetic
with no threading-dependent order), one image at a time, so features never depend on batching.

``pytorch_fid_preprocess`` is the other protocol (``--protocol sjd``, the SJD family's
``pytorch_fid.calculate_fid_given_paths``): no crop, no LANCZOS step, the whole image squashed
to 299x299 by torch's bilinear ``interpolate`` (``align_corners=False``, no antialiasing, so a
768-pixel image is aliased on the way down), values in [0, 1]; the network then maps them with
``2x - 1`` (= v / 127.5 - 1, not clean-fid's (v - 128) / 128). See ``coolsd.metrics.protocols``.

Why ours and not the libraries' code: ``cleanfid.resize.make_resizer("PIL", False, "bicubic",
(299, 299))`` (clean-fid 0.1.35) computes ``clean_resize_299`` bit for bit (tests/cli/test_eval_protocols.py,
run where clean-fid is installed), and ``cleanfid.resize`` itself imports without torchvision;
but the clean-fid distribution requires torchvision, which pip would install beside our pinned
torch 2.13 CPU where PyPI's torchvision does not import, so clean-fid cannot be a dependency of
the base install (only a ``pip install --no-deps clean-fid`` that the Makefile does not do).
pytorch-fid's resize lives in ``pytorch_fid.inception``, which imports torchvision at module
import; ``pytorch_fid_preprocess`` is one torch call (``F.interpolate``), the same operation.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

INCEPTION_SIZE = 299
LANTERN_SIZE = 256


def load_rgb(path: str | os.PathLike) -> np.ndarray:
    """uint8 (H, W, 3) pixels of an image file, greyscale/palette/alpha converted with
    PIL's ``convert("RGB")`` as clean-fid does (some COCO val2017 images are greyscale)."""
    with Image.open(path) as img:
        return np.array(img.convert("RGB"))


def _check_hwc3(img: np.ndarray, what: str) -> np.ndarray:
    img = np.asarray(img)
    if img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(f"{what} expects an (H, W, 3) image, got shape {img.shape}")
    return img


def center_crop_offsets(width: int, height: int) -> tuple[int, int, int]:
    """(left, top, side) of the centred square crop of side ``min(width, height)``, with
    torchvision ``center_crop``'s offsets ``int(round((W - s) / 2))`` / ``int(round((H - s) / 2))``:
    Python's round, i.e. half to even (640x427 -> left 106, not 107; 640x425 -> left 108;
    500x375 -> left 62; 427x640 -> top 106)."""
    s = min(width, height)
    return int(round((width - s) / 2.0)), int(round((height - s) / 2.0)), s


def center_crop_square(img: Image.Image) -> Image.Image:
    """Centre crop of a PIL image to a ``min(W, H)`` square (torchvision ``center_crop(img,
    min(img.size))`` with round-half-to-even offsets; see ``center_crop_offsets``). A square
    image is returned unchanged (as a copy)."""
    left, top, s = center_crop_offsets(*img.size)
    return img.crop((left, top, left + s, top + s))


def lantern_transform(img: np.ndarray) -> np.ndarray:
    """LANTERN's FID pre-transform: uint8 (H, W, 3) -> uint8 (256, 256, 3).

    Centre crop to the short side (``center_crop_square``), then PIL LANCZOS resize to 256x256
    on the 8-bit RGB image. A 256x256 input comes back unchanged (PIL skips a same-size resize)."""
    img = _check_hwc3(img, "lantern_transform")
    if img.dtype != np.uint8:
        raise ValueError(f"lantern_transform expects uint8 pixels, got {img.dtype}")
    pil = center_crop_square(Image.fromarray(np.ascontiguousarray(img), "RGB"))
    return np.array(pil.resize((LANTERN_SIZE, LANTERN_SIZE), Image.Resampling.LANCZOS))


def clean_resize_299(img: np.ndarray) -> np.ndarray:
    """clean-fid's "clean" resizer: (H, W, 3) uint8 or float -> float32 (299, 299, 3) in [0, 255].

    Each channel, as float32, becomes a PIL 32-bit float ('F') image, is resized to 299x299 with
    ``Image.BICUBIC`` and clipped to [0, 255] (bicubic overshoots); the result is not rounded
    or quantised. This is NOT bicubic on the uint8 image (which rounds per pass) nor torch's
    bicubic interpolate (no antialiasing on downscale)."""
    img = _check_hwc3(img, "clean_resize_299")
    if not (img.dtype == np.uint8 or np.issubdtype(img.dtype, np.floating)):
        raise ValueError(f"clean_resize_299 expects uint8 or float pixels, got {img.dtype}")
    out = np.empty((INCEPTION_SIZE, INCEPTION_SIZE, 3), np.float32)
    for c in range(3):
        ch = Image.fromarray(np.ascontiguousarray(img[:, :, c], dtype=np.float32))  # float32 -> mode 'F'
        if ch.mode != "F":
            raise RuntimeError(f"PIL made a {ch.mode!r} image from float32 pixels, expected 'F'")
        ch = ch.resize((INCEPTION_SIZE, INCEPTION_SIZE), resample=Image.Resampling.BICUBIC)
        out[:, :, c] = np.asarray(ch, dtype=np.float32).clip(0, 255)
    return out


def fid_preprocess(img: np.ndarray) -> np.ndarray:
    """The whole FID image chain: uint8 (H, W, 3) -> float32 (3, 299, 299) in [0, 255]:
    ``lantern_transform`` (centre crop, LANCZOS 256), then ``clean_resize_299``, channels first
    (clean-fid's ``ToTensor`` on a float32 array only transposes; it does not divide by 255)."""
    return np.ascontiguousarray(clean_resize_299(lantern_transform(img)).transpose(2, 0, 1))


def pytorch_fid_preprocess(img: np.ndarray) -> np.ndarray:
    """pytorch-fid's image chain (``pytorch_fid.fid_score.ImagePathDataset`` + ``InceptionV3.forward``
    with ``resize_input=True``): uint8 (H, W, 3) -> float32 (3, 299, 299) in [0, 1]:
    ``ToTensor`` (v / 255, channels first), then ``F.interpolate(size=(299, 299), mode="bilinear",
    align_corners=False)`` on the one image (the SJD evaluation runs it at batch size 1, so any
    image size works). The normalisation ``2x - 1`` is the network's (``INPUT_NORMS``)."""
    img = _check_hwc3(img, "pytorch_fid_preprocess")
    if img.dtype != np.uint8:
        raise ValueError(f"pytorch_fid_preprocess expects uint8 pixels, got {img.dtype}")
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div(255.0)[None]  # a copy: may be read-only
    x = F.interpolate(x, size=(INCEPTION_SIZE, INCEPTION_SIZE), mode="bilinear", align_corners=False)
    return np.ascontiguousarray(x[0].numpy())
