"""The generation job of continuous-token targets (``target=toy_continuous``, ``mar_h``,
``mar_l``): ``method=cspd`` and its target-only baseline ``ar`` through the shared job machinery
(``coolsd.job.run_shard``: batches, resumable per-sample records and PNGs, shards, speed
summary with the speed-up paired by prompt), then the toy metrics on the toy world.

Records add CSpD's counters: drafted, verified, accepted, acceptance_rate, resample_rounds,
fallbacks, target_forwards, draft_forwards. ``accepted_length`` is tokens per target forward
(seq_len / target_forwards), the continuous analogue of the discrete harness's accepted length.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from coolsd.continuous.generate import HeadConfig, ar_generate, check_settings, cspd_generate
from coolsd.timing import device_sync

CONTINUOUS_METHODS = ("ar", "cspd")


@dataclass(frozen=True)
class ContinuousMethod:
    """``ar`` (the target alone) or ``cspd`` (METHODS.md 5; conf/method/cspd.yaml)."""

    name: str = "cspd"
    gamma: int = 8
    mode: str = "paper"
    verify: str = "parallel"
    prefill: float = 0.05
    max_rounds: int = 100
    final_std: float | None = None
    inner_temperature: float = 1.0

    def __post_init__(self):
        if self.name not in CONTINUOUS_METHODS:
            raise ValueError(f"continuous targets run method={' or method='.join(CONTINUOUS_METHODS)}, not {self.name!r}")
        check_settings(self.gamma, self.mode, self.verify, self.prefill, self.max_rounds, self.final_std,
                       self.inner_temperature)

    @property
    def final_noise(self) -> bool:  # the exact rule samples the final step (continuous_sd.md 2.9)
        return self.mode == "exact"

    def describe(self) -> dict:
        """Record parameters (``method`` first, as the discrete methods'); AR names only how it
        samples: the exact mode's baseline has a stochastic final step."""
        if self.name == "ar":
            return {"method": "ar", **({"final_noise": True} if self.final_noise else {}),
                    **({"final_std": self.final_std} if self.final_std is not None else {})}
        d = dataclasses.asdict(self)
        return {"method": d.pop("name"), **d}


def continuous_methods(cfg, name: str, params: dict) -> dict:
    """{tag: ContinuousMethod}: the configured one, and first its target-only ``ar`` baseline
    (sampled the same way: the exact mode's final-step noise included) unless ``baseline=false``."""
    unknown = sorted(set(params) - {f.name for f in dataclasses.fields(ContinuousMethod)} - {"name"})
    if unknown:
        raise ValueError(f"method {name!r} has no parameter(s) {unknown}; its parameters: gamma, mode, verify, prefill, "
                         f"max_rounds, final_std, inner_temperature")
    method = ContinuousMethod(name=name, **params)
    if name == "ar" or not cfg.get("baseline", True):
        return {name: method}
    return {"ar": dataclasses.replace(method, name="ar"), name: method}


@dataclass
class ContinuousWorld:
    """What the job needs of a continuous target: models, shared head settings, prompt labels,
    token decoding, file identity; ``features`` only on the toy world (toy metrics)."""

    name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    head: HeadConfig
    labels: Callable  # prompts -> labels tensor
    decode: Callable  # tokens (B, L, C) -> uint8 (B, H, W, 3)
    manifest: dict
    features: object = None

    def generate(self, method: ContinuousMethod, prompts, seeds):
        labels = self.labels(prompts)
        with torch.no_grad():
            if method.name == "ar":
                return ar_generate(self.target, labels, seeds, self.head, final_noise=method.final_noise,
                                   final_std=method.final_std)
            return cspd_generate(self.target, self.draft, labels, seeds, self.head, gamma=method.gamma,
                                 mode=method.mode, verify=method.verify, prefill=method.prefill,
                                 max_rounds=method.max_rounds, final_std=method.final_std,
                                 inner_temperature=method.inner_temperature)

    def records(self, method: ContinuousMethod, sampling, prompts, idxs, seeds, tag) -> list:
        """A batch of prompts -> [(record, uint8 image)] (``latency_s``: the batch's generation
        wall time; ``decode_s``: token decoding, excluded from latency as METHODS.md 6)."""
        sync = device_sync(next(self.target.parameters()).device)
        sync()
        t0 = time.perf_counter()
        res = self.generate(method, prompts, seeds)
        sync()
        latency = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            imgs = self.decode(res.tokens)
        sync()
        decode_s = time.perf_counter() - t0
        L, B = res.tokens.shape[1], len(seeds)
        out = []
        for b, (p, idx, seed) in enumerate(zip(prompts, idxs, seeds)):
            c = res.counters[b]
            rec = {"prompt_index": idx, "caption": p.caption, "seed": seed, "method": tag, "params": method.describe(),
                   "accepted_length": L / c["target_forwards"], **c, "acceptance_rate": res.acceptance_rate(b),
                   "latency_s": latency, "decode_s": decode_s, **({"batch_size": B} if B > 1 else {})}
            out.append((rec, imgs[b]))
        return out


def continuous_summary(table: dict, outputs: dict) -> dict:
    """Adds CSpD's counters (95% t-CIs over prompts) to ``coolsd.job.speed_summary``'s table."""
    from coolsd.stats import mean_ci

    for tag, (rows, _) in outputs.items():
        for key in ("acceptance_rate", "draft_forwards", "resample_rounds", "fallbacks"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            if vals:
                table[tag][key] = mean_ci(vals)
    return table


def load_world(cfg) -> ContinuousWorld:
    t = cfg.target
    head = HeadConfig(**t.head)
    draft_kind = (cfg.get("draft") or {}).get("kind", "shipped")
    if t.kind == "toy_continuous":
        from coolsd.continuous.toy import load_toy_continuous, scene_labels
        from coolsd.toy.assets import ASSETS_DIR as TOY_ASSETS, FILES as TOY_FILES
        from coolsd.toy.features import ToyFeatureExtractor, load_feature_net

        if draft_kind not in ("shipped", "self"):
            raise ValueError(f"the toy continuous world drafts with its shipped draft (draft=toy_continuous) or itself "
                             f"(draft=self), not {draft_kind!r}")
        w = load_toy_continuous(t.get("assets"))
        feats = ToyFeatureExtractor(load_feature_net(Path(TOY_ASSETS) / TOY_FILES["features"]))
        return ContinuousWorld("toy_continuous", w.target, w.target if draft_kind == "self" else w.draft, head,
                               scene_labels, w.codec.decode, {"sha256": w.manifest["sha256"], "draft": draft_kind},
                               feats)
    if t.kind == "mar":
        from coolsd.targets.mar import load_mar_world

        return load_mar_world(cfg, head)
    raise ValueError(f"unknown continuous target kind {t.kind!r}; valid: toy_continuous, mar")


def run_continuous(cfg, method_name: str, params: dict, out_dir: Path) -> dict:
    from coolsd.job import coco_or_toy_prompts, log_and_finish, make_grid, run_logged_shard, speed_summary
    from coolsd.records import save_png_atomic, write_json_atomic

    runs = continuous_methods(cfg, method_name, params)  # bad parameters: an error before anything loads
    d = cfg.dataset
    prompts = imagenet_prompts(d) if d.name == "imagenet" else coco_or_toy_prompts(d)
    world = load_world(cfg)
    torch.set_num_threads(int(cfg.get("threads", 1)))
    identity = {"job": "continuous", "target": world.name, "methods": {t: m.describe() for t, m in runs.items()},
                "seed": int(cfg.seed), "head": dataclasses.asdict(world.head),
                "dataset": {"name": d.name, "n_prompts": int(d.n_prompts), "offset": int(d.offset)},
                "files": world.manifest}
    logger, outputs, prompts, failures, done = run_logged_shard(world, runs, None, prompts, cfg, out_dir, identity,
                                                                "continuous", f"{world.name}/{method_name}/{out_dir.name}")
    if done:
        return done
    if world.features is not None and d.name == "toy":
        from coolsd.toy.job import summarize

        table = summarize(world, outputs, prompts)
    else:
        table = speed_summary(outputs)
    table = continuous_summary(table, outputs)
    device = str(next(world.target.parameters()).device)
    summary = {"job": "continuous", "target": world.name, "method": runs[method_name].describe(),
               "n_prompts": len(prompts), "head": dataclasses.asdict(world.head), "device": device,
               "threads": torch.get_num_threads(), "batch_size": int(cfg.get("batch_size", 1)),
               "speedup_reference": "ar (the target alone) on the same prompts, same machine, same run",
               "failures": failures, "results": table}
    write_json_atomic(summary, out_dir / "summary.json")
    save_png_atomic(make_grid([outputs[t][1][:8] for t in outputs], labels=list(outputs)), out_dir / "grid.png")
    log_and_finish(logger, table, outputs, [p.caption for p in prompts], out_dir / "grid.png")
    print_summary(table, out_dir)
    return summary


def print_summary(table: dict, out_dir: Path) -> None:
    def f(e, p=3):
        return f"{e['mean']:.{p}f} [{e['ci95'][0]:.{p}f}, {e['ci95'][1]:.{p}f}]" if e else "-"

    print(f"{'method':<8} {'acceptance':<22} {'tokens/target fwd':<24} {'latency s':<24} {'speed-up':<24} toy_fid")
    for tag, e in table.items():
        fid = e.get("toy_fid")
        fid = f"{fid['fid']:.1f} [{fid['lo']:.1f}, {fid['hi']:.1f}]" if fid else "-"
        print(f"{tag:<8} {f(e.get('acceptance_rate')):<22} {f(e['accepted_length']):<24} {f(e['latency_s']):<24} "
              f"{f(e.get('speedup')):<24} {fid}")
    print(f"wrote {out_dir}/summary.json, samples.jsonl, images/, grid.png")


@dataclass(frozen=True)
class ClassPrompt:
    label: int
    caption: str


def imagenet_prompts(d) -> list:
    """Class-conditional prompts: prompt i is ImageNet class (offset + i) mod 1000 (MAR's
    evaluation draws the classes evenly: 50 images per class for 50,000)."""
    return [ClassPrompt(c % 1000, f"imagenet class {c % 1000}") for c in range(int(d.offset), int(d.offset) + int(d.n_prompts))]


def class_labels(prompts) -> torch.Tensor:
    return torch.tensor([p.label for p in prompts], dtype=torch.long)

