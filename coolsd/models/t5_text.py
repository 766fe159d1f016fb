"""LlamaGen's text condition: FLAN-T5-XL encoder features (LlamaGen ``language/t5.py``
``T5Embedder`` + the left padding of ``autoregressive/sample/sample_t2i.py``).

Invariants (upstream behaviour):
* each caption is preprocessed as ``T5Embedder.text_preprocessing`` does (two passes of the
  PixArt caption cleaner, ``coolsd.models.caption_clean``), then tokenised with
  ``max_length=120, padding="max_length", truncation=True`` and special tokens (T5 appends
  ``</s>``), and encoded by ``T5EncoderModel``: ``last_hidden_state`` (B, 120, 2048);
* LEFT padding: the valid rows are rotated to the end of the 120 slots and the mask flipped, so
  the valid slots are the last ``n_valid``; ``LlamaGenTarget.begin`` zeroes the padded slots.
Models are read from a local folder only (``local_files_only``), never downloaded.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from coolsd.models.caption_clean import preprocess_caption
from coolsd.util.loading import MissingInputFile, reading

T5_SOURCE = "https://huggingface.co/google/flan-t5-xl (the whole folder: config.json, tokenizer files, weights)"
# what a FLAN-T5 folder is fetched with from the hub: config, tokenizer files and one weight format
# (the first of safetensors or .bin the repo has; ``coolsd.worlds.files.Need.fetch``)
T5_FILES = ("*.json", "spiece.model", ("*.safetensors", "*.bin"))


def left_pad(embs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T, D) features and (B, T) mask -> the valid rows moved to the end and the
    mask flipped (upstream's ``cat([emb[valid:], emb[:valid]])``, ``flip(mask)``)."""
    out = torch.empty_like(embs)
    for b in range(embs.shape[0]):
        n = int(mask[b].sum())
        out[b] = torch.cat([embs[b, n:], embs[b, :n]])
    return out, mask.flip(-1).bool()


def check_model_folder(path, what: str, source: str, needs: Sequence[str] = ("config.json",)) -> Path:
    """A local Hugging Face model folder with the given files, or an error naming it and its source."""

    d = Path(os.fspath(path)) if path else None
    if d is None or not d.is_dir():
        raise MissingInputFile(f"{what} folder not found: {d or '(path not set)'}; download {source}")
    missing = [n for n in needs if not (d / n).exists()]
    if missing:
        raise MissingInputFile(f"{what} folder {d} lacks {', '.join(missing)}; download {source}")
    return d


class T5CaptionEncoder:
    """``encode(captions) -> {"caption_embs": (B, 120, 2048), "emb_mask": (B, 120) bool}``, the
    ``cond`` of ``LlamaGenTarget``."""

    def __init__(self, model, tokenizer, max_length: int = 120, clean: bool = True):
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_length, self.clean = max_length, clean

    @classmethod
    def from_folder(cls, path, dtype: torch.dtype = torch.bfloat16, device="cpu", **kw) -> "T5CaptionEncoder":
        from transformers import AutoTokenizer, T5EncoderModel  # lazy: transformers imports slowly


        d = check_model_folder(path, "FLAN-T5-XL", T5_SOURCE)
        with reading(d, "a FLAN-T5-XL model folder (config.json, tokenizer files, weights)", T5_SOURCE):
            tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            model = T5EncoderModel.from_pretrained(str(d), local_files_only=True, dtype=dtype)
        model = model.to(device)
        return cls(model, tok, **kw)

    def preprocess(self, caption: str) -> str:
        return preprocess_caption(caption, clean=self.clean)

    @torch.no_grad()
    def encode(self, captions: Sequence[str]) -> dict:
        texts = [self.preprocess(c) for c in captions]
        t = self.tokenizer(texts, max_length=self.max_length, padding="max_length", truncation=True,
                           return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        ids, mask = t["input_ids"].to(device), t["attention_mask"].to(device)
        embs = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        embs, mask = left_pad(embs, mask)
        return {"caption_embs": embs, "emb_mask": mask}
