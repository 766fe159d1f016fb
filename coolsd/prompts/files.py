"""Prompt lists from a user's file (``dataset=prompts dataset.path=FILE``, docs/protocols.md, "Prompt
files"): GenEval's ``evaluation_metadata.jsonl``, PartiPrompts' ``PartiPrompts.tsv``, a DPG-Bench
or own list as ``.csv`` / ``.tsv`` / ``.txt``.

Formats, by the file's suffix:

* ``.txt``: one prompt a line, taken as written (only the line ending is dropped); blank lines at
  the end are ignored, a blank (empty or whitespace-only) line before the last prompt is an error;
* ``.jsonl``: one JSON object a line; the prompt is its ``column`` key if given, else ``prompt``,
  else ``caption``; its other string / number / boolean values are kept as metadata (GenEval's
  ``tag``; lists such as GenEval's ``include`` are not);
* ``.csv`` (RFC 4180 quoting) / ``.tsv`` (tab-separated, no quoting: a field may start with ``"``,
  as in PartiPrompts): a header row; the prompt column is ``column`` if given, else the first of
  ``Prompt``, ``prompt``, ``caption``, ``text``; the other columns are kept as metadata
  (PartiPrompts' ``Category``, ``Challenge``, ``Note``).

Each prompt is a ``SimpleNamespace``: ``caption`` (the text, what every world reads), ``index`` (its
0-based position among the file's prompts: the records' ``prompt_index``), ``prompt_id`` (the
first 12 hex digits of the sha256 of the text: the same text has the same id in any file),
``line`` (its 1-based line in the file, for messages) and the metadata fields (a metadata name
equal to one of those four is not kept). Any malformed line is one ``BadInputFile`` (a
``ValueError``) naming the file, the line and the fix; a missing file one ``MissingInputFile``.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from coolsd.util.loading import BadInputFile, MissingInputFile, one_line

FORMATS = (".txt", ".jsonl", ".csv", ".tsv")
JSONL_KEYS = ("prompt", "caption")  # the prompt's key of a JSONL object, the first present
CSV_COLUMNS = ("Prompt", "prompt", "caption", "text")  # the prompt column of a CSV / TSV, the first present
RESERVED = ("caption", "index", "prompt_id", "line")  # a prompt's own fields: never overwritten by metadata
HOW = "set dataset.path=FILE or $PROMPTS_FILE: a .txt, .jsonl, .csv or .tsv prompt list (docs/protocols.md)"


def prompt_id(text: str) -> str:
    """A prompt's stable content id: the first 12 hex digits of the sha256 of its UTF-8 text."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _prompt(text: str, index: int, line: int, meta: dict) -> SimpleNamespace:
    kept = {k: v for k, v in meta.items() if k not in RESERVED and isinstance(v, (str, int, float))}
    return SimpleNamespace(caption=text, index=index, prompt_id=prompt_id(text), line=line, **kept)


