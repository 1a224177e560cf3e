"""gradstream query: read-only SQL with and without a running writer, through
:func:`analysis.read.reader.open_reader`.

- no writer: a read-only DuckDB connection; writes refused by DuckDB;
- a writer in this process serving the dashboard: the query goes over HTTP to it and runs
  in a read-only transaction (token, Host and Origin checks, one statement, locked
  configuration);
- a real ``gradstream serve`` process consuming from Kafka: ``gradstream query`` in
  another process, while it writes; a write refused; after it stops, the direct path.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.read.connect import StoreError
from analysis.read.cursors import ReadCursors
from analysis.read.query import (
    QueryError,
    ReadOnlyViolationError,
    StoreHeldError,
    execute_read_only,
)
from analysis.read.reader import open_reader
from analysis.read.sidecar import (
    new_token,
    read_sidecar,
    remove_sidecar,
    sidecar_path,
    write_sidecar,
)
from deploy.cli.reports import register
from tests.analysis.crafted import NASTY_NAMES, Stat, StoreBuilder

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Result:
    table: pa.Table
    via: str


def run_query(db: Path, sql: str, timeout_s: float | None = None) -> Result:
    """One statement through the reader, as ``gradstream query`` runs it."""
    with open_reader(db, timeout_s) as reader:
        return Result(reader.sql(sql), reader.via)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", NASTY_NAMES)
    stats = {n: Stat(norm=float(i + 1)) for i, n in enumerate(NASTY_NAMES)}
    builder.add_steps("r", range(4), stats)
    return builder.write()


def count_rows(db: Path) -> int:
    con = duckdb.connect(str(db), read_only=True)
    try:
        row = con.execute("SELECT count(*) FROM layer_stats").fetchone()
        return int(row[0]) if row else -1
    finally:
        con.close()


# -- no writer: the read-only connection ----------------------------------------------


def test_direct_query_reads(store: Path) -> None:
    result = run_query(store, "SELECT name FROM layers ORDER BY layer_index")
    assert result.via == "read-only file"
    assert result.table.column("name").to_pylist() == NASTY_NAMES


@pytest.mark.parametrize("sql", [
    "DELETE FROM layer_stats",
    "INSERT INTO runs (run_id, world_size, num_layers, vanishing_threshold, "
    "exploding_threshold) VALUES ('x', 1, 1, 1e-7, 1e3)",
    "UPDATE runs SET health = 'Critical'",
    "DROP TABLE frames",
    "CREATE TABLE t (a INTEGER)",
    "WITH x AS (SELECT 1) DELETE FROM alerts",
])
def test_direct_writes_are_refused_by_duckdb(store: Path, sql: str) -> None:
    before = count_rows(store)
    with pytest.raises(ReadOnlyViolationError, match="read-only"):
        run_query(store, sql)
    assert count_rows(store) == before


def test_one_statement_and_clear_errors(store: Path, tmp_path: Path) -> None:
    with pytest.raises(QueryError, match="one SQL statement per query"):
        run_query(store, "SELECT 1; SELECT 2")
    with pytest.raises(QueryError, match="no SQL statement"):
        run_query(store, "  ;  ")
    with pytest.raises(QueryError, match="syntax error"):
        run_query(store, "SELEC 1")
    with pytest.raises(StoreError, match="does not exist"):
        run_query(tmp_path / "missing.duckdb", "SELECT 1")
    with pytest.raises(QueryError, match="interrupted"):
        run_query(store, "SELECT count(*) FROM range(10000000000) a, range(1000) b", 0.2)


def test_cli_formats(store: Path) -> None:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    sql = "SELECT layer_index, name, [layer_index, 1] AS pair, NULL AS nothing, " \
          "'nan'::DOUBLE AS x FROM layers ORDER BY layer_index"
    result = runner.invoke(app, ["query", sql, "--db", str(store), "--format", "csv"])
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(io.StringIO(result.stdout_bytes.decode(), newline="")))
    assert rows[0] == ["layer_index", "name", "pair", "nothing", "x"]
    assert [r[1] for r in rows[1:]] == NASTY_NAMES
    assert rows[2][2:] == ["[1, 1]", "", "NaN"]
    result = runner.invoke(app, ["query", sql, "--db", str(store), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [d["name"] for d in doc] == NASTY_NAMES
    assert doc[1] == {"layer_index": 1, "name": NASTY_NAMES[1], "pair": [1, 1],
                      "nothing": None, "x": None}
    result = runner.invoke(app, ["query", "SELECT count(*) AS n FROM frames", "--db", str(store)])
    assert result.exit_code == 0, result.output
    assert re.search(r"│\s*4\s*│", result.stdout), result.stdout
    result = runner.invoke(app, ["query", "DELETE FROM frames", "--db", str(store)])
    assert result.exit_code == 1
    assert "refused" in result.output and "read-only" in result.output
    assert "Traceback" not in result.output


def test_store_held_without_server(store: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
         "print('ready', flush=True); time.sleep(120)", str(store)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        with pytest.raises(StoreHeldError, match="answers no reads"):
            run_query(store, "SELECT 1")
        # A sidecar left by a dead server is ignored.
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        sidecar_path(store).write_text(json.dumps({
            "url": "http://127.0.0.1:9", "pid": int(dead.stdout), "host": os.uname().nodename,
            "db": str(store.resolve()), "token": "t", "writer": True, "started_at": 0.0,
        }))
        assert read_sidecar(store) is None
        with pytest.raises(StoreHeldError):
            run_query(store, "SELECT 1")
    finally:
        holder.kill()
        holder.wait()


# -- a writer in this process, serving ---------------------------------------------------


@pytest.fixture
def served(store: Path):  # type: ignore[no-untyped-def]
    """This process writes ``store`` (a read-write connection) and serves it."""
    writer = duckdb.connect(str(store))
    cursors = ReadCursors.from_connection(writer.cursor(), store)
    token = new_token()
    server = DashboardServer(Dashboard(cursors, token, query_timeout_s=5.0), "127.0.0.1", 0)
    server.start()
    write_sidecar(store, server.url, token, writer=True)
    try:
        yield writer, server, token
    finally:
        remove_sidecar(store)
        server.stop()
        cursors.close()
        writer.close()


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/api/query", data=body, method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_query_through_the_serving_writer(store: Path, served) -> None:  # type: ignore[no-untyped-def]
    writer, server, _token = served
    with pytest.raises(duckdb.ConnectionException):  # the file is held read-write here
        duckdb.connect(str(store), read_only=True)
    result = run_query(store, "SELECT count(*) AS n FROM layer_stats")
    assert result.via == f"gradstream serve (pid {os.getpid()}) at {server.url}"
    assert result.table.column("n").to_pylist() == [4 * len(NASTY_NAMES)]

    # The writer keeps writing; each query sees what is committed.
    writer.execute("DELETE FROM layer_stats WHERE step = 3")
    assert run_query(store, "SELECT count(*) AS n FROM layer_stats").table.column(
        "n").to_pylist() == [3 * len(NASTY_NAMES)]

    for sql in ("DELETE FROM layer_stats", "CREATE TABLE t (a INTEGER)",
                "INSERT INTO alerts SELECT * FROM alerts", "CREATE SEQUENCE s",
                "ALTER TABLE runs ADD COLUMN z INTEGER"):
        with pytest.raises(ReadOnlyViolationError, match="read-only"):
            run_query(store, sql)
    with pytest.raises(QueryError, match="one SQL statement"):
        run_query(store, "COMMIT; DELETE FROM layer_stats")
    run_query(store, "COMMIT")  # ends the read-only transaction; nothing else runs
    with pytest.raises(QueryError, match="configuration has been locked"):
        run_query(store, "SET GLOBAL threads = 1")
    with pytest.raises(QueryError, match="interrupted"):
        run_query(store, "SELECT count(*) FROM range(10000000000) a, range(1000) b", 0.3)
    assert writer.execute("SELECT count(*) FROM layer_stats").fetchone() == (
        3 * len(NASTY_NAMES),)
    assert writer.execute("SELECT current_setting('threads')").fetchone() != (1,)
    writer.execute("CREATE TABLE writer_still_writes (a INTEGER)")


def test_server_rejects_foreign_callers(store: Path, served) -> None:  # type: ignore[no-untyped-def]
    _writer, server, token = served
    body = json.dumps({"sql": "SELECT 1"}).encode()
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    assert post(server.url, body, auth)[0] == 200
    status, detail = post(server.url, body, {"Content-Type": "application/json"})
    assert status == 401 and detail["kind"] == "unauthorized"
    status, _ = post(server.url, body, {**auth, "Authorization": "Bearer wrong"})
    assert status == 401
    status, _ = post(server.url, body, {**auth, "Content-Type": "text/plain"})
    assert status == 415  # a plain cross-site form post cannot reach the query
    status, detail = post(server.url, body, {**auth, "Host": "evil.example:80"})
    assert status == 403 and "loopback" in detail["error"]
    status, detail = post(server.url, body, {**auth, "Origin": "http://evil.example"})
    assert status == 403 and "cross-origin" in detail["error"]
    status, detail = post(server.url, json.dumps({"sql": "DROP TABLE runs"}).encode(), auth)
    assert status == 403 and detail["kind"] == "read_only"


def test_export_command_goes_through_the_server(store: Path, served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import pyarrow.parquet as pq

    writer, _server, _token = served
    app = typer.Typer()
    register(app)
    out = tmp_path / "via-server.parquet"
    result = CliRunner().invoke(app, ["export", "--db", str(store), "--format", "parquet",
                                      "--from-step", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {3 * len(NASTY_NAMES)} rows of run 'r'" in result.output
    exported = pq.read_table(out)
    expected = writer.execute(
        "SELECT step, layer_index, grad_norm FROM layer_stats WHERE step >= 1 "
        "ORDER BY step, layer_index").fetchall()
    got = sorted(zip(*(exported.column(c).to_pylist()
                       for c in ("step", "layer_index", "grad_norm")), strict=True))
    assert got == expected
    result = CliRunner().invoke(app, ["export", "--db", str(store), "--run", "nope",
                                      "-o", str(tmp_path / "x.csv")])
    assert result.exit_code == 1 and "unknown run 'nope'" in result.output
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "x.csv.part").exists()


def test_execute_read_only_on_a_read_only_cursor(store: Path) -> None:
    writer = duckdb.connect(str(store))
    try:
        cursors = ReadCursors.from_connection(writer.cursor(), store)
        with cursors.cursor() as cur:
            table = execute_read_only(cur, "SELECT max(step) AS s FROM frames")
            assert table.column("s").to_pylist() == [3]
            with pytest.raises(ReadOnlyViolationError):
                execute_read_only(cur, "DELETE FROM frames")
        cursors.close()
        with pytest.raises(Exception, match="closed"), cursors.cursor():
            pass
    finally:
        writer.close()


# -- a real `gradstream serve` process consuming from Kafka ------------------------------


def gradstream(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_query_under_a_running_serve_process(kafka_bootstrap, tmp_path, unique_name) -> None:
    from producer import GradientProducer

    db = tmp_path / "live.duckdb"
    serve = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--db", str(db), "--port", "0",
         "--bootstrap-servers", kafka_bootstrap, "--topic", f"q-{unique_name}",
         "--dlq-topic", f"q-dlq-{unique_name}", "--alerts-topic", f"q-al-{unique_name}",
         "--group", f"q-{unique_name}", "--log-level", "WARNING"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while read_sidecar(db) is None:
            assert serve.poll() is None, serve.communicate()
            assert time.monotonic() < deadline, "gradstream serve wrote no sidecar"
            time.sleep(0.1)
        info = read_sidecar(db)
        assert info is not None and info.writer and info.pid == serve.pid
        assert oct(sidecar_path(db).stat().st_mode & 0o777) == "0o600"

        run_id = f"q/{unique_name}"
        producer = GradientProducer(run_id, bootstrap_servers=kafka_bootstrap,
                                    topic=f"q-{unique_name}")
        producer.start_run({"a": 8, "b": 4})
        rng = np.random.default_rng(0)
        for step in range(12):
            producer.record_step(step, {"a": rng.standard_normal(8).astype(np.float32),
                                        "b": rng.standard_normal(4).astype(np.float32)})
        producer.finish_run()
        producer.close()

        sql = f"SELECT count(*) AS n FROM layer_stats WHERE run_id = '{run_id}'"
        deadline = time.monotonic() + 150
        while True:
            done = gradstream("query", sql, "--db", str(db), "--format", "json")
            assert done.returncode == 0, done.stderr
            if json.loads(done.stdout) == [{"n": 24}]:
                break
            if time.monotonic() > deadline:
                serve.terminate()
                pytest.fail(f"serve stored {done.stdout}; its log:\n{serve.communicate()[1]}")
            time.sleep(0.3)
        with pytest.raises(duckdb.IOException, match="lock"):
            duckdb.connect(str(db), read_only=True)  # the writer really holds the file

        table = gradstream("query", "SELECT run_id, frames FROM runs", "--db", str(db))
        assert table.returncode == 0 and run_id in table.stdout
        assert f"via gradstream serve (pid {info.pid}) at {info.url}" in table.stderr

        refused = gradstream("query", f"DELETE FROM layer_stats WHERE run_id = '{run_id}'",
                             "--db", str(db))
        assert refused.returncode == 1
        assert "refused" in refused.stderr and "read-only" in refused.stderr
        again = gradstream("query", sql, "--db", str(db), "--format", "csv")
        assert again.stdout.splitlines() == ["n", "24"]
        exported = gradstream("export", "--db", str(db), "--format", "jsonl",
                              "-o", str(tmp_path / "live.jsonl"))
        assert exported.returncode == 0, exported.stderr
        lines = (tmp_path / "live.jsonl").read_text(encoding="utf-8").splitlines()
        assert len(lines) == 24 and json.loads(lines[0])["run_id"] == run_id
    finally:
        serve.send_signal(signal.SIGTERM)
        _out, err = serve.communicate(timeout=60)
    assert serve.returncode == 0, err
    assert not sidecar_path(db).exists()
    after = gradstream("query", sql, "--db", str(db), "--format", "csv")
    assert after.returncode == 0 and after.stdout.splitlines() == ["n", "24"]


def test_serve_no_consume_serves_a_store_read_only(store: Path) -> None:
    serve = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--no-consume", "--db", str(store),
         "--port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while read_sidecar(store) is None:
            assert serve.poll() is None, serve.communicate()
            assert time.monotonic() < deadline, "no sidecar"
            time.sleep(0.1)
        info = read_sidecar(store)
        assert info is not None and not info.writer
        auth = {"Authorization": f"Bearer {info.token}"}
        with urllib.request.urlopen(urllib.request.Request(info.url + "/api/runs", headers=auth),
                                    timeout=10) as response:
            runs = json.loads(response.read())["runs"]
        assert [r["run_id"] for r in runs] == ["r"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(info.url + "/api/runs", timeout=10)
        assert refused.value.code == 401
        with urllib.request.urlopen(urllib.request.Request(info.url + "/", headers=auth),
                                    timeout=10) as response:
            page = response.read().decode()
            assert "default-src 'none'" in response.headers["Content-Security-Policy"]
        assert "<title>gradstream dashboard</title>" in page and "http" not in page.split(
            "<body>")[1].split('<script type="application/json"')[0]
        # Readers share the file: the query takes the direct read-only path.
        assert run_query(store, "SELECT count(*) FROM runs").via == "read-only file"
    finally:
        serve.send_signal(signal.SIGTERM)
        _out, err = serve.communicate(timeout=30)
    assert serve.returncode == 0, err
    assert not sidecar_path(store).exists()


def test_serve_reports_a_held_store(store: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
         "print('ready', flush=True); time.sleep(120)", str(store)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        for mode in ("--no-consume", "--consume"):
            done = gradstream("serve", mode, "--db", str(store), "--port", "0",
                              "--bootstrap-servers", "127.0.0.1:1", timeout=60)
            assert done.returncode == 1, done.stderr
            assert "held by another process" in done.stderr or "being written" in done.stderr \
                or "lock" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
    finally:
        holder.kill()
        holder.wait()


def test_closing_the_cursors_interrupts_running_queries(store: Path) -> None:
    import threading

    writer = duckdb.connect(str(store))
    cursors = ReadCursors.from_connection(writer.cursor(), store)
    outcome: list[BaseException] = []
    started = threading.Event()

    def long_query() -> None:
        try:
            with cursors.cursor() as cur:
                started.set()
                execute_read_only(cur, "SELECT count(*) FROM range(10000000000) a, range(1000) b")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=long_query)
    thread.start()
    assert started.wait(10)
    time.sleep(0.2)
    began = time.monotonic()
    cursors.close()
    thread.join(10)
    assert time.monotonic() - began < 5
    assert outcome and isinstance(outcome[0], QueryError)
    writer.execute("CHECKPOINT")  # the writer is not blocked by the reader
    writer.close()
