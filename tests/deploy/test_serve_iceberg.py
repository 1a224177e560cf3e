"""``gradstream serve --no-consume --db 'iceberg+...'``: the live dashboard of an Apache
Iceberg table set (:class:`analysis.read.snapshots.SnapshotCursors` behind
:class:`deploy.serve.ServedStore`).

The stores are real: a pyiceberg SQL catalog on SQLite with a file warehouse, written by
the Iceberg output (:class:`consumer.outputs.iceberg.IcebergOutput`), and DuckDB files
written by the DuckDB output with the same batches. The dashboard of the Iceberg store,
served by a ``gradstream serve`` process, must answer every read route as the dashboard of
the DuckDB store holding the same batches does, follow the writer's later commits, and
require its token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.dashboard.server import Dashboard
from analysis.read.cursors import StoreClosedError
from analysis.read.snapshots import IcebergSnapshots, SnapshotCursors
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from consumer.outputs.iceberg import IcebergOutput
from deploy.cli import app
from deploy.serve import ServedStore
from schemas.iceberg_catalog import s3_properties
from schemas.wire import RunStarted
from tests.analysis.read.test_iceberg_reader import RUN, _long_run, _url
from tests.consumer.outputs.test_iceberg import GROUP
from tests.deploy.test_serve import _printed_url

TOKEN = "iceberg-dashboard-token-0123456789"
"""The token the served process is given (``--token``)."""

INTERVAL_S = 0.3
"""``--snapshot-interval`` of the served process: short, so the test waits little."""

ROUTES = [
    "/api/runs",
    "/api/alerts",
    f"/api/alerts?run={RUN}&limit=5",
    f"/api/grid?run={RUN}",
    f"/api/grid?run={RUN}&max_steps=7&from_step=3",
    f"/api/report?run={RUN}",
    f"/api/heatmap?run={RUN}&max_columns=20",
    f"/api/layer?run={RUN}&layer=3",
    f"/api/scalars?run={RUN}",
    f"/api/analysis/flow?run={RUN}",
    f"/api/analysis/explosion?run={RUN}",
    f"/api/export?run={RUN}&format=csv",
    f"/api/export?run={RUN}&format=json",
]
"""Read routes whose answers must be the DuckDB store's, byte for byte."""


def _write_iceberg(batches: list[Batch], catalog: str, warehouse: str) -> None:
    output = IcebergOutput(catalog, warehouse, GROUP, io_properties=s3_properties(os.environ))
    try:
        for batch in batches:
            output.write(batch)
    finally:
        output.close()


def _write_duckdb(batches: list[Batch], db: Path) -> Path:
    sink = DuckDBSink(db, write_behind=False)
    try:
        for batch in batches:
            sink.write(batch, GROUP)
    finally:
        sink.close()
    return db


