"""``target=toy``: the embedded toy text-to-image world (coolsd.toy; weights shipped in the repo).

LlamaGen's GPT class over a 512-code VQ tokenizer of 32x32 scenes, a small caption encoder in
place of T5, and drafters: the shipped EAGLE-1 head (``draft=toy``), the target itself
(``draft=self``), or an EAGLE folder (``draft=llamagen_xl draft.path=...``, e.g. one trained by
``python -m coolsd.cli.train_drafter target=toy``). Quality: ``toy_clip`` and ``toy_fid``
(coolsd.metrics.toy) against renders of the prompts' scenes (a prompt file's, ``dataset=prompts``:
of the captions that name a whole scene, docs/protocols.md "Prompt files").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from coolsd.engine.drafting import SamplingConfig
from coolsd.metrics.toy import toy_quality as quality
from coolsd.models.eagle.model import EagleDrafter, load_eagle_head
from coolsd.models.llamagen import LlamaGenTarget
from coolsd.toy.load_assets import ASSETS_DIR, FILES, check_manifest, load_toy_assets, toy_feature_extractor
from coolsd.toy.scenes import (
    MAX_CAPTION_TOKENS,
    WORDS,
    Scene,
    caption_words,
    render_batch,
    sample_scenes,
    scene_of_caption,
)
from coolsd.util.errors import shorten
from coolsd.util.loading import BadInputFile
from coolsd.util.stats import UNSCORED
from coolsd.worlds.base import DiscreteWorld, draft_kind
from coolsd.worlds.files import DRAFTER_FOLDER, config_need
from coolsd.worlds.presentation import DISCRETE_SPEED_COLUMNS, SIGNAL_COLUMNS, TOY_COLUMNS, Presentation
from coolsd.worlds.schema import TokenTargetSchema

DRAFTS = ("shipped", "self", "eagle")
FEATURES = FILES["features"]
SHIPPED_ASSETS = ASSETS_DIR
TARGET_WEIGHTS = FILES["target"]


@functools.lru_cache(maxsize=4)
def _toy_features(assets_dir: Optional[str], sha256: str):
    return toy_feature_extractor(assets_dir, sha256)


def toy_extractor(files: dict):
    """The toy feature network a run's ``files()`` name (checked by sha256), loaded once."""
    return _toy_features(files.get("assets_dir"), files["assets"][FEATURES])


def toy_scene(prompt) -> Optional[Scene]:
    """A prompt's toy scene: a toy prompt itself, else the scene its caption describes
    (``scene_of_caption``: a prompt file's caption in the toy words), else None (unknown)."""
    if isinstance(prompt, Scene):
        return prompt
    try:
        return scene_of_caption(prompt.caption)
    except (AttributeError, ValueError):
        return None


def toy_quality(outputs: dict, prompts: list, assets_dir: Optional[str], features_sha256: str) -> dict:
    """toy_clip / toy_fid (and their paired differences to ``ar``) of every method, with the
    toy feature network the run names (checked by sha256), over the prompts whose scene is known
    (``toy_scene``: every toy prompt; a prompt file's captions that name a whole scene; each
    metric's ``n`` says how many); {} where none is. Where some prompts are not scored, every
    method's entry counts them (``UNSCORED``: the summary prints it): they would otherwise be lost
    from the toy metrics without a word."""

    scenes = [toy_scene(p) for p in prompts]
    known = [i for i, s in enumerate(scenes) if s is not None]
    if not known:
        return {}
    extractor = toy_extractor({"assets_dir": assets_dir, "assets": {FEATURES: features_sha256}})
    out = quality(extractor, {tag: imgs[known] for tag, (_, imgs) in outputs.items()}, [scenes[i] for i in known])
    if len(known) < len(scenes):
        unscored = [i for i, s in enumerate(scenes) if s is None]
        note = {"n": len(unscored), "of": len(scenes), "prompt_indices": unscored[:20],
                "why": "the caption names no whole toy scene (shape, colour, background, position and size), so the "
                       "toy metrics have no reference render for it"}
        for e in out.values():
            e[UNSCORED] = note
    return out


