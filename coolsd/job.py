"""The generation job every image target shares: for each prompt, each method (and the AR
baseline of the same target, same machine, same run) generates one image at batch 1; records
and PNGs are written as they come (resumable), then a summary with 95% CIs of accepted length,
latency, decode time and target forwards, and the speed-up against AR paired by prompt
(METHODS.md 6). Image metrics of real targets come afterwards from records and PNGs
(``python -m coolsd.evaluate``); the toy job adds its toy metrics (``coolsd.toy.job``).

A ``world`` (the toy world, ``coolsd.targets.llamagen.LlamaGenWorld``, ``...lumina.LuminaWorld``)
provides ``gpt`` (the target network: its parameters' device), ``encoder.encode(captions)``,
``vq.decode_uint8(tokens)``, ``target()`` (an ImageTarget: ``vocab_size``, ``n_image_tokens``),
``drafter()``, ``neighbours`` and ``manifest``.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from coolsd.decoding.rng import PerSampleRNG
from coolsd.drafting import SamplingConfig, build_drafter
from coolsd.generate import NonFiniteLogits, speculative_generate
from coolsd.methods import build_method
from coolsd.records import RecordWriter, claim_run_dir, resume_records, save_png_atomic, write_json_atomic
from coolsd.shards import Shard
from coolsd.stats import mean_ci, ratio_ci
from coolsd.timing import device_sync


def prompt_seed(run_seed: int, index: int) -> int:
    """Per-prompt seed from the run seed and the prompt index (never from the order of work)."""
    return int(np.random.default_rng([run_seed, index]).integers(2**62))


def generate_batch(world, method, sampling, captions: list, seeds: list):
    """One batch of prompts (each with its own seed and its own accepted lengths: per-sample KV
    commits), through the one generation loop. Equal to generating each prompt alone."""
    target = world.target()
    drafter = build_drafter(method, world.drafter() if method.drafter == "model" else None, sampling,
                            target.vocab_size)
    with torch.no_grad():
        cond = world.encoder.encode(list(captions))
        return speculative_generate(
            target, target.n_image_tokens, PerSampleRNG(list(seeds)), rule=method.rule, drafter=drafter,
            tree=method.tree, sampling=sampling, cond=cond, batch_size=len(seeds),
            sync=device_sync(next(world.gpt.parameters()).device),
        )


def generate_one(world, method, sampling, caption: str, seed: int):
    return generate_batch(world, method, sampling, [caption], [seed])


def generate_records(world, method, sampling, scenes, idxs: list[int], seeds: list[int], tag: str):
    """A batch of prompts -> [(record, uint8 image)]. ``latency_s`` is the batch's wall time (what
    each of its images waited), ``decode_s`` its VQ decode time; ``batch_size`` says which."""
    res = generate_batch(world, method, sampling, [s.caption for s in scenes], seeds)
    sync = device_sync(res.tokens.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        imgs = world.vq.decode_uint8(res.tokens)
    sync()
    decode_s = time.perf_counter() - t0
    B = len(seeds)
    return [({"prompt_index": idx, "caption": sc.caption, "seed": seed, "method": tag, "params": method.describe(),
              "round_lengths": res.round_lengths[b], "accepted_length": res.accepted_length(b),
              "target_forwards": res.target_forwards[b], "draft_forwards": res.draft_forwards,
              "latency_s": res.seconds, "decode_s": decode_s, **({"batch_size": B} if B > 1 else {})}, imgs[b])
            for b, (sc, idx, seed) in enumerate(zip(scenes, idxs, seeds))]


def generate_record(world, method, sampling, scene, idx: int, seed: int, tag: str):
    """One prompt at batch 1 -> (record, uint8 image)."""
    return generate_records(world, method, sampling, [scene], [idx], [seed], tag)[0]


def records_or_failures(world, method, sampling, scenes, idxs, seeds, tag):
    """``generate_records``; if the target's logits turn non-finite, the batch is split and the
    failing prompt gets an error record (no image) naming prompt and position. A world with
    its own generation (``records``: the continuous targets) generates the batch itself."""
    if hasattr(world, "records"):
        return world.records(method, sampling, scenes, idxs, seeds, tag)
    try:
        return generate_records(world, method, sampling, scenes, idxs, seeds, tag)
    except NonFiniteLogits as e:
        if len(scenes) > 1:
            return [r for k in range(len(scenes))
                    for r in records_or_failures(world, method, sampling, scenes[k:k + 1], idxs[k:k + 1], seeds[k:k + 1], tag)]
        print(f"prompt {idxs[0]} ({tag}): {e}; recorded as failed, the run goes on")
        return [({"prompt_index": idxs[0], "caption": scenes[0].caption, "seed": seeds[0], "method": tag,
                  "params": method.describe(), "error": f"non-finite target logits at image token {e.position}"}, None)]


def run_methods(world, methods: dict, sampling, scenes, run_seed, writer: RecordWriter, indices: list[int],
                done: list[dict] | None = None, batch_size: int = 1, failures: dict | None = None):
    """Every method on every prompt (``indices``: each scene's prompt index), in batches of
    ``batch_size`` prompts, methods interleaved per batch so that machine noise hits all of them
    alike (latency ratios are measured side by side). ``done``: records of an interrupted run in
    the same folder; their (method, prompt) pairs are skipped, and since every prompt's seed
    comes from the run seed and its index (and a batch equals its prompts run alone), the resumed
    records equal an uninterrupted run's (latencies aside). Returns {tag: (records, uint8
    images)} in prompt order, images read back from the PNGs for resumed samples, over the
    prompts where every method succeeded; ``failures`` (if given) gets {tag: failed prompt indices}."""
    have = {(r["method"], r["prompt_index"]): r for r in (done or [])}
    n_todo = sum((tag, indices[i]) not in have for i in range(len(scenes)) for tag in methods)
    if n_todo:
        for tag, m in methods.items():  # warm-up at the run's batch size, excluded
            k = min(batch_size, len(scenes))
            if hasattr(world, "records"):  # a world with its own generation (coolsd.continuous.job)
                world.records(m, sampling, scenes[:k], list(range(k)), list(range(k)), tag)
            else:
                generate_batch(world, m, sampling, [sc.caption for sc in scenes[:k]], list(range(k)))
    fresh = {}
    with tqdm(total=len(scenes) * len(methods), initial=len(scenes) * len(methods) - n_todo,
              desc="samples", unit="img") as bar:
        for start in range(0, len(scenes), batch_size):
            for tag in methods:
                pos = [i for i in range(start, min(start + batch_size, len(scenes))) if (tag, indices[i]) not in have]
                if not pos:
                    continue
                idxs = [indices[i] for i in pos]
                out = records_or_failures(world, methods[tag], sampling, [scenes[i] for i in pos], idxs,
                                          [prompt_seed(run_seed, idx) for idx in idxs], tag)
                for idx, (rec, img) in zip(idxs, out):
                    rec = writer.append(rec, img, f"{tag}/{idx:05d}.png") if img is not None else writer.append(rec)
                    fresh[(tag, idx)] = (rec, img)
                bar.update(len(pos))
    out = {}
    records = {**have, **{k: rec for k, (rec, _) in fresh.items()}}
    errors = {tag: sorted(idx for (t, idx), r in records.items() if t == tag and "error" in r) for tag in methods}
    failed = {idx for v in errors.values() for idx in v}
    if failures is not None:
        failures.update(errors)
    for tag in methods:
        rows, imgs = [], []
        for i in range(len(scenes)):
            if indices[i] in failed:  # summaries compare methods on the prompts where all succeeded
                continue
            key = (tag, indices[i])
            if key in fresh:
                rec, img = fresh[key]
            else:
                rec = have[key]
                img = np.asarray(Image.open(writer.dir / rec["image"]).convert("RGB"))
            rows.append(rec)
            imgs.append(img)
        out[tag] = (rows, np.stack(imgs) if imgs else None)  # None: a shard without prompts
    return out


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


def run_shard(world, runs: dict, sampling, prompts: list, cfg, out_dir: Path, identity: dict):
    """Claim the run folder, resume this shard's records and generate the rest. Returns
    (outputs as ``run_methods``, the prompts they cover, shard, {tag: failed prompt indices}).
    With ``shard.count`` > 1 the outputs cover this shard's prompts only; the summary comes from
    ``coolsd.merge``."""
    shard = Shard.from_cfg(cfg)  # validated before any work
    batch = int(cfg.get("batch_size", 1))
    if batch < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch}")
    # latencies depend on the batch size: a folder holds one batch size (tokens would not differ)
    identity = {**identity, **shard.identity(), **({"batch_size": batch} if batch > 1 else {})}
    offset = int(cfg.dataset.offset)
    done = resume_records(out_dir, shard.records_name) if claim_run_dir(out_dir, identity) else []
    positions = shard.select(len(prompts))
    if done:
        print(f"resuming {out_dir}: {len(done)} of {len(positions) * len(runs)} samples already there")
    mine = [prompts[i] for i in positions]
    failures: dict = {}
    outputs = run_methods(world, runs, sampling, mine, cfg.seed, RecordWriter(out_dir, shard.records_name),
                          [offset + i for i in positions], done=done, batch_size=batch, failures=failures)
    kept = {r["prompt_index"] for r in next(iter(outputs.values()))[0]} if outputs else set()
    mine = [p for i, p in zip(positions, mine) if offset + i in kept]  # prompts every method completed
    if shard.count > 1:
        print(f"shard {shard.index} of {shard.count} done ({len(mine)} prompts); when every shard is done: "
              f"python -m coolsd.merge {out_dir}")
    return outputs, mine, shard, {t: v for t, v in failures.items() if v}


def run_logged_shard(world, runs: dict, sampling, prompts: list, cfg, out_dir: Path, identity: dict, job: str,
                     log_name: str):
    """The logger (made before any work, so a missing optional extra fails first) and
    ``run_shard``. Returns (logger, outputs, prompts, failures, done): ``done`` is the job's
    return value for a shard of several (the summary comes from ``coolsd.merge``), else None."""
    from omegaconf import OmegaConf

    from coolsd.tracking import make_logger

    logger = make_logger(cfg.get("logger"), OmegaConf.to_container(cfg, resolve=True), name=log_name)
    outputs, prompts, shard, failures = run_shard(world, runs, sampling, prompts, cfg, out_dir, identity)
    if shard.count > 1:
        logger.finish()
        return logger, outputs, prompts, failures, {"job": job, "shard": shard.index, "shards": shard.count,
                                                    "n_prompts": len(prompts)}
    return logger, outputs, prompts, failures, None


def log_and_finish(logger, table: dict, outputs: dict, captions: list, grid: Path) -> None:
    """The summary table, every method's images and the grid to the tracker; then close it."""
    logger.log_summary(table)
    for tag, (_, imgs) in outputs.items():
        logger.log_images(tag, imgs, captions)
    logger.log_files([grid])
    logger.finish()


