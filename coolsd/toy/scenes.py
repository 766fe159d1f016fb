"""Procedural caption-to-image world: one shape on a plain background, 32x32 RGB.

A scene is (shape, colour, background, position, size) plus small seeded jitter (position,
radius, colour shade), so every caption has many images and sampling has entropy. Captions
come from a small grammar over the attribute words. Everything is a deterministic function
of (seed, index): any number of prompts and reference images can be drawn reproducibly.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass

import numpy as np

IMAGE_SIZE = 32
SHAPES = ("circle", "square", "triangle", "diamond", "cross")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 225), "yellow": (235, 210, 40),
    "magenta": (205, 50, 200), "cyan": (40, 200, 210), "orange": (240, 140, 30), "white": (240, 240, 240),
}
BACKGROUNDS = {"black": (15, 15, 20), "gray": (120, 120, 125), "navy": (20, 30, 85), "beige": (225, 215, 185)}
POSITIONS = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
SIZES = {"small": 4.5, "large": 7.5}
ATTRIBUTES = {  # attribute name -> class names (the feature network predicts each)
    "shape": SHAPES, "colour": tuple(COLOURS), "background": tuple(BACKGROUNDS),
    "position": POSITIONS, "size": tuple(SIZES),
}
TEMPLATES = (
    "a {size} {colour} {shape} {where} on a {background} background",
    "{size} {colour} {shape} {where}, {background} background",
    "a {colour} {shape}, {size}, {where} against {background}",
    "{background} background with a {size} {colour} {shape} {where}",
)
_SUPERSAMPLE = 4


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    position: str
    size: str
    template: int
    seed: int  # jitter seed of the reference image

    @property
    def caption(self) -> str:
        p = self.position
        where = f"in the {p}" if " " in p or p == "center" else f"at the {p}"
        return TEMPLATES[self.template].format(
            size=self.size, colour=self.colour, shape=self.shape, where=where, background=self.background
        )

    def labels(self) -> dict:
        return {k: ATTRIBUTES[k].index(getattr(self, k)) for k in ATTRIBUTES}

    def to_dict(self) -> dict:
        return {**asdict(self), "caption": self.caption}


def sample_scenes(n: int, seed: int) -> list[Scene]:
    """n scenes, a deterministic function of (seed, index); shape colour != background colour."""
    out = []
    for i in range(n):
        r = np.random.default_rng([seed, i])
        colour = str(r.choice(list(COLOURS)))
        bgs = [b for b in BACKGROUNDS if not (colour == "white" and b == "beige")]
        out.append(Scene(
            shape=str(r.choice(SHAPES)), colour=colour, background=str(r.choice(bgs)),
            position=str(r.choice(POSITIONS)), size=str(r.choice(list(SIZES))),
            template=int(r.integers(len(TEMPLATES))), seed=int(r.integers(2**31)),
        ))
    return out


PROMPT_POOL_SEED = 20260  # the 5,000 toy evaluation prompts; disjoint from every training seed
PROMPT_POOL = 5000


def toy_prompts(n: int, offset: int = 0, pool: int = PROMPT_POOL) -> list[Scene]:
    """The toy evaluation prompts ``offset .. offset + n - 1`` of the fixed pool."""
    if offset < 0 or offset + n > pool:
        raise ValueError(f"toy prompts [{offset}, {offset + n}) exceed the pool of {pool}")
    return sample_scenes(pool, PROMPT_POOL_SEED)[offset : offset + n]


def _shape_mask(shape: str, cx: float, cy: float, rad: float, n: int) -> np.ndarray:
    """Coverage mask on an n x n supersampled grid (coordinates in output pixels)."""
    c = (np.arange(n) + 0.5) / _SUPERSAMPLE
    x, y = np.meshgrid(c, c)
    dx, dy = x - cx, y - cy
    if shape == "circle":
        return dx**2 + dy**2 <= rad**2
    if shape == "square":
        s = rad * 0.85
        return (np.abs(dx) <= s) & (np.abs(dy) <= s)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= rad * 1.15
    if shape == "cross":
        w = rad * 0.38
        return ((np.abs(dx) <= w) & (np.abs(dy) <= rad)) | ((np.abs(dy) <= w) & (np.abs(dx) <= rad))
    if shape == "triangle":  # apex up, base at cy + rad*0.8
        top, base = cy - rad, cy + rad * 0.8
        half = (y - top) / (base - top) * rad
        return (y >= top) & (y <= base) & (np.abs(dx) <= half)
    raise ValueError(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)}")


def render(scene: Scene, seed: int | None = None) -> np.ndarray:
    """(32, 32, 3) uint8 image of ``scene``; ``seed`` (default scene.seed) sets the jitter."""
    r = np.random.default_rng(scene.seed if seed is None else seed)
    col, row = POSITIONS.index(scene.position) % 3, POSITIONS.index(scene.position) // 3
    cx = 8 + 8 * col + r.uniform(-1.5, 1.5)
    cy = 8 + 8 * row + r.uniform(-1.5, 1.5)
    rad = SIZES[scene.size] + r.uniform(-0.7, 0.7)
    fg = np.clip(np.array(COLOURS[scene.colour]) + r.integers(-12, 13, 3), 0, 255)
    bg = np.clip(np.array(BACKGROUNDS[scene.background]) + r.integers(-8, 9, 3), 0, 255)
    n = IMAGE_SIZE * _SUPERSAMPLE
    cover = _shape_mask(scene.shape, cx, cy, rad, n).astype(np.float64)
    cover = cover.reshape(IMAGE_SIZE, _SUPERSAMPLE, IMAGE_SIZE, _SUPERSAMPLE).mean((1, 3))[..., None]
    img = cover * fg + (1 - cover) * bg
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def render_batch(scenes, seeds=None) -> np.ndarray:
    """(n, 32, 32, 3) uint8."""
    seeds = [None] * len(scenes) if seeds is None else seeds
    return np.stack([render(s, sd) for s, sd in zip(scenes, seeds)])


# ---- caption tokenizer: words of the grammar -------------------------------------------
def _words() -> list[str]:
    words = set()
    for t in TEMPLATES:
        words.update(w for w in re.findall(r"[a-z]+", t))
    for names in (SHAPES, COLOURS, BACKGROUNDS, SIZES):
        words.update(names)
    for p in POSITIONS:
        words.update(p.split())
    words.update(("in", "at", "the"))
    return ["<pad>", "<unk>"] + sorted(words)


WORDS = _words()
MAX_CAPTION_TOKENS = 16


def tokenize(caption: str) -> list[int]:
    """Word ids of a caption (lower-cased; unknown words map to <unk>), at most 16."""
    index = {w: i for i, w in enumerate(WORDS)}
    ids = [index.get(w, 1) for w in re.findall(r"[a-z]+", caption.lower())]
    if len(ids) > MAX_CAPTION_TOKENS:
        raise ValueError(f"caption has {len(ids)} words; the toy caption encoder takes at most {MAX_CAPTION_TOKENS}: {caption!r}")
    return ids


def caption_words(caption: str) -> list[str]:
    """The words of a caption as a check sees them (lower-cased runs of letters, accented ones
    included; digits and punctuation are not words): ``tokenize`` reads the a-z runs of these."""
    return re.findall(r"[^\W\d_]+", caption.lower())


def scene_of_caption(caption: str) -> Scene:
    """The scene a caption in the toy words describes, each attribute named once in any order or
    wording ("a small red circle at the top on a black background"); its template is the one that
    writes the caption exactly (else 0), its jitter seed comes from the caption's text. A caption
    that lacks an attribute or names two values of one: ValueError naming it and its values."""
    words = caption_words(caption)
    found = {}
    for attr, names in (("shape", SHAPES), ("colour", tuple(COLOURS)), ("background", tuple(BACKGROUNDS)),
                        ("size", tuple(SIZES))):
        got = sorted({w for w in words if w in names})
        if len(got) != 1:
            why = "names no" if not got else f"names {len(got)} values ({', '.join(got)}) of its"
            raise ValueError(f"the caption {why} {attr}; valid: {', '.join(names)}")
        found[attr] = got[0]
    vertical = sorted({w for w in words if w in ("top", "bottom")})
    horizontal = sorted({w for w in words if w in ("left", "right")})
    centre = "center" in words
    if len(vertical) > 1 or len(horizontal) > 1 or (centre and (vertical or horizontal)) or not (
            centre or vertical or horizontal):
        why = "names no" if not (centre or vertical or horizontal) else "names more than one"
        raise ValueError(f"the caption {why} position; valid: {', '.join(POSITIONS)}")
    found["position"] = "center" if centre else " ".join(vertical + horizontal)
    seed = int(hashlib.sha256(caption.encode("utf-8")).hexdigest()[:8], 16) % 2**31
    template = next((k for k in range(len(TEMPLATES)) if Scene(**found, template=k, seed=seed).caption == caption), 0)
    return Scene(**found, template=template, seed=seed)
