"""The one generation job, behind ``run.py``, the sweeps, ``make paper-table2``, ``make demo``,
the benchmarks and ``coolsd.cli.merge``: prompts -> batches -> ``world.generate`` -> per-sample
records and PNGs (written as they come, resumable) -> one summary (``coolsd.job.summary``: speed and
counters from the records, plus the world's quality), one grid, one printed table.

Every method of a run (and its baseline, from the method registry) generates every prompt in
batches of ``batch_size``, methods interleaved per batch so that machine noise hits all of them
alike (latency ratios are measured side by side, docs/methods.md#6-evaluation-protocol). Where the run also
times the fastest AR (``fastest_ar``: compiled AR, tag ``ar_compiled``, on a second copy of the world loaded
with ``compile=true``), it is interleaved the same way, warmed up untimed like every method. A prompt's seed comes from the
run seed and its index, never from the order of work, so a resumed or sharded run writes the
records an uninterrupted one-process run would (latencies aside); a batch equals its prompts
generated alone in distribution, and bit for bit with ``deterministic.batch_invariant=true``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from coolsd.engine.batch_invariant import batch_invariant
from coolsd.engine.compiled import compile_count
from coolsd.engine.loop import NonFiniteLogits
from coolsd.engine.timing import hardware_name, peak_memory_gib, reset_peak_memory
from coolsd.job.config_schema import check_config, method_from_cfg
from coolsd.job.shards import Shard
from coolsd.job.summary import AR, FASTEST_AR, GRID_COLUMNS, summarize, write_outputs
from coolsd.job.tracking import NullLogger, make_logger
from coolsd.util.errors import ConfigError, OneLineError, SummaryError
from coolsd.util.log import say
from coolsd.util.records import RecordWriter, RunLock, claim_run_dir, resume_records
from coolsd.worlds import load_world, world_class

# differ between processes and machines (a sample's own numbers)
TIMING_KEYS = ("latency_s", "signal_s", "decode_s", "hardware", "peak_memory_gib")


def prompt_seed(run_seed: int, index: int) -> int:
    """Per-prompt seed from the run seed and the prompt index (never from the order of work)."""
    return int(np.random.default_rng([run_seed, index]).integers(2**62))


def job_methods(world, cfg) -> dict:
    """{tag: method}: the configured method and, first, its baseline from the registry (unless it
    is ``ar``, ``baseline=false`` or the world runs none)."""
    name, params = method_from_cfg(cfg)
    method = world.build_method(name, params, cfg.tree.name, cfg.tree.get("draft_length"))
    if name == "ar" or not cfg.get("baseline", True) or not world.runs_baseline:
        return {name: method}
    return {"ar": method.baseline(), name: method}


class OnWorld:
    """A method that runs on another loaded world than the run's: AR on the run's compiled twin
    (tag ``ar_compiled``, ``fastest_ar``). Its records and ``run.json`` describe it as its method
    plus ``compiled: true``; it has no rule, so it never tunes itself (``_tuned_rule``)."""

    def __init__(self, world, method):
        self.world, self.method = world, method

    def describe(self) -> dict:
        return {**self.method.describe(), **({"compiled": True} if self.world.compiled else {})}


def placed(world, method) -> tuple:
    """(world, method) that generate a tag's samples: an ``OnWorld``'s own, else the run's."""
    return (method.world, method.method) if isinstance(method, OnWorld) else (world, method)


def wants_fastest_ar(cfg, world, methods: dict) -> bool:
    """Whether the run also times compiled AR (``ar_compiled``): ``fastest_ar=true`` (its config check
    refused what cannot run), or ``auto`` on CUDA where the run is eager, times AR (``ar``), its target
    compiles and batch invariance is off."""
    v = cfg.get("fastest_ar", "auto")
    if v != "auto":
        return v is True
    invariant = bool((cfg.get("deterministic") or {}).get("batch_invariant", False))
    return (torch.device(world.device).type == "cuda" and type(world).compiles and not world.compiled
            and not invariant and AR in methods)


def with_fastest_ar(cfg, methods: dict, configured: str) -> dict:
    """``methods`` with ``ar_compiled`` after ``ar`` (first where there is none): the configured method's
    baseline on the run's world loaded again with ``compile=true`` (static KV cache, CUDA graphs on
    CUDA) and no drafter (AR drafts nothing)."""
    import copy

    from omegaconf import open_dict

    twin_cfg = copy.deepcopy(cfg)
    with open_dict(twin_cfg):
        twin_cfg.compile, twin_cfg.draft = True, None
    twin = load_world(twin_cfg)
    compiled_ar = OnWorld(twin, methods[configured].baseline())
    ar = {t: m for t, m in methods.items() if t == AR}
    return {**ar, FASTEST_AR: compiled_ar, **{t: m for t, m in methods.items() if t != AR}}


