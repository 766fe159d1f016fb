"""ImageReward v1.0 scores of (image, caption) pairs, run in the interpreter that has the
``image-reward`` package (docs/methods.md#6-evaluation-protocol). Standalone on purpose (imports nothing from coolsd):
``image-reward`` pins old timm and needs torchvision, so it usually lives in its own virtual
environment and ``coolsd.metrics.image_reward`` calls this file with that environment's python:

    python image_reward_worker.py JOB.json OUT.json --checkpoint ImageReward.pt \
        --med-config med_config.json [--device cuda]

JOB.json: {"items": [{"image": path, "caption": str}, ...]}. OUT.json (written atomically):
{"scores": [float, ...] in item order, "unexpected_keys": [...]}. The checkpoint is read with
``torch.load(weights_only=True)`` and loaded strictly for the parameters: a parameter the file
lacks is an error (the package's own loader would leave it at its random initial value). The
model runs with TF32 off (``worker_io.tf32_off``), the precision of every metric network of the project
(``coolsd.metrics.numerics``).
"""
from __future__ import annotations

try:  # run as a script (the way it is used): worker_io.py is beside it, on sys.path
    from worker_io import run_worker
except ImportError:
    # deferred: imported as a module of the package (the metric registry imports each one), not run as a script
    from coolsd.metrics.worker_io import run_worker


def load_model(checkpoint: str, med_config: str, device: str):
    import ImageReward as RM  # noqa: N813 (the package's name)
    import torch

    model = RM.load(checkpoint, device=device, med_config=med_config)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    result = model.load_state_dict(state, strict=False)
    params = {name for name, _ in model.named_parameters()}
    missing = sorted(k for k in result.missing_keys if k in params)
    if missing:
        raise SystemExit(f"{checkpoint} is not an ImageReward checkpoint: it lacks {len(missing)} parameters "
                         f"({', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}); "
                         "expected ImageReward.pt from https://huggingface.co/THUDM/ImageReward")
    return model.eval(), sorted(result.unexpected_keys)


def _arguments(ap) -> None:
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--med-config", required=True)


def main(argv=None) -> None:
    run_worker("image_reward", __doc__, _arguments, lambda a: load_model(a.checkpoint, a.med_config, a.device),
               lambda model, item, a: model.score(item["caption"], item["image"]), argv)


if __name__ == "__main__":
    main()