def toy_reference(prompts: list) -> Optional[np.ndarray]:
    """The grid's reference row: renders of the prompts' scenes, None unless every one is known."""
    scenes = [toy_scene(p) for p in prompts]
    return render_batch(scenes) if scenes and all(s is not None for s in scenes) else None


def toy_prompt_rules(whole_scenes: bool = False) -> str:
    """The toy worlds' prompt rules in words (``check_toy_captions`` enforces them)."""
    valid = [w for w in WORDS if not w.startswith("<")]
    scored = ("each names a whole scene: shape, colour, background, position and size" if whole_scenes else
              "the toy metrics score a caption that names a whole scene (shape, colour, background, position and "
              "size) and count the others as not scored")
    return (f"captions of at most {MAX_CAPTION_TOKENS} words from the toy vocabulary ({len(valid)} words: "
            f"{', '.join(valid)}); {scored}")


def check_toy_captions(prompts: list, path, whole_scenes: bool = False) -> None:
    """Prompt-file captions the toy worlds can encode: every word in the caption encoder's
    vocabulary (``coolsd.toy.scenes.WORDS``; ``tokenize`` would read another as ``<unk>``), at most
    ``MAX_CAPTION_TOKENS`` words, and (``whole_scenes``) a whole scene named (``scene_of_caption``);
    else one ``BadInputFile`` naming the file, the prompt's line, the word and what is valid. The
    caption and word are echoed cut (``shorten``), and a caption refused for its length comes after
    the reason, so the reason is never buried however long the prompt."""
    valid = [w for w in WORDS if not w.startswith("<")]
    for p in prompts:
        file_line = f"{path} line {getattr(p, 'line', p.index + 1)}"
        where = f"{file_line} (prompt {p.index}, {shorten(p.caption)})"
        words = caption_words(p.caption)
        unknown = [w for w in words if w not in valid]
        if unknown:
            raise BadInputFile(f"{where}: the toy caption encoder does not know the word {shorten(unknown[0], 40)}; "
                               f"valid words: {', '.join(valid)}; write the prompt in these words, or run a real "
                               "target")
        if len(words) > MAX_CAPTION_TOKENS:
            raise BadInputFile(f"{file_line} (prompt {p.index}): {len(words)} words, more than {MAX_CAPTION_TOKENS}, "
                               f"the toy caption encoder's limit; shorten it (the prompt: {shorten(p.caption)})")
        if whole_scenes:
            try:
                scene_of_caption(p.caption)
            except ValueError as e:
                raise BadInputFile(f"{where}: {e} (this target conditions on the five attributes of a toy scene: "
                                   "shape, colour, background, position, size)") from None


@dataclass
class ToyTargetSchema(TokenTargetSchema):
    assets: Optional[str] = None  # null = coolsd/toy/assets


