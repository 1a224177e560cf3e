"""What :mod:`deploy.serve` tells clients and users (the served worker itself runs against
Kafka and a browser in ``tests/integration/test_dashboard_browser.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.serve import ServedStore, ServeError, client_url, worker_failure


def test_a_wildcard_bind_is_reached_on_loopback() -> None:
    assert client_url("http://0.0.0.0:8765", "0.0.0.0") == "http://127.0.0.1:8765"
    assert client_url("http://[::]:8765", "::") == "http://[::1]:8765"
    assert client_url("http://10.0.0.2:8765", "10.0.0.2") == "http://10.0.0.2:8765"


def test_worker_failure_names_a_locked_store() -> None:
    assert "held by another process" in worker_failure(OSError("Could not set lock"), "s")
    assert worker_failure(None, "s") == "the consumer worker did not open the store in time"
    assert worker_failure(RuntimeError("boom"), "s") == "the consumer worker failed: boom"


def test_a_missing_store_is_not_served(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="no gradstream store"):
        ServedStore(tmp_path / "absent.duckdb", port=0).start()
