"""The project's own error types for wrong configuration or inputs (issue 16).

Invariant: an ``InputError`` means the user's configuration or input files are wrong, and its
message alone (one or two lines: the key or file, the value, what is valid and the fix) is what
the user needs; the command-line entry points print it without a traceback and exit non-zero
(``HYDRA_FULL_ERROR=1`` shows the traceback). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations


class InputError(Exception):
    """The user's configuration or input files are wrong: printed as one line, no traceback."""


class ConfigError(InputError, ValueError):
    """A configuration value is invalid (names the key, the value and the valid range)."""


class InputFileError(InputError, OSError):
    """An input file is missing, unreadable or of the wrong kind (names the file, what was
    expected and where to get the right one)."""
