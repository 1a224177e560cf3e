"""Reading a store kept as an Apache Iceberg table set (analysis.read.iceberg): the same
batches written by the Iceberg output (a real pyiceberg SQL catalog on SQLite, a file or
moto S3 warehouse) and by the DuckDB output into a DuckDB file, then every read command
(report, query, analyze, export, alerts, plot) and the notebook API give the same answers
on both stores, under the same read hardening."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from analysis.notebook import Store
from analysis.read.connect import StoreError
from analysis.read.iceberg import IcebergLocation, IcebergReader
from analysis.read.query import (
    QueryError,
    QueryTimeoutError,
    ReadOnlyViolationError,
    ReadRefusedError,
)
from analysis.read.reader import FileReader, open_reader
from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.outputs.base import Batch, RunState
from consumer.outputs.duckdb import DuckDBSink
from consumer.outputs.iceberg import IcebergOutput
from deploy.cli import build_app
from schemas.alert import Alert, AlertRule, AlertSeverity, AlertState
from schemas.iceberg_catalog import s3_properties
from schemas.stats import GradientSums
from schemas.wire import LocalSummary, RunFinished, RunStarted
from tests.consumer.outputs.test_iceberg import GROUP, _history, _scalars

RUN = "long-run"
"""The run the analyses read: 40 steps of 4 layers, two ranks."""

NAMES = ["embed.weight", "block.0.weight", "block.1.weight", "head.weight"]
"""Its layers in model order: block.0 vanishes, block.1 turns NaN at step 33, head explodes
from step 30."""

STEPS = 40
NUMEL = 64


def _long_frame(step: int) -> GradientFrame:
    """Frame ``step`` of :data:`RUN`: per-layer sums from a seeded generator, with the
    pathologies of :data:`NAMES` and both ranks' training scalars."""
    rng = np.random.default_rng(step)
    scale = rng.uniform(0.5, 2.0, len(NAMES)) * 1e-2
    scale[1] = 1e-12  # mean |g| below the vanishing threshold
    max_abs = scale * 4.0
    if step >= 30:
        max_abs[3] = 5e3 * (step - 29)  # above the exploding threshold
    nonfinite = np.zeros(len(NAMES), np.int64)
    if step >= 33:
        nonfinite[2] = 3
    numel = np.full(len(NAMES), NUMEL, np.int64)
    sums = GradientSums.from_columns(numel, scale * NUMEL, scale * scale * NUMEL, max_abs,
                                     nonfinite)
    merged = MergedShards.empty(len(NAMES)).merge_at(np.arange(len(NAMES)), MergedShards(sums))
    frame = compute_frame(RUN, step, merged, vanishing_threshold=1e-7,
                          exploding_threshold=1e3, ranks_seen=(0, 1), world_size=2,
                          wall_time=1000.0 + step)
    _scalars(frame, {0: 2.0 / (step + 1), 1: math.nan if step == 35 else 2.5 / (step + 1)})
    return frame


def _local(step: int, rank: int) -> LocalSummary:
    """Rank ``rank``'s flight-recorder entry for ``step`` (NaN trigger at step 33)."""
    return LocalSummary(
        run_id=RUN, step=step, rank=rank, world_size=2, wall_time=1000.0 + step,
        trigger="nonfinite", trigger_step=33, local_layer_indices=[2, 3],
        local_numel=[NUMEL, NUMEL], local_sum_abs=[0.5 * (rank + 1), 0.25],
        local_sum_sq=[0.125, 0.0625], local_max_abs=[0.1, 0.05],
        local_nonfinite=[3 if (step, rank) == (33, 1) else 0, 0])


def _alert(state: AlertState, step: int, created_at: float) -> Alert:
    return Alert(
        alert_id=f"x1-{state.value}", incident_id="x1", run_id=RUN, step=step, first_step=30,
        rule=AlertRule.EXPLODING, severity=AlertSeverity.CRITICAL, state=state,
        layers=["head.weight"], ranks=[0, 1], message=f"run {RUN}: head.weight exploding",
        values={"layers": {"head.weight": {"max_abs_grad": 5e3}}}, created_at=created_at,
        wall_time=1000.0 + step)


