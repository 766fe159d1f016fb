"""The toy world's feature network: a small CNN with one classification head per attribute.

Its penultimate layer is the feature space of ``toy_fid``; its heads are the classifier of
``toy_clip`` (``coolsd.metrics.toy``). It is trained on rendered scenes with augmentation that
mimics VQ-tokenizer reconstructions (8x8 tokens of 4x4 pixels: blur, block down/up-sampling,
per-token colour shifts, quantised colours, noise, 1 px jitter) so reconstructed/generated
images are classified nearly as well as clean renders.

    model, metrics = train_feature_net()          # 1200 steps: ~4-6 min on a shared 2-core CPU
    save_feature_net(model, path, metrics)
    ext = ToyFeatureExtractor(load_feature_net(path))
    feats = ext(images_uint8_nhwc)                 # (n, 128) float64
    preds = ext.predict_attributes(images)         # {"shape": (n,), ...}
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coolsd.metrics import FeatureExtractor
from coolsd.toy.scenes import ATTRIBUTES, IMAGE_SIZE, render_batch, sample_scenes

FORMAT = "coolsd.toy_feature_net"
FORMAT_VERSION = "1"
REBUILD_HINT = "`make toy-assets` rebuilds it"
DEFAULT_CONFIG = {"channels": [16, 32, 64], "feature_dim": 128, "image_size": IMAGE_SIZE}


class ToyFeatureNet(nn.Module):
    """Conv stages 32 -> 16 -> 8 -> 4 (conv3x3-BN-ReLU, twice in the first stage, then 2x2
    max-pool). Features: linear over [flattened 4x4 map (where), global max-pool (what)] ->
    ``feature_dim`` ReLU units; then one linear head per attribute. Input (n, 3, H, W) float in
    [0, 1]. BatchNorm uses running statistics in eval mode, so features of one image do not
    depend on the rest of the batch."""

    def __init__(self, channels=(16, 32, 64), feature_dim: int = 128, image_size: int = IMAGE_SIZE):
        super().__init__()
        channels = [int(c) for c in channels]
        if image_size % 2 ** len(channels):
            raise ValueError(f"image_size {image_size} not divisible by 2**{len(channels)}")
        self.channels, self.feature_dim, self.image_size = channels, int(feature_dim), int(image_size)
        layers, c_in = [], 3
        for i, c in enumerate(channels):
            for _ in range(2 if i == 0 else 1):
                layers += [nn.Conv2d(c_in, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
                c_in = c
            layers.append(nn.MaxPool2d(2))
        self.trunk = nn.Sequential(*layers)
        side = image_size // 2 ** len(channels)
        self.proj = nn.Linear(c_in * (side * side + 1), self.feature_dim)
        self.heads = nn.ModuleDict({k: nn.Linear(self.feature_dim, len(v)) for k, v in ATTRIBUTES.items()})

    @property
    def config(self) -> dict:
        return {"channels": list(self.channels), "feature_dim": self.feature_dim, "image_size": self.image_size}

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(n, feature_dim) penultimate-layer features (post-ReLU)."""
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"expected {self.image_size}x{self.image_size} images, got {tuple(x.shape[-2:])}")
        h = self.trunk(x - 0.5)
        return F.relu(self.proj(torch.cat([h.flatten(1), h.amax((2, 3))], 1)))

    def logits(self, feats: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: head(feats) for k, head in self.heads.items()}

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.logits(self.features(x))