def run_identity(world, methods: dict, *, seed: int, dataset: dict, threads: int, batch_size: int = 1,
                 shard: Shard = Shard(), invariant: bool = False, method: Optional[str] = None) -> dict:
    """What binds a run folder (``run.json``): target, its files (``world.files()``: each weight
    and data file's content fingerprint, ``coolsd.util.fingerprint``; the toy's manifest sha256s) and
    sampling settings, methods, seed, prompts, threads; the batch size (latencies depend on it) and
    the shard count. A resume or merge with any of these different is refused."""
    return {"target": world.name, "world": world.files(), "settings": world.settings(),
            "methods": {t: m.describe() for t, m in methods.items()}, **({"method": method} if method else {}),
            "seed": int(seed), "dataset": dataset, "device": torch.device(world.device).type, "threads": int(threads),
            **shard.identity(), **({"batch_size": batch_size} if batch_size > 1 else {}),
            **({"batch_invariant": True} if invariant else {})}


def record_head(prompt, idx: int, seed: int, tag: str, method) -> dict:
    """What every record of a sample starts with: which prompt (and its content id where it has one:
    a prompt file's, ``coolsd.prompts.files``), seed and method."""
    pid = getattr(prompt, "prompt_id", None)
    return {"prompt_index": idx, "caption": prompt.caption, **({"prompt_id": pid} if pid is not None else {}),
            "seed": seed, "method": tag, "params": method.describe()}


def generate_records(world, method, prompts: list, idxs: list[int], seeds: list[int], tag: str) -> list:
    """A batch of prompts -> [(record, uint8 image or None)]. ``latency_s`` is the batch's wall
    time (what each of its images waited); ``batch_size`` says which batch. Under ``compile=true`` the
    batch's first record counts the graphs compiled while generating it (``compilations``; 0 after
    a complete warm-up). On CUDA every record carries ``peak_memory_gib``, the most device memory
    tensors held while its batch generated (``coolsd.engine.timing.peak_memory_gib``, reset just before
    the batch; outside its ``latency_s``); elsewhere the field is absent."""
    n0 = compile_count()
    tuned = _tuned_rule(method)
    price = {"budget_price": tuned.price} if tuned is not None else {}
    world, generating = placed(world, method)
    reset_peak_memory(world.device)
    samples = world.generate(generating, prompts, seeds)
    peak = peak_memory_gib(world.device)
    B, hw = len(seeds), hardware_name(world.device)
    out = [({**record_head(p, idx, seed, tag, method), **s.fields, "hardware": hw, **price,
             **({"batch_size": B} if B > 1 else {}),
             **({"peak_memory_gib": peak} if peak is not None else {}),
             **({"compilations": compile_count() - n0 if k == 0 else 0} if world.compiled else {})}, s.image)
           for k, (s, p, idx, seed) in enumerate(zip(samples, prompts, idxs, seeds))]
    if tuned is not None:  # the next batch's price, from this batch's distortion
        tuned.observe([rec.get("step_tv") for rec, _ in out])
    return out


def _tuned_rule(method):
    """The method's rule if it tunes itself over a run's images (``BudgetRule.adaptive``), else None."""
    rule = getattr(method, "rule", None)
    return rule if getattr(rule, "adaptive", False) else None


def replay_tuning(methods: dict, done: dict, indices: list[int], batch_size: int) -> None:
    """A resumed run's self-tuning rules brought to where the interrupted run left them: each
    observes its finished images again, batch by batch as the run generated them (``run_methods``:
    positions [k b, (k + 1) b) of ``indices``), failed ones skipped as they were."""
    for tag, m in methods.items():
        rule = _tuned_rule(m)
        if rule is None:
            continue
        for start in range(0, len(indices), batch_size):
            rule.observe([done[(tag, i)].get("step_tv") for i in indices[start:start + batch_size]
                          if (tag, i) in done and "error" not in done[(tag, i)]])


