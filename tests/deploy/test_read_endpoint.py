"""Every process that writes a store answers reads (:mod:`deploy.serve`): real
``gradstream consume`` and ``gradstream store`` processes write a store from a real Kafka
while ``gradstream query`` reads the same ``--db``; ``--no-read-endpoint`` keeps the file to
itself."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from analysis.read.sidecar import ServeInfo, read_sidecar, sidecar_path

REPO = Path(__file__).resolve().parents[2]
LAYERS = {"encoder.weight": 8, "head.weight": 4}
"""The producer's model: two layers, so a stored step is two ``layer_stats`` rows."""


def gradstream(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``gradstream ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@contextmanager
def process(log: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A ``gradstream ARGS`` process writing its output to ``log``, stopped with SIGTERM
    on exit (killed if it hangs)."""
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deploy.cli", *args, "--log-level",
                                 "WARNING"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def logs(*paths: Path) -> str:
    """The output of the processes logged in ``paths`` so far, for a failure message."""
    return "\n".join(f"--- {p.name}:\n{p.read_text(encoding='utf-8')[-4000:]}" for p in paths)


def wait_for_endpoint(db: Path, proc: subprocess.Popen[str], log: Path) -> ServeInfo:
    """The sidecar ``proc`` writes once its store is open and served."""
    deadline = time.monotonic() + 90
    while (info := read_sidecar(db)) is None:
        assert proc.poll() is None, logs(log)
        assert time.monotonic() < deadline, f"no endpoint advertised\n{logs(log)}"
        time.sleep(0.1)
    return info


def stored_rows(db: Path, run_id: str) -> int:
    """``layer_stats`` rows of ``run_id``, read by ``gradstream query --db db``."""
    done = gradstream("query", f"SELECT count(*) AS n FROM layer_stats WHERE run_id = "
                      f"'{run_id}'", "--db", str(db), "--format", "json")
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout)[0]["n"])


def wait_for_rows(db: Path, run_id: str, rows: int, procs: list[subprocess.Popen[str]],
                  log: list[Path]) -> None:
    """Query ``db`` until ``run_id`` has ``rows`` rows (never more) while ``procs`` run."""
    deadline = time.monotonic() + 180
    while (seen := stored_rows(db, run_id)) != rows:
        assert seen < rows, f"{seen} rows stored, {rows} sent"
        assert all(p.poll() is None for p in procs), logs(*log)
        assert time.monotonic() < deadline, f"{seen} of {rows} rows in time\n{logs(*log)}"
        time.sleep(0.3)


def send_and_read(bootstrap: str, topic: str, db: Path, run_id: str, steps: tuple[int, int],
                  procs: list[subprocess.Popen[str]], log: list[Path]) -> None:
    """Send ``steps[0]`` steps of ``run_id``, read them back with ``gradstream query``,
    then ``steps[1]`` more (the reader sees the rows grow)."""
    from producer import GradientProducer

    producer = GradientProducer(run_id, bootstrap_servers=bootstrap, topic=topic)
    producer.start_run(LAYERS)
    rng = np.random.default_rng(0)
    sent = 0
    for burst in steps:
        for step in range(sent, sent + burst):
            producer.record_step(step, {name: rng.standard_normal(numel).astype(np.float32)
                                        for name, numel in LAYERS.items()})
        sent += burst
        if sent == sum(steps):
            producer.finish_run()
        assert producer.flush(30)
        wait_for_rows(db, run_id, sent * len(LAYERS), procs, log)
    producer.close()


def stop_and_check(proc: subprocess.Popen[str], db: Path, log: Path) -> None:
    """SIGTERM ends ``proc`` cleanly and removes its sidecar."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, logs(log)
    assert not sidecar_path(db).exists()


def test_query_reads_a_running_consume_process(kafka_bootstrap: str, tmp_path: Path,
                                               unique_name: str) -> None:
    db, run_id, topic = tmp_path / "live.duckdb", f"consume/{unique_name}", f"c-{unique_name}"
    log = tmp_path / "consume.log"
    with process(log, "consume", "--db", str(db), "--bootstrap-servers", kafka_bootstrap,
                 "--topic", topic, "--dlq-topic", f"{topic}-dlq", "--alerts-topic",
                 f"{topic}-alerts", "--group", topic) as consume:
        info = wait_for_endpoint(db, consume, log)
        assert info.writer and info.pid == consume.pid and info.command == "consume"
        assert info.url.startswith("http://127.0.0.1:")
        assert oct(sidecar_path(db).stat().st_mode & 0o777) == "0o600"
        send_and_read(kafka_bootstrap, topic, db, run_id, (6, 9), [consume], [log])
        second = gradstream("serve", "--no-consume", "--db", str(db), "--port", "0")
        assert second.returncode == 1  # a second server cannot open the file, and says where
        assert f"`gradstream consume` (pid {consume.pid}) writes it" in second.stderr
        assert info.url in second.stderr
        frames = gradstream("query", "SELECT run_id, frames FROM runs", "--db", str(db))
        assert frames.returncode == 0 and run_id in frames.stdout, frames.stderr
        assert info.url in frames.stderr  # the rows came through the process's endpoint
        stop_and_check(consume, db, log)
    after = gradstream("query", f"SELECT count(*) AS n FROM layer_stats WHERE run_id = "
                       f"'{run_id}'", "--db", str(db), "--format", "csv")
    assert after.returncode == 0 and after.stdout.splitlines() == ["n", "30"], after.stderr


def test_query_reads_a_running_store_process(kafka_bootstrap: str, tmp_path: Path,
                                             unique_name: str) -> None:
    """Scale-out: a ``consume --frames-topic`` worker publishes frames (it writes no store,
    so it serves nothing) and ``gradstream store`` writes them, answering reads meanwhile."""
    db, run_id, name = tmp_path / "scaled.duckdb", f"store/{unique_name}", f"s-{unique_name}"
    kafka = ("--bootstrap-servers", kafka_bootstrap, "--frames-topic", f"{name}-frames",
             "--alerts-topic", f"{name}-alerts")
    store_log, worker_log = tmp_path / "store.log", tmp_path / "worker.log"
    with process(store_log, "store", "--db", str(db), *kafka, "--group", name) as store:
        info = wait_for_endpoint(db, store, store_log)
        assert info.writer and info.pid == store.pid and info.command == "store"
        with process(worker_log, "consume", "--db", str(tmp_path / "unused.duckdb"), *kafka,
                     "--topic", name, "--dlq-topic", f"{name}-dlq", "--runs-topic",
                     f"{name}-runs", "--group", name) as worker:
            send_and_read(kafka_bootstrap, name, db, run_id, (5, 7), [store, worker],
                          [store_log, worker_log])
        assert not sidecar_path(tmp_path / "unused.duckdb").exists()
        assert not (tmp_path / "unused.duckdb").exists()
        stop_and_check(store, db, store_log)


def test_no_read_endpoint_keeps_the_file_to_itself(kafka_bootstrap: str, tmp_path: Path,
                                                   unique_name: str) -> None:
    db, topic, log = tmp_path / "held.duckdb", f"n-{unique_name}", tmp_path / "consume.log"
    with process(log, "consume", "--no-read-endpoint", "--db", str(db), "--bootstrap-servers",
                 kafka_bootstrap, "--topic", topic, "--dlq-topic", f"{topic}-dlq",
                 "--alerts-topic", f"{topic}-alerts", "--group", topic) as consume:
        deadline = time.monotonic() + 90
        while True:
            done = gradstream("query", "SELECT count(*) FROM runs", "--db", str(db))
            if done.returncode != 0 and "held by another process" in done.stderr:
                break
            assert consume.poll() is None, logs(log)
            assert time.monotonic() < deadline, (done.returncode, done.stdout, done.stderr)
            time.sleep(0.3)
        assert not sidecar_path(db).exists()
        stop_and_check(consume, db, log)
    free = gradstream("query", "SELECT count(*) AS n FROM runs", "--db", str(db), "--format",
                      "csv")
    assert free.returncode == 0 and free.stdout.splitlines() == ["n", "0"], free.stderr


@pytest.mark.parametrize("command", ["consume", "store"])
def test_a_locked_store_is_reported_and_no_sidecar_is_left(
        command: str, tmp_path: Path) -> None:
    """A second writer of the same file stops with the lock message (before Kafka is
    reached) and leaves the first writer's file alone."""
    import duckdb

    db = tmp_path / "locked.duckdb"
    holder = duckdb.connect(str(db))
    try:
        done = gradstream(command, "--db", str(db), "--bootstrap-servers", "127.0.0.1:1",
                          "--log-level", "ERROR")
    finally:
        holder.close()
    assert done.returncode == 1, done.stderr
    assert f"gradstream {command} failed" in done.stderr
    assert "held by another process" in done.stderr
    assert not sidecar_path(db).exists()
