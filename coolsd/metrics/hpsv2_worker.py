"""HPSv2 scores of (image, caption) pairs, run in the interpreter that has the ``hpsv2`` package
(its open_clip needs torchvision, which does not install beside this project's torch). Standalone
on purpose (imports nothing from coolsd); ``coolsd.metrics.hps`` calls it with that environment's
python:

    python hpsv2_worker.py JOB.json OUT.json --checkpoint HPS_v2.1_compressed.pt [--device cuda]

JOB.json / OUT.json as ``coolsd.metrics.external`` says. The score is the package's
(``hpsv2.img_score.score``): its ViT-H-14 from ``create_model_and_transforms`` with the package's
arguments, the checkpoint's ``state_dict`` loaded into it, its ``preprocess_val`` on the image file,
its tokenizer on the caption, and the diagonal of image features @ text features, one pair at a
time. Where ours differs, and why: the model is built without ``pretrained`` (the package names
``laion2B-s32B-b79K``, 3.9 GB its open_clip would download, every tensor of which the HPS
checkpoint replaces), the checkpoint is read with ``torch.load(weights_only=True)`` and loaded
strictly (every parameter must come from it), and the network runs in float32 with TF32 off (the
project's metric precision, ``coolsd.metrics.numerics``; the package autocasts to float16 on
CUDA, which moves scores in their third decimal), so CPU and GPU scores agree.
"""
from __future__ import annotations

try:  # run as a script (the way it is used): worker_io.py is beside it, on sys.path
    from worker_io import run_worker
except ImportError:
    # deferred: imported as a module of the package (the metric registry imports each one), not run as a script
    from coolsd.metrics.worker_io import run_worker

# hpsv2.img_score.initialize_model's arguments, less ``pretrained`` (the module docstring)
MODEL_ARGS = dict(precision="fp32", jit=False, force_quick_gelu=False, force_custom_text=False,
                  force_patch_dropout=False, force_image_size=None, pretrained_image=False, image_mean=None,
                  image_std=None, light_augmentation=True, aug_cfg={}, output_dict=True, with_score_predictor=False,
                  with_region_predictor=False)
ARCH = "ViT-H-14"


def load_model(checkpoint: str, device: str):
    import torch
    from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer

    model, _, preprocess_val = create_model_and_transforms(ARCH, None, device=device, **MODEL_ARGS)
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys:
        raise SystemExit(f"{checkpoint} is not an HPSv2 checkpoint: it lacks {len(result.missing_keys)} parameters "
                         f"({', '.join(sorted(result.missing_keys)[:8])}{', ...' if len(result.missing_keys) > 8 else ''}); "
                         "expected HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt) from https://huggingface.co/xswu/HPSv2")
    return (model.to(device).eval(), preprocess_val, get_tokenizer(ARCH)), sorted(result.unexpected_keys)


def _arguments(ap) -> None:
    ap.add_argument("--checkpoint", required=True)


def score_one(loaded, item: dict, a) -> float:
    """The image's and the caption's features' dot product (``hpsv2.img_score.score``)."""
    import torch
    from PIL import Image

    model, preprocess, tokenizer = loaded
    image = preprocess(Image.open(item["image"])).unsqueeze(0).to(a.device)
    out = model(image, tokenizer([item["caption"]]).to(a.device))
    return torch.diagonal(out["image_features"] @ out["text_features"].T)[0]


def main(argv=None) -> None:
    run_worker("hpsv2", __doc__, _arguments, lambda a: load_model(a.checkpoint, a.device), score_one, argv)


if __name__ == "__main__":
    main()
