"""The main job on the embedded toy world: generate images for toy prompts with a method and
with the AR baseline (same target, same machine, same run), write per-sample records, images,
a grid and a summary with 95% CIs (accepted length, latency, speed-up, toy_clip, toy_fid)."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from coolsd.decoding.rng import PerSampleRNG
from coolsd.drafting import SamplingConfig, build_drafter
from coolsd.generate import speculative_generate
from coolsd.methods import build_method
from coolsd.metrics.toy import bootstrap_fid_ci, caption_attributes, paired_fid_difference_ci, toy_clip_scores
from coolsd.records import RecordWriter, claim_run_dir, resume_records, save_png_atomic, write_json_atomic
from coolsd.stats import mean_ci, ratio_ci
from coolsd.timing import device_sync
from coolsd.toy.assets import load_toy_world
from coolsd.toy.world import render_batch, sample_scenes

PROMPT_POOL_SEED = 20260  # the 5,000 toy evaluation prompts; disjoint from every training seed


def toy_prompts(n: int, offset: int = 0, pool: int = 5000):
    if offset < 0 or offset + n > pool:
        raise ValueError(f"toy prompts [{offset}, {offset + n}) exceed the pool of {pool}")
    return sample_scenes(pool, PROMPT_POOL_SEED)[offset : offset + n]


def prompt_seed(run_seed: int, index: int) -> int:
    """Per-prompt seed from the run seed and the prompt index (never from the order of work)."""
    return int(np.random.default_rng([run_seed, index]).integers(2**62))


def generate_one(world, method, sampling, caption: str, seed: int):
    target = world.target()
    drafter = build_drafter(method, world.drafter() if method.drafter == "model" else None, sampling,
                            world.gpt.config.vocab_size)
    with torch.no_grad():
        cond = world.encoder.encode([caption])
        return speculative_generate(
            target, world.gpt.config.block_size, PerSampleRNG([seed]), rule=method.rule, drafter=drafter,
            tree=method.tree, sampling=sampling, cond=cond, batch_size=1,
            sync=device_sync(next(world.gpt.parameters()).device),
        )


def generate_record(world, method, sampling, scene, idx: int, seed: int, tag: str):
    """One prompt at batch 1 -> (record, uint8 image)."""
    res = generate_one(world, method, sampling, scene.caption, seed)
    sync = device_sync(res.tokens.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        img = world.vq.decode_uint8(res.tokens)[0]
    sync()
    decode_s = time.perf_counter() - t0
    rec = {
        "prompt_index": idx, "caption": scene.caption, "seed": seed, "method": tag,
        "params": method.describe(), "round_lengths": res.round_lengths[0],
        "accepted_length": res.accepted_length(0), "target_forwards": res.target_forwards[0],
        "draft_forwards": res.draft_forwards, "latency_s": res.seconds, "decode_s": decode_s,
    }
    return rec, img


def run_methods(world, methods: dict, sampling, scenes, run_seed, writer: RecordWriter, offset: int,
                done: list[dict] | None = None):
    """Every method on every prompt, methods interleaved per prompt so that machine noise hits
    all of them alike (latency ratios are measured side by side). ``done``: records of an
    interrupted run in the same folder; their (method, prompt) pairs are skipped, and since
    every prompt's seed comes from the run seed and its index, the resumed records equal an
    uninterrupted run's (latencies aside). Returns {tag: (records, uint8 images)} in prompt
    order, images read back from the PNGs for resumed samples."""
    have = {(r["method"], r["prompt_index"]): r for r in (done or [])}
    todo = [(i, tag) for i in range(len(scenes)) for tag in methods if (tag, offset + i) not in have]
    if todo:
        for tag, m in methods.items():  # warm-up, excluded
            generate_one(world, m, sampling, scenes[0].caption, 0)
    fresh = {}
    with tqdm(total=len(scenes) * len(methods), initial=len(scenes) * len(methods) - len(todo),
              desc="samples", unit="img") as bar:
        for i, tag in todo:
            idx = offset + i
            rec, img = generate_record(world, methods[tag], sampling, scenes[i], idx, prompt_seed(run_seed, idx), tag)
            fresh[(tag, idx)] = (writer.append(rec, img, f"{tag}/{idx:05d}.png"), img)
            bar.update()
    out = {}
    for tag in methods:
        rows, imgs = [], []
        for i in range(len(scenes)):
            key = (tag, offset + i)
            if key in fresh:
                rec, img = fresh[key]
            else:
                rec = have[key]
                img = np.asarray(Image.open(writer.dir / rec["image"]).convert("RGB"))
            rows.append(rec)
            imgs.append(img)
        out[tag] = (rows, np.stack(imgs))
    return out


def summarize(world, outputs: dict, scenes) -> dict:
    """Per method: accepted length, latency, decode time, toy_clip (95% t-CIs over prompts),
    toy_fid (bootstrap CI) against renders of the same prompts, speed-up against ``ar``. With
    fewer than 2 prompts a covariance does not exist: toy_fid and its difference are None."""
    fid_ok = len(scenes) >= 2
    ref_feats = world.features(render_batch(scenes))
    attrs = caption_attributes(scenes)
    scored = {tag: world.features.features_and_predictions(imgs) for tag, (_, imgs) in outputs.items()}
    clip = {tag: toy_clip_scores(preds, attrs) for tag, (_, preds) in scored.items()}
    ar = "ar" if "ar" in outputs else None
    table = {}
    for tag, (rows, _) in outputs.items():
        feats = scored[tag][0]
        lat = [x["latency_s"] for x in rows]
        e = {
            "params": rows[0]["params"],
            "accepted_length": mean_ci([x["accepted_length"] for x in rows]),
            "latency_s": mean_ci(lat),
            "decode_s": mean_ci([x["decode_s"] for x in rows]),
            "target_forwards": mean_ci([x["target_forwards"] for x in rows]),
            "toy_clip": mean_ci(clip[tag]),
            "toy_fid": bootstrap_fid_ci(feats, ref_feats, n_resamples=200, seed=0) if fid_ok else None,
        }
        if ar is not None:
            # every comparison with AR is paired by prompt (same prompts, same seeds, same run)
            ar_lat = [x["latency_s"] for x in outputs[ar][0]]
            e["speedup"] = ratio_ci(ar_lat, lat, paired=True)
            e["speedup_per_accepted_length"] = e["speedup"]["mean"] / e["accepted_length"]["mean"]
            e["toy_clip_minus_ar"] = mean_ci(np.asarray(clip[tag]) - np.asarray(clip[ar]))
            e["toy_fid_minus_ar"] = (paired_fid_difference_ci(feats, scored[ar][0], ref_feats, n_resamples=200, seed=0)
                                     if fid_ok else None)
        table[tag] = e
    return table


def run_toy(cfg, method_name: str, params: dict, tree: str, draft_length, out_dir: Path) -> dict:
    world = load_toy_world(cfg.target.assets, cfg_scale=cfg.target.cfg_scale)
    method = build_method(method_name, tree=tree, draft_length=draft_length, neighbours=world.neighbours, **params)
    baseline = build_method("ar")
    sampling = SamplingConfig.resolve(cfg.target.get("sampling"), cfg.get("sampling"))
    d = cfg.dataset
    scenes = toy_prompts(d.n_prompts, d.offset)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    runs = {method_name: method} if method_name == "ar" or not cfg.get("baseline", True) else {"ar": baseline, method_name: method}
    identity = {"job": "toy", "methods": {t: m.describe() for t, m in runs.items()}, "seed": int(cfg.seed),
                "sampling": dataclasses.asdict(sampling), "cfg_scale": float(cfg.target.cfg_scale),
                "dataset": {"name": d.name, "n_prompts": int(d.n_prompts), "offset": int(d.offset)},
                "assets": world.manifest["sha256"]}
    from omegaconf import OmegaConf

    from coolsd.tracking import make_logger

    logger = make_logger(cfg.get("logger"), OmegaConf.to_container(cfg, resolve=True),
                         name=f"toy/{method_name}/{out_dir.name}")  # before work: a missing extra fails here
    resumed = claim_run_dir(out_dir, identity)
    done = resume_records(out_dir) if resumed else []
    if done:
        print(f"resuming {out_dir}: {len(done)} of {len(scenes) * len(runs)} samples already there")
    writer = RecordWriter(out_dir)
    outputs = run_methods(world, runs, sampling, scenes, cfg.seed, writer, d.offset, done=done)
    table = summarize(world, outputs, scenes)
    summary = {"job": "toy", "method": method.describe(), "n_prompts": len(scenes), "sampling": dataclasses.asdict(sampling),
               "device": "cpu", "threads": torch.get_num_threads(), "batch_size": 1,
               "speedup_reference": "ar on the same prompts, same machine, same run", "results": table}
    write_json_atomic(summary, out_dir / "summary.json")
    ref = render_batch(scenes[:8])
    grid = make_grid([outputs[t][1][:8] for t in outputs] + [ref], labels=list(outputs) + ["reference"])
    save_png_atomic(grid, out_dir / "grid.png")
    logger.log_summary(table)
    for tag, (_, imgs) in outputs.items():
        logger.log_images(tag, imgs, [sc.caption for sc in scenes])
    logger.log_files([out_dir / "grid.png"])
    logger.finish()
    print_summary(table, out_dir)
    return summary


def make_grid(rows: list[np.ndarray], scale: int = 3, labels: list[str] | None = None) -> np.ndarray:
    """Rows of equal-size images -> one uint8 image, nearest-neighbour upscaled, each row
    optionally labelled on the left (method names)."""
    h, w = rows[0].shape[1:3]
    n = max(len(r) for r in rows)
    out = np.full((len(rows) * (h + 2), n * (w + 2), 3), 255, np.uint8)
    for i, r in enumerate(rows):
        for j, im in enumerate(r):
            out[i * (h + 2) : i * (h + 2) + h, j * (w + 2) : j * (w + 2) + w] = im
    out = out.repeat(scale, 0).repeat(scale, 1)
    if not labels:
        return out
    from PIL import Image, ImageDraw

    margin = 8 + 7 * max(len(t) for t in labels)
    canvas = Image.new("RGB", (out.shape[1] + margin, out.shape[0]), "white")
    canvas.paste(Image.fromarray(out), (margin, 0))
    draw = ImageDraw.Draw(canvas)
    for i, text in enumerate(labels):
        draw.text((4, i * (h + 2) * scale + (h * scale) // 2 - 5), text, fill="black")
    return np.asarray(canvas)


def print_summary(table: dict, out_dir: Path) -> None:
    def f(e):
        return f"{e['mean']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"

    print(f"{'method':<12} {'accepted length':<24} {'latency s':<24} {'speed-up':<24} {'toy_clip':<24} toy_fid")
    for tag, e in table.items():
        sp = f(e["speedup"]) if "speedup" in e else "-"
        fid = e["toy_fid"]
        fid = f"{fid['fid']:.1f} [{fid['lo']:.1f}, {fid['hi']:.1f}]" if fid else "- (needs >= 2 prompts)"
        print(f"{tag:<12} {f(e['accepted_length']):<24} {f(e['latency_s']):<24} {sp:<24} {f(e['toy_clip']):<24} {fid}")
    print(f"wrote {out_dir}/summary.json, samples.jsonl, images/, grid.png")
