"""The toy continuous world (continuous_sd.md 4.1): the toy scenes (coolsd.toy.scenes)
as 8x8 grids of continuous 16-dim tokens, and a MAR target and a smaller MAR draft over them.

* ``PatchPCA``: the continuous "autoencoder": each 4x4x3 patch -> its top-16 principal
  components, one global scale so tokens have unit variance (MAR's KL-16 VAE role and its 0.2325
  scale). Decoding is the linear inverse; the reconstruction error is measured at build time.
* ``ToyMAR``: ``coolsd.models.mar.MAR`` conditioned on the scene's five attributes (a sum of
  attribute embeddings, in the buffer positions) instead of an ImageNet class; ``NULL_LABEL``
  rows use ``fake_latent`` (classifier-free guidance).
* ``build`` trains both (``python -m coolsd.toy.continuous``, ``make toy-continuous-assets``):
  MAR's training (random order, a random number of masked tokens, the diffusion loss on masked
  tokens, labels dropped 10% of the time) on rendered scenes; weights ship in
  ``coolsd/toy/assets/continuous_*.safetensors`` (fp16) with ``continuous_manifest.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from coolsd.models.mar import MAR, NULL_LABEL, MARConfig
from coolsd.models.mar_loss import mar_loss
from coolsd.toy.scenes import ATTRIBUTES, IMAGE_SIZE, render_batch, sample_scenes
from coolsd.toy.weights import check_checksums, read_weights, save_weights
from coolsd.util.loading import BadInputFile
from coolsd.util.records import sha256_file, write_json_atomic

PATCH = 4
TOKEN_DIM = 16
SIDE = IMAGE_SIZE // PATCH  # 8 x 8 tokens
ASSETS_DIR = Path(__file__).resolve().parents[1] / "toy" / "assets"
FILES = {"codec": "continuous_codec.safetensors", "target": "continuous_target.safetensors",
         "draft": "continuous_draft.safetensors"}
MANIFEST = "continuous_manifest.json"
REBUILD = "run `make toy-continuous-assets` to rebuild it"
DATA_SEED = 7101  # training scenes; evaluation prompts come from coolsd.toy.scenes.toy_prompts (another seed)
N_ATTR = tuple(len(v) for v in ATTRIBUTES.values())

_BACKBONE = dict(seq_len=SIDE * SIDE, token_dim=TOKEN_DIM, buffer_size=4, n_classes=1)
TOY_TARGET = MARConfig(encoder_dim=128, encoder_depth=3, encoder_heads=4, decoder_dim=128, decoder_depth=3,
                       decoder_heads=4, head_width=128, head_depth=3, **_BACKBONE)
TOY_DRAFT = MARConfig(encoder_dim=64, encoder_depth=1, encoder_heads=4, decoder_dim=64, decoder_depth=1,
                      decoder_heads=4, head_width=64, head_depth=2, **_BACKBONE)


def _patches(images: np.ndarray) -> torch.Tensor:
    """uint8 (B, 32, 32, 3) -> float64 (B, 64, 48) in [-1, 1], raster order."""
    x = torch.from_numpy(np.ascontiguousarray(images)).double() / 127.5 - 1
    B = x.shape[0]
    return x.reshape(B, SIDE, PATCH, SIDE, PATCH, 3).permute(0, 1, 3, 2, 4, 5).reshape(B, SIDE * SIDE, -1)


class PatchPCA(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(PATCH * PATCH * 3, dtype=torch.float64))
        self.register_buffer("basis", torch.zeros(TOKEN_DIM, PATCH * PATCH * 3, dtype=torch.float64))
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))

    @classmethod
    def fit(cls, images: np.ndarray) -> "PatchPCA":
        codec = cls()
        p = _patches(images).reshape(-1, PATCH * PATCH * 3)
        codec.mean = p.mean(0)
        _, _, v = torch.linalg.svd(p - codec.mean, full_matrices=False)
        codec.basis = v[:TOKEN_DIM]
        codec.scale = ((p - codec.mean) @ codec.basis.T).std()
        return codec

    def encode(self, images: np.ndarray) -> torch.Tensor:
        """uint8 (B, 32, 32, 3) -> float32 tokens (B, 64, 16)."""
        return (((_patches(images) - self.mean) @ self.basis.T) / self.scale).float()

    def decode(self, tokens: torch.Tensor) -> np.ndarray:
        """tokens (B, 64, 16) -> uint8 (B, 32, 32, 3) (clamped)."""
        p = (tokens.double().cpu() * self.scale) @ self.basis + self.mean
        B = p.shape[0]
        x = p.reshape(B, SIDE, SIDE, PATCH, PATCH, 3).permute(0, 1, 3, 2, 4, 5).reshape(B, IMAGE_SIZE, IMAGE_SIZE, 3)
        return ((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()


class ToyMAR(MAR):
    """MAR conditioned on the five scene attributes; labels: (B, 5) indices, or NULL_LABEL rows."""

    def __init__(self, cfg: MARConfig):
        super().__init__(cfg)
        del self.class_emb
        self.attr_emb = nn.ModuleList(nn.Embedding(n, cfg.encoder_dim) for n in N_ATTR)
        for e in self.attr_emb:
            nn.init.normal_(e.weight, std=0.02)

    def class_embedding(self, labels: torch.Tensor) -> torch.Tensor:
        null = (labels[:, 0] == NULL_LABEL).unsqueeze(-1)
        emb = sum(e(labels[:, i].clamp(min=0)) for i, e in enumerate(self.attr_emb))
        return torch.where(null, self.fake_latent, emb)


def scene_labels(scenes) -> torch.Tensor:
    """(B, 5) attribute indices of toy scenes (the toy prompts' conditioning)."""
    return torch.tensor([list(s.labels().values()) for s in scenes], dtype=torch.long)


def train(model: MAR, tokens, labels, steps: int, batch: int = 32, lr: float = 1e-3, seed: int = 0, log=print):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    t0, hist = time.time(), []
    for step in range(steps):
        idx = torch.randint(0, len(tokens), (batch,), generator=gen)
        loss, parts = mar_loss(model, tokens[idx], labels[idx], gen)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        hist.append(float(loss.detach()))
        if step % 200 == 0 or step == steps - 1:
            log(f"step {step}/{steps} loss {np.mean(hist[-200:]):.4f} (mse {parts['mse']:.4f}) {time.time() - t0:.0f} s")
    model.eval()
    return {"steps": steps, "batch": batch, "lr": lr, "final_loss": float(np.mean(hist[-200:])), "seconds": time.time() - t0}


@dataclass
class ToyContinuousAssets:
    codec: PatchPCA
    target: ToyMAR
    draft: ToyMAR
    manifest: dict


def _save_model(path: Path, model: MAR, metrics: dict):
    save_weights(path, {k: v.half() for k, v in model.state_dict().items()}, "coolsd-toy-mar",
                 json.dumps({"config": asdict(model.config), "metrics": metrics}))


def _load_model(path: Path) -> ToyMAR:
    sd, meta = read_weights(path, "coolsd-toy-mar", "toy continuous weights", REBUILD)
    model = ToyMAR(MARConfig(**json.loads(meta)["config"]))
    try:
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    except RuntimeError as e:
        raise BadInputFile(f"toy continuous weights {path} do not match the model ({' '.join(str(e).split())[:300]}); "
                         f"{REBUILD}") from e
    return model.eval()


def check_continuous_manifest(assets_dir) -> dict:
    return check_checksums(assets_dir, MANIFEST, FILES.values(), "toy continuous weights", REBUILD)


def load_toy_continuous(assets_dir=None) -> ToyContinuousAssets:
    d = Path(assets_dir) if assets_dir else ASSETS_DIR
    manifest = check_continuous_manifest(d)
    sd, _ = read_weights(d / FILES["codec"], "coolsd-patch-pca", "toy continuous codec", REBUILD)
    codec = PatchPCA()
    codec.load_state_dict(sd, strict=True)
    return ToyContinuousAssets(codec, _load_model(d / FILES["target"]), _load_model(d / FILES["draft"]), manifest)


def build(out_dir: Path, n_images: int = 20000, steps: dict | None = None, log=print, configs: dict | None = None) -> dict:
    """Fit the codec and train target and draft (deterministic given the seeds and threads).
    ``configs``: other {"target", "draft"} MARConfigs (tests build tiny ones)."""
    steps = steps or {"target": 6000, "draft": 4000}
    configs = configs or {"target": TOY_TARGET, "draft": TOY_DRAFT}
    out_dir.mkdir(parents=True, exist_ok=True)
    scenes = sample_scenes(n_images, DATA_SEED)
    images = render_batch(scenes)
    codec = PatchPCA.fit(images[:4000])
    held = render_batch(sample_scenes(512, DATA_SEED + 1))
    err = np.abs(codec.decode(codec.encode(held)).astype(float) - held.astype(float)) / 255
    codec_m = {"heldout_mae": float(err.mean()), "heldout_p99": float(np.quantile(err, 0.99)), "fit_images": 4000}
    save_weights(out_dir / FILES["codec"], dict(codec.state_dict()), "coolsd-patch-pca", json.dumps(codec_m))
    log(f"codec: held-out mean abs error {codec_m['heldout_mae']:.4f} (of 1)")
    tokens, labels = codec.encode(images), scene_labels(scenes)
    metrics = {"codec": codec_m}
    for name, cfg in configs.items():
        torch.manual_seed(1 if name == "target" else 2)
        model = ToyMAR(cfg)
        log(f"{name}: {sum(p.numel() for p in model.parameters()):,} parameters")
        metrics[name] = train(model, tokens, labels, steps[name], seed=3 if name == "target" else 4, log=log)
        _save_model(out_dir / FILES[name], model, metrics[name])
    manifest = {"sha256": {f: sha256_file(out_dir / f) for f in FILES.values()},
                "bytes": {f: (out_dir / f).stat().st_size for f in FILES.values()},
                "metrics": metrics, "n_images": n_images, "threads": torch.get_num_threads()}
    write_json_atomic(manifest, out_dir / MANIFEST)
    return manifest


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train the toy continuous world's codec, MAR target and MAR draft.")
    ap.add_argument("--out", type=Path, default=ASSETS_DIR)
    ap.add_argument("--target-steps", type=int, default=6000)
    ap.add_argument("--draft-steps", type=int, default=4000)
    ap.add_argument("--images", type=int, default=20000)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    m = build(args.out, args.images, {"target": args.target_steps, "draft": args.draft_steps})
    print(json.dumps(m["bytes"]), f"wrote {args.out}")


if __name__ == "__main__":
    main()
