"""The shipped toy-world weights, loaded strictly (``coolsd.toy.build_assets`` makes them).

Files in ``coolsd/toy/assets/``: vq, target (GPT + caption encoder), drafter (EAGLE-1 head),
features (toy metric network), each safetensors, and ``manifest.json`` with every file's
sha256 and the metrics measured when it was built. Loading checks the checksums, so a
truncated or altered file is an error naming it, never silent garbage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from coolsd.models.eagle.model import EagleConfig, EagleHead
from coolsd.models.llamagen import LlamaGenConfig, LlamaGenGPT
from coolsd.toy.features import ToyFeatureExtractor, load_feature_net
from coolsd.toy.target import CaptionEncoder
from coolsd.toy.vq import load_vq
from coolsd.toy.weights import REBUILD, check_checksums, read_weights
from coolsd.util.loading import BadInputFile

ASSETS_DIR = Path(__file__).parent / "assets"
FILES = {"vq": "vq.safetensors", "target": "target.safetensors", "drafter": "drafter.safetensors",
         "features": "features.safetensors"}


def read_toy_weights(path: Path, fmt: str) -> tuple[dict, dict]:
    sd, config = read_weights(path, fmt)
    return sd, json.loads(config)


def load_strict(module: torch.nn.Module, sd: dict, path: Path) -> None:
    try:
        module.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise BadInputFile(f"toy weights {path} do not match the model ({' '.join(str(e).split())[:300]}); {REBUILD}") from e


def check_manifest(assets_dir: Path) -> dict:
    return check_checksums(assets_dir, "manifest.json", FILES.values(), "toy weights", REBUILD)


@dataclass
class ToyAssets:
    """The shipped toy weights, loaded (``coolsd.worlds.toy`` assembles the world from them)."""

    vq: torch.nn.Module
    gpt: LlamaGenGPT
    encoder: CaptionEncoder
    head: EagleHead
    manifest: dict


def load_toy_assets(assets_dir=None) -> ToyAssets:
    d = Path(assets_dir) if assets_dir else ASSETS_DIR
    manifest = check_manifest(d)
    vq = load_vq(d / FILES["vq"])
    sd, cfg = read_toy_weights(d / FILES["target"], "coolsd.toy.target")
    gpt = LlamaGenGPT(LlamaGenConfig(**cfg["gpt"]))
    enc = CaptionEncoder(cfg["gpt"]["caption_dim"], cfg["gpt"]["cls_token_num"])
    load_strict(gpt, {k[4:]: v for k, v in sd.items() if k.startswith("gpt.")}, d / FILES["target"])
    load_strict(enc, {k[8:]: v for k, v in sd.items() if k.startswith("caption.")}, d / FILES["target"])
    hsd, hcfg = read_toy_weights(d / FILES["drafter"], "coolsd.toy.eagle")
    head = EagleHead(EagleConfig(**hcfg))
    load_strict(head, hsd, d / FILES["drafter"])
    for m in (vq, gpt, enc, head):
        m.eval().requires_grad_(False)
    return ToyAssets(vq, gpt, enc, head, manifest)


def toy_feature_extractor(assets_dir=None, sha256: str | None = None) -> ToyFeatureExtractor:
    """The toy metrics' feature network (checked against the manifest); ``sha256``: the one a
    run was scored with, so that toy metrics are never computed with another network."""
    d = Path(assets_dir) if assets_dir else ASSETS_DIR
    found = check_manifest(d)["sha256"][FILES["features"]]
    if sha256 is not None and found != sha256:
        raise ValueError(f"the toy metrics of this run need the feature network {FILES['features']} with sha256 "
                         f"{sha256[:12]}..., but {d} holds {found[:12]}: the run was made with other toy weights "
                         f"(make toy-assets rebuilds them; target.assets=... points at another folder)")
    return ToyFeatureExtractor(load_feature_net(d / FILES["features"]))