def speed_summary(outputs: dict) -> dict:
    """Per method tag: accepted length, latency, decode time, target forwards (95% t-CIs over
    prompts) and, where ``ar`` ran on the same prompts, the speed-up (paired bootstrap)."""
    table = {}
    for tag, (rows, _) in outputs.items():
        lat = [x["latency_s"] for x in rows]
        e = {
            "params": rows[0]["params"],
            "accepted_length": mean_ci([x["accepted_length"] for x in rows]),
            "latency_s": mean_ci(lat),
            "decode_s": mean_ci([x["decode_s"] for x in rows]),
            "target_forwards": mean_ci([x["target_forwards"] for x in rows]),
            # throughput at the run's batch size: images per second of generation
            "images_per_s": mean_ci([x.get("batch_size", 1) / x["latency_s"] for x in rows]),
        }
        if "ar" in outputs:
            e["speedup"] = ratio_ci([x["latency_s"] for x in outputs["ar"][0]], lat, paired=True)
            e["speedup_per_accepted_length"] = e["speedup"]["mean"] / e["accepted_length"]["mean"]
        table[tag] = e
    return table


def job_methods(cfg, method_name: str, params: dict, tree: str, draft_length, neighbours) -> dict:
    """{tag: Method}: the configured method, and AR first unless it is AR or ``baseline=false``."""
    method = build_method(method_name, tree=tree, draft_length=draft_length, neighbours=neighbours, **params)
    if method_name == "ar" or not cfg.get("baseline", True):
        return {method_name: method}
    return {"ar": build_method("ar"), method_name: method}


