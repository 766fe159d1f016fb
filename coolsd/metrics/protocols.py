"""The two evaluation protocols of the field, as presets of ``python -m coolsd.cli.evaluate --protocol``.

``lantern`` (LANTERN, LANTERN++, COOL-SD; ``jadohu/LANTERN:entrypoints/eval_fid_clip.py``):

* FID: clean-fid ``mode="clean"`` with LANTERN's centre crop + LANCZOS 256 on both sets, COCO
  val2017 (all 5,000 images) as the reference (``coolsd.metrics.inception``, ``image_prep``);
* CLIP: OpenAI ViT-B/32 (HF ``openai/clip-vit-base-patch32``), raw cosine (~0.33), captions
  prefixed "A photo depicts " (``coolsd.metrics.clip_score``);
* prompts: the longest caption of each of the 5,000 COCO 2017 val images (``dataset=coco2017val``).

``sjd`` (SJD, MC-SJD, GSD; ``tyshiwo1/Accelerating-T2I-AR-with-SJD:evaluation_metrics.py``):

* FID: ``pytorch_fid.calculate_fid_given_paths`` against the COCO val2017 folder: no crop,
  torch bilinear 299, ``2x - 1``, pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth``;
* CLIP: torchmetrics ``CLIPScore`` with ``openai/clip-vit-base-patch16`` (100 x cosine, ~31),
  no prefix, on the image bilinearly resized to 299 first (``coolsd.metrics.clip_torchmetrics``);
* prompts: COCO 2017 val, one caption per image, the longest of its 5 (the SJD repo's
  ``MSCOCOPromptBench``, /work/shared/research/models_sjd.md section 4: LANTERN's selection rule,
  so ``dataset=coco2017val`` serves both; the order of SJD's list is not checked); and PartiPrompts (1,632 prompts, the ``Prompt`` column of the user's
  ``PartiPrompts.tsv``), scored by CLIP only (no reference images, so no FID, as in SJD).

The same Lumina-mGPT AR baseline scores FID 28.99 under one and 30.79 under the other:
numbers are comparable only within one protocol, which is why every number in ``metrics.json``
names the protocol that produced it.
"""
from __future__ import annotations

import csv
from pathlib import Path

from functools import partial

from coolsd.metrics.clip_score import CLIP_FILES, CLIP_HF_REPO, CLIP_SOURCE, ClipScorer
from coolsd.metrics.clip_torchmetrics import SJD_CLIP_FILES, SJD_CLIP_HF_REPO, SJD_CLIP_SOURCE, TorchmetricsClipScorer
from coolsd.metrics.inception import (
    PT_WEIGHTS_NAME,
    PT_WEIGHTS_URL,
    WEIGHTS_NAME,
    WEIGHTS_URL,
    default_inception_path,
)
from coolsd.metrics.registry import PROTOCOLS, InputSpec, Protocol, register_protocol
from coolsd.util.errors import ConfigError
from coolsd.util.loading import BadInputFile, require_file

# what a hub CLIP folder is fetched with: config, tokenizer files, one weight format
CLIP_FETCH = ("*.json", "*.txt", ("model.safetensors", "pytorch_model.bin"))
_INCEPTION_HELP = ("FID Inception weights: weights-inception-2015-12-05-6726825d.pth (lantern) or "
                   "pt_inception-2015-12-05-6726825d.pth (sjd) (default: torch hub cache)")
_CLIP_HELP = "local CLIP folder: openai/clip-vit-base-patch32 (lantern) or -patch16 (sjd)"

