"""Train an EAGLE-1 drafter for a LlamaGen-class target on the target's own samples (LANTERN's
recipe, ``coolsd.drafters.train``), and save it as a LANTERN-style folder that
``coolsd.targets.llamagen.load_eagle_head`` reads back:

    python -m coolsd.drafters.train target=llamagen_xl train.captions=captions_train2017.json \
        train.samples=20000 train.steps=20000 train.out=drafters/llamagen_xl

Data: for each training caption the target samples an image (CFG and warpers of the target's
protocol, per-caption seeds) and a teacher-forced pass gives its features (both CFG halves);
the head regresses the next feature with the LANTERN loss. ``train.captions``: a COCO captions
file (longest caption per image, as the evaluation prompts) or a text file with one caption per
line; never the evaluation captions. The toy world's training captions are its own scenes.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from coolsd.drafters.eagle import EagleHead
from coolsd.drafters.train import EagleBatch, evaluate_eagle, llamagen_features, target_samples, train_eagle

DEFAULTS = {"captions": None, "samples": 2048, "heldout": 128, "steps": 2000, "batch_size": 16, "lr": 1e-4,
            "seed": 0, "chunk": 64, "out": None}


def target_data(target, gpt, encode: Callable, items: Sequence, seed: int, log=print, chunk: int = 256, tag: str = "drafter"):
    """The target's own samples for ``items`` (captions, or whatever ``encode`` takes) and their
    features (both CFG halves): (tokens (n, N), features (n, N+1, 2, H)). Sample i of chunk c
    uses seed ``seed * 1_000_003 + c*chunk + j``."""
    toks, feats = [], []
    t0 = time.perf_counter()
    for i in range(0, len(items), chunk):
        cond = encode(items[i : i + chunk])
        n = len(cond["emb_mask"])
        t = target_samples(target, cond, gpt.config.block_size, [seed * 1_000_003 + i + j for j in range(n)])
        toks.append(t)
        feats.append(llamagen_features(gpt, cond, t, both_halves=True)[0])
        log(f"[{tag}] target samples {i + len(t)}/{len(items)} ({time.perf_counter() - t0:.0f}s)")
    return torch.cat(toks), torch.cat(feats)


def train_on_target(target, gpt, encode: Callable, train_items, heldout_items, steps: int, log=print, *,
                    batch_size: int = 32, lr: float = 1e-4, seed: int = 0, chunk: int = 256, tag: str = "drafter"):
    """A fresh EAGLE head (the target's embedding, seeded init) trained on the target's samples
    of ``train_items``; held-out metrics on ``heldout_items``. Returns (head, metrics)."""
    t0 = time.perf_counter()
    with torch.no_grad():
        toks, feats = target_data(target, gpt, encode, train_items, seed=1, log=log, chunk=chunk, tag=tag)
        vt, vf = target_data(target, gpt, encode, heldout_items, seed=2, log=log, chunk=chunk, tag=tag)
    data_s = time.perf_counter() - t0
    head = EagleHead.from_target(gpt, seed=seed)
    g = torch.Generator().manual_seed(1)

    def batch_at(step):
        idx = torch.randint(0, len(toks), (batch_size,), generator=g)
        return EagleBatch(toks[idx], feats[idx])

    evals = [EagleBatch(vt[i : i + 64], vf[i : i + 64]) for i in range(0, len(vt), 64)]

    def progress(step, stats):
        if (step + 1) % max(1, steps // 10) == 0:
            log(f"[{tag}] step {step + 1}/{steps} loss {stats['loss']:.4f} top1 {stats['top1']:.3f} "
                f"({time.perf_counter() - t0:.0f}s)")

    t1 = time.perf_counter()
    lm_head = gpt.output.weight.detach()
    train_eagle(head, lm_head, batch_at, steps, lr=lr, seed=seed, on_step=progress)
    ev = evaluate_eagle(head, lm_head, evals, cfg_scale=target.cfg_scale)
    log(f"[{tag}] held-out (target samples): " + ", ".join(f"{k} {float(v):.4f}" for k, v in ev.items()))
    return head, {**{k: float(v) for k, v in ev.items()}, "n_target_samples": len(toks), "batch_size": batch_size,
                  "data_seconds": data_s, "train_seconds": time.perf_counter() - t1}


def save_drafter(head: EagleHead, out: Path, metrics: dict) -> Path:
    """``config.json`` (LANTERN fields + ``block_size`` + ``text_prefix: false``: trained without
    the text-slot prefix) and ``model.safetensors``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**head.config.to_lantern_json(), "text_prefix": False}, indent=1))
    (out / "train_metrics.json").write_text(json.dumps(metrics, indent=1))
    return out


def read_captions(path) -> list[str]:
    p = Path(path) if path else None
    if p is None or not p.is_file():
        raise FileNotFoundError(f"training captions {p or '(train.captions not set)'} not found: give a COCO captions "
                                "file (e.g. captions_train2017.json) or a text file with one caption per line")
    if p.suffix == ".json":
        from coolsd.prompts.coco import coco_longest_captions

        return [c["caption"] for c in coco_longest_captions(p)]
    return [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv=None) -> Path:
    from omegaconf import OmegaConf

    from coolsd.runner import compose

    argv = list(sys.argv[1:] if argv is None else argv)
    opts = dict(DEFAULTS)
    unknown = [a.split("=")[0][len("train."):] for a in argv if a.startswith("train.") and
               a.split("=")[0][len("train."):] not in DEFAULTS]
    if unknown:
        raise SystemExit(f"unknown train option(s) {unknown}; valid: {sorted(DEFAULTS)}")
    opts.update(OmegaConf.to_container(OmegaConf.from_dotlist([a[len("train."):] for a in argv if a.startswith("train.")])))
    cfg = compose(*[a for a in argv if not a.startswith("train.")], "draft=self")
    kind = cfg.target.kind
    if kind == "toy":
        from coolsd.toy.assets import load_toy_world
        from coolsd.toy.world import sample_scenes

        world = load_toy_world(cfg.target.assets, cfg_scale=cfg.target.cfg_scale)
        scenes = sample_scenes(int(opts["samples"]) + int(opts["heldout"]), 31_000_000 + int(opts["seed"]))
        captions = [s.caption for s in scenes]
    elif kind == "llamagen":
        from coolsd.targets.llamagen import load_llamagen_world

        captions = read_captions(opts["captions"])  # before loading the target
        world = load_llamagen_world(cfg.target.get("name", kind), cfg.target, cfg.draft,
                                    device=cfg.target.get("device", "cuda"))
    else:
        raise SystemExit(f"drafter training supports LlamaGen-class targets (toy, llamagen_*), not kind {kind!r}")
    n, h = int(opts["samples"]), int(opts["heldout"])
    if len(captions) < n + h:
        raise SystemExit(f"{len(captions)} training captions < train.samples + train.heldout = {n + h}")
    name = cfg.target.get("name", kind)
    out = Path(opts["out"] or f"outputs/drafters/{name}/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    head, metrics = train_on_target(world.target(), world.gpt, world.encoder.encode, captions[:n], captions[n:n + h],
                                    int(opts["steps"]), batch_size=int(opts["batch_size"]), lr=float(opts["lr"]),
                                    seed=int(opts["seed"]), chunk=int(opts["chunk"]), tag=f"{name} drafter")
    save_drafter(head, out, {**metrics, "options": opts, "target": name})
    use = f"target={name} draft.path={out}" if kind != "toy" else f"draft=llamagen_xl draft.path={out}"
    print(f"wrote {out} (use it: python run.py {use})")
    return out
