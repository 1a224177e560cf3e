"""``gradstream demo``'s first lines and its log lines (deploy/cli/demo.py)."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from rich.console import Console

from deploy.cli.demo import DemoLogFormatter, intro


def plain(markup: str) -> str:
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(markup, highlight=False)
    return out.getvalue()


def test_intro_says_what_runs_where_the_store_is_and_how_to_read_it() -> None:
    lines = plain(intro(["healthy", "bad-rank"], 3, Path("out/[x]/demo.duckdb"), None)
                  ).splitlines()
    assert len(lines) == 3
    assert lines[0] == (
        "gradstream demo: trains an MLP on digits in 2 scenarios (healthy, bad-rank), "
        "3 data-parallel ranks each.")
    assert "to a local Kafka broker;" in lines[1]
    assert "to out/[x]/demo.duckdb." in lines[1]  # a path is never read as markup
    assert "gradstream report --db out/[x]/demo.duckdb --all" in lines[2]
    assert 'gradstream query "SELECT * FROM runs" --db out/[x]/demo.duckdb' in lines[2]
    given = plain(intro(["healthy"], 1, Path("d.duckdb"), "kafka-0:9092"))
    assert "Kafka at kafka-0:9092" in given and "local" not in given
    assert "in 1 scenario (healthy), 1 data-parallel rank each" in given


def record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_alert_and_health_events_are_labelled_not_levelled() -> None:
    fmt = DemoLogFormatter()
    critical = "[critical] nonfinite firing: run r: non-finite gradients at step 20"
    assert fmt.format(record("gradstream.alerts", logging.ERROR, critical)) == (
        f"alert: {critical}")
    assert fmt.format(record("gradstream.consumer", logging.WARNING, "run r health Healthy"
                             " -> Critical at step 20")) == (
        "worker: run r health Healthy -> Critical at step 20")
    # A real failure keeps its level and logger name.
    assert fmt.format(record("gradstream.consumer", logging.ERROR, "write failed")) == (
        "ERROR gradstream.consumer: write failed")
    assert fmt.format(record("kafka.conn", logging.ERROR, "refused")) == (
        "ERROR kafka.conn: refused")
