"""``target=emu3``: Emu3-Gen (BAAI, 8B; 720 px at upstream's ``image_area`` 720 x 720) from its
transformers-format folder (``BAAI/Emu3-Gen-hf``), through transformers' own
``Emu3ForConditionalGeneration`` (``coolsd.models.emu3``: the adapter, the VQ inside the model).

Prompts as upstream's image-generation example (transformers' docs/source/en/model_doc/emu3.md,
and BAAI's ``image_generation.py``): the caption plus ``positive_prompt`` (upstream's " masterpiece,
film grained, best quality."), then the image header ``<|image start|>{h}*{w}<|image token|>``
(``coolsd.models.emu3.generation_prompt``; h, w from ``ratio`` and ``image_area`` as
``Emu3Processor.calculate_generate_size``), tokenized by the folder's tokenizer with the BOS in
front, as ``Emu3Processor(..., return_for_image_generation=True)``. The unconditional branch of
CFG is ``negative_prompt``; ``negative_header`` says whether it carries the image header too:
true in BAAI's original (its processor's mode "G" formats every text alike), false in the
transformers docs' example (``processor(text=[neg_prompt])``). Pixels are the model's VQ decoder
output through the folder's ``Emu3ImageProcessor.postprocess`` (unnormalise, x 255, clip,
truncate to uint8), as upstream saves its images.

Drafting (``draft``): ``draft=self`` (the target drafts for itself: an engine check, not a
speed-up); model-free methods (``ar``, ``sjd``) need none; no trained drafter exists here.
Structural tokens (the header, the row ends) are the target's, never drafted against.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
import torch
from omegaconf import MISSING

from coolsd.engine.drafting import SamplingConfig
from coolsd.models.emu3 import (EMU3_SOURCE, SPATIAL_FACTOR, Emu3Prompt, Emu3Target, generate_size, generation_prompt,
                                load_emu3_target)
from coolsd.util.loading import BadInputFile, reading
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.base import DiscreteWorld, EncodedPromptWorld, draft_kind
from coolsd.worlds.files import DTYPES, config_need
from coolsd.worlds.presentation import REAL_TARGET_HINT, Presentation
from coolsd.worlds.schema import TokenTargetSchema

# what the folder must hold besides the weights: the model config, the tokenizer's special tokens
# (boi / image wrapper) and the image processor's unnormalisation
FOLDER_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json")


@dataclass
class Emu3TargetSchema(TokenTargetSchema):
    ratio: str = "1:1"  # the image's W:H (Emu3Processor's ``ratio``)
    image_area: int = MISSING  # pixels of the generated image (Emu3Processor's ``image_area``; 518400 = 720 x 720)
    positive_prompt: str = ""  # appended to every caption
    negative_prompt: str = MISSING  # the unconditional branch of CFG
    negative_header: bool = True  # the negative prompt carries the image header too (BAAI's original)
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "bfloat16"


class Emu3Prompts:
    """``encode(captions) -> [Emu3Prompt]``: each caption (+ ``positive``) with the image header,
    and the negative prompt (tokenized once), as ``Emu3Processor`` tokenizes them."""

    def __init__(self, tokenizer, height: int, width: int, positive: str, negative: str, negative_header: bool):
        missing = [a for a in ("bos_token", "boi_token", "image_wrapper_token") if not getattr(tokenizer, a, None)]
        if missing:
            raise ValueError(f"the tokenizer lacks {', '.join(missing)} (tokenizer_config.json's special tokens of "
                             f"an Emu3 folder)")
        self.tok, self.height, self.width, self.positive = tokenizer, height, width, positive
        self.negative = self._ids(negative, header=negative_header)

    def _ids(self, text: str, header: bool = True) -> list[int]:
        t = self.tok
        s = generation_prompt(text, self.height, self.width, bos=t.bos_token, boi=t.boi_token,
                              image_wrapper=t.image_wrapper_token, header=header)
        return list(t(s)["input_ids"])

    def encode(self, captions) -> list[Emu3Prompt]:
        return [Emu3Prompt(self._ids(c + self.positive), self.negative) for c in captions]


class Emu3World(EncodedPromptWorld):

    targets = ("emu3",)  # conf/target/<name>.yaml
    schema = ("emu3_schema", Emu3TargetSchema)  # its conf files name it first
    presentation = Presentation(DiscreteWorld.presentation.columns, next_step=REAL_TARGET_HINT)

    @classmethod
    def grid(cls, cfg) -> tuple[int, int]:
        """(h, w) tokens of ``target.ratio`` and ``target.image_area`` (``generate_size``); a bad
        value is one line naming its key."""
        t = cfg.target
        try:
            h, w = generate_size(t.ratio, int(t.image_area))
        except ValueError as e:
            raise ValueError(f"target.ratio={t.ratio!r} is invalid: {e}") from None
        if h < 1 or w < 1:
            raise ValueError(f"target.image_area={t.image_area} gives a {h}x{w} token grid at ratio {t.ratio}: set "
                             f"target.image_area to at least {SPATIAL_FACTOR ** 2} pixels a token")
        return h, w

    @classmethod
    def image_tokens(cls, cfg) -> int:
        """h x w of ``ratio`` and ``image_area`` (90 x 90 = 8100 at upstream's 720 x 720; row ends
        excluded: the adapter inserts them, they are never drafted)."""
        h, w = cls.grid(cfg)
        return h * w

    @classmethod
    def needs(cls, cfg) -> list:
        return [config_need(cfg, "target.files.model", "model", EMU3_SOURCE, folder=True, contains=FOLDER_FILES,
                            fetch=("*.json", "*.safetensors", "*.txt"))]

    @classmethod
    def load(cls, cfg) -> "Emu3World":
        from transformers import AutoTokenizer, Emu3ImageProcessor  # lazy: transformers imports slowly

        t = cfg.target
        folder = t.files.model
        kind = draft_kind(cfg, "none", ("self", "none"), t.name, "itself (draft=self)")
        h, w = cls.grid(cfg)
        with reading(folder, "the Emu3 tokenizer (tokenizer_config.json, tokenizer files)", EMU3_SOURCE):
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        try:
            encoder = Emu3Prompts(tok, h, w, t.get("positive_prompt", ""), t.negative_prompt,
                                  bool(t.get("negative_header", True)))
        except ValueError as e:
            raise BadInputFile(f"{folder}: {e}; get the folder from {EMU3_SOURCE}") from e
        with reading(folder, "the Emu3 image processor (preprocessor_config.json)", EMU3_SOURCE):
            processor = Emu3ImageProcessor.from_pretrained(str(folder), local_files_only=True)
        target = load_emu3_target(folder, h_latent=h, w_latent=w, cfg_scale=float(t.cfg_scale),
                                  image_mean=_three(processor.image_mean), image_std=_three(processor.image_std),
                                  dtype=DTYPES[t.get("dtype", "bfloat16")], device=t.get("device", "cuda"))
        drafter = None
        if kind == "self":  # a second target over the same weights: its own caches
            drafter = Emu3Target(target.model, target.codes, h_latent=h, w_latent=w, cfg_scale=target.cfg_scale,
                                 image_mean=target.image_mean, image_std=target.image_std)
        sampling = SamplingConfig.resolve(t.get("sampling"), cfg.get("sampling"))
        return cls(t.name, target, encoder, processor, sampling, {"model": file_identity(folder)}, drafter)

    def __init__(self, name: str, target: Emu3Target, encoder: Emu3Prompts, processor, sampling: SamplingConfig,
                 files: dict, drafter=None):
        super().__init__(name, target, encoder, sampling, files, drafter)
        self.processor = processor

    @torch.no_grad()
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """uint8 (B, H, W, 3) exactly as upstream saves images: the VQ decoder's float32 pixels through
        ``Emu3ImageProcessor.postprocess`` (unnormalise, rescale to 0..255, clip, ``astype(uint8)``:
        truncation, not rounding)."""
        x = self.target.decode_raw(tokens).cpu()
        images = self.processor.postprocess(list(x), return_tensors="PIL.Image.Image")["pixel_values"]
        return np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in images])

    def codebook(self):
        return self.target.model.vq.quantize.embedding.weight.detach().float()  # (codebook_size, embed_dim)



def _three(x) -> tuple[float, float, float]:
    """An image processor's mean / std (a number or 3 numbers) as 3 numbers."""
    return tuple(float(v) for v in x) if isinstance(x, (list, tuple)) else (float(x),) * 3
