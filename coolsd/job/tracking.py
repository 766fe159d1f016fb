"""Experiment tracking: ``logger=none`` (default) or ``logger=wandb`` (optional extra).

A logger is told the run folder's identity once its folder is claimed (``start``), then every
record as it is written (``log_record``), and, where a summary is made (a one-process run, or
``coolsd.cli.merge`` of shards), the summary (``log_results``), its plots and a table of sample
images with captions. ``NullLogger`` does nothing: with ``logger=none`` a record costs one no-op call.

W&B (``WandbLogger``):

* one W&B run per shard, its id derived from the run folder: the configuration (``run.json``,
  ``configuration_key``), the folder's resolved path and the shard (``wandb_run_id``), opened
  with ``resume="allow"``: a resumed or requeued shard (same folder) continues its own run. The
  merged summary is one more run of the folder (id suffix ``merged``);
* the runs of one configuration (every shard, the merge) share one group,
  ``<target>/<method>/<configuration key>``, unless ``logger.group`` names another (then the
  configuration key stays in the run's config, ``coolsd.configuration``);
* per record, at step = images this shard has written (over its methods, resumed ones included):
  ``<method>/<field>`` and its running mean ``<method>/<field>_mean`` for each of ``TRACKED`` the
  record has, ``<method>/failed`` for an error record, and every ``logger.image_every``-th image
  of a method as ``<method>/sample`` (1st, N+1-th, ...; 0: none);
* with the summary: its numbers flattened to ``<method>/<metric>`` (``_lo`` / ``_hi``: 95% CIs),
  ``summary/table`` (one row per method: every reported metric with its interval) and, for each
  quality signal of the summary (``quality_metrics``), ``pareto/<metric>``: a W&B scatter chart
  of the metric against the speed-up over same-mode AR, and ``pareto_fastest_ar/<metric>``: against
  the speed-up over the fastest AR (``speedup_vs_fastest_ar``), each table holding both intervals
  (the merge adds the first plot with error bars, ``figures/pareto``).

Failures: without wandb installed, ``logger=wandb`` is an error before any work; so is a
``wandb.init`` that fails (before generation starts: nothing is lost, the message names
``logger.mode``). Once generation runs, the records on disk are the truth: a W&B call that fails
prints one warning, the logger turns itself off and the run goes on generating.

W&B runs offline by default (nothing leaves the machine): each process of a run writes its own
``offline-run-*-<id>`` folder under ``logger.dir``; ``wandb sync`` uploads them, the pieces of one
run id in order of their start.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

from coolsd.job.shards import Shard
from coolsd.util.errors import ConfigError
from coolsd.util.log import say
from coolsd.util.records import write_json_atomic

# per-image record fields logged as they come (a world's records carry the ones it measures)
TRACKED = ("latency_s", "accepted_length", "target_forwards", "step_tv")
# summary metrics that measure speed or count work, never quality (the x side of a Pareto plot)
SPEED_METRICS = frozenset({
    "accepted_length", "exact_accepted_length", "sampled_accepted_length", "latency_s", "signal_s", "decode_s",
    "target_forwards", "draft_forwards", "images_per_s", "speedup", "speedup_per_accepted_length",
    "speedup_without_signals", "speedup_vs_fastest_ar", "acceptance_rate", "resample_rounds", "fallbacks", "peak_memory_gib", "resolution"})
# the Pareto charts: (key prefix, x: a speed-up, its title, {} = the fastest AR's tag), the two speed-ups
# labelled apart (coolsd.job.summary.FASTEST_AR_REFERENCE)
PARETO_AXES = (("pareto", "speedup", "speed-up over same-mode AR"),
               ("pareto_fastest_ar", "speedup_vs_fastest_ar", "speed-up over the fastest AR ({})"))
# the logger settings a run folder keeps for ``coolsd.cli.merge`` (its ``WANDB_FILE``)
WANDB_FILE = "wandb.json"


def _point(v) -> Optional[tuple[float, Optional[float], Optional[float]]]:
    """(point, lo, hi) of a summary entry: {"mean", "ci95"} | {"fid"|"diff", "lo", "hi"} | a number."""
    if isinstance(v, dict):
        point = next((v[k] for k in ("mean", "fid", "diff") if k in v), None)
        if point is None:
            return None
        lo, hi = v["ci95"] if "ci95" in v else (v.get("lo"), v.get("hi"))
        return float(point), (None if lo is None else float(lo)), (None if hi is None else float(hi))
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v), None, None
    return None


def flatten_summary(results: dict) -> dict[str, float]:
    """{tag: {metric: {"mean", "ci95"} | {"fid", "lo", "hi"} | {"diff", "lo", "hi"} | number}}
    -> {"tag/metric": mean, "tag/metric_lo": lo, "tag/metric_hi": hi}."""
    out: dict[str, float] = {}
    for tag, metrics in results.items():
        for name, v in metrics.items():
            p = _point(v)
            if p is None:
                continue
            out[f"{tag}/{name}"] = p[0]
            if p[1] is not None:
                out[f"{tag}/{name}_lo"], out[f"{tag}/{name}_hi"] = p[1], p[2]
    return out


def summary_rows(results: dict) -> list[dict]:
    """One row per method tag of a summary's ``results``: tag, family (the method), params (JSON)
    and, for every reported number m, m, m_lo, m_hi (None without an interval); the shape of
    ``coolsd.report.sweep.sweep_frame``'s rows."""
    rows = []
    for tag, metrics in results.items():
        params = metrics.get("params") or {}
        r: dict = {"tag": tag, "family": params.get("method", tag), "params": json.dumps(params, sort_keys=True),
                   **({"fastest_ar": metrics["fastest_ar"]} if metrics.get("fastest_ar") else {})}
        for name, v in metrics.items():
            p = _point(v)
            if p is not None:
                r[name], r[name + "_lo"], r[name + "_hi"] = p
        rows.append(r)
    return rows


