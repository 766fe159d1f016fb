"""Registers coolsd's structured config schemas (``coolsd.job.config_schema``) in Hydra's ConfigStore.
Hydra imports every ``hydra_plugins`` module when it starts, so ``run.py``, ``hydra.compose`` in
tests and notebooks, and the launchers all compose against the same schemas."""
from coolsd.job.config_schema import register_schemas

register_schemas()
