"""Record files read back (coolsd.util.records.read_records): a truncated last line is a run killed
mid-write and is skipped; any other line that is not one JSON object is a corrupted file, one
``InputError`` (exit status 2 on the command line) naming the file, the line and the fix. Every
record's image is checked at once (``image_problems``), the first few named in one line."""
import numpy as np
import pytest

from coolsd.util.errors import InputError
from coolsd.util.records import RecordWriter, read_records, resume_records


def _records(folder, n=3):
    w = RecordWriter(folder)
    for i in range(n):
        w.append({"method": "ar", "prompt_index": i}, np.zeros((4, 4, 3), np.uint8), f"ar/{i:05d}.png")
    return w.path


@pytest.mark.parametrize("bad, what", [(b'{"method": "ar", "prompt_in', "is not JSON"),
                                       (b"\xff\xfe garbage", "is not JSON"),
                                       (b"[1, 2]", "is a JSON list, not a record object")])
def test_a_corrupted_line_mid_file_is_one_input_error_naming_file_line_and_fix(tmp_path, bad, what):
    path = _records(tmp_path)
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([lines[0], bad, *lines[1:]]) + b"\n")
    with pytest.raises(InputError) as e:
        read_records(path)
    msg = str(e.value)
    assert msg.startswith(f"{path} line 2 of 4 {what}") and "\n" not in msg and len(msg) < 400
    assert "corrupted" in msg and "delete that line" in msg and "rerun" in msg
    with pytest.raises(InputError, match="line 2 of 4"):
        resume_records(tmp_path)  # a resumed run reads it the same way


def test_a_truncated_last_line_is_still_skipped(tmp_path):
    path = _records(tmp_path)
    path.write_bytes(path.read_bytes() + b'{"method": "ar", "prompt_index": 3, "cap\xc3')  # killed mid-character
    assert [r["prompt_index"] for r in read_records(path)] == [0, 1, 2]
    assert [r["prompt_index"] for r in resume_records(tmp_path)] == [0, 1, 2]
    assert path.read_bytes().endswith(b"}\n")  # the resumed file ends on a whole line


def test_every_missing_image_is_counted_and_the_first_named(tmp_path):
    from coolsd.util.records import image_problems, images_mismatch

    path = _records(tmp_path, n=5)
    for i in (1, 3, 4):
        (tmp_path / "images" / "ar" / f"{i:05d}.png").unlink()
    (tmp_path / "images" / "ar" / "00000.png").write_bytes(b"not a png")
    records = read_records(path)
    bad = image_problems(tmp_path, records)
    assert [b.split(" ")[0] for b in bad] == ["images/ar/00000.png", "images/ar/00001.png", "images/ar/00003.png",
                                             "images/ar/00004.png"]
    assert bad[0] == "images/ar/00000.png (method 'ar', prompt 0): unreadable (cannot identify image file)"
    assert bad[1] == "images/ar/00001.png (method 'ar', prompt 1): missing"
    line = images_mismatch(bad, records)
    assert line.startswith("4 of its 5 records point to images that are missing or unreadable") and "and 1 more" in line
    with pytest.raises(InputError, match=r"samples\.jsonl: 4 of its 5 records .*does not match its records"):
        resume_records(tmp_path)