def records_or_failures(world, method, prompts, idxs, seeds, tag) -> list:
    """``generate_records``; if the target's logits turn non-finite, the batch is split and the
    failing prompt gets an error record (no image) naming prompt and position."""
    try:
        return generate_records(world, method, prompts, idxs, seeds, tag)
    except NonFiniteLogits as e:
        if len(prompts) > 1:
            return [r for k in range(len(prompts))
                    for r in records_or_failures(world, method, prompts[k:k + 1], idxs[k:k + 1], seeds[k:k + 1], tag)]
        say(f"prompt {idxs[0]} ({tag}): {e}; recorded as failed, the run goes on")
        return [({**record_head(prompts[0], idxs[0], seeds[0], tag, method),
                  "error": f"non-finite target logits at image token {e.position}"}, None)]


def kept_images(world_cls, at_least: int = GRID_COLUMNS) -> Optional[int]:
    """How many images per method a run keeps in memory: all (None) where the world's quality
    reads them (the toy worlds' 32 px images), else the first ``at_least`` (the grid's, or
    more for the tracker)."""
    return None if world_cls.quality_reads_images else max(at_least, GRID_COLUMNS)


def read_image(folder: Path, record: dict) -> np.ndarray:
    return np.asarray(Image.open(folder / record["image"]).convert("RGB"))


def collect(world_cls, methods, records: dict, folder: Path, positions: list[int], fresh_images: dict,
            keep: Optional[int] = GRID_COLUMNS) -> dict:
    """{tag: (records, images)} in prompt order over ``positions`` (prompt indices), images from
    memory or read back from the PNGs (``keep`` of them, None: all), None for worlds without images."""
    out = {}
    for tag in methods:
        rows = [records[(tag, p)] for p in positions]
        imgs = None
        if world_cls.makes_images and rows:
            take = rows if keep is None else rows[:keep]
            imgs = np.stack([fresh_images[(tag, r["prompt_index"])] if (tag, r["prompt_index"]) in fresh_images
                             else read_image(folder, r) for r in take])
        out[tag] = (rows, imgs)
    return out


def warm_up(world, methods: dict, prompts: list, batch_size: int) -> dict:
    """One untimed batch per method at every batch size the run will use (the last batch may be
    smaller), so that compiled graphs (``compile=true``, and ``ar_compiled``'s on its compiled twin)
    are all built before timing. Returns {"warmup_s", "graphs_compiled"}."""
    t0, n0 = time.perf_counter(), compile_count()
    for m in methods.values():
        w, generating = placed(world, m)
        sizes = {min(batch_size, len(prompts))}
        if w.compiled and len(prompts) % batch_size:
            sizes.add(len(prompts) % batch_size)
        for k in sorted(sizes):
            w.generate(generating, prompts[:k], list(range(k)))
    return {"warmup_s": time.perf_counter() - t0, "graphs_compiled": compile_count() - n0}


def run_methods(world, methods: dict, prompts: list, indices: list[int], run_seed: int, writer: RecordWriter,
                done: list[dict] | None = None, batch_size: int = 1, keep_images: int = GRID_COLUMNS,
                stats: Optional[dict] = None, on_record=None) -> tuple[dict, dict]:
    """Every method on every prompt (``indices``: each prompt's index), in batches of
    ``batch_size``, methods interleaved per batch. ``done``: records of an interrupted run in
    the same folder, whose (method, prompt) pairs are skipped. Returns (outputs {tag:
    (records, images)} over the prompts where every method succeeded (``kept_images`` of the
    images), {tag: failed prompt indices}); ``stats`` receives the warm-up's (``warm_up``).
    ``on_record(record, image or None)`` is called with each record once it is written (the
    tracker's ``log_record``)."""
    have = {(r["method"], r["prompt_index"]): r for r in (done or [])}
    replay_tuning(methods, have, indices, batch_size)
    n_todo = sum((tag, indices[i]) not in have for i in range(len(prompts)) for tag in methods)
    if n_todo and world.warmup:  # excluded from latency
        (stats if stats is not None else {}).update(warm_up(world, methods, prompts, batch_size))
    keep = kept_images(type(world), keep_images)
    fresh = {}
    with tqdm(total=len(prompts) * len(methods), initial=len(prompts) * len(methods) - n_todo,
              desc="samples", unit="img") as bar:
        for start in range(0, len(prompts), batch_size):
            for tag in methods:
                pos = [i for i in range(start, min(start + batch_size, len(prompts))) if (tag, indices[i]) not in have]
                if not pos:
                    continue
                idxs = [indices[i] for i in pos]
                out = records_or_failures(world, methods[tag], [prompts[i] for i in pos], idxs,
                                          [prompt_seed(run_seed, idx) for idx in idxs], tag)
                for i, idx, (rec, img) in zip(pos, idxs, out):
                    rec = writer.append(rec, img, f"{tag}/{idx:05d}.png") if img is not None else writer.append(rec)
                    have[(tag, idx)] = rec
                    if on_record is not None:
                        on_record(rec, img)
                    if img is not None and (keep is None or i < keep):
                        fresh[(tag, idx)] = img
                bar.update(len(pos))
    mine = set(indices)
    failures = {tag: sorted(idx for (t, idx), r in have.items() if t == tag and "error" in r and idx in mine)
                for tag in methods}
    failed = {idx for v in failures.values() for idx in v}
    ok = [idx for idx in indices if idx not in failed]  # methods are compared on the prompts all completed
    return collect(type(world), methods, have, writer.dir, ok, fresh, keep), {t: v for t, v in failures.items() if v}


