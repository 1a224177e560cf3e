"""The demo and the `gradstream consume` process, through the real broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
from typer.testing import CliRunner

from analysis.report import build_report
from deploy.cli import app
from producer import GradientProducer
from schemas.wire import GradientHealth


def test_demo_reports_each_scenario(kafka_bootstrap: str, tmp_path: Path) -> None:
    """`gradstream demo` trains the three scenarios through Kafka; the reports read back
    from DuckDB show healthy / vanishing early layers / exploding layers."""
    result = CliRunner().invoke(
        app,
        ["demo", "--ranks", "2", "--out", str(tmp_path), "--no-heatmap",
         "--bootstrap-servers", kafka_bootstrap],
    )
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(tmp_path / "demo.duckdb"), read_only=True)
    runs = {r.split("-")[1]: r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()}
    healthy = build_report(con, runs["healthy"])
    vanishing = build_report(con, runs["vanishing"])
    exploding = build_report(con, runs["exploding"])
    con.close()
    assert healthy.overall_health is GradientHealth.HEALTHY
    assert healthy.layers_with_vanishing_grads == healthy.layers_with_exploding_grads == []
    assert vanishing.layers_with_vanishing_grads[:2] == ["layers.0.weight", "layers.0.bias"]
    assert "layers.12.weight" not in vanishing.layers_with_vanishing_grads
    assert vanishing.overall_health is not GradientHealth.HEALTHY
    assert exploding.layers_with_exploding_grads
    assert exploding.overall_health is GradientHealth.CRITICAL
    for run_id in runs.values():
        assert (tmp_path / f"{run_id}.csv").stat().st_size > 0
        assert (tmp_path / f"{run_id}.json").stat().st_size > 0
    assert "Healthy" in result.output and "Critical" in result.output


def test_consume_process_stops_cleanly_on_sigterm(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """`gradstream consume` stores what it read, then exits 0 on SIGTERM."""
    db = tmp_path / "worker.duckdb"
    topic = f"cli-{unique_name}"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "GRADSTREAM_DB": str(db)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "consume", "--topic", topic,
         "--dlq-topic", f"{topic}-dlq", "--group", f"g-{unique_name}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        with GradientProducer(f"run-{unique_name}", bootstrap_servers=kafka_bootstrap,
                              topic=topic) as gp:
            gp.start_run({"w": 3})
            for step in range(10):
                gp.record_step(step, {"w": np.array([1.0, -2.0, 3.0], np.float32)})
            gp.finish_run()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("finished (health" in x for x in lines):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "received SIGTERM" in out and "worker stopped" in out
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM frames").fetchone() == (10,)
    con.close()
