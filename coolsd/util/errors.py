"""The project's own error types: what a person sees as one line, without a traceback.

Invariant: a ``OneLineError``'s message alone (one or two lines: what failed, the key or file,
the value, what is valid and the fix) is what the user needs; the command-line entry points
print it without a traceback and exit with its ``exit_status`` (``coolsd.cli.runner.one_line_errors``;
``HYDRA_FULL_ERROR=1`` or ``COOLSD_VERBOSE=1`` shows the traceback). Two kinds:

* ``InputError`` (exit status 2): the user's configuration or input files are wrong;
* ``SummaryError`` (exit status 3): a run generated and kept its records, then summarising them
  failed; the message says how to summarise again without generating again.

Anything else is a bug and keeps its traceback. A user's value echoed in such a message goes
through ``shorten``, so that a long one (a 10,000-word prompt) cannot bury the reason.
"""
from __future__ import annotations

import reprlib


class OneLineError(Exception):
    """Printed as its message alone, no traceback; the process exits with ``exit_status``."""

    exit_status = 1


class InputError(OneLineError):
    """The user's configuration or input files are wrong: printed as one line, no traceback."""

    exit_status = 2


class ConfigError(InputError, ValueError):
    """A configuration value is invalid (names the key, the value and the valid range)."""


class InputFileError(InputError, OSError):
    """An input file is missing, unreadable or of the wrong kind (names the file, what was
    expected and where to get the right one)."""


class SummaryError(OneLineError, RuntimeError):
    """A run's records are complete on disk but its summary failed: hours of generation must not
    end in a traceback that reads as if they were lost. The message names the failure (its cause
    is chained for ``COOLSD_VERBOSE=1``) and the command that summarises the kept records."""

    exit_status = 3


def shorten(value, limit: int = 80) -> str:
    """``repr(value)`` in at most about ``limit`` characters, its middle elided as ``...``
    (``reprlib``: a string keeps its start and end and its quotes; a list its first items), for
    echoing a user's value in a one-line error."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = limit
    return r.repr(value)
