"""What :mod:`deploy.serve` tells clients and users, and its read endpoint on a real
DuckDB store (the endpoint attached to real ``gradstream consume`` / ``store`` processes
runs against Kafka in ``tests/deploy/test_read_endpoint.py``, the served worker in a
browser in ``tests/integration/test_dashboard_browser.py``)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from analysis.read.cursors import ReadCursors
from analysis.read.sidecar import read_sidecar, sidecar_path
from consumer.outputs.duckdb import DuckDBSink
from deploy.serve import (
    READER_NICE,
    BoundedReadCursors,
    EndpointOptions,
    ReadEndpoint,
    ServedStore,
    ServeError,
    client_url,
    worker_failure,
)


def test_a_wildcard_bind_is_reached_on_loopback() -> None:
    assert client_url("http://0.0.0.0:8765", "0.0.0.0") == "http://127.0.0.1:8765"
    assert client_url("http://[::]:8765", "::") == "http://[::1]:8765"
    assert client_url("http://10.0.0.2:8765", "10.0.0.2") == "http://10.0.0.2:8765"


def test_worker_failure_names_a_locked_store() -> None:
    assert "held by another process" in worker_failure(OSError("Could not set lock"), "s")
    assert worker_failure(None, "s") == "the store s was not opened in time"
    assert worker_failure(RuntimeError("boom"), "s") == "boom"
    assert worker_failure(ServeError("cannot listen on x: lock"), "s") == (
        "cannot listen on x: lock")


def test_a_missing_store_is_not_served(tmp_path: Path) -> None:
    with pytest.raises(ServeError, match="no gradstream store"):
        ServedStore(tmp_path / "absent.duckdb", port=0).start()


# -- the read endpoint of a writing process (deploy.serve.ReadEndpoint) ------------------


def _reader_cursors(tmp_path: Path) -> tuple[duckdb.DuckDBPyConnection, ReadCursors]:
    """A writer's connection on a real store file and read cursors on its instance."""
    con = duckdb.connect(str(tmp_path / "s.duckdb"))
    con.execute("CREATE TABLE t AS SELECT range AS x FROM range(1000)")
    return con, ReadCursors.from_connection(con.cursor(), tmp_path / "s.duckdb")


def test_at_most_max_readers_read_at_once(tmp_path: Path) -> None:
    con, cursors = _reader_cursors(tmp_path)
    bounded = BoundedReadCursors(cursors, max_readers=1, nice=0)
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()
    seen: list[int] = []

    def first() -> None:
        with bounded.cursor() as cur:
            seen.append(cur.execute("SELECT count(*) FROM t").fetchone()[0])
            first_in.set()
            release.wait(10)

    def second() -> None:
        with bounded.cursor() as cur:
            second_in.set()
            seen.append(cur.execute("SELECT sum(x) FROM t").fetchone()[0])

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    assert first_in.wait(10)
    threads[1].start()
    assert not second_in.wait(0.5), "a second reader ran while the only slot was taken"
    release.set()
    assert second_in.wait(10)
    for thread in threads:
        thread.join(10)
    assert seen == [1000, 499500]
    bounded.close()
    con.close()
    with pytest.raises(ValueError, match="max_readers"):
        BoundedReadCursors(cursors, max_readers=0)
    with pytest.raises(ValueError, match="nice"):
        BoundedReadCursors(cursors, max_readers=None, nice=20)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread nice values: Linux")
def test_readers_run_at_the_lowest_priority_and_the_writer_keeps_its_own(
        tmp_path: Path) -> None:
    con, cursors = _reader_cursors(tmp_path)
    bounded = BoundedReadCursors(cursors, max_readers=None, nice=READER_NICE)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    priority: list[int] = []

    def read() -> None:
        with bounded.cursor() as cur:
            cur.execute("SELECT count(*) FROM t").fetchone()
            priority.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(10)
    assert priority == [READER_NICE]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    con.execute("INSERT INTO t VALUES (1000)")  # the writer goes on
    bounded.close()
    con.close()


def test_an_endpoint_on_a_sink_answers_reads_until_closed(tmp_path: Path) -> None:
    """``ReadEndpoint.attach`` (the ``on_open`` hook of every consumer loop) serves the
    writer's instance over HTTP with the sidecar's token, sees the writer's commits, and
    :meth:`close` removes the sidecar and lets the writer close the file."""
    db = tmp_path / "w.duckdb"
    sink = DuckDBSink(db, write_behind=False)
    endpoint = ReadEndpoint(db, EndpointOptions(port=0), command="store")
    endpoint.attach(sink)
    try:
        info = read_sidecar(db)
        assert info is not None and info.writer and info.url == endpoint.url
        assert info.command == "store" and info.pid == os.getpid()
        assert _post_query(info.url, info.token, "SELECT count(*) AS n FROM runs") == [0]
        sink.con.execute("INSERT INTO kafka_offsets VALUES ('g', 't', 0, 7)")
        assert _post_query(info.url, info.token,
                           "SELECT next_offset AS n FROM kafka_offsets") == [7]
        with pytest.raises(urllib.error.HTTPError) as refused:
            _post_query(info.url, "wrong-token", "SELECT 1 AS n")
        assert refused.value.code == 401
    finally:
        endpoint.close()
    assert not sidecar_path(db).exists() and endpoint.server is None
    sink.close()
    with duckdb.connect(str(db), read_only=True) as con:  # the file is free again
        assert con.execute("SELECT count(*) FROM kafka_offsets").fetchone() == (1,)


