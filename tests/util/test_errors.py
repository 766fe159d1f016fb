"""``coolsd.util.errors.shorten``: a user's value echoed in a one-line error is cut, so that a long
one cannot bury the reason."""
from coolsd.util.errors import shorten


def test_shorten_cuts_the_middle_of_a_long_value_and_keeps_a_short_one():
    prompt = "red " * 10_000
    cut = shorten(prompt)
    assert len(cut) <= 80 and cut.startswith("'red red") and cut.endswith("red '") and "..." in cut
    assert shorten("a photo") == "'a photo'" and shorten(3) == "3"
    assert len(shorten(list(range(1000)))) < 80 and len(shorten(prompt, 30)) <= 30
