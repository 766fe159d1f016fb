"""``target=toy_continuous``: the toy scenes as 8x8 grids of 16-dim PCA patch tokens, a MAR target
and a smaller MAR draft (coolsd.toy.continuous; weights shipped in coolsd/toy/assets/continuous_*).
Drafts: the shipped draft (``draft=toy_continuous``) or the target itself (``draft=self``).
Quality: ``toy_fid`` and ``toy_clip`` with the discrete toy world's feature network. A prompt file's
captions (``dataset=prompts``) must each name a whole toy scene (``check_toy_captions``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from coolsd.engine.continuous.generate import HeadConfig
from coolsd.toy.continuous import check_continuous_manifest, load_toy_continuous, scene_labels
from coolsd.toy.load_assets import ASSETS_DIR
from coolsd.worlds.base import ContinuousWorld, draft_kind
from coolsd.worlds.presentation import CONTINUOUS_COLUMNS, Presentation, metric_column
from coolsd.worlds.schema import HeadSchema, TargetSchema
from coolsd.worlds.toy import FEATURES, check_toy_captions, toy_prompt_rules, toy_quality, toy_reference, toy_scene


@dataclass
class ToyContinuousTargetSchema(TargetSchema):
    assets: Optional[str] = None
    head: HeadSchema = field(default_factory=HeadSchema)


class ToyContinuousWorld(ContinuousWorld):
    targets = ("toy_continuous",)  # conf/target/<name>.yaml
    schema = ("toy_continuous_schema", ToyContinuousTargetSchema)  # its conf files name it first
    presentation = Presentation(CONTINUOUS_COLUMNS + (metric_column("toy_fid"),))
    quality_reads_images = True

    @classmethod
    def missing_files(cls, cfg) -> list[str]:
        """Every input the run lacks, after the weights' checksums (a missing or corrupted weight file
        is refused naming it before any folder is made)."""
        check_continuous_manifest(cfg.target.get("assets") or ASSETS_DIR)
        return super().missing_files(cfg)

    @classmethod
    def quality(cls, outputs, prompts, files):
        return toy_quality(outputs, prompts, None, files["features"])

    @classmethod
    def check_prompts(cls, prompts, path):
        check_toy_captions(prompts, path, whole_scenes=True)  # it conditions on a scene's labels, not on words

    @classmethod
    def prompt_rules(cls):
        return toy_prompt_rules(whole_scenes=True)

    @classmethod
    def load(cls, cfg) -> "ToyContinuousWorld":
        kind = draft_kind(cfg, "shipped", ("shipped", "self"), "toy_continuous",
                          "its shipped draft (draft=toy_continuous) or itself (draft=self)")
        head = HeadConfig(**cfg.target.head)
        return cls(load_toy_continuous(cfg.target.get("assets")), head, kind)

    def __init__(self, assets, head: HeadConfig, draft: str):
        self.name, self.assets, self.head, self.draft_kind = "toy_continuous", assets, head, draft
        self.target = assets.target
        self.draft = assets.target if draft == "self" else assets.draft
        self.device = next(self.target.parameters()).device

    def files(self) -> dict:
        """The continuous weights, the draft, and the (shipped) toy feature network of the metrics."""
        import json


        features = json.loads((ASSETS_DIR / "manifest.json").read_text())["sha256"][FEATURES]
        return {"sha256": self.assets.manifest["sha256"], "draft": self.draft_kind, "features": features}

    def labels(self, prompts) -> torch.Tensor:
        return scene_labels([toy_scene(p) for p in prompts])  # a prompt file's: the scenes its captions name

    def decode_uint8(self, tokens):
        return self.assets.codec.decode(tokens)

    def reference_images(self, prompts):
        return toy_reference(prompts)