def quality_metrics(rows: list[dict]) -> list[str]:
    """The quality signals of summary rows, in their order: every metric with a value that is
    neither speed nor work (``SPEED_METRICS``) nor a difference to AR (``*_minus_ar``)."""
    out: list[str] = []
    for r in rows:
        for k, v in r.items():
            if (k in ("tag", "family", "params") or k.endswith(("_lo", "_hi", "_minus_ar")) or k in SPEED_METRICS
                    or k in out or not isinstance(v, float)):
                continue
            out.append(k)
    return out


def configuration_key(identity: dict) -> str:
    """12 hex digits naming a configuration: a hash of its run identity (``run.json``, which every
    shard of a run shares), read as ``claim_run_dir`` stores it."""
    canon = json.dumps(json.loads(json.dumps(identity, default=float)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:12]


def wandb_group(identity: dict) -> str:
    """The W&B group of a configuration: ``<target>/<method>/<configuration key>``."""
    return f"{identity.get('target', '?')}/{identity.get('method') or list(identity.get('methods') or ['?'])[-1]}/" \
           f"{configuration_key(identity)}"


def wandb_run_id(identity: dict, folder: Path, shard: Optional[Shard]) -> str:
    """The W&B run id of one shard of a run folder (``shard`` None: the folder's merged summary):
    the same for every process that ever writes it (a resume, a requeue), different for another
    folder or another shard."""
    where = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:8]
    part = "merged" if shard is None else ("run" if shard.count == 1 else f"shard-{shard.index}-of-{shard.count}")
    return f"coolsd-{configuration_key(identity)}-{where}-{part}"


class NullLogger:
    """``logger=none``: every call is a no-op."""

    def start(self, identity: dict, folder: Path, shard: Optional[Shard] = Shard(), done=()) -> None: ...
    def start_report(self, folders, name: str) -> None: ...
    def log_record(self, record: dict, image=None) -> None: ...
    def log_summary(self, results: dict) -> None: ...
    def log_results(self, results: dict, figures=()) -> None: ...
    def log_images(self, tag: str, images, captions) -> None: ...
    def log_files(self, paths) -> None: ...
    def finish(self) -> None: ...


def _int_setting(cfg: dict, key: str, default: int) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"logger.{key} must be an integer >= 0, got {v!r}")
    return v


