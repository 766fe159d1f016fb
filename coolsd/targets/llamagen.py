"""LlamaGen-XL text-to-image from the official local files (``target=llamagen_xl`` / ``_512``).

Assembles the pieces: the GPT (``coolsd.models.llamagen``, ``t2i_XL_stage1_256.pt`` or
``t2i_XL_stage2_512.pt``), FLAN-T5-XL (``coolsd.models.t5_text``), the VQ-16 tokenizer
(``coolsd.models.llamagen_vq``) and the drafter (``draft`` config: LANTERN's EAGLE-1 head, or
the target drafting for itself). ``LlamaGenWorld`` has the duck type of the toy world that the
generation job (``coolsd.job``) runs on. Every file is checked before anything is loaded.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from coolsd.decoding.lantern import neighbours_from_codebook
from coolsd.drafters.eagle import EagleConfig, EagleDrafter, EagleHead
from coolsd.models.llamagen import GPT_XL, GPT_XL_512, LlamaGenConfig, LlamaGenGPT, LlamaGenTarget
from coolsd.models.llamagen_vq import VQ_16, VQ_SOURCE, VQConfig, check_state_dict, load_llamagen_vq, read_torch_checkpoint
from coolsd.models.t5_text import T5_SOURCE, T5CaptionEncoder
from coolsd.targets.files import DTYPES, file_identity, missing_paths

GPT_CONFIGS = {"GPT_XL": GPT_XL, "GPT_XL_512": GPT_XL_512}
SOURCES = {
    "gpt": "https://huggingface.co/peizesun/llamagen_t2i (t2i_XL_stage1_256.pt; t2i_XL_stage2_512.pt for 512 px)",
    "vq": VQ_SOURCE,
    "t5": T5_SOURCE,
    "drafter": "https://huggingface.co/jadohu/llamagen_drafter (config.json + pytorch_model.bin; "
               "jadohu/llamagen2_drafter for 512 px), or train one: python -m coolsd.drafters.train",
}


def missing_files(target_cfg, draft_cfg=None) -> list[str]:
    """'name: path (why) -- source' for every file the target and its drafter need but lack."""
    out = missing_paths(dict(target_cfg.get("files") or {}), SOURCES)
    if draft_cfg is not None and draft_cfg.get("kind") == "eagle":
        out += missing_paths({"drafter": draft_cfg.get("path")}, SOURCES, prefix="draft.path")
    return out


def require_files(target_name: str, target_cfg, draft_cfg=None) -> None:
    missing = missing_files(target_cfg, draft_cfg)
    if missing:
        raise FileNotFoundError(f"target {target_name!r} cannot run: missing files\n  " + "\n  ".join(missing))


def load_gpt(path, cfg: LlamaGenConfig, dtype=torch.bfloat16, device="cpu") -> LlamaGenGPT:
    """Strictly load an official t2i GPT checkpoint (``{"model": sd}``); a checkpoint of another
    size or grid is an error naming the keys/shapes that differ."""
    state = read_torch_checkpoint(path, "LlamaGen t2i GPT checkpoint", SOURCES["gpt"])
    with torch.device("meta"):
        model = LlamaGenGPT(cfg)
    check_state_dict(model, state, os.fspath(path), SOURCES["gpt"])
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_eagle_head(folder, target: LlamaGenGPT) -> EagleHead:
    """LANTERN's drafter folder (``config.json`` + ``pytorch_model.bin`` or ``model.safetensors``),
    strictly loaded; its embedding must equal the target's shape (a drafter of another target is
    an error)."""
    d = Path(os.fspath(folder))
    weights = next((d / n for n in ("model.safetensors", "pytorch_model.bin") if (d / n).is_file()), None)
    if not (d / "config.json").is_file() or weights is None:
        raise FileNotFoundError(f"drafter folder {d} needs config.json and pytorch_model.bin (or model.safetensors); "
                                f"download {SOURCES['drafter']}")
    raw = json.loads((d / "config.json").read_text())
    cfg = EagleConfig.from_lantern(raw)
    t = target.config
    if (cfg.hidden_size, cfg.vocab_size, cfg.block_size) != (t.dim, t.vocab_size, t.block_size):
        raise ValueError(f"drafter {d} is for hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.block_size} tokens; "
                         f"the target has {t.dim}, {t.vocab_size}, {t.block_size}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = read_torch_checkpoint(weights, "drafter weights", SOURCES["drafter"])
    head = EagleHead(cfg)
    head.load_lantern(state)
    # LANTERN's drafters were trained with the text-slot prefix; ours (coolsd.drafters.build) without
    head.text_prefix = bool(raw.get("text_prefix", True))
    return head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def gpt_config(spec) -> LlamaGenConfig:
    """A named config (``GPT_XL``, ``GPT_XL_512``) or a mapping of ``LlamaGenConfig`` fields."""
    if isinstance(spec, str):
        if spec not in GPT_CONFIGS:
            raise ValueError(f"unknown gpt_config {spec!r}; valid: {sorted(GPT_CONFIGS)} or a mapping of fields")
        return GPT_CONFIGS[spec]
    return LlamaGenConfig(**dict(spec))


@dataclass
class LlamaGenWorld:
    """What the generation job needs: ``gpt``, ``encoder.encode``, ``vq.decode_uint8``,
    ``target()``, ``drafter()``, ``neighbours`` (LANTERN), ``manifest`` (file identities)."""

    gpt: LlamaGenGPT
    encoder: Any
    vq: Any
    cfg_scale: float
    draft_kind: str = "eagle"
    head: Optional[EagleHead] = None
    manifest: dict = field(default_factory=dict)

    def __post_init__(self):
        self.neighbours = neighbours_from_codebook(self.vq.quantize.codebook().detach().float())
        # LANTERN's drafters prefill every text slot's feature: the target hands them all over
        prefix = self.head is not None and getattr(self.head, "text_prefix", True)
        self._target = LlamaGenTarget(self.gpt, cfg_scale=self.cfg_scale, prefill_features="all" if prefix else "last")
        if self.draft_kind == "self":  # the target drafts for itself (its own caches)
            self._drafter = LlamaGenTarget(self.gpt, cfg_scale=self.cfg_scale)
        elif self.head is not None:
            self._drafter = EagleDrafter.for_target(self.head, self._target, text_prefix=prefix)
        else:
            self._drafter = None

    def target(self) -> LlamaGenTarget:
        return self._target

    def drafter(self):
        if self._drafter is None:
            raise ValueError("this method drafts with a model, but no drafter is configured (draft=...)")
        return self._drafter


def load_llamagen_world(name: str, target_cfg, draft_cfg, device: str = "cuda") -> LlamaGenWorld:
    require_files(name, target_cfg, draft_cfg)
    dtype = DTYPES[target_cfg.get("dtype", "bfloat16")]
    f = target_cfg.files
    gpt = load_gpt(f.gpt, gpt_config(target_cfg.gpt_config), dtype, device)
    vq_cfg = target_cfg.get("vq_config")
    vq = load_llamagen_vq(f.vq, VQConfig(**{k: tuple(v) if k == "ch_mult" else v for k, v in vq_cfg.items()})
                          if vq_cfg else VQ_16, device=device)
    encoder = T5CaptionEncoder.from_folder(f.t5, dtype=DTYPES[target_cfg.get("t5_dtype", "bfloat16")], device=device,
                                           max_length=gpt.config.cls_token_num)
    kind = draft_cfg.get("kind", "eagle") if draft_cfg is not None else "none"
    head = load_eagle_head(draft_cfg.path, gpt) if kind == "eagle" else None
    manifest = {k: file_identity(v) for k, v in f.items()}
    if kind == "eagle":
        manifest["drafter"] = file_identity(draft_cfg.path)
    return LlamaGenWorld(gpt, encoder, vq, float(target_cfg.cfg_scale), draft_kind=kind, head=head, manifest=manifest)
