"""``gradstream consume`` and ``gradstream store`` (:mod:`deploy.cli.consume`) as processes,
against a real Kafka."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            return answer.read().decode()
    except OSError:
        return None


def test_store_serves_its_metrics_port_once(kafka_bootstrap: str, tmp_path: Path,
                                            unique_name: str) -> None:
    """The store process serves ``--metrics-port`` (bound once, by the consumer loop) and
    stops cleanly on SIGTERM."""
    port = _free_port()
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "store", "--db", str(tmp_path / "s.duckdb"),
         "--frames-topic", f"frames-{unique_name}", "--alerts-topic", f"alerts-{unique_name}",
         "--group", f"store-{unique_name}", "--metrics-port", str(port)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        page = None
        while page is None:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "no metrics endpoint"
            time.sleep(0.2)
            page = _metrics(port)
        assert "gradstream" in page
        # the store sees whole runs and evaluates the alert rules: both gauges have series
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(page) for s in f.samples}
        assert samples[("gradstream_runs", (("finished", "false"), ("health", "Healthy")))] == 0
        assert samples[("gradstream_firing_incidents",
                        (("rule", "nonfinite"), ("severity", "critical")))] == 0
        assert samples[("gradstream_store_write_failures_total", (("output", "duckdb"),))] == 0
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
