"""``target=janus_pro`` / ``janus_pro_7b``: Janus-Pro-1B / -7B text-to-image (384 px, 24 x 24 = 576
image tokens) from one local transformers-format folder.

``coolsd.models.janus`` (transformers' ``JanusForConditionalGeneration`` behind a ``JanusTarget``:
image-code vocabulary, CFG by a doubled batch as transformers' image ``generate``, the tree-masked
KV cache) with the folder's ``tokenizer.json`` (read by the ``tokenizers`` library) and Janus's
text-to-image prompt (``prompt_ids``). The folder is checked before anything is loaded, and its
config's image grid against ``target.image_size`` / ``target.vq_downsample`` before the weights are.
Drafting (``draft``): ``draft=self`` (the target drafts for itself: an engine check, not a speed-up);
model-free methods (``ar``, ``sjd``) need none. No trained Janus drafter exists yet.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch
from omegaconf import MISSING

from coolsd.engine.drafting import SamplingConfig
from coolsd.models.janus import JanusTarget, JanusTokens, check_generation_config, load_janus, pixels_uint8, \
    prompt_ids
from coolsd.util.loading import BadInputFile, read_json, reading
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.base import DiscreteWorld, EncodedPromptWorld, draft_kind
from coolsd.worlds.files import DTYPES, config_need
from coolsd.worlds.presentation import REAL_TARGET_HINT, Presentation
from coolsd.worlds.schema import TokenTargetSchema

# the transformers-format conversions (transformers' convert_janus_weights_to_hf.py) of DeepSeek's
# deepseek-ai/Janus-Pro-* repos, which are in DeepSeek's own remote-code layout and do not load into
# JanusForConditionalGeneration
REPOS = {"janus_pro": "deepseek-community/Janus-Pro-1B", "janus_pro_7b": "deepseek-community/Janus-Pro-7B"}
FOLDER = ("config.json", "tokenizer.json", ("model.safetensors", "model.safetensors.index.json"))


def source(name: str) -> str:
    repo = REPOS.get(name, REPOS["janus_pro"])
    return (f"https://huggingface.co/{repo} (transformers-format Janus-Pro: config.json, model*.safetensors, "
            f"tokenizer.json)")


def load_tokenizer(path, where: str):
    """A ``tokenizers.Tokenizer`` from Janus's ``tokenizer.json`` with its BOS / pad /
    ``<begin_of_image>`` ids; a file it cannot read, or one without them, is one error naming it."""
    from tokenizers import Tokenizer

    with reading(path, "Janus's tokenizer.json", where):
        tok = Tokenizer.from_file(str(path))
        return tok, JanusTokens.from_tokenizer(tok)


class TextPrompts:
    """``encode(captions) -> [prompt ids]``: BOS + Janus's text-to-image prompt, ending with
    ``<begin_of_image>``, as ``JanusTarget.begin`` takes them."""

    def __init__(self, tokenizer, tokens: JanusTokens):
        self.tok, self.tokens = tokenizer, tokens

    def encode(self, captions) -> list[list[int]]:
        enc = lambda s: self.tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        return [prompt_ids(enc, c, self.tokens.bos) for c in captions]


@dataclass
class JanusTargetSchema(TokenTargetSchema):
    image_size: int = MISSING
    vq_downsample: int = 16  # pixels per image token side (Janus's VQ: 384 px / 24 tokens)
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "bfloat16"


def checkpoint_grid(folder: Path, where: str) -> int:
    """Image tokens per side of the folder's config.json: ``vision_config.image_size // patch_size``
    (transformers' ``JanusConfig`` sets ``vq_config.num_patches`` from it; 384 // 16 = 24)."""
    cfg = read_json(folder / "config.json", "Janus-Pro's config.json", where)
    vision = cfg.get("vision_config") or {}
    return int(vision.get("image_size", 384)) // int(vision.get("patch_size", 16))


class JanusWorld(EncodedPromptWorld):

    targets = tuple(REPOS)  # conf/target/<name>.yaml
    schema = ("janus_schema", JanusTargetSchema)  # its conf files name it first
    presentation = Presentation(DiscreteWorld.presentation.columns, next_step=REAL_TARGET_HINT)
    row_parallel = True  # JanusTarget.forward takes by_position=True (zipar, pjd)

    @classmethod
    def image_tokens(cls, cfg) -> int:
        """(image_size / vq_downsample)^2: 24 x 24 = 576 at 384 px."""
        return (int(cfg.target.image_size) // int(cfg.target.vq_downsample)) ** 2

    @classmethod
    def needs(cls, cfg) -> list:
        return [config_need(cfg, "target.files.model", "model", source(cfg.target.name), folder=True, contains=FOLDER,
                            fetch=("*.json", "*.safetensors"))]

    @classmethod
    def load(cls, cfg) -> "JanusWorld":
        t = cfg.target
        where = source(t.name)
        folder = Path(t.files.model)
        size, down = int(t.image_size), int(t.vq_downsample)
        grid = checkpoint_grid(folder, where)
        if size % down or size // down != grid:
            raise ValueError(f"target.image_size={size} is not the checkpoint's {grid} x {grid} image tokens of "
                             f"{down} px (target.vq_downsample): set target.image_size={grid * down}")
        kind = draft_kind(cfg, "none", ("self", "none"), t.name, "itself (draft=self)")
        tok, tokens = load_tokenizer(folder / "tokenizer.json", where)  # first: seconds, not minutes
        check_generation_config(folder, tokens)
        model = load_janus(folder, dtype=DTYPES[t.get("dtype", "bfloat16")], device=t.get("device", "cuda"))
        target = JanusTarget(model, cfg_scale=float(t.cfg_scale), tokens=tokens)
        if target.h_latent != grid:
            raise BadInputFile(f"{folder}: vq_config.num_patches {target.h_latent} is not the vision grid {grid}; "
                               f"expected {where}")
        drafter = JanusTarget(model, cfg_scale=target.cfg_scale, tokens=tokens) if kind == "self" else None
        sampling = SamplingConfig.resolve(t.get("sampling"), cfg.get("sampling"))
        return cls(t.name, target, TextPrompts(tok, tokens), sampling, {"model": file_identity(folder)}, drafter)

    @torch.no_grad()
    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        """The VQ decoder's pixels -> uint8 (B, H, W, 3) exactly as upstream
        (``generation_inference.py``: ``np.clip((dec + 1) / 2 * 255, 0, 255)`` into a uint8 array,
        i.e. truncated; ``coolsd.models.janus.pixels_uint8``)."""
        return pixels_uint8(self.target.decode_raw(tokens)).cpu().numpy()

    def codebook(self) -> torch.Tensor:
        return self.target.codebook()  # L2-normalised, as looked up (Janus's VQ is LlamaGen's)