def lock_wait() -> float:
    """Seconds a run waits for another process holding its record file (``$COOLSD_LOCK_WAIT``,
    default 0: refused at once; a SLURM set-up line may export it so that a requeued task waits
    for its predecessor to finish flushing)."""
    import os

    raw = os.environ.get("COOLSD_LOCK_WAIT", "0")
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if not wait >= 0:
        raise ConfigError(f"$COOLSD_LOCK_WAIT must be a number of seconds >= 0, got {raw!r}; unset it to refuse at once")
    return wait


def run_shard(world, methods: dict, prompts: list, out_dir: Path, identity: dict, *, seed: int, offset: int = 0,
              batch_size: int = 1, shard: Shard = Shard(), keep_images: int = GRID_COLUMNS,
              stats: Optional[dict] = None, logger=NullLogger(), config: Optional[str] = None):
    """Lock this shard's record file (``RunLock``: a second process writing it is refused, naming
    the holder), claim the run folder, resume this shard's records and generate the rest. Returns
    (outputs, the prompts they cover, failures); with ``shard.count`` > 1 they cover this
    shard's prompts only (the summary comes from ``coolsd.cli.merge``). ``logger``
    (``coolsd.job.tracking``) starts once the folder is claimed and gets every record as it is written.
    ``config``: the job's ``config_digest``, kept in the lock so that a refusal advises rightly."""
    with RunLock(out_dir, shard.records_name, wait=lock_wait(), config=config):
        done = resume_records(out_dir, shard.records_name) if claim_run_dir(out_dir, identity) else []
        positions = shard.select(len(prompts))
        if done:
            say(f"resuming {out_dir}: {len(done)} of {len(positions) * len(methods)} samples already there")
        logger.start(identity, out_dir, shard, done)
        mine = [prompts[i] for i in positions]
        outputs, failures = run_methods(world, methods, mine, [offset + i for i in positions], seed,
                                        RecordWriter(out_dir, shard.records_name), done=done, batch_size=batch_size,
                                        keep_images=keep_images, stats=stats, on_record=logger.log_record)
    kept = {r["prompt_index"] for r in next(iter(outputs.values()))[0]} if outputs else set()
    return outputs, [p for i, p in zip(positions, mine) if offset + i in kept], failures


def summary_failed(e: Exception, out_dir: Path, records_name: str, dir_key: str) -> SummaryError:
    """The one line for a summary that failed after generation: what failed, that the records
    are kept, and the two ways to summarise them without generating again: ``coolsd.cli.merge``
    (summarises a run folder's records, one-process or sharded, without loading the target) or
    the same job in the same folder (it resumes, finds every sample done, and summarises)."""
    why = " ".join(str(e).split()) or "no message"
    n = _count_lines(out_dir / records_name)
    return SummaryError(f"summarising {out_dir} failed ({type(e).__name__}: {why[:400]}); its {n} records are kept "
                        f"in {out_dir / records_name}: summarise them with `python -m coolsd.cli.merge {out_dir}`, or "
                        f"rerun the same command with {dir_key}={out_dir} (it resumes: nothing is generated again); "
                        "COOLSD_VERBOSE=1 shows the traceback")


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def config_digest(cfg) -> str:
    """A digest of a job config without what does not change its samples' folder (the shard, the
    logger, the folder itself): runs of one configuration have one digest (``RunLock``'s advice)."""
    import hashlib

    from omegaconf import OmegaConf

    keep = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in ("shard", "logger", "out_dir")}
    return hashlib.sha256(repr(sorted(keep.items())).encode()).hexdigest()[:16]


def job_settings(cfg) -> tuple[Shard, int, int, bool]:
    """(shard, batch_size, threads, batch_invariant) of a job config (its ranges are
    ``coolsd.job.config_schema.check_config``'s, run first)."""
    shard = Shard.from_cfg(cfg)
    batch, threads = int(cfg.get("batch_size", 1)), int(cfg.get("threads", 1))
    return shard, batch, threads, bool((cfg.get("deterministic") or {}).get("batch_invariant", False))


