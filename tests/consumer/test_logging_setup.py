"""Structured logs: ``--log-format json`` writes one JSON object per line."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from consumer.logging_setup import JsonFormatter, setup_logging


def _record(msg: str, *args: object, exc: bool = False, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("gradstream.test")
    exc_info = None
    if exc:
        try:
            raise ValueError("bad\nvalue")
        except ValueError:
            exc_info = sys.exc_info()
    return logger.makeRecord("gradstream.test", logging.WARNING, __file__, 1, msg, args,
                             exc_info, extra=extra or None)


def test_json_formatter_writes_one_object_per_line_with_extras_and_traceback() -> None:
    line = JsonFormatter().format(_record("run %s\nhealth %s", "r-1", "Critical", exc=True,
                                          run_id="r-1", path=Path("/x")))
    assert "\n" not in line
    doc = json.loads(line)
    assert doc["message"] == "run r-1\nhealth Critical"
    assert doc["level"] == "WARNING" and doc["logger"] == "gradstream.test"
    assert doc["run_id"] == "r-1" and doc["path"] == "/x"
    assert "ValueError: bad" in doc["exc_info"]
    assert doc["time"].endswith("+00:00") and abs(doc["ts"] - time.time()) < 60
    assert doc["process"] == os.getpid()


def test_setup_logging_refuses_unknown_format_or_level() -> None:
    with pytest.raises(ValueError, match="'text' or 'json'"):
        setup_logging("INFO", "yaml")
    with pytest.raises(ValueError, match="DEBUG, INFO"):
        setup_logging("LOUD", "json")


def test_consume_log_format_json(kafka_bootstrap: str, tmp_path: Path, unique_name: str) -> None:
    """Every line `gradstream consume --log-format json` writes to stderr is a JSON object."""
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "consume", "--db", str(tmp_path / "j.duckdb"),
         "--topic", f"json-{unique_name}", "--dlq-topic", f"json-dlq-{unique_name}",
         "--alerts-topic", f"json-alerts-{unique_name}", "--group", f"json-{unique_name}",
         "--log-format", "json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("joined group" in x for x in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    docs = [json.loads(x) for x in lines]
    assert {d["logger"] for d in docs} >= {"gradstream.consumer"}
    assert any(d["message"].startswith("worker stopped") for d in docs)
    assert all(d["level"] in {"DEBUG", "INFO", "WARNING", "ERROR"} for d in docs)
