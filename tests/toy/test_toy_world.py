"""The procedural toy world: deterministic scenes, captions within the encoder's vocabulary."""
import numpy as np
import pytest

from coolsd.toy.scenes import ATTRIBUTES, WORDS, render, render_batch, sample_scenes, tokenize


def test_scenes_and_images_are_deterministic():
    a, b = sample_scenes(50, 3), sample_scenes(50, 3)
    assert a == b and sample_scenes(50, 4) != a
    assert sample_scenes(60, 3)[:50] == a  # prefix-stable: index i depends on (seed, i) only
    np.testing.assert_array_equal(render_batch(a[:5]), render_batch(b[:5]))
    img = render(a[0])
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8


def test_captions_name_their_attributes_and_tokenize():
    for s in sample_scenes(300, 0):
        words = s.caption.split()
        for attr in ("shape", "colour", "background", "size"):
            assert getattr(s, attr) in s.caption
        ids = tokenize(s.caption)
        assert 0 < len(ids) <= 16 and 1 not in ids  # no <unk>
        assert s.labels().keys() == ATTRIBUTES.keys()
        del words
    assert WORDS[0] == "<pad>"
    with pytest.raises(ValueError, match="at most 16"):
        tokenize("a " * 17)


def test_attributes_are_visible():
    """Two scenes that differ only in background differ in the corner pixel colour."""
    s = sample_scenes(1, 0)[0]
    from dataclasses import replace

    other = "black" if s.background != "black" else "beige"
    assert not np.array_equal(render(s)[0, 0], render(replace(s, background=other))[0, 0])
