"""``run(cfg)``: the package entry behind ``run.py`` (Hydra composes cfg; tests call this).

The project's own configuration and input errors (``coolsd.util.errors.InputError``) reach a person as
one or two lines and exit status 2, without a traceback (``one_line_errors``), and so does a
summary that failed after generating (``coolsd.util.errors.SummaryError``, exit status 3: the records
are kept, the line says how to summarise them); set ``HYDRA_FULL_ERROR=1`` or
``COOLSD_VERBOSE=1`` for the full traceback. ``CheckBeforeRun`` (a Hydra callback,
conf/config.yaml ``hydra.callbacks``) runs the config's range checks and the output folder's
before Hydra creates the run folder or its log, so a refused config writes nothing.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from coolsd.engine import plugins
from coolsd.job.config_schema import check_config, check_output_dir
from coolsd.util.errors import ConfigError, OneLineError
from coolsd.util.log import say

VERBOSE_ENV = ("HYDRA_FULL_ERROR", "COOLSD_VERBOSE")  # =1: tracebacks for the project's own errors too


def short_hash(overrides: str, digits: int = 6) -> str:
    """Hex digits of a sha256 of a command's ``override_dirname``: six are the default run folder's
    suffix (``hydra.run.dir``, conf/config.yaml), so launches of different configurations in the same
    second never pick one folder."""
    import hashlib

    return hashlib.sha256(overrides.encode()).hexdigest()[:digits]


def safe_dirname(overrides: str, limit: int = 100) -> str:
    """A folder name from Hydra's ``override_dirname``: path separators replaced; long names
    cut and suffixed with a hash of the whole, so distinct configurations never share a folder."""
    name = overrides.replace("/", "_") or "default"
    if len(name) > limit:
        name = name[:limit] + "_" + short_hash(overrides, 10)
    return name


SCHEMA_SUFFIX = "_schema"  # a schema node (coolsd.job.config_schema): what a conf file types itself against


def config_groups() -> str:
    """``python run.py --help``'s group list (``hydra.help.template``, conf/config.yaml): every
    configuration group and its options as Hydra lists them, less Hydra's own groups and the schema
    nodes the conf files type themselves against (``*_schema``: never chosen on the command line)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str = "") -> list[str]:
        out = []
        for g in loader.list_groups(parent):
            name = f"{parent}/{g}" if parent else g
            if name == "hydra":
                continue
            if loader.get_group_options(name, ObjectType.CONFIG):
                out.append(name)
            out += groups(name)
        return out

    lines = []
    for g in sorted(groups()):
        options = [o for o in sorted(loader.get_group_options(g)) if not o.endswith(SCHEMA_SUFFIX)]
        if options:
            lines.append(f"{g}: {', '.join(options)}")
    return "\n".join(lines)


# ``hydra.sweep.subdir`` (conf/config.yaml) names each run folder with it
OmegaConf.register_new_resolver("coolsd_dirname", safe_dirname, replace=True)
OmegaConf.register_new_resolver("coolsd_hash", short_hash, replace=True)
OmegaConf.register_new_resolver("coolsd_config_groups", config_groups, replace=True)


def compose(*overrides) -> DictConfig:
    """The job config ``run.py`` would get for these overrides (conf/ composed by Hydra)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def output_dir(cfg: DictConfig) -> Path:
    if cfg.get("out_dir"):
        return Path(cfg.out_dir)
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig) -> dict:
    """The one generation job (``coolsd.job.generation.run_job``) for every target and method. Methods from
    outside the package (``COOLSD_INCLUDE``) are registered here too: a launcher's job process
    may run this without starting Hydra's plugins (loading twice is a no-op)."""

    plugins.load()
    # deferred: a refused config stops before the job's modules (scipy, the metrics) load
    from coolsd.job.generation import run_job

    return run_job(cfg, output_dir(cfg))


def verbose() -> bool:
    return any(os.environ.get(k, "") not in ("", "0") for k in VERBOSE_ENV)


@contextmanager
def one_line_errors():
    """A ``OneLineError`` inside (``coolsd.util.errors``: an ``InputError``, a ``SummaryError``) becomes
    its message on stderr and its exit status (2, 3; a traceback with ``HYDRA_FULL_ERROR=1`` or
    ``COOLSD_VERBOSE=1``); any other exception is a bug and keeps its traceback."""
    try:
        yield
    except OneLineError as e:
        if verbose():
            raise
        say(f"error: {e}", logging.ERROR)  # printed, and in the job's log where one is open
        raise SystemExit(e.exit_status) from None


def job_config(config: DictConfig) -> DictConfig:
    """The job's part of a Hydra config (without the ``hydra`` node)."""
    return OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])


class CheckBeforeRun(Callback):
    """Refuse a bad config before Hydra writes anything: ``coolsd.job.config_schema.check_config``
    (ranges, device, the run folder writable) on a single run; every job's config (``check_sweep``)
    and the sweep folder on a multirun (each job checks its config again as it starts)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig


        HydraConfig.instance().set_config(config)  # resolves ${hydra:...} in hydra.run.dir
        with one_line_errors():
            check_config(job_config(config))
            if config.get("out_dir"):
                check_output_dir(config.out_dir, "out_dir")
            check_output_dir(config.hydra.run.dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        with one_line_errors():
            check_sweep(config)  # before the sweep folder: a refused sweep writes nothing
            check_output_dir(config.hydra.sweep.dir, "hydra.sweep.dir")


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """Every job's overrides, in launch order, as Hydra's basic sweeper will make them from a
    multirun's config (``hydra.sweeper.params`` first, then the command line's overrides)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
    parsed = parser.parse_overrides(params + list(config.hydra.overrides.task))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def check_sweep(config: DictConfig) -> None:
    """Compose and check every job of a multirun before the first one starts (``check_config`` on
    each: values, unknown and unused settings, files, device): a sweep with a bad job runs none, and
    the refusal names each bad job by the values that vary across the sweep, one line each. A
    sweeper other than Hydra's basic one makes its own jobs: each is then checked as it starts."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    if config.hydra.sweeper.get("_target_") != BASIC_SWEEPER:
        return
    jobs = sweep_jobs(config)
    varying = {o.split("=", 1)[0] for job in jobs for o in job if sum(o in j for j in jobs) < len(jobs)}
    loader = GlobalHydra.instance().config_loader()
    refused = []
    for i, overrides in enumerate(jobs):
        try:
            job = loader.load_sweep_config(config, overrides)
            check_config(job_config(job), overrides=list(job.hydra.overrides.task))
        except (OneLineError, HydraException) as e:
            label = " ".join(o for o in overrides if o.split("=", 1)[0] in varying) or " ".join(overrides)
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            refused.append(f"job {i} ({label}): {why}")
    if refused:
        raise SweepRefused("\n".join(refused + [f"{len(refused)} of {len(jobs)} jobs refused: nothing ran; "
                                                 "fix or drop their values and run the sweep again"]))


class SweepRefused(ConfigError):
    """Jobs of a multirun refused before any ran: one line per bad job and a last line saying so."""
