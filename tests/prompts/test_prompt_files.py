"""Prompt files (``dataset=prompts dataset.path=FILE``, docs/protocols.md "Prompt files"): each format
parsed with its metadata and stable ids, each malformed file refused in one line naming the file and
the line, the file listed up front when missing, toy-vocabulary checks, and a toy run on a
PartiPrompts-style TSV that resumes, merges from shards and refuses a changed file."""
import hashlib
import json
import shutil

import pytest

from coolsd.cli.merge import merge
from coolsd.cli.runner import run
from coolsd.job.config_schema import check_config
from coolsd.prompts import load_prompts
from coolsd.prompts.files import load_prompt_file, prompt_id
from coolsd.util.errors import ConfigError, InputFileError

TIMING = ("latency_s", "signal_s", "decode_s", "hardware", "batch_size", "draft_forwards")  # as tests/worlds
GENEVAL = [  # evaluation_metadata.jsonl's layout
    {"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "a photo of a bench"},
    {"tag": "counting", "include": [{"class": "clock", "count": 2}], "exclude": [{"class": "clock", "count": 3}],
     "prompt": "a photo of two clocks"},
]
PARTI_HEADER = "Prompt\tCategory\tChallenge\tNote\n"
TOY_CAPTIONS = [  # the toy words; the last names no size or position (no toy scene: no toy metrics for it)
    ("a small red circle at the top on a black background", "Illustrations", "Basic", ""),
    ("large blue square in the center, gray background", "Illustrations", "Basic", "a note"),
    ("a green triangle on a navy background", "Abstract", "Complex", ""),
]


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def _tsv(path, rows) -> object:
    return _write(path, PARTI_HEADER + "".join("\t".join(r) + "\n" for r in rows))


# ------------------------------------------------------------------------------ the formats
def test_txt_one_prompt_a_line_with_stable_content_ids(tmp_path):
    a = load_prompt_file(_write(tmp_path / "a.txt", "a photo of a cat\r\n  spaced  \nthe last one\n\n"))
    assert [(p.caption, p.index, p.line) for p in a] == [("a photo of a cat", 0, 1), ("  spaced  ", 1, 2),
                                                         ("the last one", 2, 3)]
    assert a[0].prompt_id == hashlib.sha256(b"a photo of a cat").hexdigest()[:12] == prompt_id("a photo of a cat")
    b = load_prompt_file(_write(tmp_path / "b.txt", "the last one\na photo of a cat"))  # other file, order, no newline
    assert (b[1].prompt_id, b[0].prompt_id) == (a[0].prompt_id, a[2].prompt_id)  # the text's id, not its place
    assert len({p.prompt_id for p in a}) == 3


def test_geneval_jsonl_keeps_scalar_metadata(tmp_path):
    f = _write(tmp_path / "evaluation_metadata.jsonl", "".join(json.dumps(r) + "\n" for r in GENEVAL))
    p = load_prompt_file(f)
    assert [(x.caption, x.index, x.tag) for x in p] == [("a photo of a bench", 0, "single_object"),
                                                        ("a photo of two clocks", 1, "counting")]
    assert not hasattr(p[0], "include") and not hasattr(p[1], "exclude")  # lists are not kept
    caps = _write(tmp_path / "c.jsonl", '{"caption": "a dog", "id": 7}\n{"caption": "a cat", "id": 8}\n')
    assert [(x.caption, x.id) for x in load_prompt_file(caps)] == [("a dog", 7), ("a cat", 8)]
    own = _write(tmp_path / "own.jsonl", '{"text_en": "a fox", "prompt": "ignored"}\n')
    (x,) = load_prompt_file(own, column="text_en")
    assert (x.caption, x.prompt) == ("a fox", "ignored")


def test_partiprompts_tsv_keeps_category_and_literal_quotes(tmp_path):
    # PartiPrompts.tsv is unquoted: one of its prompts starts with a literal '"' (kept as written)
    rows = [("bond", "Abstract", "Basic", "Biology-inspired concepts"),
            ('"G I G G L E" painted as graffiti', "Illustrations", "Writing & Symbols", ""),
            ('A sign: "Fly an airplane"', "Outdoor Scenes", "Complex", "")]
    p = load_prompt_file(_tsv(tmp_path / "PartiPrompts.tsv", rows))
    assert [(x.caption, x.Category, x.Challenge, x.Note) for x in p] == rows
    assert [(x.index, x.line) for x in p] == [(0, 2), (1, 3), (2, 4)]


def test_csv_with_a_named_column_and_quoted_fields(tmp_path):
    f = _write(tmp_path / "dpg.csv", 'item_id,description,category\n'
                                     'a1,"a cat, a dog",animals\n'
                                     'a2,"two lines\nof text",misc\n'
                                     'a3,a car,vehicles\n')
    p = load_prompt_file(f, column="description")
    assert [(x.caption, x.item_id, x.category, x.index, x.line) for x in p] == [
        ("a cat, a dog", "a1", "animals", 0, 2), ("two lines\nof text", "a2", "misc", 1, 3),
        ("a car", "a3", "vehicles", 2, 5)]
    text = load_prompt_file(_write(tmp_path / "t.csv", "id,text\n1,a boat\n"))  # the default columns: 'text'
    assert text[0].caption == "a boat" and text[0].id == "1"


def test_load_prompts_slices_a_file_and_null_means_all(tmp_path):
    f = _write(tmp_path / "p.txt", "one\ntwo\nthree\n")
    got = load_prompts({"name": "prompts", "path": str(f), "n_prompts": None, "offset": 1})
    assert [(p.caption, p.index) for p in got] == [("two", 1), ("three", 2)]
    assert [p.caption for p in load_prompts({"name": "prompts", "path": str(f), "n_prompts": 1, "offset": 0})] == ["one"]


# ------------------------------------------------------------------------------ refused files
@pytest.mark.parametrize("name, text, column, message", [
    ("p.txt", "a cat\n\na dog\n", None, r"p\.txt line 2: empty line among the prompts; delete it"),
    ("p.txt", "a cat\n   \na dog\n", None, r"p\.txt line 2: whitespace-only line among the prompts"),
    ("p.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog",}\n', None, r"p\.jsonl line 2: not valid JSON .*one JSON object"),
    ("p.jsonl", '{"prompt": "a cat"}\n{"tag": "x", "include": []}\n', None,
     r"p\.jsonl line 2: no 'prompt' or 'caption' key \(its keys: tag, include\); set dataset.column="),
    ("p.jsonl", '{"prompt": 3}\n', None, r"p\.jsonl line 1: the prompt is a JSON int, expected text"),
    ("p.tsv", "Text\tCategory\nbond\tAbstract\n", None,
     r"p\.tsv: no prompt column 'Prompt' or 'prompt' or 'caption' or 'text' \(its columns: 'Text', 'Category'\); "
     r"set dataset.column="),
    ("p.csv", "prompt,tag\na cat,x\n", "caption", r"p\.csv: no prompt column 'caption' \(its columns: 'prompt', 'tag'\)"),
    ("p.tsv", PARTI_HEADER + "a cat\tA\tB\t\n\na dog\tA\tB\t\n", None, r"p\.tsv line 3: empty row among the prompts"),
    ("p.tsv", PARTI_HEADER + "a cat\tA\tB\t\textra\n", None, r"p\.tsv line 2: 5 fields but the header has 4"),
    ("p.json", "[]", None, r"p\.json: unknown prompt file format '.json'; valid: .txt, .jsonl, .csv, .tsv"),
    ("p.txt", "\n\n", None, r"p\.txt holds no prompts"),
])
def test_a_malformed_file_is_refused_in_one_line_naming_file_and_line(tmp_path, name, text, column, message):
    with pytest.raises(InputFileError, match=message) as e:
        load_prompt_file(_write(tmp_path / name, text), column)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value) and str(tmp_path / name) in str(e.value)