class WandbLogger(NullLogger):
    def __init__(self, cfg: dict, resolved_config: dict, name: str):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logger=wandb needs the optional extra: pip install -e '.[wandb]' "
                              "(or run with logger=none)") from e
        self.wandb = wandb
        self.cfg, self.config, self.name = cfg, resolved_config, name
        self.n_images = _int_setting(cfg, "n_images", 16)
        self.image_every = _int_setting(cfg, "image_every", 100)
        self.run = None
        self.broken = False  # a W&B call failed mid-run: the logger is off, generation goes on
        self.step = 0  # images this shard has written (its resumed records included)
        self.sums: dict = {}  # {(tag, field): [sum, n]}: the running means
        self.per_tag: dict = {}  # {tag: images written}, for ``image_every``

    def settings(self) -> dict:
        """What a run folder keeps (``WANDB_FILE``) so that ``coolsd.cli.merge`` logs where its shards did."""
        keep = ("project", "entity", "mode", "group", "n_images", "image_every")
        return {**{k: self.cfg.get(k) for k in keep}, "name": "wandb",
                "tags": [str(t) for t in self.cfg.get("tags") or []], "dir": str(Path(self.cfg["dir"]).resolve())}

    def _init(self, **kw) -> None:
        Path(self.cfg["dir"]).mkdir(parents=True, exist_ok=True)
        try:
            self.run = self.wandb.init(project=self.cfg["project"], entity=self.cfg.get("entity"),
                                       mode=self.cfg.get("mode", "offline"), dir=self.cfg["dir"],
                                       tags=list(self.cfg.get("tags") or []), config=self.config,
                                       reinit="finish_previous", **kw)
        except Exception as e:
            why = " ".join(str(e).split())[:300] or type(e).__name__
            mode = self.cfg.get("mode", "offline")
            fix = (f"check that logger.dir={self.cfg['dir']} is writable" if mode == "offline" else
                   f"logger.mode={mode!r} needs W&B reachable: use logger.mode=offline (upload later with wandb sync)")
            raise ConfigError(f"logger=wandb: wandb.init failed ({why}); {fix}, or run with logger=none") from e

    def start(self, identity: dict, folder: Path, shard: Optional[Shard] = Shard(), done=()) -> None:
        """Open (or continue) the W&B run of this shard of ``folder`` (``shard`` None: its merged
        summary), ``done``: the records already there (a resume), counted in the step and the
        running means. Keeps the logger settings in ``folder``'s ``WANDB_FILE``."""
        key = configuration_key(identity)
        self.config = {**self.config, "coolsd": {"configuration": key, "folder": str(Path(folder).resolve()),
                                                 **({"shard": shard.index, "shards": shard.count} if shard else {})}}
        part = "merged" if shard is None else ("" if shard.count == 1 else f"shard-{shard.index}-of-{shard.count}")
        self._init(id=wandb_run_id(identity, folder, shard), resume="allow",
                   group=self.cfg.get("group") or wandb_group(identity),
                   job_type="merge" if shard is None else "generate", name="/".join(filter(None, [self.name, part])))
        write_json_atomic(self.settings(), Path(folder) / WANDB_FILE)
        for r in done:
            self._count(r)

    def start_report(self, folders, name: str) -> None:
        """Open (or continue) the W&B run of a report over run folders (``coolsd.report.consolidate
        --wandb``): its id from the folders' resolved paths (the same report again continues it),
        group ``logger.group`` or ``reports``."""
        paths = sorted(str(Path(f).resolve()) for f in folders)
        key = hashlib.sha256("\n".join(paths).encode()).hexdigest()[:12]
        self.config = {**self.config, "coolsd": {"report": name, "folders": paths}}
        self._init(id=f"coolsd-report-{key}", resume="allow", group=self.cfg.get("group") or "reports",
                   job_type="report", name=name)

    def _ensure(self):
        if self.run is None:  # used without ``start`` (a summary alone): a fresh run, as named
            self._init(name=self.name, group=self.cfg.get("group"))
        return self.run

    def _failed(self, what: str, e: Exception) -> None:
        if not self.broken:
            why = " ".join(str(e).split())[:300] or type(e).__name__
            say(f"warning: W&B logging failed while logging {what} ({type(e).__name__}: {why}); W&B logging is "
                "off for the rest of this run, which goes on (its records on disk are complete)", logging.WARNING)
        self.broken = True

    def _count(self, record: dict) -> dict:
        """Advance the step and running means by one record; its row of numbers."""
        self.step += 1
        tag = record["method"]
        self.per_tag[tag] = self.per_tag.get(tag, 0) + 1
        row: dict = {"images_done": self.step}
        if "error" in record:
            s = self.sums.setdefault((tag, "failed"), [0.0, 0])
            s[0] += 1
            row[f"{tag}/failed"] = s[0]
        for k in TRACKED:
            v = record.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                s = self.sums.setdefault((tag, k), [0.0, 0])
                s[0] += v
                s[1] += 1
                row[f"{tag}/{k}"], row[f"{tag}/{k}_mean"] = v, s[0] / s[1]
        return row

    def log_record(self, record: dict, image=None) -> None:
        row = self._count(record)
        if self.broken:
            return
        try:
            tag = record["method"]
            if image is not None and self.image_every and (self.per_tag[tag] - 1) % self.image_every == 0:
                row[f"{tag}/sample"] = self.wandb.Image(image, caption=f"{record.get('prompt_index')}: "
                                                                        f"{record.get('caption', '')}")
            self._ensure().log(row, step=self.step)
        except Exception as e:
            self._failed(f"image {self.step}", e)

    def log_summary(self, results: dict) -> None:
        if self.broken:
            return
        try:
            flat = flatten_summary(results)
            self._ensure().log(flat)
            self.run.summary.update(flat)
        except Exception as e:
            self._failed("the summary", e)

    def log_results(self, results: dict, figures=()) -> None:
        """The summary (``log_summary``), ``summary/table`` and the Pareto charts (speed-up against
        each quality signal); ``figures``: image files logged beside them as ``figures/<stem>``."""
        self.log_summary(results)
        if self.broken:
            return
        try:
            rows = summary_rows(results)
            cols = list(dict.fromkeys(k for r in rows for k in r))
            table = self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in rows])
            out = {"summary/table": table}
            fastest = next((r["fastest_ar"] for r in rows if r.get("fastest_ar")), None)
            for key, x, title in PARETO_AXES:
                for m in quality_metrics(rows):
                    pts = [r for r in rows if r.get(x) is not None and r.get(m) is not None]
                    if not pts:
                        continue
                    cols = ["tag", "family", x, x + "_lo", x + "_hi", m, m + "_lo", m + "_hi"]
                    t = self.wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in pts])
                    out[f"{key}/{m}"] = self.wandb.plot.scatter(t, x, m, title=f"{m} vs {title.format(fastest)}")
            for p in map(Path, figures):
                out[f"figures/{p.stem}"] = self.wandb.Image(str(p))
            self._ensure().log(out)
        except Exception as e:
            self._failed("the summary table", e)

    def log_images(self, tag: str, images, captions) -> None:
        if self.broken:
            return
        try:
            table = self.wandb.Table(columns=["method", "prompt", "caption", "image"])
            for i, (img, cap) in enumerate(list(zip(images, captions))[: self.n_images]):
                table.add_data(tag, i, cap, self.wandb.Image(img, caption=cap))
            self._ensure().log({f"samples/{tag}": table})
        except Exception as e:
            self._failed(f"the sample images of {tag}", e)

    def log_files(self, paths) -> None:
        if self.broken:
            return
        try:
            for p in paths:
                p = Path(p)
                if p.suffix == ".png":
                    self._ensure().log({f"plots/{p.stem}": self.wandb.Image(str(p))})
        except Exception as e:
            self._failed("the plots", e)

    def finish(self) -> None:
        if self.run is None:
            return
        try:
            self.run.finish()
        except Exception as e:
            self._failed("the end of the run", e)


def make_logger(cfg: Optional[Any], resolved_config: dict, name: str):
    """``cfg``: the ``logger`` config group (None or name none -> NullLogger)."""
    if cfg is None:
        return NullLogger()
    cfg = dict(cfg)
    kind = cfg.get("name", "none")
    if kind == "none":
        return NullLogger()
    if kind == "wandb":
        return WandbLogger(cfg, resolved_config, name)
    raise ValueError(f"unknown logger {kind!r}; valid: none, wandb")


def folder_logger(folder: Path, resolved_config: dict, name: str):
    """The logger a run folder's shards used (its ``WANDB_FILE``; None where they used none):
    how ``coolsd.cli.merge`` logs the merged summary beside them."""
    path = Path(folder) / WANDB_FILE
    if not path.is_file():
        return None
    return make_logger(json.loads(path.read_text()), resolved_config, name)
