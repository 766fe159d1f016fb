"""Building the shipped toy-world weights (``make toy-assets``: ``python -m coolsd.toy.build_assets``):
VQ -> target -> drafter -> features, each written atomically with its metrics, resumable per
stage; ``coolsd.toy.load_assets`` loads them strictly.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from coolsd.metrics.toy import caption_attributes, toy_clip_scores
from coolsd.models.eagle.training import train_on_target
from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT, LlamaGenTarget
from coolsd.toy.features import ToyFeatureExtractor, load_feature_net, save_feature_net, train_feature_net
from coolsd.toy.load_assets import ASSETS_DIR, FILES, load_strict, read_toy_weights
from coolsd.toy.scenes import render_batch, sample_scenes
from coolsd.toy.target import TOY_GPT, CaptionEncoder
from coolsd.toy.train_target import train_target
from coolsd.toy.vq import load_vq, save_vq, train_vq
from coolsd.toy.weights import save_weights
from coolsd.util.records import sha256_file

TARGET_DATA_SEED = 7001  # the training scenes of target and drafter; evaluation prompts use another
TOY_CFG_SCALE = 3.0  # the guidance the drafter is trained and evaluated under (conf/target/toy.yaml)


def _save(path: Path, tensors: dict, fmt: str, config: dict) -> None:
    save_weights(path, tensors, fmt, json.dumps(config))


def _dataset(vq, n: int, seed: int, enc: CaptionEncoder):
    scenes = sample_scenes(n, seed)
    tokens = []
    with torch.no_grad():
        for i in range(0, n, 512):
            tokens.append(vq.encode(render_batch(scenes[i : i + 512])))
    return enc.ids([s.caption for s in scenes]), torch.cat(tokens)


def _train_drafter(gpt, enc, ids, vids, steps: int, n_gen: int, log, batch_size: int = 32):
    """EAGLE-1 head on the target's own samples (LANTERN recipe; coolsd.models.eagle.training)."""

    return train_on_target(LlamaGenTarget(gpt, cfg_scale=TOY_CFG_SCALE), gpt, enc, ids[:n_gen], vids[:256], steps, log,
                           batch_size=batch_size, lr=1e-3, seed=0, chunk=256, tag="toy drafter")


def build_assets(out_dir: Path, quick: bool = False, force: bool = False, log=print) -> dict:
    """Train every toy weight file in order VQ -> target -> drafter -> features.

    Each stage writes its file atomically and its metrics to ``build_metrics.json``; a stage
    whose file already exists is skipped unless ``force`` (so an interrupted build resumes).
    ``manifest.json`` (checksums) is written last, so a half-built folder never loads.
    """

    torch.set_num_threads(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = {"vq": 300 if quick else 3000, "target": 60 if quick else 2100,
             "drafter": 60 if quick else 2500, "features": 100 if quick else 1200}
    n_train = 2000 if quick else 40000
    log_path = out_dir / "build_metrics.json"
    metrics: dict = json.loads(log_path.read_text()) if log_path.exists() and not force else {}
    metrics.update({"quick": quick, "steps": steps})
    (out_dir / "manifest.json").unlink(missing_ok=True)

    def done(name):
        return (out_dir / FILES[name]).is_file() and name in metrics and not force

    def record(name, m):
        metrics[name] = m
        log_path.write_text(json.dumps(metrics, indent=1, default=float))

    def atomic(name, write):
        tmp = out_dir / (FILES[name] + ".partial")
        write(tmp)
        tmp.replace(out_dir / FILES[name])

    t_all = time.perf_counter()
    if not done("vq"):
        vq, m = train_vq(steps=steps["vq"], seed=0, log=log)
        atomic("vq", lambda p: save_vq(vq, p))
        record("vq", {k: v for k, v in m.items() if k != "config"})
    vq = load_vq(out_dir / FILES["vq"])

    cap = CaptionEncoder()
    ids, toks = _dataset(vq, n_train, TARGET_DATA_SEED, cap)
    vids, vtoks = _dataset(vq, 1000, TARGET_DATA_SEED + 1, cap)
    if not done("target"):
        gpt, enc, m = train_target(TOY_GPT, ids, toks, steps=steps["target"], seed=0, val=(vids, vtoks), log=log)
        tensors = {**{f"gpt.{k}": v for k, v in gpt.state_dict().items()},
                   **{f"caption.{k}": v for k, v in enc.state_dict().items()}}
        atomic("target", lambda p: _save(p, tensors, "coolsd.toy.target", {"gpt": dataclasses.asdict(TOY_GPT)}))
        record("target", m)
    sd, cfg = read_toy_weights(out_dir / FILES["target"], "coolsd.toy.target")
    gpt = LlamaGenGPT(LlamaGenConfig(**cfg["gpt"]))
    enc = CaptionEncoder(cfg["gpt"]["caption_dim"], cfg["gpt"]["cls_token_num"])
    load_strict(gpt, {k[4:]: v for k, v in sd.items() if k.startswith("gpt.")}, out_dir / FILES["target"])
    load_strict(enc, {k[8:]: v for k, v in sd.items() if k.startswith("caption.")}, out_dir / FILES["target"])
    gpt.eval(), enc.eval()

    if not done("drafter"):
        head, m = _train_drafter(gpt, enc, ids, vids, steps["drafter"], n_gen=512 if quick else 6144, log=log)
        atomic("drafter", lambda p: _save(p, head.state_dict(), "coolsd.toy.eagle", dataclasses.asdict(head.config)))
        record("drafter", m)

    if not done("features"):
        fnet, m = train_feature_net(steps=steps["features"], seed=0, log=log)
        atomic("features", lambda p: save_feature_net(fnet, p, m))
        record("features", m)
        # how well the feature network reads VQ reconstructions (nearly as well as originals)
        feats = ToyFeatureExtractor(load_feature_net(out_dir / FILES["features"]))
        scenes = sample_scenes(1000, TARGET_DATA_SEED + 2)
        imgs = render_batch(scenes)
        with torch.no_grad():
            recon = vq.decode_uint8(vq.encode(imgs))

        attrs = caption_attributes(scenes)
        m2 = {"toy_clip_originals": float(toy_clip_scores(feats.predict_attributes(imgs), attrs).mean()),
              "toy_clip_vq_reconstructions": float(toy_clip_scores(feats.predict_attributes(recon), attrs).mean())}
        log(f"feature net on originals vs VQ reconstructions: {m2}")
        record("features", {**m, **m2})

    metrics["total_seconds_this_build"] = time.perf_counter() - t_all
    manifest = {"sha256": {f: sha256_file(out_dir / f) for f in FILES.values()},
                "bytes": {f: (out_dir / f).stat().st_size for f in FILES.values()}, "metrics": metrics}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=float))
    log(json.dumps(metrics, indent=1, default=lambda x: round(float(x), 5) if isinstance(x, (float, np.floating)) else str(x)))
    return manifest


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m coolsd.toy.build_assets", description="Retrain every toy-world weight file.")
    ap.add_argument("--out", type=Path, default=ASSETS_DIR)
    ap.add_argument("--quick", action="store_true", help="a few steps of each (for tests), not the shipped weights")
    ap.add_argument("--force", action="store_true", help="retrain stages whose files already exist")
    a = ap.parse_args(argv)
    build_assets(a.out, a.quick, a.force)


if __name__ == "__main__":
    main()