def _long_run() -> list[Batch]:
    """:data:`RUN` in two writes: the start and steps 0-19, then steps 20-39 with the
    flight-recorder entries, the exploding incident (fired, resolved) and the finish."""
    first, second = Batch(), Batch()
    first.runs_started.append(RunStarted(
        run_id=RUN, rank=0, world_size=2, layer_names=NAMES, numel=[NUMEL] * len(NAMES),
        vanishing_threshold=1e-7, exploding_threshold=1e3, host="trainer-0",
        start_time=1000.0, config={"lr": 0.01}))
    for step in range(STEPS):
        batch = first if step < 20 else second
        batch.frames[(RUN, step)] = (_long_frame(step), "MinorIssues")
    first.run_states[RUN] = RunState("MinorIssues", 20, 20, 19, None)
    first.offsets[("t", 2)] = 21
    second.local_summaries.extend(_local(s, r) for s in (32, 33) for r in (0, 1))
    second.alerts.extend([_alert(AlertState.FIRING, 30, 2000.0),
                          _alert(AlertState.RESOLVED, 39, 2009.0)])
    second.runs_finished.extend(
        RunFinished(run_id=RUN, rank=r, world_size=2, last_step=STEPS - 1,
                    steps_recorded=STEPS, end_time=1100.0 + r) for r in (0, 1))
    second.run_states[RUN] = RunState("Critical", STEPS, STEPS, STEPS - 1, 33)
    second.offsets[("t", 2)] = 45
    return [first, second]


def _write_both(batches: list[Batch], db: Path, catalog: str, warehouse: str) -> None:
    """``batches`` into the DuckDB file ``db`` and into the Iceberg table set."""
    sink = DuckDBSink(db, write_behind=False)
    try:
        for batch in batches:
            sink.write(batch, GROUP)
    finally:
        sink.close()
    output = IcebergOutput(catalog, warehouse, GROUP, io_properties=s3_properties(os.environ))
    try:
        for batch in batches:
            output.write(batch)
    finally:
        output.close()


def _url(catalog: str, warehouse: str, namespace: str | None = None) -> str:
    tail = f"&namespace={namespace}" if namespace else ""
    return f"iceberg+{catalog}?warehouse={warehouse}{tail}"


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(DuckDB file, Iceberg store URL) holding the same writes: :data:`RUN` and the
    history of the Iceberg output's tests (a partial frame and its late rank's rewrite, a
    refused rank, a run without frames)."""
    root = tmp_path_factory.mktemp("stores")
    catalog, warehouse = f"sqlite:///{root}/catalog.db", (root / "warehouse").as_uri()
    _write_both([*_long_run(), *_history()], root / "store.duckdb", catalog, warehouse)
    return root / "store.duckdb", _url(catalog, warehouse)


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return build_app()


def _invoke(app: typer.Typer, *args: str) -> str:
    """``gradstream <args>``'s standard output; fails the test on a non-zero exit."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, (args, result.output)
    return result.stdout