# ---- augmentation / degradation (batched torch; (n, 3, H, W) float in [0, 1]) -------------
def _gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, radius: int = 2) -> torch.Tensor:
    """Per-image separable Gaussian blur, replicate padding; sigma (n,) > 0."""
    n, c, h, w = x.shape
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    k = torch.exp(-0.5 * (t[None] / sigma[:, None].to(x.dtype)) ** 2)
    k = (k / k.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (n*c, 2r+1)
    y = x.reshape(1, n * c, h, w)
    y = F.conv2d(F.pad(y, (radius, radius, 0, 0), mode="replicate"), k[:, None, None, :], groups=n * c)
    y = F.conv2d(F.pad(y, (0, 0, radius, radius), mode="replicate"), k[:, None, :, None], groups=n * c)
    return y.reshape(n, c, h, w)


def _down_up(x: torch.Tensor, factor: int, mode: str = "bilinear") -> torch.Tensor:
    """Average-pool by ``factor`` then upsample back (bilinear or nearest)."""
    small = F.avg_pool2d(x, factor)
    if mode == "nearest":
        return F.interpolate(small, scale_factor=factor, mode="nearest")
    return F.interpolate(small, scale_factor=factor, mode="bilinear", align_corners=False)


def _quantise(x: torch.Tensor, levels) -> torch.Tensor:
    lv = torch.as_tensor(levels, dtype=x.dtype, device=x.device).reshape(-1, 1, 1, 1) - 1
    return torch.round(x * lv) / lv


def _shift(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, max_shift: int = 1) -> torch.Tensor:
    """Per-image integer translation by (dy, dx) in [-max_shift, max_shift], replicate edges."""
    m = max_shift
    n, _, h, w = x.shape
    xp = F.pad(x, (m, m, m, m), mode="replicate")
    rows = (torch.arange(h, device=x.device)[None] + m - dy[:, None]).clamp(0, h + 2 * m - 1)  # (n, h)
    cols = (torch.arange(w, device=x.device)[None] + m - dx[:, None]).clamp(0, w + 2 * m - 1)
    b = torch.arange(n, device=x.device)[:, None, None]
    return xp.permute(0, 2, 3, 1)[b, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """VQ-artefact augmentation of a training batch; all randomness from ``g`` (CPU)."""
    n, c, h, w = x.shape

    def u(*shape):
        return torch.rand(*shape, generator=g)

    def pick(p):
        return torch.nonzero(u(n) < p).flatten()

    x = _shift(x, torch.randint(-1, 2, (n,), generator=g), torch.randint(-1, 2, (n,), generator=g))
    i = pick(0.5)  # blur
    if len(i):
        x[i] = _gaussian_blur(x[i], 0.4 + 0.9 * u(len(i)))
    i = pick(0.35)  # token-grid down/up-sampling
    if len(i):
        f4 = u(len(i)) < 0.5
        nearest = u(len(i)) < 0.3
        for fac, sel in ((4, f4), (2, ~f4)):
            for mode, msel in (("nearest", nearest), ("bilinear", ~nearest)):
                j = i[sel & msel]
                if len(j):
                    x[j] = _down_up(x[j], fac, mode)
    i = pick(0.4)  # per-token (4x4 block) colour offsets
    if len(i):
        s = 0.04 * u(len(i), 1, 1, 1)
        noise = torch.randn(len(i), c, h // 4, w // 4, generator=g) * s
        x[i] = x[i] + F.interpolate(noise, scale_factor=4, mode="nearest")
    i = pick(0.5)  # global colour shift
    if len(i):
        x[i] = x[i] + 0.025 * torch.randn(len(i), c, 1, 1, generator=g)
    i = pick(0.5)  # pixel noise
    if len(i):
        x[i] = x[i] + 0.04 * u(len(i), 1, 1, 1) * torch.randn(len(i), c, h, w, generator=g)
    i = pick(0.3)  # colour quantisation, 8..16 levels per channel
    if len(i):
        x[i] = _quantise(x[i].clamp(0, 1), torch.randint(8, 17, (len(i),), generator=g))
    return x.clamp(0, 1)


DEGRADATIONS = {
    "clean": lambda x: x,
    "down2_up": lambda x: _down_up(x, 2),  # 2x average-pool then bilinear upsample
    "down4_up": lambda x: _down_up(x, 4),  # 4x (one value per VQ token) then bilinear upsample
    "blur1_quant8": lambda x: _quantise(_gaussian_blur(x, torch.full((len(x),), 1.0)), 8),
}


def degrade(images: torch.Tensor, kind: str) -> torch.Tensor:
    """Deterministic degraded copy of (n, 3, H, W) float images in [0, 1] (see DEGRADATIONS)."""
    if kind not in DEGRADATIONS:
        raise ValueError(f"unknown degradation {kind!r}; valid: {', '.join(DEGRADATIONS)}")
    return DEGRADATIONS[kind](images).clamp(0, 1)


# ---- training ------------------------------------------------------------------------------
def _scene_data(n: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    scenes = sample_scenes(n, seed)
    x = torch.from_numpy(render_batch(scenes)).permute(0, 3, 1, 2).float() / 255
    y = {k: torch.tensor([s.labels()[k] for s in scenes]) for k in ATTRIBUTES}
    return x, y


@torch.no_grad()
def evaluate_feature_net(model: ToyFeatureNet, x: torch.Tensor, y: dict, kinds=tuple(DEGRADATIONS), batch_size: int = 500) -> dict:
    """{degradation: {attribute: accuracy, "all": fraction of images with every attribute right}}."""
    was = model.training
    model.eval()
    out = {}
    for kind in kinds:
        correct = {k: 0 for k in ATTRIBUTES}
        all_right = 0
        for s in range(0, len(x), batch_size):
            logits = model(degrade(x[s:s + batch_size], kind))
            ok = torch.stack([logits[k].argmax(1) == y[k][s:s + batch_size] for k in ATTRIBUTES])
            for k, row in zip(ATTRIBUTES, ok):
                correct[k] += int(row.sum())
            all_right += int(ok.all(0).sum())
        out[kind] = {**{k: correct[k] / len(x) for k in ATTRIBUTES}, "all": all_right / len(x)}
    model.train(was)
    return out


def train_feature_net(
    steps: int = 1200,
    batch_size: int = 128,
    seed: int = 0,
    log: Callable | None = print,
    n_train: int = 12000,
    n_eval: int = 2000,
    lr: float = 2e-3,
    config: dict | None = None,
    log_every: int = 250,
) -> tuple[ToyFeatureNet, dict]:
    """Train a ToyFeatureNet; deterministic given ``seed`` (and torch's thread count).

    Training images: ``n_train`` scenes ``sample_scenes(n_train, 1000 + 2 * seed)`` rendered once,
    augmented per step (``augment``). Held-out: ``n_eval`` scenes from ``sample_scenes(n_eval,
    1001 + 2 * seed)``. Adam, cosine learning-rate decay, summed cross-entropy over attributes.
    Returns (model in eval mode, metrics) with metrics["heldout"] = evaluate_feature_net on the
    held-out set (clean and degraded renders) and timings.
    """
    log = log or (lambda *a, **k: None)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    t0 = time.perf_counter()
    x_tr, y_tr = _scene_data(n_train, 1000 + 2 * seed)
    x_ev, y_ev = _scene_data(n_eval, 1001 + 2 * seed)
    t_data = time.perf_counter() - t0
    log(f"[toy features] rendered {n_train} train + {n_eval} held-out scenes in {t_data:.1f}s")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ToyFeatureNet(cfg["channels"], cfg["feature_dim"], cfg["image_size"])
    g = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    run_loss = None
    for step in range(1, steps + 1):
        idx = torch.randint(0, n_train, (batch_size,), generator=g)
        xb = augment(x_tr[idx].clone(), g)
        logits = model(xb)
        loss = sum(F.cross_entropy(logits[k], y_tr[k][idx]) for k in ATTRIBUTES)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        lv = loss.item()
        run_loss = lv if run_loss is None else 0.98 * run_loss + 0.02 * lv
        if log_every and (step % log_every == 0 or step == steps):
            log(f"[toy features] step {step}/{steps} loss {run_loss:.4f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    t_train = time.perf_counter() - t0 - t_data
    heldout = evaluate_feature_net(model, x_ev, y_ev)
    for kind, acc in heldout.items():
        log(f"[toy features] held-out {kind}: " + " ".join(f"{k}={v:.3f}" for k, v in acc.items()))
    metrics = {
        "heldout": heldout, "final_loss": run_loss, "steps": steps, "batch_size": batch_size, "seed": seed,
        "n_train": n_train, "n_eval": n_eval, "lr": lr, "config": cfg,
        "data_s": t_data, "train_s": t_train, "wall_s": time.perf_counter() - t0,
    }
    return model, metrics


# ---- persistence -----------------------------------------------------------------------------
def save_feature_net(model: ToyFeatureNet, path: str | os.PathLike, metrics: dict | None = None) -> None:
    """safetensors file; config (and optional training metrics) as JSON in the metadata."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "config": json.dumps(model.config)}
    if metrics is not None:
        meta["metrics"] = json.dumps(metrics)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = path + ".tmp"
    save_file(state, tmp, metadata=meta)
    os.replace(tmp, path)


def read_feature_net_metadata(path: str | os.PathLike) -> dict:
    """The file's metadata (config and metrics parsed from JSON)."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"toy feature network weights not found: {path} ({REBUILD_HINT})")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
    except Exception as e:
        raise ValueError(f"toy feature network file {path} is unreadable or corrupted ({' '.join(str(e).split())}); {REBUILD_HINT}") from e
    if meta.get("format") != FORMAT or "config" not in meta:
        raise ValueError(f"{path} is not a toy feature network file (metadata format={meta.get('format')!r}); {REBUILD_HINT}")
    try:
        meta["config"] = json.loads(meta["config"])
        if "metrics" in meta:
            meta["metrics"] = json.loads(meta["metrics"])
    except json.JSONDecodeError as e:
        raise ValueError(f"toy feature network file {path} has corrupted metadata ({e}); {REBUILD_HINT}") from e
    return meta


def load_feature_net(path: str | os.PathLike, device: str | torch.device = "cpu") -> ToyFeatureNet:
    """Strictly load a file written by ``save_feature_net``; the model is returned in eval mode."""
    from safetensors.torch import load_file

    path = os.fspath(path)
    meta = read_feature_net_metadata(path)
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: toy feature network format version {meta.get('version')!r}, expected {FORMAT_VERSION!r}; {REBUILD_HINT}")
    try:
        model = ToyFeatureNet(**meta["config"])
        state = load_file(path)
        model.load_state_dict(state, strict=True)
    except Exception as e:
        detail = " ".join(str(e).split())
        raise ValueError(f"toy feature network file {path} does not match the model ({detail}); {REBUILD_HINT}") from e
    return model.to(device).eval()


# ---- feature extractor ------------------------------------------------------------------------
class ToyFeatureExtractor(FeatureExtractor):
    """Penultimate-layer features of a ToyFeatureNet (``toy_fid``), and attribute predictions
    (``toy_clip``). Images: uint8 (n, 32, 32, 3) or float (n, 3, 32, 32) in [0, 1]."""

    name = "toy_feature_net"

    def __init__(self, model: ToyFeatureNet, batch_size: int = 256, device: str | torch.device | None = None):
        device = next(model.parameters()).device if device is None else device
        super().__init__(batch_size, device)
        self.model = model.to(self.device).eval()
        self.feature_dim = model.feature_dim
        self._empty_hw = (model.image_size, model.image_size)

    @classmethod
    def from_file(cls, path, batch_size: int = 256, device: str | torch.device = "cpu") -> "ToyFeatureExtractor":
        return cls(load_feature_net(path, device), batch_size, device)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.features(x)

    def _forward_all(self, x: torch.Tensor):
        f = self.model.features(x)
        logits = self.model.logits(f)
        return (f, *(logits[k].argmax(1) for k in ATTRIBUTES))

    def predict_attributes(self, images, batch_size: int | None = None) -> dict[str, np.ndarray]:
        """attribute -> (n,) int64 predicted class ids (indices into ``ATTRIBUTES[attribute]``)."""
        return self.features_and_predictions(images, batch_size)[1]

    def features_and_predictions(self, images, batch_size: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Both in one pass: ((n, d) float64 features, attribute -> (n,) int64 class ids)."""
        out = self._run(images, batch_size, self._forward_all)
        feats = out[0].double().numpy().reshape(len(images), self.feature_dim)
        return feats, {k: o.numpy().astype(np.int64) for k, o in zip(ATTRIBUTES, out[1:])}