def _get(base: str, path: str, token: str | None = TOKEN) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(base + path, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.read()  # type: ignore[no-any-return]


def _count(base: str, sql: str) -> int:
    """``sql``'s one value, through ``POST /api/query`` (Arrow answer)."""
    import pyarrow as pa

    request = urllib.request.Request(
        f"{base}/api/query", data=json.dumps({"sql": sql}).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return int(pa.ipc.open_stream(answer).read_all().column(0)[0].as_py())


def _answers(base: str, token: str | None = TOKEN) -> dict[str, bytes]:
    return {path: _get(base, path, token) for path in ROUTES}


@pytest.fixture
def iceberg(tmp_path: Path) -> tuple[str, str, str]:
    """(catalog, warehouse, store URL) of a table set holding the first write of
    :data:`RUN` (its start and steps 0-19)."""
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", (tmp_path / "wh").as_uri()
    _write_iceberg(_long_run()[:1], catalog, warehouse)
    return catalog, warehouse, _url(catalog, warehouse)


@pytest.fixture
def served(iceberg: tuple[str, str, str]) -> Iterator[subprocess.Popen[str]]:
    """``gradstream serve --no-consume`` on the Iceberg store URL (a real process)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--no-consume", "--db", iceberg[2],
         "--port", "0", "--snapshot-interval", str(INTERVAL_S)],
        cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "COLUMNS": "400", "GRADSTREAM_TOKEN": TOKEN})
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)


def test_serve_follows_the_iceberg_store_and_answers_as_the_duckdb_store(
        tmp_path: Path, iceberg: tuple[str, str, str],
        served: subprocess.Popen[str]) -> None:
    """Every read route answers what the DuckDB store of the same batches answers; after
    the writer's next commit (the run's last 20 steps, its alerts and its end), the served
    snapshot is re-read within a few intervals and every route, the cached grid and
    analyses included, answers what the DuckDB store of all the batches answers."""
    url = _printed_url(served)
    assert url.endswith(f"/?token={TOKEN}")
    base = url.split("/?")[0]
    first = _write_duckdb(_long_run()[:1], tmp_path / "first.duckdb")
    both = _write_duckdb(_long_run(), tmp_path / "both.duckdb")
    expected: dict[Path, dict[str, bytes]] = {}
    for db in (first, both):
        duck = ServedStore(db, port=0, token=TOKEN)
        duck.start()
        try:
            expected[db] = _answers(duck.url)
        finally:
            duck.stop()
    assert expected[first] != expected[both]
    assert _answers(base) == expected[first]
    assert _count(base, "SELECT count(*) FROM layer_stats") == 20 * 4
    status = json.loads(_get(base, "/api/status"))
    assert status["writer"] is False and status["db"] == iceberg[2]
    assert status["snapshot"]["number"] == 1 and status["snapshot"]["error"] is None

    _write_iceberg(_long_run()[1:], iceberg[0], iceberg[1])  # the writer commits more
    deadline = time.monotonic() + 30
    while _get(base, "/api/runs") != expected[both][
            "/api/runs"] and time.monotonic() < deadline:
        time.sleep(INTERVAL_S / 2)  # each read after the interval starts a check
    assert _answers(base) == expected[both]
    assert _count(base, "SELECT count(*) FROM layer_stats") == 40 * 4
    assert json.loads(_get(base, "/api/status"))["snapshot"]["number"] >= 2


def test_every_route_of_the_iceberg_dashboard_requires_the_token(
        served: subprocess.Popen[str]) -> None:
    """Without the token (or with another) pages and ``/api`` routes answer 401, saying
    where the token is (no sidecar file for a store URL: the printed URL); the printed URL
    lets a browser in."""
    url = _printed_url(served)
    base = url.split("/?")[0]
    for path in ("/", "/api/runs", f"/api/grid?run={RUN}", "/static/dashboard.js"):
        for token in (None, "another-token-0123456789"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                _get(base, path, token)
            assert refused.value.code == 401, path
            text = refused.value.read().decode()
            assert "serve.json" not in text and "gradstream serve" in text, text
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
    with opener.open(url, timeout=30) as page:  # 303 with the cookie, then the page
        assert b"<title>gradstream dashboard</title>" in page.read()


def test_a_cached_answer_is_recomputed_on_a_new_snapshot_and_old_reads_finish(
        tmp_path: Path, iceberg: tuple[str, str, str]) -> None:
    """A snapshot re-read after a commit that leaves the run's frames alone (another run
    starts) still gets its own cache entries; a read that began on the old snapshot
    finishes on it, and that snapshot is closed once the read ends."""
    catalog, warehouse, url = iceberg
    cursors = SnapshotCursors(IcebergSnapshots(url), interval_s=3600.0)
    app_ = Dashboard(cursors, TOKEN)  # type: ignore[arg-type]
    computed: list[int] = []

    def compute() -> object:
        computed.append(1)
        return {"n": len(computed)}

    try:
        assert cursors.check() is False  # nothing committed: nothing re-read
        with cursors.cursor() as old:
            assert cursors.snapshot_key(old) == 1
            app_.cached(old, RUN, ("k",), compute)
            app_.cached(old, RUN, ("k",), compute)
            assert len(computed) == 1  # same snapshot, same frames: the cached answer
            another = Batch()
            another.runs_started.append(RunStarted(
                run_id="other", rank=0, world_size=1, layer_names=["a"], numel=[3],
                vanishing_threshold=1e-7, exploding_threshold=1e3, host="h",
                start_time=1.0))
            _write_iceberg([another], catalog, warehouse)
            replaced = cursors._current.cursors  # the snapshot `old` reads
            assert cursors.check() is True
            assert old.execute("SELECT count(*) FROM runs").fetchone() == (1,)
            with cursors.cursor() as new:
                assert cursors.snapshot_key(new) == 2
                assert new.execute("SELECT count(*) FROM runs").fetchone() == (2,)
                app_.cached(new, RUN, ("k",), compute)
                assert len(computed) == 2  # frames alike, snapshot not: recomputed
            with replaced.cursor() as still:  # open while `old` reads it
                assert still.execute("SELECT 1").fetchone() == (1,)
        with pytest.raises(StoreClosedError), replaced.cursor():
            pass
    finally:
        cursors.close()
    with pytest.raises(StoreClosedError), cursors.cursor():
        pass


@pytest.mark.parametrize("where", ["flag", "environment"])
def test_serve_that_consumes_refuses_a_store_url(tmp_path: Path, where: str) -> None:
    url = _url(f"sqlite:///{tmp_path}/catalog.db", (tmp_path / "wh").as_uri())
    args = ["serve", "--bootstrap-servers", "127.0.0.1:1", "--port", "0"]
    result = CliRunner().invoke(app, [*args, "--db", url] if where == "flag" else args,
                                env={"GRADSTREAM_DB": url, "COLUMNS": "400"})
    assert result.exit_code == 2, result.output
    flat = " ".join(result.output.split())
    assert "writes a DuckDB file" in flat and "--no-consume" in flat, flat
    assert "consume --iceberg-catalog" in flat, flat
    assert not any(tmp_path.iterdir())  # nothing created


def test_serve_no_consume_on_a_missing_catalog_says_so(tmp_path: Path) -> None:
    url = _url(f"sqlite:///{tmp_path}/absent.db", (tmp_path / "wh").as_uri())
    result = CliRunner().invoke(app, ["serve", "--no-consume", "--port", "0", "--db", url],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    assert "no Iceberg catalog at" in " ".join(result.output.split())
    assert not any(tmp_path.iterdir())


def test_a_failed_re_read_keeps_the_last_snapshot_served(
        tmp_path: Path, iceberg: tuple[str, str, str]) -> None:
    """A check that cannot load the new snapshot (its files unreachable) is reported by
    ``status()`` and changes nothing; the next check after they are back loads it."""
    catalog, warehouse, url = iceberg
    cursors = SnapshotCursors(IcebergSnapshots(url), interval_s=3600.0)
    try:
        _write_iceberg(_long_run()[1:], catalog, warehouse)
        (tmp_path / "wh").rename(tmp_path / "away")
        assert cursors.check() is False
        error = cursors.status()["snapshot"]["error"]
        assert "cannot read the Iceberg table" in error, error
        with cursors.cursor() as cur:
            assert cur.execute("SELECT count(*) FROM frames").fetchone() == (20,)
        (tmp_path / "away").rename(tmp_path / "wh")
        assert cursors.check() is True
        assert cursors.status()["snapshot"] == {
            "number": 2, "loaded_at": cursors.loaded_at, "interval_s": 3600.0, "error": None}
        with cursors.cursor() as cur:
            assert cur.execute("SELECT count(*) FROM frames").fetchone() == (40,)
    finally:
        cursors.close()
