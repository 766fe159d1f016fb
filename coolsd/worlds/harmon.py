"""``target=harmon_1_5b``: Harmon-1.5B text-to-image (512 px by default, ``target.grid=16`` for 256 px)
from the official local files, with ``draft=harmon_0_5b`` (Harmon-0.5B, the continuous-SD paper's
draft; the default) or ``draft=self``: the Harmon target and draft (``coolsd.models.harmon``,
``harmon_1.5b.pth`` / ``harmon_0.5b.pth`` or the HF ``model.safetensors``), the KL-16 VAE
(``coolsd.models.kl16_vae``, ``kl16.ckpt``: MAR's file) and the Qwen2.5 tokenizer
(``tokenizer.json``, read by the ``tokenizers`` library). Every file is checked before anything is
loaded. Prompts are text: any data set's captions (``dataset=coco2017val``; the toy set's captions
too), templated as upstream (``coolsd.models.harmon.encode_prompts``); the CFG branch is upstream's
null prompt "Generate an image.".

Draft and target share the run's grid (``target.grid``, applied to both) and the head's settings;
the loop runs upstream's 64 MaskGIT-cosine steps of several tokens along each sample's random order
(``target.head.num_iter``; null: one token a step, docs/targets.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from omegaconf import MISSING, OmegaConf

from coolsd.models.harmon import HARMON_CONFIGS, HARMON_SOURCE, HarmonConfig, QwenConfig, encode_prompts, \
    load_harmon, set_null_prompt
from coolsd.models.mar import MARConfig
from coolsd.util.loading import BadInputFile
from coolsd.util.fingerprint import file_identity
from coolsd.worlds.files import architecture, config_need
from coolsd.worlds.mar import KL16World
from coolsd.worlds.schema import HeadSchema, TargetSchema

TOKENIZER_SOURCE = ("tokenizer.json of Qwen/Qwen2.5-1.5B-Instruct (Hugging Face; the 0.5B's is the same vocabulary) "
                    "or of wusize/Harmon-1_5B")


@dataclass
class HarmonTargetSchema(TargetSchema):
    arch: Any = MISSING  # a released architecture name or a mapping {llm: QwenConfig fields, mar: MARConfig fields}
    grid: Optional[int] = None  # tokens per side of the run (32: 512 px, 16: 256 px); null: the architecture's
    vae: Any = None  # a mapping of KLVAEConfig fields (tiny test files); null = MAR's KL-16 VAE
    files: Dict[str, Optional[str]] = field(default_factory=dict)
    device: str = "cuda"
    dtype: str = "float32"
    head: HeadSchema = field(default_factory=HeadSchema)


def load_tokenizer(path):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (Qwen2.5's: its chat special tokens are added
    tokens; no BOS is added, as upstream's ``encode``); a file it cannot read is one error naming it."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise BadInputFile(f"{path} is not a tokenizer.json ({type(e).__name__}: {e}); expected the "
                           f"{TOKENIZER_SOURCE}") from e


class HarmonWorld(KL16World):

    targets = ("harmon_1_5b",)  # conf/target/<name>.yaml
    schema = ("harmon_schema", HarmonTargetSchema)  # its conf files name it first
    draft_kind, source, presets, config_cls = "harmon", HARMON_SOURCE, HARMON_CONFIGS, HarmonConfig
    draft_hint = "a Harmon checkpoint (draft=harmon_0_5b) or itself (draft=self)"

    @classmethod
    def parse_arch(cls, arch, where: str, t) -> HarmonConfig:
        """A released name (``harmon_0_5b`` / ``harmon_1_5b``) or {llm: ..., mar: ..., grid: ...}; the
        run's grid ``t.grid`` (when set) replaces the architecture's, for draft and target alike."""
        arch = OmegaConf.to_object(arch) if OmegaConf.is_config(arch) else arch
        if isinstance(arch, str):
            cfg = architecture(arch, where, cls.presets, cls.config_cls)
        else:
            parts = dict(arch)
            unknown = sorted(set(parts) - {"llm", "mar", "grid"})
            if unknown or not {"llm", "mar"} <= set(parts):
                raise ValueError(f"{where} must be a released name or a mapping with keys llm, mar (and grid); "
                                 f"got keys {sorted(parts)}")
            try:
                cfg = HarmonConfig(QwenConfig(**parts["llm"]), MARConfig(**parts["mar"]), grid=parts.get("grid", 32))
            except TypeError as e:
                raise ValueError(f"{where}: {e}") from e
        grid = t.get("grid")
        return dataclasses.replace(cfg, grid=int(grid)) if grid is not None else cfg

    @classmethod
    def geometry(cls, arch) -> dict:
        return {"grid": arch.grid, "token_dim": arch.token_dim}

    @classmethod
    def load_model(cls, path, arch, dtype, device):
        return load_harmon(path, arch, dtype=dtype, device=device)

    @classmethod
    def extra_needs(cls, cfg) -> list:
        return [config_need(cfg, "target.files.tokenizer", "tokenizer", TOKENIZER_SOURCE, folder=False)]

    def attach(self, t) -> None:
        """The tokenizer: prompts' ids (``labels``) and each model's null prompt; its vocabulary must fit
        the checkpoints' embeddings."""
        self.tokenizer = load_tokenizer(t.files.tokenizer)
        for m in {id(self.target): self.target, id(self.draft): self.draft}.values():
            vocab = m.config.llm.vocab_size
            if self.tokenizer.get_vocab_size() > vocab:
                raise BadInputFile(f"{t.files.tokenizer} has {self.tokenizer.get_vocab_size()} ids, more than the "
                                   f"checkpoint's vocabulary of {vocab}; expected the {TOKENIZER_SOURCE}")
            set_null_prompt(m, self.tokenizer)
        self._files["tokenizer"] = file_identity(t.files.tokenizer)

    def labels(self, prompts) -> torch.Tensor:
        """(B, T) templated prompt ids, right-padded with -1 (``encode_prompts``)."""
        return encode_prompts(self.tokenizer, [p.caption for p in prompts])
