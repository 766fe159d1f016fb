"""COCO 2017 val prompts: LANTERN's longest-caption rule on a fixture in the official schema."""
import hashlib
import json
import os
from pathlib import Path

import pytest

from coolsd.util.errors import InputFileError
from coolsd.prompts import coco_longest_captions, load_coco_prompts

FIXTURE = Path(__file__).parents[1] / "fixtures" / "captions_val2017_tiny.json"


def test_longest_caption_rule_keeps_lantern_quirks():
    got = coco_longest_captions(FIXTURE)
    # order of first appearance among annotations (not the images list); strictly longer
    # replaces, ties keep the first seen; raw captions (trailing space, newline) kept
    assert got == [
        {"image_id": 30, "caption": "A cat lying on a rug\n"},
        {"image_id": 10, "caption": "A dog in a park "},
        {"image_id": 20, "caption": "Two birds on a wire"},
    ]


def test_load_slices_and_caches(tmp_path):
    p = load_coco_prompts(FIXTURE, n=2, offset=1, cache_dir=tmp_path)
    assert p == [{"index": 1, "image_id": 10, "caption": "A dog in a park "},
                 {"index": 2, "image_id": 20, "caption": "Two birds on a wire"}]
    cached = list(tmp_path.glob("coco2017val_longest_*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())[0]["image_id"] == 30
    assert load_coco_prompts(FIXTURE, n=2, offset=1, cache_dir=tmp_path) == p  # from the cache
    with pytest.raises(ValueError, match=r"\[2, 4\) exceed the 3 captions"):
        load_coco_prompts(FIXTURE, n=2, offset=2)


def test_missing_or_malformed_file_is_named(tmp_path):
    with pytest.raises(InputFileError, match=r"COCO captions file .* not found: .*nope.json.*annotations_trainval2017.zip"):
        coco_longest_captions(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match=r"not found: \(path not set\)"):
        load_coco_prompts(None, n=1)
    bad = tmp_path / "bad.json"
    for text, why in [(json.dumps({"images": []}), "KeyError: 'annotations'"), ("", "JSONDecodeError"),
                      ("[1]", "holds a JSON list"), (json.dumps({"annotations": [{"id": 1}]}), "annotation 0 lacks")]:
        bad.write_text(text)
        with pytest.raises(InputFileError, match=rf"cannot read .*bad.json as a COCO captions file .*{why}"):
            coco_longest_captions(bad)


@pytest.mark.skipif(not os.environ.get("COCO_CAPTIONS"), reason="set COCO_CAPTIONS=/path/to/captions_val2017.json")
def test_real_file_matches_lantern_list():
    caps = [p["caption"] for p in coco_longest_captions(os.environ["COCO_CAPTIONS"])]
    assert len(caps) == 5000
    # sha256 of LANTERN's shipped captions_val2017_longest.json (json.dumps(list, indent=4))
    digest = hashlib.sha256(json.dumps(caps, indent=4).encode()).hexdigest()
    assert digest == "99ec01cb63b51d8af4b02a378fe03170369f88fdb67f18e8eb1535ce75d33639"