def _lines(path: Path, text: str) -> list[tuple[int, str]]:
    """(1-based line, text) of every line up to the last non-blank one; a blank line before it is
    an error."""
    lines = [s.removesuffix("\r") for s in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    for n, s in enumerate(lines, 1):
        if not s.strip():
            raise BadInputFile(f"{path} line {n}: {'empty' if not s else 'whitespace-only'} line among the prompts; "
                               f"delete it (one prompt a line, blank lines only at the end)")
    return list(enumerate(lines, 1))


def _text(path: Path, value, where: str, fix: str) -> str:
    """``value`` as a prompt's text: a string with a non-blank character, else one error."""
    if not isinstance(value, str) or not value.strip():
        got = "blank" if isinstance(value, str) else f"a JSON {type(value).__name__}"
        raise BadInputFile(f"{path} line {where}: the prompt is {got}, expected text; {fix}")
    return value


def _read_txt(path: Path, text: str, column: Optional[str]) -> list[SimpleNamespace]:
    if column is not None:
        raise BadInputFile(f"{path}: dataset.column={column!r} is set, but a .txt file has no columns (one prompt "
                           "a line); set dataset.column=null")
    return [_prompt(s, i, n, {}) for i, (n, s) in enumerate(_lines(path, text))]


def _read_jsonl(path: Path, text: str, column: Optional[str]) -> list[SimpleNamespace]:
    keys = (column,) if column is not None else JSONL_KEYS
    out = []
    for i, (n, s) in enumerate(_lines(path, text)):
        try:
            obj = json.loads(s)
        except ValueError as e:
            raise BadInputFile(f"{path} line {n}: not valid JSON ({one_line(e, 200)}); each line must be one JSON "
                               "object, e.g. {\"prompt\": \"a photo of a bench\"}") from None
        if not isinstance(obj, dict):
            raise BadInputFile(f"{path} line {n}: a JSON {type(obj).__name__}, expected an object with a "
                               f"{' or '.join(repr(k) for k in keys)} key")
        key = next((k for k in keys if k in obj), None)
        if key is None:
            has = ", ".join(map(str, obj)) or "none"
            raise BadInputFile(f"{path} line {n}: no {' or '.join(repr(k) for k in keys)} key (its keys: {has}); "
                               "set dataset.column=<the prompt's key>")
        caption = _text(path, obj[key], str(n), f"give key {key!r} a prompt")
        out.append(_prompt(caption, i, n, {k: v for k, v in obj.items() if k != key}))
    return out


def _read_table(path: Path, text: str, column: Optional[str], tsv: bool) -> list[SimpleNamespace]:
    fmt = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tsv else {"delimiter": ","}
    reader = csv.reader(io.StringIO(text, newline=""), strict=not tsv, **fmt)
    try:
        header = next(reader, None)
        if header is None or not any(h.strip() for h in header):
            raise BadInputFile(f"{path}: no header row; the first line names the columns, e.g. "
                               f"{'Prompt<TAB>Category' if tsv else 'prompt,category'}")
        header = [h.strip() for h in header]
        wanted = (column,) if column is not None else CSV_COLUMNS
        col = next((header.index(c) for c in wanted if c in header), None)
        if col is None:
            raise BadInputFile(f"{path}: no prompt column {' or '.join(repr(c) for c in wanted)} (its columns: "
                               f"{', '.join(repr(h) for h in header)}); set dataset.column=<the prompt column>")
        out, start = [], reader.line_num + 1
        for row in reader:
            n, start = start, reader.line_num + 1
            if not row or not any(f.strip() for f in row):
                if any(any(f.strip() for f in r) for r in reader):  # blank rows are fine at the end only
                    raise BadInputFile(f"{path} line {n}: empty row among the prompts; delete it (blank lines only "
                                       "at the end)")
                break
            if len(row) > len(header):
                raise BadInputFile(f"{path} line {n}: {len(row)} fields but the header has {len(header)}; "
                                   f"{'a tab inside a prompt?' if tsv else 'quote a field that holds a comma'}")
            row = row + [""] * (len(header) - len(row))
            caption = _text(path, row[col], str(n), f"give column {header[col]!r} a prompt on every row")
            out.append(_prompt(caption, len(out), n, {h: v for k, (h, v) in enumerate(zip(header, row))
                                                       if k != col and h}))
        return out
    except csv.Error as e:
        raise BadInputFile(f"{path} line {reader.line_num}: not readable as {'TSV' if tsv else 'CSV'} ({e}); "
                           "check its quoting") from None


def load_prompt_file(path, column: Optional[str] = None) -> list[SimpleNamespace]:
    """Every prompt of a prompt file, in file order (module docstring: formats, fields, errors)."""
    if path in (None, "", "null"):
        raise MissingInputFile(f"prompt file not set; {HOW}")
    p = Path(os.fspath(path))
    if not p.is_file():
        raise MissingInputFile(f"prompt file not found: {p}{' (a folder)' if p.is_dir() else ''}; {HOW}")
    suffix = p.suffix.lower()
    if suffix not in FORMATS:
        raise BadInputFile(f"{p}: unknown prompt file format {p.suffix or '(no suffix)'!r}; valid: "
                           f"{', '.join(FORMATS)} (docs/protocols.md); rename it if it is one of them")
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise BadInputFile(f"{p} line {line}: not UTF-8 text ({e.reason}); save it as UTF-8") from None
    if suffix == ".txt":
        prompts = _read_txt(p, text, column)
    elif suffix == ".jsonl":
        prompts = _read_jsonl(p, text, column)
    else:
        prompts = _read_table(p, text, column, tsv=suffix == ".tsv")
    if not prompts:
        raise BadInputFile(f"{p} holds no prompts; {HOW}")
    return prompts


def file_prompts(path, n: Optional[int], offset: int = 0, column: Optional[str] = None) -> list[SimpleNamespace]:
    """Prompts [offset, offset + n) of a prompt file (``n`` None: every one from ``offset``)."""
    prompts = load_prompt_file(path, column)
    n = len(prompts) - offset if n is None else n
    if n < 1 or offset < 0 or offset + n > len(prompts):
        raise ValueError(f"prompts [{offset}, {offset + n}) exceed the {len(prompts)} prompts of {path}")
    return prompts[offset: offset + n]


__all__ = ["CSV_COLUMNS", "FORMATS", "JSONL_KEYS", "file_prompts", "load_prompt_file", "prompt_id"]