class Interrupted(OneLineError):
    """Ctrl-C during a job: every record written is kept (``RecordWriter`` appends whole lines) and
    the message says how many and how to resume. Exit status 130, the shell's for SIGINT."""

    exit_status = 130


def interrupted(out_dir: Path, records_name: str, dir_key: str) -> Interrupted:
    n = _count_lines(out_dir / records_name)
    return Interrupted(f"interrupted: {n} sample record(s) are kept in {out_dir / records_name}; to resume, run the "
                       f"same command with {dir_key}={out_dir} (nothing kept is generated again)")


def run_job(cfg, out_dir: Path, world=None) -> dict:
    """The job of one composed config (``run.py``): validate, load the world (unless given,
    e.g. one loaded target for every row of a sweep), generate, summarise. A shard of several
    returns its shard info; ``python -m coolsd.cli.merge`` writes the summary. Ctrl-C ends it in
    one line (``Interrupted``) that says what is kept and how to resume."""
    dir_key = "out_dir" if cfg.get("out_dir") else "hydra.run.dir"
    world_cls = world_class(cfg.target.name) if world is None else type(world)
    # every range, the method's names, every missing file at once, the device and the output folder:
    # before anything loads
    check_config(cfg, world_cls, out_dir, dir_key)
    try:
        return _generate_and_summarise(cfg, out_dir, world, world_cls, dir_key)
    except KeyboardInterrupt:
        raise interrupted(out_dir, Shard.from_cfg(cfg).records_name, dir_key) from None


def _generate_and_summarise(cfg, out_dir: Path, world, world_cls, dir_key: str) -> dict:
    from omegaconf import OmegaConf

    shard, batch, threads, invariant = job_settings(cfg)
    name, _ = method_from_cfg(cfg)
    digest = config_digest(cfg)
    RunLock(out_dir, shard.records_name, wait=lock_wait(), config=digest).refuse_if_held()  # before loading
    prompts = world_cls.prompts(cfg)
    logger = make_logger(cfg.get("logger"), OmegaConf.to_container(cfg, resolve=True),  # a missing extra fails here
                         name=f"{cfg.target.name}/{name}/{out_dir.name}")
    torch.set_num_threads(threads)
    world = world or load_world(cfg)
    methods = job_methods(world, cfg)
    if wants_fastest_ar(cfg, world, methods):
        methods = with_fastest_ar(cfg, methods, name)
    dataset = world_cls.dataset(cfg)
    identity = run_identity(world, methods, seed=cfg.seed, dataset=dataset, threads=threads, batch_size=batch,
                            shard=shard, invariant=invariant, method=name)
    stats: dict = {}
    with batch_invariant(invariant):
        outputs, prompts, failures = run_shard(world, methods, prompts, out_dir, identity, seed=cfg.seed,
                                               offset=int(dataset.get("offset", 0)), batch_size=batch, shard=shard,
                                               keep_images=int((cfg.get("logger") or {}).get("n_images", 0)),
                                               stats=stats, logger=logger, config=digest)
    if stats:
        say(f"warm-up (excluded from latency): {stats['warmup_s']:.1f} s"
              + (f", {stats['graphs_compiled']} graphs compiled" if world.compiled or FASTEST_AR in methods else ""))
    if shard.count > 1:
        logger.finish()
        say(f"shard {shard.index} of {shard.count} done ({len(prompts)} prompts); when every shard is done: "
              f"python -m coolsd.cli.merge {out_dir}")
        return {"target": world.name, "shard": shard.index, "shards": shard.count, "n_prompts": len(prompts)}
    try:  # every record is durable by now: a failure from here on must not read as lost work
        summary = summarize(world_cls, identity, outputs, prompts, failures)
        if "compile" in summary and stats:
            summary["compile"]["warmup_s"] = stats["warmup_s"]
        lines = write_outputs(world_cls, summary, outputs, out_dir, world.reference_images(prompts[:GRID_COLUMNS]),
                              [p.caption for p in prompts[:GRID_COLUMNS]])
    except Exception as e:
        raise summary_failed(e, out_dir, shard.records_name, dir_key) from e
    logger.log_results(summary["results"])
    for tag, (_, imgs) in outputs.items():
        if imgs is not None:
            logger.log_images(tag, imgs, [p.caption for p in prompts])
    logger.log_files([p for p in [out_dir / "grid.png"] if p.exists()])
    logger.finish()
    say("\n".join(lines))
    return summary
