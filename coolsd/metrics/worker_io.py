"""The job in, the scores out, of the metric workers (``image_reward_worker.py``,
``hpsv2_worker.py``): standalone on purpose, like them (it imports nothing from coolsd; a worker
imports it as a sibling file, its folder being the script's). ``coolsd.metrics.external`` says what
the job and the result hold."""
from __future__ import annotations

import argparse
import json
import os
import sys


def tf32_off() -> None:
    """IEEE float32 cuBLAS matmuls and cuDNN convolutions for this process (the legacy flags,
    which every torch since 1.7 has; cuDNN's is on by default): the precision of every metric
    network of the project (``coolsd.metrics.numerics``)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def run_worker(name: str, description: str, add_arguments, load, score_one, argv=None) -> None:
    """Parse ``JOB OUT [--device D]`` and the worker's own flags (``add_arguments(parser)``), turn
    TF32 off, ``load(args) -> (model, unexpected_keys)``, then ``score_one(model, item, args)`` for
    every item under ``torch.no_grad``, with progress on stderr; the result is written atomically."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job")
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    add_arguments(ap)
    a = ap.parse_args(argv)
    with open(a.job, encoding="utf-8") as f:
        items = json.load(f)["items"]
    tf32_off()
    model, unexpected = load(a)
    import torch

    scores = []
    with torch.no_grad():
        for i, item in enumerate(items):
            scores.append(float(score_one(model, item, a)))
            if (i + 1) % 100 == 0 or i + 1 == len(items):
                print(f"{name}: {i + 1}/{len(items)}", file=sys.stderr, flush=True)
    tmp = a.out + ".partial"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"scores": scores, "unexpected_keys": unexpected}, f)
    os.replace(tmp, a.out)
