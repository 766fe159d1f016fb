"""The tiny metric networks (a CLIP with its BPE vocabulary, the FID Inception-v3, moment
features) are built in ``factories.py``, the tests' one factory; this module re-exports them for
the metric tests that import them from here."""
from factories import MomentFeatures, random_inception, write_tiny_bpe, write_tiny_clip

__all__ = ["MomentFeatures", "random_inception", "write_tiny_bpe", "write_tiny_clip"]
