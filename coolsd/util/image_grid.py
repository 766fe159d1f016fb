"""Image grids with captions: a column caption over each column (a method or configuration) and a
row caption beside each row (its prompt, cut), drawn with PIL. Every grid the project writes
(a run's ``grid.png``, a sweep's, the toy demo's) is one of these, so none is unlabelled."""
from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

GRID_FONT_SIZE = 12
GRID_PAD = 4
CAPTION_WIDTH = 200  # pixels of the prompt captions' column
CAPTION_CHARS = 60  # a prompt is cut to this many characters


def _wrap(text: str, font, width: float) -> list[str]:
    """``text`` in lines no wider than ``width`` pixels, broken at spaces (a word wider than a line
    is broken inside)."""
    lines, line = [], ""
    for word in text.split():
        while font.getlength(word) > width:  # a word alone wider than a line
            cut = max(1, next(i for i in range(len(word), 0, -1) if font.getlength(word[:i]) <= width))
            if line:
                lines.append(line)
                line = ""
            lines.append(word[:cut])
            word = word[cut:]
        trial = f"{line} {word}".strip()
        if font.getlength(trial) <= width:
            line = trial
        else:
            lines.append(line)
            line = word
    return lines + ([line] if line else [])


def captioned_grid(columns: list[str], rows: list[str], images: list[list], cell: int = 96
                   ) -> tuple[np.ndarray, list[tuple[str, tuple[int, int, int, int]]]]:
    """One image of a sweep's samples: ``images[i][j]`` (uint8 H x W x 3, or None where that
    configuration has no image of that prompt) at row i, column j, each scaled to ``cell`` pixels
    (nearest neighbour); each column's caption (``columns[j]``: its configuration's label, wrapped)
    above it, each row's (``rows[i]``: its prompt, cut to ``CAPTION_CHARS``, wrapped) on its left.
    Returns the image and every caption as (text, (left, top, right, bottom)) as drawn."""
    font = ImageFont.load_default(size=GRID_FONT_SIZE)
    line = GRID_FONT_SIZE + 3
    head = [_wrap(t, font, cell) for t in columns]
    side = [_wrap(t if len(t) <= CAPTION_CHARS else t[: CAPTION_CHARS - 1] + "\u2026", font, CAPTION_WIDTH - 2 * GRID_PAD)
            for t in rows]
    top = GRID_PAD + line * max(map(len, head), default=0) + GRID_PAD
    step = max(cell, line * max(map(len, side), default=0)) + GRID_PAD
    canvas = Image.new("RGB", (CAPTION_WIDTH + len(columns) * (cell + GRID_PAD), top + len(rows) * step), "white")
    draw = ImageDraw.Draw(canvas)
    captions = []

    def write(lines: list[str], x: int, y: int, text: str):
        if not lines:
            return
        for k, ln in enumerate(lines):
            draw.text((x, y + k * line), ln, fill="black", font=font)
        boxes = [draw.textbbox((x, y + k * line), ln, font=font) for k, ln in enumerate(lines)]
        captions.append((text, (min(b[0] for b in boxes), min(b[1] for b in boxes),
                                max(b[2] for b in boxes), max(b[3] for b in boxes))))

    for j, lines in enumerate(head):
        write(lines, CAPTION_WIDTH + j * (cell + GRID_PAD), GRID_PAD, columns[j])
    for i, lines in enumerate(side):
        y = top + i * step
        write(lines, GRID_PAD, y, rows[i])
        for j, img in enumerate(images[i]):
            x = CAPTION_WIDTH + j * (cell + GRID_PAD)
            if img is None:
                draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=(235, 235, 235))
                continue
            canvas.paste(Image.fromarray(np.asarray(img, dtype=np.uint8)).resize((cell, cell), Image.NEAREST), (x, y))
    return np.asarray(canvas), captions


def method_grid(images: dict, captions: list[str], cell: int = 96) -> np.ndarray:
    """``captioned_grid`` of ``images`` ({label: that column's images, one per prompt, in prompt
    order}): one row per caption (its prompt), one column per label; a column with fewer images
    than prompts leaves the rest empty."""
    labels = list(images)
    rows = [[images[k][i] if i < len(images[k]) else None for k in labels] for i in range(len(captions))]
    return captioned_grid(labels, list(captions), rows, cell)[0]
