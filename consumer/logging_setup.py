"""Logging of the long-running commands: human-readable text or JSON lines.

``--log-format json`` (``GRADSTREAM_LOG_FORMAT=json``) writes one JSON object per line,
for log collectors (Loki, Elasticsearch, Cloud Logging): ``ts`` (unix s), ``time`` (ISO
8601, UTC), ``level``, ``logger``, ``message``, ``process``, ``thread``, ``exc_info`` (the
formatted traceback, when there is one) and any ``extra={...}`` fields given to the call.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message", "asctime", "taskName",
}


class JsonFormatter(logging.Formatter):
    """A ``logging.Formatter`` writing each record as one JSON object on one line.

    Values that JSON cannot hold (e.g. a Path given in ``extra``) are written with
    ``str()``. Newlines in messages and tracebacks are escaped by JSON, so one record is
    always one line.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single-line JSON object (keys in the module docstring)."""
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger for a command: ``level`` (DEBUG, INFO, WARNING, ERROR)
    and ``fmt`` ``text`` or ``json``, on stderr; kafka-python is held at WARNING.

    Raises:
        ValueError: unknown level or format (the message lists the valid ones).
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown log format {fmt!r}: use 'text' or 'json'")
    name = level.upper()
    if name not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"unknown log level {level!r}: use DEBUG, INFO, WARNING or ERROR")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(name)
    logging.getLogger("kafka").setLevel(logging.WARNING)
