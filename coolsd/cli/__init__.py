"""The apps layer's command lines: the Hydra runner, merge, evaluate, drafter training."""
