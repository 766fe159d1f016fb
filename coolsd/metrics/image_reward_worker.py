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
model runs with TF32 off (``tf32_off``), the precision of every metric network of the project
(``coolsd.metrics.numerics``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def tf32_off() -> None:
    """IEEE float32 cuBLAS matmuls and cuDNN convolutions for this process (the legacy flags,
    which every torch since 1.7 has; cuDNN's is on by default)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("out")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--med-config", required=True)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    items = json.loads(open(a.job, encoding="utf-8").read())["items"]
    tf32_off()
    model, unexpected = load_model(a.checkpoint, a.med_config, a.device)
    import torch

    scores = []
    with torch.no_grad():
        for i, item in enumerate(items):
            scores.append(float(model.score(item["caption"], item["image"])))
            if (i + 1) % 100 == 0 or i + 1 == len(items):
                print(f"image_reward: {i + 1}/{len(items)}", file=sys.stderr, flush=True)
    tmp = a.out + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"scores": scores, "unexpected_keys": unexpected}, f)
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