def test_a_missing_prompt_file_is_in_the_up_front_list(compose, tmp_path, monkeypatch):
    monkeypatch.delenv("PROMPTS_FILE", raising=False)
    for path, state in [(None, r"not set \(set dataset.path=/path or \$PROMPTS_FILE\)"),
                        (tmp_path / "PartiPrompts.tsv", r"\S*PartiPrompts.tsv does not exist \(set dataset.path=/path\)")]:
        cfg = compose("target=toy", "dataset=prompts", *([f"dataset.path={path}"] if path else []),
                      "draft=llamagen_xl", "draft.path=/nowhere/drafter", f"+out_dir={tmp_path / 'out'}")
        with pytest.raises(FileNotFoundError, match=r"target 'toy' cannot run: missing files\n  prompt file: " + state) as e:
            run(cfg)
        assert "drafter: /nowhere/drafter" in str(e.value)  # every missing input at once
    assert not (tmp_path / "out").exists()


def test_ranges_come_from_the_file_and_other_sets_keep_their_types(compose, tmp_path):
    f = _tsv(tmp_path / "p.tsv", TOY_CAPTIONS)
    check_config(compose("target=toy", "dataset=prompts", f"dataset.path={f}"))  # n_prompts null: all 3
    check_config(compose("target=toy", "dataset=prompts", f"dataset.path={f}", "dataset.offset=2", "dataset.n_prompts=1"))
    for over, message in [(["dataset.n_prompts=4"], r"dataset.n_prompts=4 is invalid: .* 1 \.\. 3 \(the prompt file "
                                                     r".*p\.tsv holds 3 prompts, from dataset.offset=0\)"),
                          (["dataset.offset=3"], r"dataset.offset=3 is invalid: .* 0 \.\. 2 \(the prompt file"),
                          (["dataset.n_prompts=0"], r"dataset.n_prompts=0 is invalid: it must be an integer >= 1 or null")]:
        with pytest.raises(ConfigError, match=message):
            check_config(compose("target=toy", "dataset=prompts", f"dataset.path={f}", *over))
    with pytest.raises(Exception, match="n_prompts"):  # the built-in sets still need a number
        compose("target=toy", "dataset.n_prompts=null")