register_protocol(Protocol(
    "lantern", "LANTERN, LANTERN++, COOL-SD: clean-fid FID, CLIP ViT-B/32 raw cosine with 'A photo depicts '",
    inputs={
        "--clip": InputSpec("--clip", _CLIP_HELP, "CLIP model folder", CLIP_SOURCE, "CLIP_DIR", True, CLIP_FILES,
                            CLIP_FETCH, hub=f"hf://{CLIP_HF_REPO}"),
        "--inception": InputSpec("--inception", _INCEPTION_HELP, "Inception weights", WEIGHTS_URL, "INCEPTION_WEIGHTS",
                                 default=partial(default_inception_path, WEIGHTS_NAME)),
    },
    description={"fid": "clean-fid clean (LANTERN crop + LANCZOS 256, PIL float bicubic 299), " + WEIGHTS_NAME,
                 "clip_score": f"{CLIP_HF_REPO} raw cosine, prefix 'A photo depicts '",
                 "prompts": "COCO 2017 val, longest caption of each of the 5,000 images"},
    fid_recipe="clean_fid", clip=ClipScorer, prompt_sets=("coco",)))

register_protocol(Protocol(
    "sjd", "SJD, MC-SJD, GSD: pytorch-fid FID, torchmetrics CLIPScore ViT-B/16 x 100; COCO or PartiPrompts",
    inputs={
        "--clip": InputSpec("--clip", _CLIP_HELP, "CLIP ViT-B/16 model folder", SJD_CLIP_SOURCE, "CLIP_B16_DIR", True,
                            SJD_CLIP_FILES, CLIP_FETCH, hub=f"hf://{SJD_CLIP_HF_REPO}"),
        "--inception": InputSpec("--inception", _INCEPTION_HELP, "pytorch-fid Inception weights", PT_WEIGHTS_URL,
                                 "PT_INCEPTION_WEIGHTS", default=partial(default_inception_path, PT_WEIGHTS_NAME)),
    },
    description={"fid": "pytorch-fid (torch bilinear 299, no crop), " + PT_WEIGHTS_NAME,
                 "clip_score": f"torchmetrics CLIPScore {SJD_CLIP_HF_REPO}, 100 x cosine, no prefix, bilinear 299 first",
                 "prompts": "COCO 2017 val (longest caption per image) or PartiPrompts (--parti-tsv)"},
    fid_recipe="pytorch_fid", clip=TorchmetricsClipScorer, prompt_sets=("coco", "parti")))

PARTI_SOURCE = "PartiPrompts.tsv from https://github.com/google-research/parti (1,632 prompts, a 'Prompt' column)"


def check_protocol(name: str) -> str:
    """``name`` if it is a registered protocol, else a ``ConfigError`` naming the closest one."""
    if name not in PROTOCOLS:
        raise ConfigError(PROTOCOLS.unknown(name).replace("unknown protocol", "unknown --protocol", 1))
    return name


def read_parti_prompts(path) -> list[str]:
    """The ``Prompt`` column of a PartiPrompts TSV (tab-separated, header row, no quoting: prompt 1560
    starts with a literal ``"``), in file order, as ``dataset=prompts`` reads it (docs/protocols.md)."""

    p = require_file(path, "the PartiPrompts TSV", PARTI_SOURCE)
    with open(p, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows or "Prompt" not in rows[0]:
        raise BadInputFile(f"{p} has no 'Prompt' column (tab-separated with a header row expected); it comes from "
                           f"{PARTI_SOURCE}")
    return [r["Prompt"] for r in rows]


def check_parti_captions(by_tag: dict, prompts: list[str], path) -> None:
    """Every record's caption is the TSV's prompt at its ``prompt_index`` (the run was generated on
    this PartiPrompts file), else one error naming the first mismatch."""
    for tag, recs in by_tag.items():
        for r in recs:
            i = r["prompt_index"]
            if i >= len(prompts) or prompts[i] != r["caption"]:
                want = prompts[i] if i < len(prompts) else f"(none: the TSV has {len(prompts)} prompts)"
                raise ValueError(f"{Path(path)}: record {tag}/{i} has caption {r['caption']!r} but the TSV's prompt {i} "
                                 f"is {want!r}; was the run generated on this PartiPrompts file?")
