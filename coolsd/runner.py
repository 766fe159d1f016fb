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


def method_from_cfg(cfg: DictConfig) -> tuple[str, dict]:
    m = OmegaConf.to_container(cfg.method, resolve=True)
    name = m.pop("name")
    return name, m


def output_dir(cfg: DictConfig) -> Path:
    if cfg.get("out_dir"):
        return Path(cfg.out_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig) -> dict:
    from coolsd.shards import Shard

    Shard.from_cfg(cfg)  # a bad shard is an error before anything loads
    name, params = method_from_cfg(cfg)
    tree, draft_length = cfg.tree.name, cfg.tree.get("draft_length")
    kind = cfg.target.kind
    continuous = kind in ("toy_continuous", "mar")
    if (name == "cspd") != (continuous and name != "ar"):
        raise ValueError(f"method={name} cannot run on target kind {kind!r}: method=cspd (continuous speculative "
                         f"decoding) needs a continuous target (target=toy_continuous, mar_h, mar_l), which run "
                         f"method=cspd or method=ar")
    if continuous:
        from coolsd.continuous.job import run_continuous

        return run_continuous(cfg, name, params, output_dir(cfg))
    if kind == "tabular":
        from coolsd.theory.job import run_lab

        return run_lab(cfg, name, params, tree, draft_length, output_dir(cfg))
    if kind == "toy":
        from coolsd.toy.job import run_toy

        return run_toy(cfg, name, params, tree, draft_length, output_dir(cfg))
    if kind == "llamagen":
        from coolsd.job import run_image_target
        from coolsd.targets.llamagen import load_llamagen_world, require_files

        target_name = cfg.target.get("name", kind)
        require_files(target_name, cfg.target, cfg.get("draft"))  # before any work: every missing file at once
        device = cfg.target.get("device", "cuda")
        world = load_llamagen_world(target_name, cfg.target, cfg.get("draft"), device=device)
        return run_image_target(cfg, world, name, params, tree, draft_length, output_dir(cfg), device)
    if kind == "lumina":
        from coolsd.job import run_image_target
        from coolsd.targets.lumina import load_lumina_world

        device = cfg.target.get("device", "cuda")
        world = load_lumina_world(cfg.target.get("name", kind), cfg.target, cfg.get("draft"), device=device)
        return run_image_target(cfg, world, name, params, tree, draft_length, output_dir(cfg), device)
    raise ValueError(f"unknown target kind {kind!r}; valid: tabular, toy, llamagen, lumina, toy_continuous, mar")