def test_toy_worlds_refuse_words_and_scenes_they_cannot_encode(compose, tmp_path):
    f = _write(tmp_path / "p.txt", "a small red circle at the top on a black background\na photo of a red circle\n")
    with pytest.raises(InputFileError, match=r"p\.txt line 2 \(prompt 1, 'a photo of a red circle'\): the toy caption "
                                             r"encoder does not know the word 'photo'; valid words: a, against, .*, yellow"):
        run(compose("target=toy", "dataset=prompts", f"dataset.path={f}", f"+out_dir={tmp_path / 'out'}"))
    assert not (tmp_path / "out").exists()
    check_config(compose("target=toy", "dataset=prompts", f"dataset.path={f}", "dataset.n_prompts=1"))  # line 1 is fine
    g = _tsv(tmp_path / "p.tsv", TOY_CAPTIONS)  # every word known, but line 4 names no size: the continuous
    check_config(compose("target=toy", "dataset=prompts", f"dataset.path={g}"))  # world conditions on whole scenes
    with pytest.raises(InputFileError, match=r"p\.tsv line 4 \(prompt 2, .*\): the caption names no size; valid: small, "
                                             r"large \(this target conditions on the five attributes"):
        check_config(compose("target=toy_continuous", "method=cspd", "dataset=prompts", f"dataset.path={g}"))


# ------------------------------------------------------------------------------ a run on a file
def _records(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


def _strip(records) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING}
            for r in sorted(records, key=lambda r: (r["prompt_index"], r["method"]))]


def test_toy_run_on_a_partiprompts_tsv_resumes_merges_and_refuses_a_changed_file(compose, tmp_path):
    tsv = _tsv(tmp_path / "PartiPrompts.tsv", TOY_CAPTIONS)

    def cfg(out, *extra):
        return compose("target=toy", "dataset=prompts", f"dataset.path={tsv}", f"+out_dir={out}", *extra)

    one = tmp_path / "one"
    s_one = run(cfg(one))
    recs = _records(one)
    assert s_one["n_prompts"] == 3 and len(recs) == 6
    for tag in ("ar", "coolsd"):  # every prompt exactly once per method, with its text and content id
        mine = sorted((r["prompt_index"], r["caption"], r["prompt_id"]) for r in recs if r["method"] == tag)
        assert mine == [(i, c[0], prompt_id(c[0])) for i, c in enumerate(TOY_CAPTIONS)]
        # toy metrics over the prompts whose captions name a whole scene (2 of 3); the third is counted
        assert s_one["results"][tag]["toy_clip"]["n"] == 2 and s_one["results"][tag]["unscored_prompts"]["n"] == 1
    assert "quality metrics over 2 of 3 prompts: 1 not scored (prompts " in (one / "summary.md").read_text()
    ident = json.loads((one / "run.json").read_text())["dataset"]
    assert ident == {"name": "prompts", "n_prompts": 3, "offset": 0,
                     "path": {"name": "PartiPrompts.tsv", "bytes": tsv.stat().st_size,
                              "sha256": hashlib.sha256(tsv.read_bytes()).hexdigest()}}

    killed = tmp_path / "killed"  # killed part-way: two records and half a line written
    shutil.copytree(one, killed)
    lines = (killed / "samples.jsonl").read_text().splitlines()
    (killed / "samples.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    (killed / "summary.json").unlink()
    for r in recs[3:]:
        (killed / r["image"]).unlink()
    run(cfg(killed))
    assert _strip(_records(killed)) == _strip(recs)

    sharded = tmp_path / "sharded"
    for k in (1, 0):
        assert run(cfg(sharded, f"shard.index={k}", "shard.count=2"))["shard"] == k
    merged = merge(sharded)
    assert _strip(_records(sharded)) == _strip(recs) and merged["prompts_missing"] == []
    for tag in ("ar", "coolsd"):
        assert merged["results"][tag]["toy_clip"] == s_one["results"][tag]["toy_clip"]

    _tsv(tsv, [TOY_CAPTIONS[0], TOY_CAPTIONS[2], TOY_CAPTIONS[1]])  # same name, same size, other order
    with pytest.raises(ConfigError, match=r"holds a run of another configuration \(dataset.path \(PartiPrompts.tsv\) "
                                          r"has other content than the file this folder was started with"):
        run(cfg(one))
    assert _records(one) == recs
