"""Class-conditional prompts for ImageNet targets (MAR): prompt i is class (offset + i) mod 1000
(MAR's evaluation draws the classes evenly: 50 images per class for 50,000)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClassPrompt:
    label: int
    caption: str


def imagenet_prompts(n: int, offset: int = 0) -> list[ClassPrompt]:
    return [ClassPrompt(c % 1000, f"imagenet class {c % 1000}") for c in range(offset, offset + n)]
