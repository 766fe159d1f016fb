"""The run's own messages: printed as they are, and written to the job's log (``run.log``, or
``run.shard-<k>-of-<n>.log``: Hydra's file handler, conf/config.yaml ``hydra.job_logging``), where
the console handler's ``NotPrinted`` filter keeps them from being printed twice. Outside a Hydra
job (tests, the lab, ``python -m`` tools) nothing handles the ``coolsd`` logger's records: they are only
printed."""
from __future__ import annotations

import logging
import sys

LOG = logging.getLogger("coolsd")
# without a configured handler (outside a Hydra job) Python's last-resort handler would print a
# warning or an error a second time: a handler that drops them stands in (records still propagate)
LOG.addHandler(logging.NullHandler())
_PRINTED = "coolsd_printed"  # a record's attribute: ``say`` printed it already


def say(message: str, level: int = logging.INFO) -> None:
    """``message`` printed (a warning or an error on stderr) and logged at ``level`` to the job's log."""
    print(message, file=sys.stderr if level >= logging.WARNING else sys.stdout, flush=True)
    LOG.log(level, message, extra={_PRINTED: True})


class NotPrinted(logging.Filter):
    """For the console handler: a record ``say`` printed is not printed again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _PRINTED, False)
