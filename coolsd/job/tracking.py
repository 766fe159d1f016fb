"""Experiment tracking: ``logger=none`` (default) or ``logger=wandb`` (optional extra).

A logger receives the resolved config at the start, then the run's summary (flattened to
``<method>/<metric>`` keys with ``_lo``/``_hi`` for 95% CIs), its plots and a table of sample
images with captions. W&B runs offline by default (nothing leaves the machine; ``wandb sync``
uploads later); without wandb installed, ``logger=wandb`` is a clear error before any work.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


def flatten_summary(results: dict) -> dict[str, float]:
    """{tag: {metric: {"mean", "ci95"} | {"fid", "lo", "hi"} | {"diff", "lo", "hi"} | number}}
    -> {"tag/metric": mean, "tag/metric_lo": lo, "tag/metric_hi": hi}."""
    out: dict[str, float] = {}
    for tag, metrics in results.items():
        for name, v in metrics.items():
            key = f"{tag}/{name}"
            if isinstance(v, dict):
                point = next((v[k] for k in ("mean", "fid", "diff") if k in v), None)
                if point is None:
                    continue
                out[key] = float(point)
                lo, hi = v["ci95"] if "ci95" in v else (v.get("lo"), v.get("hi"))
                if lo is not None:
                    out[key + "_lo"], out[key + "_hi"] = float(lo), float(hi)
            elif isinstance(v, (int, float)):
                out[key] = float(v)
    return out


class NullLogger:
    def log_summary(self, results: dict) -> None: ...
    def log_images(self, tag: str, images, captions) -> None: ...
    def log_files(self, paths) -> None: ...
    def finish(self) -> None: ...


class WandbLogger(NullLogger):
    def __init__(self, cfg: dict, resolved_config: dict, name: str):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("logger=wandb needs the optional extra: pip install -e '.[wandb]' "
                              "(or run with logger=none)") from e
        self.wandb = wandb
        Path(cfg["dir"]).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg["project"], entity=cfg.get("entity"), mode=cfg.get("mode", "offline"),
                              dir=cfg["dir"], group=cfg.get("group"), tags=list(cfg.get("tags") or []), name=name,
                              config=resolved_config, reinit="finish_previous")
        self.n_images = int(cfg.get("n_images", 16))

    def log_summary(self, results: dict) -> None:
        flat = flatten_summary(results)
        self.run.log(flat)
        self.run.summary.update(flat)

    def log_images(self, tag: str, images, captions) -> None:
        table = self.wandb.Table(columns=["method", "prompt", "caption", "image"])
        for i, (img, cap) in enumerate(list(zip(images, captions))[: self.n_images]):
            table.add_data(tag, i, cap, self.wandb.Image(img, caption=cap))
        self.run.log({f"samples/{tag}": table})

    def log_files(self, paths) -> None:
        for p in paths:
            p = Path(p)
            if p.suffix == ".png":
                self.run.log({f"plots/{p.stem}": self.wandb.Image(str(p))})

    def finish(self) -> None:
        self.run.finish()


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