COMMANDS: list[tuple[str, ...]] = [
    ("report", "--all", "--heatmap"),
    ("report", "--run", RUN, "--format", "json", "--heatmap", "--heatmap-style", "reference",
     "--to-step", "32"),
    ("report", "--run", "r", "--from-step", "1", "--to-step", "4", "--order", "name"),
    ("query", "SELECT * EXCLUDE (finalized_at) FROM frames ORDER BY run_id, step",
     "--format", "csv"),
    ("query", "SELECT run_id, step, name, value FROM step_scalars ORDER BY ALL",
     "--format", "json"),
    ("query", "SELECT * FROM layer_stats ORDER BY run_id, step, layer_index",
     "--format", "json"),
    ("query", "SELECT * FROM runs ORDER BY run_id"),
    ("analyze", "--kind", "flow", "--run", RUN, "--format", "json"),
    ("analyze", "--kind", "explosion", "--run", RUN),
    ("analyze", "--kind", "enhanced", "--run", RUN, "--format", "json"),
    ("alerts", "--json"),
    ("alerts", "--run", RUN, "--state", "firing"),
]
"""Read commands whose standard output must be the same on both stores (``frames.
finalized_at`` is each write's own clock)."""


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a)[:60])
def test_a_read_command_prints_what_it_prints_on_the_duckdb_store(
    app: typer.Typer, stores: tuple[Path, str], args: tuple[str, ...]
) -> None:
    db, url = stores
    duck = _invoke(app, *args, "--db", str(db))
    assert len(duck.strip().splitlines()) > 1  # not vacuous
    assert _invoke(app, *args, "--db", url) == duck


@pytest.mark.parametrize("fmt,style", [("csv", "gradstream"), ("json", "gradstream"),
                                       ("csv", "reference"), ("jsonl", "gradstream")])
def test_export_writes_the_same_bytes(
    app: typer.Typer, stores: tuple[Path, str], tmp_path: Path, fmt: str, style: str
) -> None:
    db, url = stores
    files = []
    for name, store in (("duck", str(db)), ("ice", url)):
        target = tmp_path / f"{name}.{fmt}"
        # the reference's style has no NaN count to show: the steps before the NaN
        steps = ("--to-step", "32") if style == "reference" else ()
        _invoke(app, "export", "--db", store, "--run", RUN, "--format", fmt,
                "--style", style, "--output", str(target), *steps)
        files.append(target.read_bytes())
    assert files[0] == files[1] and files[0].count(b"\n") >= 30


def test_the_environment_names_the_iceberg_store_and_plot_draws_it(
    app: typer.Typer, stores: tuple[Path, str], tmp_path: Path
) -> None:
    _, url = stores
    result = CliRunner().invoke(app, ["plot", "--run", RUN, "--out", str(tmp_path),
                                      "--max-frames", "5", "--width", "400"],
                                env={"GRADSTREAM_DB": url})
    assert result.exit_code == 0, result.output
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".html", ".png", ".png"]
    helped = CliRunner().invoke(app, ["report", "--help"], env={"COLUMNS": "200"})
    assert "iceberg+sqlite:////abs/catalog.db?warehouse=" in helped.stdout