def _post_query(url: str, token: str, sql: str) -> list[object]:
    """POST ``sql`` to ``/api/query``; the column ``n`` of the Arrow answer."""
    request = urllib.request.Request(
        f"{url}/api/query", data=json.dumps({"sql": sql}).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return pa.ipc.open_stream(answer).read_all().column("n").to_pylist()


# -- the token: chosen or random, printed in the URL, in the sidecar -----------------------


def test_an_endpoint_takes_a_chosen_token(tmp_path: Path) -> None:
    """``EndpointOptions.token`` is the one the server requires and the sidecar holds;
    without it each endpoint draws its own."""
    from tests.analysis.crafted import write_history

    db = write_history(tmp_path / "t.duckdb", np.ones((2, 3)))
    chosen = "chosen-token_0123456789"
    endpoint = ReadEndpoint(db, EndpointOptions(port=0, reader_nice=0, token=chosen))
    endpoint.open_read_only()
    try:
        info = read_sidecar(db)
        assert info is not None and info.token == chosen == endpoint.token
        assert endpoint.dashboard_url == info.dashboard_url == f"{info.url}/?token={chosen}"
        assert _post_query(info.url, chosen, "SELECT count(*) AS n FROM runs") == [1]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{info.url}/api/runs", timeout=10)
        assert refused.value.code == 401
    finally:
        endpoint.close()
    with pytest.raises(ValueError, match="at least 16 characters"):
        EndpointOptions(token="short")
    first, second = (ReadEndpoint(db, EndpointOptions(port=0, reader_nice=0)) for _ in range(2))
    first.open_read_only()
    first.close()
    second.open_read_only()
    second.close()
    assert first.token != second.token and len(first.token) == 43


def _serve(db: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--no-consume", "--db", str(db),
         "--port", "0", *args],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "80", **(env or {})},
    )


def _printed_url(serve: subprocess.Popen[str]) -> str:
    """The URL of the line ``gradstream dashboard: URL  (...)`` that serve prints."""
    assert serve.stderr is not None
    for line in serve.stderr:
        if line.startswith("gradstream dashboard: "):
            return line.split()[2]
    raise AssertionError(f"serve printed no URL (exit {serve.wait(30)})")


@pytest.mark.parametrize("chosen", [None, "env-token-0123456789abcdef"])
def test_serve_prints_the_url_with_the_token(tmp_path: Path, chosen: str | None) -> None:
    """`gradstream serve` prints http://127.0.0.1:PORT/?token=TOKEN (one line, as a user
    copies it), the token of the sidecar: $GRADSTREAM_TOKEN when set, else a random one.
    The URL sets the cookie and opens the page; the bare address is refused."""
    from tests.analysis.crafted import write_history

    db = write_history(tmp_path / "s.duckdb", np.ones((2, 3)))
    serve = _serve(db, env={"GRADSTREAM_TOKEN": chosen} if chosen else None)
    try:
        url = _printed_url(serve)
        info = read_sidecar(db)
        assert info is not None and url == info.dashboard_url
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[A-Za-z0-9_-]+", url), url
        if chosen:
            assert info.token == chosen
        address = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        conn.request("GET", f"/?{address.query}")
        login = conn.getresponse()
        login.read()
        assert login.status == 303 and login.headers["Location"] == "/"
        cookie = login.headers["Set-Cookie"].split(";")[0]
        conn.request("GET", "/", headers={"Cookie": cookie})
        page = conn.getresponse()
        assert page.status == 200 and b"<title>gradstream dashboard</title>" in page.read()
        conn.close()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(info.url + "/", timeout=10)
        assert refused.value.code == 401
        assert b"gradstream serve" in refused.value.read()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=30)
    assert serve.returncode == 0


def test_serve_refuses_a_weak_token(tmp_path: Path) -> None:
    from tests.analysis.crafted import write_history

    db = write_history(tmp_path / "s.duckdb", np.ones((2, 3)))
    serve = _serve(db, "--token", "short")
    _out, err = serve.communicate(timeout=60)
    flat = " ".join(err.replace("│", " ").split())  # the message as rich boxed it
    assert serve.returncode == 2 and "a token needs at least 16 characters" in flat, err
    assert not sidecar_path(db).exists()


def test_queued_reads_never_hold_up_the_page(tmp_path: Path) -> None:
    """Reads beyond --max-readers wait for a slot inside their own request threads; more of
    them than anyio's default pool (40 threads) must not hold up the page's static files,
    nor fail: once the slot is free every queued read answers."""
    from concurrent.futures import ThreadPoolExecutor

    from analysis.dashboard.server import Dashboard, DashboardServer
    from tests.analysis.crafted import write_history

    db = write_history(tmp_path / "q.duckdb", np.array([[1.0, 2.0], [3.0, 4.0]]))
    cursors = BoundedReadCursors(ReadCursors.open_read_only(Path(db)), max_readers=1)
    server = DashboardServer(Dashboard(cursors, "tok"), "127.0.0.1", 0)
    server.start()
    address = urllib.parse.urlsplit(server.url)

    def get(path: str) -> int:
        conn = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
        try:
            conn.request("GET", path, headers={"Authorization": "Bearer tok"})
            response = conn.getresponse()
            response.read()
            return response.status
        finally:
            conn.close()

    try:
        with ThreadPoolExecutor(60) as pool:
            with cursors.cursor():  # the one read slot is taken: every read waits
                waiting = [pool.submit(get, "/api/runs") for _ in range(50)]
                time.sleep(2.0)  # the reads reach their threads (none can answer)
                assert not any(f.done() for f in waiting)
                page = pool.submit(get, "/static/dashboard.js")
                assert page.result(timeout=10) == 200
            assert [f.result(timeout=60) for f in waiting] == [200] * len(waiting)
    finally:
        server.stop()
        cursors.close()
