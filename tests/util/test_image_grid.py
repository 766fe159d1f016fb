"""A run's ``grid.png`` (``coolsd.job.summary.run_grid``) is captioned: each method's tag over its
column and each prompt beside its row (``coolsd.util.image_grid``)."""
import numpy as np

from coolsd.job.summary import run_grid
from coolsd.util.image_grid import CAPTION_WIDTH, captioned_grid


def _ink(a: np.ndarray) -> bool:
    return bool((a != 255).any())


def test_a_runs_grid_has_each_prompt_beside_its_row_and_each_tag_over_its_column():
    imgs = np.zeros((2, 8, 8, 3), np.uint8)
    outputs = {"ar": ([], imgs), "coolsd": ([], imgs[:1])}  # coolsd has one image only: its second cell stays empty
    captions = ["a large red square at the top", "a small blue circle on a gray background"]
    grid, boxes = captioned_grid(["ar", "coolsd"], captions, [[imgs[0], imgs[0]], [imgs[1], None]])
    assert np.array_equal(run_grid(outputs, None, captions), grid)
    texts = [t for t, _ in boxes]
    assert texts == ["ar", "coolsd", *captions]
    (ar, cool), rows = [b for _, b in boxes[:2]], [b for _, b in boxes[2:]]
    assert ar[2] <= cool[0] and ar[0] >= CAPTION_WIDTH  # the tags over their columns, left to right
    assert all(r[2] <= CAPTION_WIDTH for r in rows) and rows[0][3] <= rows[1][1]  # prompts on the left, in order
    assert max(ar[3], cool[3]) <= min(r[1] for r in rows)  # the tags above the first row
    uncaptioned = run_grid(outputs, None, ["", ""])
    assert _ink(grid[:, :CAPTION_WIDTH]) and not _ink(uncaptioned[ar[3]:, :CAPTION_WIDTH])


def test_a_grid_without_captions_names_its_rows_by_prompt_number():
    imgs = np.zeros((3, 8, 8, 3), np.uint8)
    grid = run_grid({"ar": ([], imgs)}, imgs, [])
    expected, _ = captioned_grid(["ar", "reference"], ["prompt 0", "prompt 1", "prompt 2"],
                                 [[im, im] for im in imgs])
    assert np.array_equal(grid, expected)
