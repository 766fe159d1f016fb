"""``run(cfg)``: the package entry behind ``run.py`` (Hydra composes cfg; tests call this)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def safe_dirname(overrides: str, limit: int = 100) -> str:
    """A folder name from Hydra's ``override_dirname``: path separators replaced; long names
    cut and suffixed with a hash of the whole, so distinct configurations never share a folder."""
    import hashlib

    name = overrides.replace("/", "_") or "default"
    if len(name) > limit:
        name = name[:limit] + "_" + hashlib.sha256(overrides.encode()).hexdigest()[:10]
    return name


# ``hydra.sweep.subdir`` (conf/config.yaml) names each run folder with it
OmegaConf.register_new_resolver("coolsd_dirname", safe_dirname, replace=True)


def compose(*overrides) -> DictConfig:
    """The job config ``run.py`` would get for these overrides (conf/ composed by Hydra)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def output_dir(cfg: DictConfig) -> Path:
    if cfg.get("out_dir"):
        return Path(cfg.out_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig) -> dict:
    """The one generation job (``coolsd.job.run_job``) for every target and method."""
    from coolsd.job import run_job

    return run_job(cfg, output_dir(cfg))
