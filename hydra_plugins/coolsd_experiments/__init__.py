"""Hydra search-path plugin: puts the repository's ``experiments/`` folder on the config
search path, so ``python run.py -m +experiment=<name>`` finds the sweep configs from any
working directory (a relative ``hydra.searchpath`` entry would resolve against the cwd)."""
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


class CoolsdExperimentsSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if EXPERIMENTS.is_dir():
            search_path.append(provider="coolsd-experiments", path=f"file://{EXPERIMENTS}")