class ToyWorld(DiscreteWorld):

    targets = ("toy",)  # conf/target/<name>.yaml
    schema = ("toy_schema", ToyTargetSchema)  # its conf files name it first
    presentation = Presentation(DISCRETE_SPEED_COLUMNS + SIGNAL_COLUMNS + TOY_COLUMNS)
    quality_reads_images = True

    @classmethod
    def quality(cls, outputs, prompts, files):
        return toy_quality(outputs, prompts, files.get("assets_dir"), files["assets"][FEATURES])

    @classmethod
    def check_prompts(cls, prompts, path):
        check_toy_captions(prompts, path)

    @classmethod
    def prompt_rules(cls):
        return toy_prompt_rules()

    trains_drafters = True
    compiles = True
    row_parallel = True

    @classmethod
    def training_captions(cls, n: int, seed: int, path=None) -> list[str]:
        """The toy world's own scenes (a seed range disjoint from the evaluation prompts')."""

        return [s.caption for s in sample_scenes(n, 31_000_000 + seed)]

    @classmethod
    def needs(cls, cfg) -> list:
        d = cfg.get("draft") or {}
        return [config_need(cfg, "draft.path", "drafter", "python -m coolsd.cli.train_drafter target=toy", folder=True,
                            contains=DRAFTER_FOLDER)] if d.get("kind") == "eagle" else []

    @classmethod
    def missing_files(cls, cfg) -> list[str]:
        """The drafter folder if one is configured, after the toy weights' checksums: a missing or
        corrupted weight file is refused naming it before any folder is made (``check_manifest``)."""
        check_manifest(Path(cfg.target.get("assets") or SHIPPED_ASSETS))
        return super().missing_files(cfg)

    @classmethod
    def image_tokens(cls, cfg) -> Optional[int]:
        """The shipped (or ``target.assets``) GPT's block size, from its safetensors header alone
        (None for a file that is not there or unreadable: ``missing_files`` names it)."""
        import json

        from safetensors import safe_open

        path = Path(cfg.target.get("assets") or SHIPPED_ASSETS) / TARGET_WEIGHTS
        try:
            with safe_open(str(path), "pt") as f:
                return int(json.loads(f.metadata()["config"])["gpt"]["block_size"])
        except Exception:  # noqa: BLE001 -- any unreadable header: the checksum check words it
            return None

    @classmethod
    def load(cls, cfg) -> "ToyWorld":
        kind = draft_kind(cfg, "shipped", DRAFTS, cfg.target.name, "its shipped drafter (draft=toy), itself (draft=self) or an "
                          "EAGLE folder (draft=llamagen_xl draft.path=...)")
        return cls(load_toy_assets(cfg.target.get("assets")), cfg, kind)

    def __init__(self, assets, cfg, draft: str):
        # the configured name: a world subclassing this one under another target name (an included
        # file, docs/add_target.md) records its own name, never "toy"
        self.name, self.assets, self.draft_kind = str(cfg.target.name), assets, draft
        self.assets_dir = cfg.target.get("assets")  # None: the shipped weights
        self.cfg_scale = float(cfg.target.cfg_scale)
        self.sampling = SamplingConfig.resolve(cfg.target.get("sampling"), cfg.get("sampling"))
        self.gpt, self.vq, self.encoder = assets.gpt, assets.vq, assets.encoder
        self.device = self.gpt.device
        self.compiled = bool(cfg.get("compile", False))
        self.target = LlamaGenTarget(self.gpt, cfg_scale=self.cfg_scale, compile=self.compiled)
        self.draft_path = str(cfg.draft.path) if draft == "eagle" else None
        if draft == "self":  # the target drafts for itself (its own caches): EAGLE accepts every token
            self._drafter = LlamaGenTarget(self.gpt, cfg_scale=self.cfg_scale, compile=self.compiled)
        else:
            head = load_eagle_head(self.draft_path, self.gpt) if draft == "eagle" else assets.head
            self._drafter = EagleDrafter.for_target(head, self.target, compile=self.compiled)

    def files(self) -> dict:
        return {"assets": self.assets.manifest["sha256"], **({"assets_dir": str(self.assets_dir)} if self.assets_dir else {}),
                **({"draft": self.draft_kind} if self.draft_kind != "shipped" else {}),
                **({"draft_path": self.draft_path} if self.draft_path else {})}

    def encode(self, captions):
        return self.encoder.encode(captions)

    def decode_uint8(self, tokens: torch.Tensor) -> np.ndarray:
        return self.vq.decode_uint8(tokens)

    def codebook(self) -> torch.Tensor:
        return self.vq.codebook.detach()

    def drafter(self):
        return self._drafter

    def reference_images(self, prompts):
        return toy_reference(prompts)