def _arrow(table: pa.Table) -> list[dict[str, object]]:
    """Rows comparable across stores: NaN as a string."""
    return [{k: "NaN" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
            for r in table.to_pylist()]


def test_the_notebook_store_reads_the_iceberg_table_set(stores: tuple[Path, str]) -> None:
    db, url = stores
    duck, ice = Store(db), Store(url)
    assert ice.db == url and ice.via.startswith("Iceberg snapshot of namespace gradstream")
    assert _arrow(ice.runs(as_="arrow")) == _arrow(duck.runs(as_="arrow"))
    with ice:  # one reader, the table set loaded once
        run = ice.run("long")
        assert run.report().model_dump_json() == duck.run("long").report().model_dump_json()
        for method in ("layer_stats", "frames", "alerts", "rank_stats"):
            ours = getattr(run, method)(as_="arrow")
            theirs = getattr(duck.run("long"), method)(as_="arrow")
            drop = [c for c in ("finalized_at",) if c in ours.column_names]
            assert _arrow(ours.drop_columns(drop)) == _arrow(theirs.drop_columns(drop)), method
        assert run.scalars().equals(duck.run("long").scalars())
        assert run.analyze("explosion").model_dump_json() == duck.run("long").analyze(
            "explosion").model_dump_json()
        assert ice.sql("SELECT count(*) AS n FROM local_layer_stats WHERE run_id = $run",
                       {"run": RUN})["n"][0] == 8
    with open_reader(url) as reader, open_reader(db) as file:
        grid, expected = reader.grid(RUN), file.grid(RUN)
        assert np.array_equal(grid.max_norm, expected.max_norm, equal_nan=True)
        assert grid.row_labels == NAMES


def test_the_iceberg_reader_is_hardened_as_the_file_reader(stores: tuple[Path, str],
                                                           app: typer.Typer) -> None:
    db, url = stores
    with open_reader(url, timeout_s=0.5) as reader:
        assert isinstance(reader, IcebergReader) and isinstance(reader, FileReader)
        with pytest.raises(ReadRefusedError, match="outside the store"):
            reader.sql("SELECT * FROM read_csv('/etc/passwd')")
        with pytest.raises(ReadRefusedError):
            reader.sql(f"COPY runs TO '{db.parent / 'leak.csv'}'")
        with pytest.raises(ReadOnlyViolationError, match="read-only"):
            reader.sql("DELETE FROM layer_stats")
        with pytest.raises(ReadOnlyViolationError):
            reader.sql("CREATE TABLE copied AS SELECT * FROM runs")
        with pytest.raises(QueryError, match="locked"):
            reader.sql("SET enable_external_access = true")
        with pytest.raises(QueryError, match="one SQL statement"):
            reader.sql("SELECT 1; SELECT 2")
        started = time.monotonic()
        with pytest.raises(QueryTimeoutError, match=r"longer than 0\.5 s"):
            reader.sql("SELECT count(*) FROM range(100000000) a, range(100000000) b")
        assert time.monotonic() - started < 10
        assert reader.sql("SELECT count(*) AS n FROM layer_stats")["n"][0].as_py() == (
            STEPS * len(NAMES) + 25)  # nothing was deleted
    assert not (db.parent / "leak.csv").exists()
    result = CliRunner().invoke(app, ["query", "SELECT * FROM read_text('/etc/passwd')",
                                      "--db", url])
    assert result.exit_code == 1 and "refused" in result.output


def test_reads_need_no_writer_and_see_the_snapshot_they_opened(tmp_path: Path) -> None:
    """A reader opens while the writer holds its catalog open, sees the writes committed
    before it opened and not the one after; a new reader sees that one too."""
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", (tmp_path / "wh").as_uri()
    first, second, third = _history()
    output = IcebergOutput(catalog, warehouse, GROUP)
    try:
        output.write(first)
        output.write(second)
        with open_reader(_url(catalog, warehouse)) as before:
            output.write(third)
            with open_reader(_url(catalog, warehouse)) as after:
                count = "SELECT count(*) AS n FROM layer_stats WHERE step = 4"
                assert before.sql(count)["n"][0].as_py() == 2  # the partial frame
                assert after.sql(count)["n"][0].as_py() == 5  # the late rank's rewrite
                assert not before.sql("SELECT * FROM run_ranks").num_rows
                assert after.sql("SELECT * FROM run_ranks").num_rows == 2
    finally:
        output.close()


def test_a_store_that_cannot_be_read_says_what_to_do(
    stores: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = stores
    catalog = url.removeprefix("iceberg+").split("?")[0]
    missing = f"iceberg+sqlite:///{tmp_path}/nope.db"
    with pytest.raises(StoreError, match=r"no Iceberg catalog at .*four slashes"):
        open_reader(missing)
    assert not (tmp_path / "nope.db").exists()  # nothing created by a read
    with pytest.raises(StoreError, match=r"no namespace 'lab'.*'gradstream'"):
        open_reader(f"iceberg+{catalog}?namespace=lab")
    with pytest.raises(StoreError, match="in-memory SQLite catalog"):
        open_reader("iceberg+sqlite://")
    with pytest.raises(StoreError, match=r"store URL kind 'delta' .* iceberg\+"):
        open_reader("delta+s3://bucket/table")
    with pytest.raises(StoreError, match=r"not a gradstream table set .*layer_stats"):
        _partial_namespace(catalog, tmp_path)
        open_reader(f"iceberg+{catalog}?namespace=partial")
    result = CliRunner().invoke(build_app(), ["report", "--db", missing])
    assert result.exit_code == 1 and "no Iceberg catalog" in result.output
    monkeypatch.setitem(sys.modules, "pyiceberg.catalog.sql", None)  # as if not installed
    with pytest.raises(StoreError, match=r"pip install 'gradstream\[iceberg\]'"):
        open_reader(url)


def _partial_namespace(catalog: str, tmp_path: Path) -> None:
    """Namespace ``partial`` of ``catalog`` holding only a ``runs`` table."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.schema import Schema
    from pyiceberg.types import NestedField, StringType

    other = SqlCatalog("gradstream", uri=catalog, warehouse=(tmp_path / "p").as_uri())
    other.create_namespace_if_not_exists("partial")
    other.create_table_if_not_exists(("partial", "runs"), schema=Schema(
        NestedField(1, "run_id", StringType(), required=True)))
    other.engine.dispose()


def test_the_url_keeps_catalog_parameters_and_hides_passwords() -> None:
    location = IcebergLocation.parse(
        "iceberg+postgresql+psycopg2://u:secret@db/lake?sslmode=require&warehouse="
        "s3://bucket/h&namespace=team.a")
    assert location == IcebergLocation(
        "postgresql+psycopg2://u:secret@db/lake?sslmode=require", "s3://bucket/h", "team.a")
    assert "secret" not in location.url() and ":***@" in location.url()
    assert IcebergLocation.parse("iceberg+sqlite:////a/c.db").namespace == "gradstream"


def test_the_shared_catalog_contract_is_the_writers() -> None:
    """The reader's catalog name, namespace, S3 variables and commit order
    (schemas.iceberg_catalog) are the Iceberg output's (its catalog name and S3
    variables are imported from there)."""
    from consumer.outputs import iceberg as output
    from consumer.settings import DEFAULT_ICEBERG_NAMESPACE
    from schemas import iceberg_catalog as contract

    assert contract.CATALOG_NAME == output.CATALOG_NAME
    assert contract.DEFAULT_NAMESPACE == DEFAULT_ICEBERG_NAMESPACE
    assert contract.s3_properties is output.s3_properties
    assert contract.COMMITTED_LAST == output.COMMIT_LAST


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on a free loopback port (stopped after the test)."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def test_a_table_set_on_s3_reads_as_the_duckdb_store(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, app: typer.Typer
) -> None:
    import boto3

    environment = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "gradstream",
                   "AWS_SECRET_ACCESS_KEY": "gradstream-secret", "AWS_REGION": "us-east-1"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                 aws_access_key_id="gradstream",
                 aws_secret_access_key="gradstream-secret").create_bucket(Bucket="lake")
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", "s3://lake/history"
    _write_both(_long_run(), tmp_path / "store.duckdb", catalog, warehouse)
    url = _url(catalog, warehouse)
    for args in (("report", "--format", "json"), ("analyze", "--kind", "flow")):
        duck = _invoke(app, *args, "--db", str(tmp_path / "store.duckdb"))
        assert _invoke(app, *args, "--db", url) == duck
    for name, store in (("duck", str(tmp_path / "store.duckdb")), ("ice", url)):
        _invoke(app, "export", "--db", store, "--output", str(tmp_path / f"{name}.csv"))
    assert (tmp_path / "ice.csv").read_bytes() == (tmp_path / "duck.csv").read_bytes()
    report = json.loads(_invoke(app, "report", "--format", "json", "--db", url))
    assert report["overall_health"] == "Critical" and report["total_steps"] == STEPS
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nobody
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot read the Iceberg table .*AWS_ENDPOINT_URL"):
        Store(url)
    assert time.monotonic() - started < 30
