"""Hydra plugins of the project:

* a search-path plugin that puts the repository's ``experiments/`` folder on the config search
  path, so ``python run.py -m +experiment=<name>`` finds the sweep configs from any working
  directory (a relative ``hydra.searchpath`` entry would resolve against the cwd);
* a search-path plugin that loads methods and targets from outside the package (``COOLSD_INCLUDE``,
  ``coolsd.engine.plugins``), stores every registered method's config node and target schema (those
  registered since Hydra's plugins were discovered too) and puts the included config folders on
  the search path;
* the ``coolsd_log_name`` resolver (conf/config.yaml ``hydra.job_logging``): one job log per shard;
* ``MergeHint``, a callback (conf/config.yaml ``hydra.callbacks``) that prints, on the console
  of the command that launched a multirun, the ``python -m coolsd.cli.merge`` command of every sharded
  run folder once all jobs have returned (the jobs' own hints land in the launcher's job logs).

Invariant: importing this module registers the resolver; Hydra imports it while discovering
plugins, and a launcher's job process imports it when it unpickles the callback.
"""
from pathlib import Path
from typing import Any

from hydra.core.config_search_path import ConfigSearchPath
from hydra.experimental.callback import Callback
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import DictConfig, OmegaConf

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def _log_name(job, index, count) -> str:
    from coolsd.job.shards import log_name

    return log_name(job, index, count)


OmegaConf.register_new_resolver("coolsd_log_name", _log_name, replace=True)


class CoolsdExperimentsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if EXPERIMENTS.is_dir():
            search_path.append(provider="coolsd-experiments", path=f"file://{EXPERIMENTS}")


class CoolsdIncludeSearchPath(SearchPathPlugin):
    """Methods from outside the package (``coolsd.engine.plugins``): imports what ``COOLSD_INCLUDE``
    names and puts the config folders they bring on the search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        import sys

        from coolsd.engine import plugins
        from coolsd.job.config_schema import register_schemas
        from coolsd.util.errors import ConfigError

        confs = []
        if plugins.include_paths():
            from coolsd.cli.runner import verbose

            try:
                confs = plugins.load()
            except ConfigError as e:  # a path that is not there, a file that raises: one line (exit status 2)
                if verbose():
                    raise
                print(f"error: {e}", file=sys.stderr)
                sys.exit(2)
        # a method or world registered after the schema plugin filled the ConfigStore (an included
        # file, ``plugins.load`` in Python before ``compose``) has no node there yet: store the
        # schemas again on every Hydra start, so that ``method=<name>`` and a target's conf file's
        # defaults list find theirs when Hydra composes (next, after the search path is set)
        register_schemas()
        for conf in confs:
            search_path.append(provider="coolsd-include", path=f"file://{conf}")


class MergeHint(Callback):
    """At the end of a multirun, print the merge command of each sharded run folder in it."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from coolsd.job.shards import merge_commands

        commands = merge_commands(config.hydra.sweep.dir)
        if commands:
            print("every shard has returned; merge each sharded run into its records and summary:\n  "
                  + "\n  ".join(commands), flush=True)
