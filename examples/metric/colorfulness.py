"""A metric from outside the package: colourfulness (Hasler & Suesstrunk, "Measuring colourfulness
in natural images", SPIE 2003, eq. 3), a no-reference statistic of an image's pixels, higher for
more colourful images. Copy this file to add your own (docs/add_metric.md), then:

    python -m coolsd.cli.evaluate <run folder> --include examples/metric --metrics colorfulness
"""
import numpy as np

from coolsd.metrics.registry import Scorer, register_metric


class Colorfulness(Scorer):
    """One number per image from its RGB pixels (``pixels = True``: uint8 (H, W, 3) arrays)."""

    def score(self, images, captions):
        out = []
        for im in images:
            r, g, b = (np.asarray(im, dtype=np.float64)[..., c] for c in range(3))
            rg, yb = r - g, 0.5 * (r + g) - b
            out.append(np.hypot(rg.std(), yb.std()) + 0.3 * np.hypot(rg.mean(), yb.mean()))
        return np.asarray(out)


@register_metric("colorfulness", higher_is_better=True, label="colourfulness", digits=2, pareto=True)
def build_colorfulness(ctx):
    """Colourfulness of the image (Hasler & Suesstrunk 2003, eq. 3): no reference, no network."""
    return Colorfulness()
