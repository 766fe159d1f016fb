"""Opening and parsing the user's input files with one readable error.

Every loader of a user-supplied file (weights, tokenizer JSON, config JSON, captions) goes through
these helpers, so that any failure while opening or parsing it -- a truncated or random
``.safetensors`` header, invalid JSON, a tokenizer file of another kind, ``torch.load`` with
``weights_only=True`` refusing a pickle, a state dict of another model -- reaches the user as ONE
``coolsd.util.errors.InputFileError`` naming the file, what was expected and where the right one comes
from (one line; the original exception is chained as ``__cause__`` for ``HYDRA_FULL_ERROR=1``).

Invariants: ``MissingInputFile`` is also a ``FileNotFoundError`` and ``BadInputFile`` also a
``ValueError`` (callers that caught those keep working); an ``InputError`` raised inside
``reading`` passes through unchanged (no double wrapping); nothing is half-loaded: the state dict
check runs before any tensor is copied.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from coolsd.util.errors import InputError, InputFileError

DETAIL_CHARS = 600  # how much of the underlying error a message keeps
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_UNPICKLER = re.compile(r"WeightsUnpickler error: (.+?)(?: Check the documentation|$)")


class MissingInputFile(InputFileError, FileNotFoundError):
    """An input file or folder is not set or not there (names it and where it comes from)."""


class BadInputFile(InputFileError, ValueError):
    """An input file exists but is not what was expected: unreadable, of another format or of
    another model (names it, what was expected and where the right one comes from)."""


def one_line(text, limit: int = DETAIL_CHARS) -> str:
    """``text`` with its whitespace (newlines included) collapsed, cut to ``limit`` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _detail(e: BaseException) -> str:
    """The underlying error in a few words: its message (its type unless a plain ValueError)."""
    text = one_line(e)
    if not text:
        return f"{type(e).__name__}: empty or truncated file" if isinstance(e, EOFError) else type(e).__name__
    return text if type(e) is ValueError else f"{type(e).__name__}: {text}"


def _unpickling_detail(e: BaseException) -> str:
    """torch's weights_only refusal without its advice (re-run unsafely, file an issue): which
    class or pickle opcode it met."""
    text = " ".join(str(e).split())
    if m := _GLOBAL.search(text):
        return f"it pickles a {m.group(1)} object, and torch.load(weights_only=True) reads only tensors and plain " \
               f"containers"
    if m := _UNPICKLER.search(text):
        return f"{type(e).__name__}: {one_line(m.group(1))}"
    return _detail(e)


@contextmanager
def reading(path, what: str, source: str):
    """Run the body that opens / parses ``path``; any failure becomes one ``BadInputFile``
    "cannot read PATH as WHAT (detail); get the right file from SOURCE" (``InputError`` passes through)."""
    try:
        yield
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure here means: not the expected file)
        raise BadInputFile(f"cannot read {os.fspath(path)} as {what} ({_detail(e)}); get the right file from {source}") \
            from e


def require_file(path, what: str, source: str, folder: bool = False) -> Path:
    """``path`` as a Path if it is an existing file (``folder``: directory), else ``MissingInputFile``."""
    p = Path(os.fspath(path)) if path not in (None, "") else None
    if p is None or not (p.is_dir() if folder else p.is_file()):
        state = "(path not set)" if p is None else (f"{p} (a folder, expected a file)" if p.is_dir() and not folder
                                                     else str(p))
        raise MissingInputFile(f"{what} not found: {state}; download it from {source}")
    return p


def read_json(path, what: str, source: str) -> dict:
    """A JSON object file (a missing file, invalid JSON or another top-level type: one error)."""
    p = require_file(path, what, source)
    with reading(p, what, source):
        data = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"the file holds a JSON {type(data).__name__}, not an object")
    return data


def unwrap_checkpoint(obj, path, keys: Sequence[str] = ("model", "module", "state_dict")) -> dict:
    """The state dict inside an upstream checkpoint (``{key: sd}``, the first of ``keys`` present)."""
    import torch

    if isinstance(obj, dict):
        for key in keys:
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{os.fspath(path)} does not hold a state dict of tensors")
    return obj


def torch_load(path, what: str, source: str, allow: tuple = ()):
    """``torch.load(path, weights_only=True)`` (``allow``: harmless classes upstream pickles beside
    the weights, e.g. argparse.Namespace); a missing or unreadable file is one error."""
    import torch

    p = require_file(path, what, source)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (any unpickling failure means: not a weights file)
        raise BadInputFile(f"{p} is not a readable PyTorch weight file ({_unpickling_detail(e)}); expected {what} "
                           f"from {source}") from e


def read_torch_checkpoint(path, what: str, source: str, keys: Sequence[str] = ("model", "module", "state_dict"),
                          allow: tuple = ()) -> dict:
    """A local weight file's state dict: ``.safetensors``, or ``torch_load`` unwrapped by ``keys``."""
    p = require_file(path, what, source)
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        with reading(p, what, source):
            return load_file(str(p))
    obj = torch_load(p, what, source, allow)
    with reading(p, what, source):
        return unwrap_checkpoint(obj, p, keys)


def _describe(keys, limit: int = 6) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_state_dict(model, state: dict, path, source: str) -> None:
    """Strict key and shape check of ``state`` against ``model`` with one ``BadInputFile`` naming
    the file and what differs (a checkpoint of another model: never a partial load)."""
    own = model.state_dict()
    missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
    shapes = [k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shapes:
        parts = ([f"missing keys: {_describe(missing)}"] if missing else []) + \
                ([f"unexpected keys: {_describe(unexpected)}"] if unexpected else []) + \
                (["wrong shapes: " + ", ".join(f"{k} {tuple(state[k].shape)} (expected {tuple(own[k].shape)})"
                                                 for k in sorted(shapes)[:6])] if shapes else [])
        raise BadInputFile(f"{os.fspath(path)} does not fit {type(model).__name__} ({'; '.join(parts)}); "
                           f"expected the file from {source}")


__all__ = ["BadInputFile", "MissingInputFile", "check_state_dict", "one_line", "read_json", "read_torch_checkpoint",
           "reading", "require_file", "torch_load", "unwrap_checkpoint"]
