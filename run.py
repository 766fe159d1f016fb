"""coolsd entry point: `python run.py method=coolsd method.delta=2.0` (Hydra overrides).
`--include PATH` (a Python file or a folder of them) registers methods from outside the
package first (``coolsd.engine.plugins``; docs/add_method.md). `--list methods|targets|drafters|trees|metrics|protocols`
prints what can be chosen, with every method parameter's default and valid values (``coolsd.cli.listing``).

A wrong configuration or input stops with one or two lines naming the key or file and exit
status 2 (``coolsd.cli.runner.one_line_errors``); HYDRA_FULL_ERROR=1 or COOLSD_VERBOSE=1 shows the traceback."""
import sys

import hydra
from omegaconf import DictConfig

from coolsd.cli.listing import list_from_argv
from coolsd.cli.runner import one_line_errors, run
from coolsd.engine.plugins import include_from_argv


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    with one_line_errors():
        run(cfg)


if __name__ == "__main__":
    sys.argv = include_from_argv(sys.argv)
    listed = list_from_argv(sys.argv[1:])  # --list methods|...|metrics|protocols: print and stop
    if listed is not None:
        sys.exit(listed)
    main()
