"""Reads of the store cannot write files, read outside files, or run without a time limit.

The attacks a new user tried with ``gradstream query`` (``COPY ... TO``, ``EXPORT
DATABASE``, ``read_text('/etc/passwd')``, a cross join of 1e8 x 1e5 rows) are refused with
one clear line, or stopped by the time limit, on both read paths: the file opened
read-only (:class:`analysis.read.reader.FileReader`) and the endpoint of a process that writes
the store (its hardened :class:`analysis.read.cursors.ReadCursors`), called by
:class:`analysis.read.reader.EndpointReader` and by raw HTTP with the token.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.read.cursors import ReadCursors
from analysis.read.query import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    QueryError,
    QueryTimeoutError,
    ReadRefusedError,
    resolve_timeout,
)
from analysis.read.reader import EndpointReader, FileReader, StoreReader, open_reader
from analysis.read.sidecar import new_token, remove_sidecar, write_sidecar
from deploy.cli.reports import register
from tests.analysis.crafted import Stat, StoreBuilder

REFUSAL = "refused: reads may not touch files outside the store"
CROSS_JOIN = "SELECT count(*) FROM range(100000000) a, range(100000) b"
LIMIT_S = 1.0
BOUND_S = 10.0
"""A read limited to ``LIMIT_S`` must have returned within this (a loaded 2-core machine)."""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["a", "b"])
    builder.add_steps("r", range(3), {"a": Stat(), "b": Stat(norm=2.0)})
    return builder.write()


@pytest.fixture
def writer(store: Path) -> Iterator[tuple[duckdb.DuckDBPyConnection, str, str]]:
    """This process writes the store and serves reads from its instance: (connection,
    URL, token)."""
    con = duckdb.connect(str(store))
    cursors = ReadCursors.from_connection(con.cursor(), store)
    token = new_token()
    server = DashboardServer(Dashboard(cursors, token, query_timeout_s=30.0), "127.0.0.1", 0)
    server.start()
    write_sidecar(store, server.url, token, writer=True, command="store")
    try:
        yield con, server.url, token
    finally:
        remove_sidecar(store)
        server.stop()
        cursors.close()
        con.close()


@pytest.fixture(params=["file", "endpoint"])
def reader(request: pytest.FixtureRequest, store: Path) -> Iterator[StoreReader]:
    if request.param == "file":
        with open_reader(store, timeout_s=LIMIT_S) as direct:
            assert isinstance(direct, FileReader)
            yield direct
    else:
        served = request.getfixturevalue("writer")
        with open_reader(store, timeout_s=LIMIT_S) as endpoint:
            assert isinstance(endpoint, EndpointReader)
            yield endpoint
        assert served[0].execute("SELECT count(*) FROM runs").fetchone() == (1,)


def test_copy_to_a_file_is_refused(reader: StoreReader, tmp_path: Path) -> None:
    target = tmp_path / "x.csv"
    with pytest.raises(ReadRefusedError, match=REFUSAL) as caught:
        reader.sql(f"COPY runs TO '{target}'")
    assert "\n" not in str(caught.value)
    assert not target.exists()


def test_export_database_is_refused(reader: StoreReader, tmp_path: Path) -> None:
    target = tmp_path / "dump"
    with pytest.raises(ReadRefusedError, match=REFUSAL):
        reader.sql(f"EXPORT DATABASE '{target}'")
    assert not target.exists()


@pytest.mark.parametrize("sql", [
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_csv('/etc/passwd')",
    "ATTACH '/tmp/gradstream-attack.duckdb' AS other",
])
def test_outside_files_are_refused(reader: StoreReader, sql: str) -> None:
    with pytest.raises(ReadRefusedError, match=REFUSAL):
        reader.sql(sql)


def test_file_access_cannot_be_turned_back_on(reader: StoreReader) -> None:
    for sql in ("SET enable_external_access = true", "SET lock_configuration = false",
                "RESET enable_external_access"):
        with pytest.raises(QueryError, match="locked"):
            reader.sql(sql)
    with pytest.raises(QueryError, match="one SQL statement per query"):
        reader.sql("SET enable_external_access = true; COPY runs TO '/tmp/x.csv'")
    setting = reader.sql("SELECT current_setting('enable_external_access') AS on_")
    assert setting.column("on_").to_pylist() == [False]


def test_a_cross_join_is_stopped_by_the_limit(reader: StoreReader) -> None:
    began = time.monotonic()
    with pytest.raises(QueryTimeoutError, match=f"longer than {LIMIT_S:g} s"):
        reader.sql(CROSS_JOIN)
    assert time.monotonic() - began < BOUND_S
    # The reader still answers afterwards.
    assert reader.sql("SELECT count(*) AS n FROM runs").column("n").to_pylist() == [1]


def test_the_limit_covers_builders_too(store: Path) -> None:
    """A report is a read too: it runs under the same interrupt timer."""
    with FileReader(store, timeout_s=LIMIT_S) as direct:
        assert direct.report("r").total_steps == 3  # fast reads are unaffected


def test_timeout_settings(monkeypatch: pytest.MonkeyPatch, store: Path) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert resolve_timeout(None) == DEFAULT_TIMEOUT_S == 60.0
    assert resolve_timeout(2.5) == 2.5
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    assert resolve_timeout(None) == 0.5
    with open_reader(store) as direct:
        assert direct.timeout_s == 0.5
        began = time.monotonic()
        with pytest.raises(QueryTimeoutError, match=TIMEOUT_ENV):
            direct.sql(CROSS_JOIN)
        assert time.monotonic() - began < BOUND_S
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(QueryError, match=TIMEOUT_ENV):
            resolve_timeout(None)


def post(url: str, token: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        url + "/api/query", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_raw_http_with_the_token_is_refused(writer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _con, url, token = writer
    for sql in (f"COPY runs TO '{tmp_path / 'x.csv'}'", f"EXPORT DATABASE '{tmp_path / 'd'}'",
                "SELECT * FROM read_text('/etc/passwd')"):
        status, detail = post(url, token, {"sql": sql})
        assert (status, detail["kind"]) == (403, "refused"), detail
        assert str(detail["error"]).startswith(REFUSAL)
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "d").exists()
    began = time.monotonic()
    status, detail = post(url, token, {"sql": CROSS_JOIN, "timeout_s": LIMIT_S})
    assert (status, detail["kind"]) == (408, "timeout")
    assert time.monotonic() - began < BOUND_S


def test_the_writer_still_writes_on_its_hardened_instance(writer) -> None:  # type: ignore[no-untyped-def]
    """What the consumer's sink does on the shared instance still works: insert from a
    registered Arrow table, checkpoint."""
    con, _url, _token = writer
    assert con.execute("SELECT current_setting('enable_external_access'), "
                       "current_setting('lock_configuration')").fetchall() == [(False, True)]
    con.register("incoming", pa.table({"run_id": ["r2"], "world_size": [1], "num_layers": [1],
                                       "vanishing_threshold": [1e-7],
                                       "exploding_threshold": [1e3]}))
    con.execute("INSERT INTO runs BY NAME SELECT * FROM incoming")
    con.execute("CHECKPOINT")
    assert con.execute("SELECT count(*) FROM runs").fetchall() == [(2,)]


@pytest.mark.parametrize("through", ["file", "endpoint"])
def test_cli_query_refuses_in_one_line(request: pytest.FixtureRequest, store: Path,
                                       tmp_path: Path, through: str) -> None:
    if through == "endpoint":
        request.getfixturevalue("writer")
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    target = tmp_path / "x.csv"
    done = runner.invoke(app, ["query", f"COPY runs TO '{target}'", "--db", str(store)])
    assert done.exit_code == 1 and REFUSAL in done.output and "Traceback" not in done.output
    assert not target.exists()
    began = time.monotonic()
    done = runner.invoke(app, ["query", CROSS_JOIN, "--db", str(store), "--timeout", "0.5"])
    assert done.exit_code == 1 and "longer than 0.5 s" in done.output
    assert time.monotonic() - began < BOUND_S