def coco_or_toy_prompts(d) -> list:
    """Prompt objects with ``.caption`` for the configured data set (``dataset.name``)."""
    if d.name == "coco2017val":
        from coolsd.prompts.coco import load_coco_prompts

        return [SimpleNamespace(**p) for p in load_coco_prompts(d.captions, int(d.n_prompts), int(d.offset),
                                                                  cache_dir=Path(d.cache_dir))]
    if d.name == "toy":
        from coolsd.toy.job import toy_prompts

        return toy_prompts(int(d.n_prompts), int(d.offset))
    raise ValueError(f"unknown dataset {d.name!r}; valid: coco2017val, toy")


def run_image_target(cfg, world, method_name: str, params: dict, tree: str, draft_length, out_dir: Path,
                     device: str) -> dict:
    """The job for a real target: records, PNGs, a grid and ``summary.json`` (speed numbers;
    image metrics via ``python -m coolsd.evaluate``)."""
    runs = job_methods(cfg, method_name, params, tree, draft_length, world.neighbours)
    sampling = SamplingConfig.resolve(cfg.target.get("sampling"), cfg.get("sampling"))
    d = cfg.dataset
    prompts = coco_or_toy_prompts(d)
    target_name = cfg.target.get("name", cfg.target.kind)
    identity = {"job": "image_target", "target": target_name, "methods": {t: m.describe() for t, m in runs.items()},
                "seed": int(cfg.seed), "sampling": dataclasses.asdict(sampling), "cfg_scale": float(cfg.target.cfg_scale),
                "dataset": {"name": d.name, "n_prompts": int(d.n_prompts), "offset": int(d.offset)},
                "files": world.manifest}
    logger, outputs, prompts, failures, done = run_logged_shard(world, runs, sampling, prompts, cfg, out_dir, identity,
                                                                "image_target", f"{target_name}/{method_name}/{out_dir.name}")
    if done:
        return done
    table = speed_summary(outputs)
    summary = {"job": "image_target", "target": target_name, "method": runs[method_name].describe(),
               "n_prompts": len(prompts), "sampling": dataclasses.asdict(sampling), "device": device,
               "gpu": torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None,
               "batch_size": int(cfg.get("batch_size", 1)),
               "speedup_reference": "ar on the same prompts, same machine, same run (same batch size)",
               "failures": failures, "results": table}
    write_json_atomic(summary, out_dir / "summary.json")
    save_png_atomic(make_grid([outputs[t][1][:8] for t in outputs], scale=1, labels=list(outputs)), out_dir / "grid.png")
    log_and_finish(logger, table, outputs, [p.caption for p in prompts], out_dir / "grid.png")
    for tag, e in table.items():
        sp = e.get("speedup")
        print(f"{tag:<12} accepted length {e['accepted_length']['mean']:.3f}  latency {e['latency_s']['mean']:.3f} s"
              + (f"  speed-up {sp['mean']:.3f} [{sp['ci95'][0]:.3f}, {sp['ci95'][1]:.3f}]" if sp else ""))
    print(f"wrote {out_dir}/summary.json, samples.jsonl, images/, grid.png; image metrics: python -m coolsd.evaluate {out_dir}")
    return summary
