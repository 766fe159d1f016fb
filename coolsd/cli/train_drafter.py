"""Train an EAGLE-1 drafter for a LlamaGen-class target on the target's own samples (LANTERN's
recipe, ``coolsd.models.eagle.training``), and save it as a LANTERN-style folder that
``coolsd.models.eagle.model.load_eagle_head`` reads back:
    python -m coolsd.cli.train_drafter target=llamagen_xl train.captions=captions_train2017.json \
        train.samples=20000 train.steps=20000 train.out=drafters/llamagen_xl
    python -m coolsd.cli.train_drafter target=lumina_mgpt train.captions=captions_train2017.json \
        train.samples=2000 train.steps=20000 train.batch_size=4 train.out=drafters/lumina_mgpt

Lumina-mGPT (``coolsd.models.eagle.training_lumina``): LANTERN's Chameleon-layer head, trained on
teacher-forced features of the target's own samples (both CFG halves, text prefix included),
computed per batch. The folder records ``target_variant`` (``target.variant``, ``upstream``
when the target has none): loading it under another variant warns, naming both.

Data: for each training caption the target samples an image (CFG and warpers of the target's
protocol, per-caption seeds) and a teacher-forced pass gives its features (both CFG halves);
the head regresses the next feature with the LANTERN loss. ``train.captions``: a COCO captions
file (longest caption per image, as the evaluation prompts) or a text file with one caption per
line; never the evaluation captions. The toy world's training captions are its own scenes.

Precision (``coolsd.models.eagle.precision``): with a bf16 target the head trains with fp32 master
weights and AdamW state, forwards under bf16 autocast, the loss in fp32; ``model.safetensors``
holds the fp32 weights, which the loaders cast to the running target's dtype.
``train_metrics.json`` records ``master_dtype`` and ``autocast_dtype``.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from coolsd.cli.runner import compose, one_line_errors
from coolsd.models.eagle.lumina import save_lumina_drafter
from coolsd.models.eagle.training import save_drafter, train_on_target
from coolsd.models.eagle.training_lumina import train_lumina_on_target
from coolsd.worlds import load_world, world_class
from coolsd.util.errors import ConfigError

DEFAULTS = {"captions": None, "samples": 2048, "heldout": 128, "steps": 2000, "batch_size": 16, "lr": 1e-4,
            "seed": 0, "chunk": 64, "out": None}


def main(argv=None) -> Path:
    from omegaconf import OmegaConf


    argv = list(sys.argv[1:] if argv is None else argv)
    opts = dict(DEFAULTS)
    unknown = [a.split("=")[0][len("train."):] for a in argv if a.startswith("train.") and
               a.split("=")[0][len("train."):] not in DEFAULTS]
    if unknown:
        raise ConfigError(f"unknown train option(s) {unknown}; valid: {sorted(DEFAULTS)}")
    opts.update(OmegaConf.to_container(OmegaConf.from_dotlist([a[len("train."):] for a in argv if a.startswith("train.")])))
    cfg = compose(*[a for a in argv if not a.startswith("train.")], "draft=self")
    name = cfg.target.name
    world_cls = world_class(name)
    if not world_cls.trains_drafters:
        raise ConfigError(f"drafter training supports toy, llamagen_* and lumina_mgpt targets, not {name!r}")
    n, h = int(opts["samples"]), int(opts["heldout"])
    captions = world_cls.training_captions(n + h, int(opts["seed"]), opts["captions"])  # before loading the target
    if len(captions) < n + h:
        raise ConfigError(f"{len(captions)} training captions < train.samples + train.heldout = {n + h}")
    world = load_world(cfg)
    out = Path(opts["out"] or f"outputs/drafters/{name}/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    variant = str(cfg.target.get("variant", "upstream"))  # whose features the drafter learns
    kw = dict(batch_size=int(opts["batch_size"]), lr=float(opts["lr"]), seed=int(opts["seed"]), chunk=int(opts["chunk"]),
              tag=f"{name} drafter")
    if name == "lumina_mgpt":
        head, metrics = train_lumina_on_target(world.target, world.encode, captions[:n], captions[n:n + h],
                                               int(opts["steps"]), **kw)
        save_lumina_drafter(head, out, {**metrics, "options": opts, "target": name}, target_variant=variant)
    else:
        head, metrics = train_on_target(world.target, world.gpt, world.encode, captions[:n], captions[n:n + h],
                                        int(opts["steps"]), **kw)
        save_drafter(head, out, {**metrics, "options": opts, "target": name}, target_variant=variant)
    use = f"target={name} draft.path={out}" if name != "toy" else f"draft=llamagen_xl draft.path={out}"
    print(f"wrote {out} (use it: python run.py {use})")
    return out


if __name__ == "__main__":
    with one_line_errors():
        main()
