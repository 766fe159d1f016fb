"""coolsd entry point: `python run.py method=coolsd method.delta=2.0` (Hydra overrides)."""
import hydra
from omegaconf import DictConfig

from coolsd.runner import run


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
