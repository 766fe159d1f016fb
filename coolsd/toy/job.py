"""The main job on the embedded toy world: generate images for toy prompts with a method and
with the AR baseline (same target, same machine, same run), write per-sample records, images,
a grid and a summary with 95% CIs (accepted length, latency, speed-up, toy_clip, toy_fid)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from coolsd.drafting import SamplingConfig
from coolsd.job import job_methods, log_and_finish, make_grid, run_logged_shard, speed_summary
from coolsd.metrics.toy import bootstrap_fid_ci, caption_attributes, paired_fid_difference_ci, toy_clip_scores
from coolsd.records import save_png_atomic, write_json_atomic
from coolsd.stats import mean_ci
from coolsd.toy.assets import load_toy_world
from coolsd.toy.world import render_batch, sample_scenes

PROMPT_POOL_SEED = 20260  # the 5,000 toy evaluation prompts; disjoint from every training seed


def toy_prompts(n: int, offset: int = 0, pool: int = 5000):
    if offset < 0 or offset + n > pool:
        raise ValueError(f"toy prompts [{offset}, {offset + n}) exceed the pool of {pool}")
    return sample_scenes(pool, PROMPT_POOL_SEED)[offset : offset + n]


def summarize(world, outputs: dict, scenes) -> dict:
    """``coolsd.job.speed_summary`` plus, per method, toy_clip (95% t-CI over prompts) and
    toy_fid (bootstrap CI) against renders of the same prompts, and their paired differences to
    ``ar``. With fewer than 2 prompts a covariance does not exist: toy_fid and its difference
    are None."""
    fid_ok = len(scenes) >= 2
    ref_feats = world.features(render_batch(scenes))
    attrs = caption_attributes(scenes)
    scored = {tag: world.features.features_and_predictions(imgs) for tag, (_, imgs) in outputs.items()}
    clip = {tag: toy_clip_scores(preds, attrs) for tag, (_, preds) in scored.items()}
    table = speed_summary(outputs)
    for tag, e in table.items():
        feats = scored[tag][0]
        e["toy_clip"] = mean_ci(clip[tag])
        e["toy_fid"] = bootstrap_fid_ci(feats, ref_feats, n_resamples=200, seed=0) if fid_ok else None
        if "ar" in outputs:
            # every comparison with AR is paired by prompt (same prompts, same seeds, same run)
            e["toy_clip_minus_ar"] = mean_ci(np.asarray(clip[tag]) - np.asarray(clip["ar"]))
            e["toy_fid_minus_ar"] = (paired_fid_difference_ci(feats, scored["ar"][0], ref_feats, n_resamples=200, seed=0)
                                     if fid_ok else None)
    return table


def run_toy(cfg, method_name: str, params: dict, tree: str, draft_length, out_dir: Path) -> dict:
    world = load_toy_world(cfg.target.assets, cfg_scale=cfg.target.cfg_scale)
    draft = (cfg.get("draft") or {}).get("kind", "shipped")
    if draft == "self":
        world.use_self_drafting()
    elif draft == "eagle":  # a drafter folder (python -m coolsd.drafters.train target=toy): draft=llamagen_xl draft.path=...
        from coolsd.targets.llamagen import load_eagle_head

        world.use_head(load_eagle_head(cfg.draft.path, world.gpt))
    elif draft != "shipped":
        raise ValueError(f"the toy world drafts with its shipped drafter (draft=toy), itself (draft=self) or an EAGLE "
                         f"folder (draft=llamagen_xl draft.path=...), not {draft!r}")
    runs = job_methods(cfg, method_name, params, tree, draft_length, world.neighbours)
    method = runs[method_name]
    sampling = SamplingConfig.resolve(cfg.target.get("sampling"), cfg.get("sampling"))
    d = cfg.dataset
    scenes = toy_prompts(d.n_prompts, d.offset)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    identity = {"job": "toy", "methods": {t: m.describe() for t, m in runs.items()}, "seed": int(cfg.seed),
                "sampling": dataclasses.asdict(sampling), "cfg_scale": float(cfg.target.cfg_scale),
                "dataset": {"name": d.name, "n_prompts": int(d.n_prompts), "offset": int(d.offset)},
                "assets": world.manifest["sha256"], **({"draft": draft} if draft != "shipped" else {}),
                **({"draft_path": str(cfg.draft.path)} if draft == "eagle" else {})}
    logger, outputs, scenes, failures, done = run_logged_shard(world, runs, sampling, scenes, cfg, out_dir, identity,
                                                               "toy", f"toy/{method_name}/{out_dir.name}")
    if done:
        return done
    table = summarize(world, outputs, scenes)
    summary = {"job": "toy", "method": method.describe(), "n_prompts": len(scenes), "sampling": dataclasses.asdict(sampling),
               "device": "cpu", "threads": torch.get_num_threads(), "batch_size": int(cfg.get("batch_size", 1)),
               "speedup_reference": "ar on the same prompts, same machine, same run", "failures": failures,
               "results": table}
    write_json_atomic(summary, out_dir / "summary.json")
    ref = render_batch(scenes[:8])
    grid = make_grid([outputs[t][1][:8] for t in outputs] + [ref], labels=list(outputs) + ["reference"])
    save_png_atomic(grid, out_dir / "grid.png")
    log_and_finish(logger, table, outputs, [sc.caption for sc in scenes], out_dir / "grid.png")
    print_summary(table, out_dir)
    return summary


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
