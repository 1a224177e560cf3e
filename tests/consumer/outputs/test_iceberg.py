"""The Apache Iceberg output (consumer.outputs.iceberg): the DuckDB store's tables and rows,
written to a real pyiceberg SQL catalog (SQLite) and warehouse (local files, or S3 served
by moto on loopback), read back by pyiceberg alone, with the Kafka offsets in the snapshot
properties of each write's last commit."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.table.snapshots import Operation, ancestors_of

from consumer.checkpoint import Checkpoint
from consumer.frames import GradientFrame, LocalRows, MergedShards, compute_frame
from consumer.merge import frame_scalars
from consumer.outputs.base import Batch, RunState
from consumer.outputs.duckdb import DuckDBSink
from consumer.outputs.iceberg import (
    IcebergOutput,
    NewObjectFile,
    WriterFileIO,
    offset_property,
    s3_properties,
)
from consumer.outputs.registry import open_output
from consumer.runbook import RunBook
from consumer.settings import ConsumerSettings
from schemas.alert import Alert, AlertRule, AlertSeverity, AlertState
from schemas.grid_rollup import ROLLUP_TABLE
from schemas.scalars import RankScalars
from schemas.stats import GradientSums
from schemas.stats.exponent_histogram import EXP_HIST_BINS
from schemas.wire import RunFinished, RunStarted
from tests.consumer.outputs.test_duckdb_local import _local
from tests.consumer.outputs.test_duckdb_replay import LAYERS, _frame, _started

GROUP = "g.workers"
"""A consumer group with a dot, as the offset keys must keep it apart from the topic."""


def _scalars(frame: GradientFrame, losses: dict[int, float], rewrite: bool = False) -> None:
    """Give ``frame`` the training scalars of ``losses`` (rank -> loss, NaN allowed)."""
    frame.rewrite = rewrite
    rows = [RankScalars.of_rank(r, {"loss": v, "compute_time_s": 0.1 * (r + 1)})
            for r, v in losses.items()]
    frame.scalars, frame.rank_scalars = frame_scalars(
        [(r, {"lr": 0.01, "loss_scale": 512.0}) for r in losses], rows)


def _history() -> list[Batch]:
    """Three batches touching every table: run starts, full frames with histograms, weight
    norms, local rows and scalars, a partial frame, a late rank's rewrite of it,
    flight-recorder rows, alerts, a refused rank, finished ranks."""
    first = Batch()
    first.runs_started.append(_started())
    for step in range(4):
        frame = _frame(step, np.arange(LAYERS), 1.0 + step, (0, 1))
        _scalars(frame, {0: 2.0 + step, 1: math.nan if step == 3 else 3.0})
        first.frames[("r", step)] = (frame, "Healthy")
    hist = np.zeros((LAYERS, EXP_HIST_BINS), np.int64)
    hist[:, 3], hist[:, 7] = 60, 40
    first.frames[("r", 0)][0].exp_hist = hist
    first.frames[("r", 0)][0].weight_sum_sq = np.linspace(1.0, 2.0, LAYERS)
    first.frames[("r", 1)][0].local = LocalRows(
        rank=np.array([0, 1], np.int32), layer_index=np.array([2, 2], np.int32),
        numel=np.array([50, 50], np.int64), sum_abs=np.array([0.5, 0.75]),
        sum_sq=np.array([0.25, 0.5]), max_abs=np.array([0.1, 0.2]),
        nonfinite=np.array([0, 1], np.int64))
    first.run_states["r"] = RunState("Healthy", 4, 0, 3, None)
    first.offsets[("t", 0)] = 8

    second = Batch()
    second.runs_started.append(RunStarted(
        run_id="q", rank=0, world_size=3, layer_names=["a", "b"], numel=[4, 6],
        vanishing_threshold=1e-7, exploding_threshold=1e3, host="h2", start_time=5.0,
        config={"lr": 0.1}, ignore_layers=["b"]))
    partial = _frame(4, np.array([0, 2]), 7.0, (0,))
    partial.refused_ranks = {1: "conflicting_run"}  # (the verdict a late rank keeps)
    partial.layout_violations = np.array([[2, 0, 0, 40, 100], [2, 1, 0, 40, 100]], np.int64)
    _scalars(partial, {0: 5.0})
    second.frames[("r", 4)] = (partial, "MinorIssues")
    second.run_states["r"] = RunState("MinorIssues", 5, 1, 4, None)
    second.local_summaries.extend(_local(s, 1, [0, 1], 2.0, 4) for s in (3, 4))
    second.refusals.append(("q", 2, "conflicting_run"))
    second.alerts.append(Alert(
        alert_id="i1-firing", incident_id="i1", run_id="r", step=4, first_step=4,
        rule=AlertRule.MISSING_RANKS, severity=AlertSeverity.WARNING,
        state=AlertState.FIRING, layers=["l0"], ranks=[1], message="rank 1 missing",
        values={"missing": [1]}, created_at=10.0, wall_time=4.0))
    second.offsets[("t", 0)] = 11
    second.offsets[("t", 1)] = 3

    third = Batch()
    late = _frame(4, np.arange(LAYERS), 9.0, (0, 1))
    _scalars(late, {1: 7.0}, rewrite=True)  # the late rank's frame carries its own rows
    third.frames[("r", 4)] = (late, "Healthy")
    third.runs_finished.extend(
        RunFinished(run_id="r", rank=r, world_size=2, last_step=4, steps_recorded=5,
                    end_time=20.0 + r) for r in (0, 1))
    third.run_states["r"] = RunState("Healthy", 5, 0, 4, None)
    third.alerts.append(Alert(
        alert_id="i1-resolved", incident_id="i1", run_id="r", step=4, first_step=4,
        rule=AlertRule.MISSING_RANKS, severity=AlertSeverity.WARNING,
        state=AlertState.RESOLVED, layers=["l0"], ranks=[1], message="rank 1 back",
        created_at=11.0, wall_time=4.0))
    third.offsets[("t", 0)] = 15
    return [first, second, third]


def _value(v: Any) -> Any:
    """A cell comparable across readers: NaN as a string, lists as tuples."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, list):
        return tuple(_value(x) for x in v)
    return v


def _rows(tbl: pa.Table, drop: tuple[str, ...] = ()) -> list[tuple[Any, ...]]:
    """The rows of ``tbl`` without the columns ``drop``, sorted."""
    columns = [c for c in tbl.column_names if c not in drop]
    return sorted((tuple(_value(r[c]) for c in columns) for r in tbl.select(columns).to_pylist()),
                  key=repr)


def _duckdb_tables(batches: list[Batch], path: Path,
                   ignore_layers: tuple[str, ...] = ()) -> dict[str, pa.Table]:
    """Every table of a DuckDB store that the DuckDB output wrote ``batches`` into."""
    sink = DuckDBSink(path, write_behind=False)
    sink.ignore_layers = ignore_layers
    for batch in batches:
        sink.write(batch, GROUP)
    names = [n for (n,) in sink.con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
             if n != ROLLUP_TABLE]  # derived from layer_stats; the Iceberg output has none
    tables = {n: sink.con.sql(f"SELECT * FROM {n}").to_arrow_table() for n in names}
    sink.close()
    return tables


def _reader(catalog: str, warehouse: str, **properties: str) -> SqlCatalog:
    """A pyiceberg catalog of its own on the same database, as another engine opens it
    (the SQL catalog's name, ``gradstream``, is part of its key)."""
    return SqlCatalog("gradstream", uri=catalog, warehouse=warehouse, **properties)


def _iceberg_tables(reader: SqlCatalog) -> dict[str, pa.Table]:
    """Every table of the ``gradstream`` namespace, read with pyiceberg alone."""
    return {ident[-1]: reader.load_table(ident).scan().to_arrow()
            for ident in reader.list_tables("gradstream")}


def _assert_same_store(iceberg: dict[str, pa.Table], store: dict[str, pa.Table],
                       written_after: float) -> None:
    """The two table sets hold the same columns and rows (``frames.finalized_at``, the
    write's own clock, only checked to be recent)."""
    assert set(iceberg) == set(store)
    for name, rows in store.items():
        assert iceberg[name].column_names == rows.column_names, name
        assert _rows(iceberg[name], ("finalized_at",)) == _rows(rows, ("finalized_at",)), name
    assert min(iceberg["frames"]["finalized_at"].to_pylist()) >= written_after


@pytest.fixture
def local_catalog(tmp_path: Path) -> tuple[str, str]:
    """(catalog URL, warehouse URL) of a SQLite catalog and a file warehouse in tmp_path."""
    return f"sqlite:///{tmp_path}/iceberg/catalog.db", (tmp_path / "warehouse").as_uri()


def test_pyiceberg_alone_reads_the_rows_the_duckdb_store_holds(
    tmp_path: Path, local_catalog: tuple[str, str]
) -> None:
    catalog, warehouse = local_catalog
    started = time.time()
    output = IcebergOutput(catalog, warehouse, GROUP, ignore_layers=["*.bias"])
    for batch in _history():
        output.write(batch)
        assert output.settle(wait=False)
    output.close()
    store = _duckdb_tables(_history(), tmp_path / "s.duckdb", ("*.bias",))
    reader = _reader(catalog, warehouse)
    iceberg = _iceberg_tables(reader)
    # not vacuous: the late rank's rewrite, the replay and the recomputed step values
    assert len(store["layer_stats"]) == 5 * LAYERS
    assert _rows(store["step_scalars"].filter(pa.compute.equal(store["step_scalars"]["step"], 4))
                 .select(["name", "value"])) == [
        ("compute_time_s", 0.2), ("loss", 6.0), ("loss_scale", 512.0), ("lr", 0.01)]
    _assert_same_store(iceberg, store, started)
    # what other engines see of the layout: run_id partitions, the primary keys
    layer_stats = reader.load_table(("gradstream", "layer_stats"))
    assert [f.name for f in layer_stats.spec().fields] == ["run_id"]
    frames = reader.load_table(("gradstream", "frames")).schema()
    assert sorted(frames.identifier_field_names()) == ["run_id", "step"]
    assert not reader.load_table(("gradstream", "kafka_offsets")).spec().fields


def test_a_replayed_batch_leaves_the_rows_of_one_write(
    tmp_path: Path, local_catalog: tuple[str, str]
) -> None:
    """A crash between a write's table commits and its offsets commit makes the restarted
    worker write the batch again (its frames not marked as rewrites: the worker did not
    know they were stored): every table ends as after one write, ``rank_scalars``
    included."""
    catalog, warehouse = local_catalog
    output = IcebergOutput(catalog, warehouse, GROUP)
    for batch in [*_history(), *_history()[1:], _history()[2]]:
        output.write(batch)
    output.close()
    store = _duckdb_tables(_history(), tmp_path / "s.duckdb")
    _assert_same_store(_iceberg_tables(_reader(catalog, warehouse)), store, 0.0)


def test_offsets_come_back_from_the_snapshot_history(local_catalog: tuple[str, str]) -> None:
    catalog, warehouse = local_catalog
    output = IcebergOutput(catalog, warehouse, GROUP)
    assert output.stored_offsets(["t"]) == {}
    for batch in _history():
        output.write(batch)
    output.close()

    reopened = IcebergOutput(catalog, warehouse, GROUP)
    try:
        # t/1 was last written two commits before the newest: found in an ancestor
        assert reopened.stored_offsets(["t", "other"]) == {("t", 0): 15, ("t", 1): 3}
        assert IcebergOutput(catalog, warehouse, "g").stored_offsets(["t"]) == {}
        book = RunBook(max_frames=0)
        state = reopened.restore(book)
        assert set(book.runs) == {"r", "q"} and book.finished == {"r": {0, 1}}
        steps, complete, _ = state.frames["r"]
        assert steps.tolist() == [0, 1, 2, 3, 4] and complete.all()
        assert state.refusals == [("q", 2, "conflicting_run")]
        assert state.incidents == []  # the missing-ranks incident resolved
        sums = reopened.load_sums(book.runs["r"], 4)
        assert sums is not None and sums.gradient.numel.tolist() == [100] * LAYERS
        assert reopened.load_sums(book.runs["r"], 99) is None
        assert reopened.load_frame_verdict("r", 3) == ([], 0)
        assert reopened.load_frame_verdict("r", 99) == ([], 0)
    finally:
        reopened.close()

    table = _reader(catalog, warehouse).load_table(("gradstream", "kafka_offsets"))
    newest = table.current_snapshot()
    assert newest is not None
    assert newest.summary[offset_property(GROUP, "t", 0)] == "15"
    assert offset_property(GROUP, "t", 0) == "gradstream.offsets.g%2Eworkers.t.0"
    assert _rows(table.scan().to_arrow()) == [(GROUP, "t", 0, 15), (GROUP, "t", 1, 3)]
    history = [s.summary.additional_properties.get(offset_property(GROUP, "t", 0))
               for s in ancestors_of(newest, table.metadata)]
    assert list(dict.fromkeys(v for v in history if v is not None)) == ["15", "11", "8"]


def test_a_late_rank_rewrite_replaces_the_partial_frame(local_catalog: tuple[str, str]) -> None:
    catalog, warehouse = local_catalog
    output = IcebergOutput(catalog, warehouse, GROUP)
    first, second, third = _history()
    output.write(first)
    output.write(second)
    layer_stats = _reader(catalog, warehouse).load_table(("gradstream", "layer_stats"))
    partial = layer_stats.scan(row_filter="step = 4").to_arrow()
    assert sorted(partial["layer_index"].to_pylist()) == [0, 2]
    assert output.load_frame_verdict("r", 4) == ([1], 1)  # what a late rank merges into
    output.write(third)
    assert output.load_frame_verdict("r", 4) == ([], 0)
    output.close()

    reader = _reader(catalog, warehouse)
    rows = reader.load_table(("gradstream", "layer_stats")).scan(row_filter="step = 4").to_arrow()
    assert sorted(rows["layer_index"].to_pylist()) == list(range(LAYERS))  # no duplicates
    assert set(rows["sum_abs"].to_pylist()) == {9.0}
    frame = reader.load_table(("gradstream", "frames")).scan(row_filter="step = 4").to_arrow()
    assert frame.select(["complete", "ranks_seen", "health"]).to_pylist() == [
        {"complete": True, "ranks_seen": [0, 1], "health": "Healthy"}]
    ranks = reader.load_table(("gradstream", "rank_scalars")).scan(
        row_filter="step = 4 and name = 'loss'").to_arrow()
    assert _rows(ranks.select(["rank", "value"])) == [(0, 5.0), (1, 7.0)]


def test_a_failed_write_commits_nothing_and_refuses_the_next(
    local_catalog: tuple[str, str]
) -> None:
    catalog, warehouse = local_catalog
    output = IcebergOutput(catalog, warehouse, GROUP)
    first, second, _ = _history()
    output.write(first)
    frame, _health = second.frames[("r", 4)]
    second.frames[("r", 4)] = (frame, None)  # type: ignore[assignment]  # health NOT NULL
    with pytest.raises(duckdb.Error):
        output.write(second)
    with pytest.raises(duckdb.Error):
        output.settle(wait=True)
    with pytest.raises(duckdb.Error):
        output.write(_history()[2])
    output.close()
    reopened = IcebergOutput(catalog, warehouse, GROUP)
    try:
        assert reopened.stored_offsets(["t"]) == {("t", 0): 8}
        assert reopened.tables["runs"].scan().to_arrow()["run_id"].to_pylist() == ["r"]
    finally:
        reopened.close()


def test_the_settings_open_the_iceberg_output(local_catalog: tuple[str, str]) -> None:
    catalog, warehouse = local_catalog
    settings = ConsumerSettings(iceberg_catalog=catalog, iceberg_warehouse=warehouse,
                                iceberg_namespace="lab", group_id=GROUP)
    assert settings.output == "iceberg"
    output = open_output(settings.output, settings)
    try:
        assert isinstance(output, IcebergOutput) and output.name == "iceberg"
        assert output.describe().endswith("namespace lab")
        assert ("lab", "runs") in _reader(catalog, warehouse).list_tables("lab")
        # a worker's output commits behind, no more often than the setting asks
        assert output.min_write_interval_s == settings.iceberg_commit_interval_s == 5.0
        assert output.settle(wait=False)
    finally:
        output.close()
    with pytest.raises(ValueError, match="GRADSTREAM_ICEBERG_WAREHOUSE"):
        open_output("iceberg", ConsumerSettings(iceberg_catalog=catalog))
    with pytest.raises(ValueError, match="file:///path or s3://"):
        ConsumerSettings(iceberg_catalog=catalog, iceberg_warehouse="/no/scheme")


def _run_batch(run_id: str, steps: range, offsets: dict[tuple[str, int], int],
               start: bool = False, scale: float = 1.0) -> Batch:
    """Complete 2-rank frames of ``run_id`` at ``steps`` (``LAYERS`` layers), its run
    state and ``offsets``; its RunStarted with ``start``."""
    batch = Batch()
    if start:
        batch.runs_started.append(_started().model_copy(update={"run_id": run_id}))
    for step in steps:
        merged = MergedShards(GradientSums.from_columns(
            np.full(LAYERS, 100, np.int64), np.full(LAYERS, scale + step),
            np.full(LAYERS, scale), np.full(LAYERS, scale / 10), np.zeros(LAYERS, np.int64)))
        frame = compute_frame(run_id, step, merged, vanishing_threshold=1e-7,
                              exploding_threshold=1e3, ranks_seen=(0, 1), world_size=2,
                              wall_time=float(step))
        _scalars(frame, {0: 1.0, 1: 2.0})
        batch.frames[(run_id, step)] = (frame, "Healthy")
    batch.run_states[run_id] = RunState("Healthy", steps.stop, 0, steps.stop - 1, None)
    batch.offsets.update(offsets)
    return batch


def _operations(reader: SqlCatalog, table: str) -> list[str]:
    """The operation of every snapshot of ``table``, oldest first."""
    metadata = reader.load_table(("gradstream", table)).metadata
    return [s.summary.operation.value for s in metadata.snapshots if s.summary is not None]


def _keys(reader: SqlCatalog, table: str = "layer_stats",
          columns: tuple[str, ...] = ("run_id", "step", "layer_index")) -> list[tuple[Any, ...]]:
    """``columns`` of every row of ``table``, sorted (duplicates kept)."""
    rows = reader.load_table(("gradstream", table)).scan(selected_fields=columns).to_arrow()
    return sorted(zip(*(rows[c].to_pylist() for c in columns), strict=True))


def test_new_frames_are_appended_and_a_restarted_output_replaces_a_replay(
    tmp_path: Path, local_catalog: tuple[str, str]
) -> None:
    """New frames (of two runs in one batch) are pure appends: no delete, nothing read
    back. A restarted output knows what is stored from the tables' metadata, so the
    frames a crash makes it write again replace their rows; the step after them is
    appended again."""
    catalog, warehouse = local_catalog
    first = _run_batch("a", range(0, 3), {("t", 0): 6}, start=True)
    first.runs_started.append(_started().model_copy(update={"run_id": "b"}))
    first.frames.update(_run_batch("b", range(0, 2), {}).frames)
    first.run_states["b"] = RunState("Healthy", 2, 0, 1, None)
    output = IcebergOutput(catalog, warehouse, GROUP)
    output.write(first)
    output.write(_run_batch("a", range(3, 5), {("t", 0): 10}))
    output.close()
    reader = _reader(catalog, warehouse)
    for table in ("layer_stats", "frames", "step_scalars", "rank_scalars", "layers"):
        assert set(_operations(reader, table)) == {Operation.APPEND.value}, table
    assert len(_operations(reader, "layer_stats")) == 2
    layer_stats = reader.load_table(("gradstream", "layer_stats"))
    partitions = layer_stats.inspect.files()["partition"].to_pylist()
    assert sorted(p["run_id"] for p in partitions) == ["a", "a", "b"]  # a file per run

    # the crash lost the offsets of the last write: the restarted worker replays it
    restarted = IcebergOutput(catalog, warehouse, GROUP)
    try:
        restarted.write(_run_batch("a", range(3, 5), {("t", 0): 10}, scale=2.0))
        restarted.write(_run_batch("a", range(5, 6), {("t", 0): 12}))
    finally:
        restarted.close()
    expected = sorted([("a", s, i) for s in range(6) for i in range(LAYERS)]
                      + [("b", s, i) for s in range(2) for i in range(LAYERS)])
    assert _keys(reader) == expected
    assert _keys(reader, "frames", ("run_id", "step")) == sorted(
        [("a", s) for s in range(6)] + [("b", s) for s in range(2)])
    replayed = reader.load_table(("gradstream", "layer_stats")).scan(
        row_filter="run_id = 'a' and step = 4").to_arrow()
    assert set(replayed["sum_abs"].to_pylist()) == {6.0}  # the replay's values
    replay, *appends = _operations(reader, "layer_stats")[2:]
    assert replay in {Operation.DELETE.value, Operation.OVERWRITE.value}  # rows replaced
    assert appends == [Operation.APPEND.value] * 2  # the replay's rows, then step 5
    ranks = reader.load_table(("gradstream", "rank_scalars")).scan(
        row_filter="run_id = 'a' and step = 4 and name = 'loss'").to_arrow()
    assert sorted(ranks["rank"].to_pylist()) == [0, 1]


def test_a_write_behind_output_commits_in_order_and_stops_at_a_failed_commit(
    tmp_path: Path, local_catalog: tuple[str, str]
) -> None:
    """With ``write_behind`` (the worker's output) every batch is committed by the time
    the output settles, as a synchronous write would; a commit that fails on the writer
    thread is raised to the loop, and no later batch commits its offsets."""
    catalog, warehouse = local_catalog
    output = IcebergOutput(catalog, warehouse, GROUP, write_behind=True, commit_interval_s=0)
    for batch in _history():
        output.write(batch)
    assert output.settle(wait=True)
    _assert_same_store(_iceberg_tables(_reader(catalog, warehouse)),
                       _duckdb_tables(_history(), tmp_path / "s.duckdb"), 0.0)

    _reader(catalog, warehouse).drop_table(("gradstream", "layer_stats"))  # behind its back
    output.write(_run_batch("r", range(5, 7), {("t", 0): 20}))
    with pytest.raises(Exception, match="layer_stats"):
        output.settle(wait=True)
    with pytest.raises(Exception, match="layer_stats"):
        output.write(_run_batch("r", range(7, 8), {("t", 0): 22}))
    output.close()
    reopened = IcebergOutput(catalog, warehouse, GROUP)
    try:
        assert reopened.stored_offsets(["t"]) == {("t", 0): 15, ("t", 1): 3}
    finally:
        reopened.close()


def test_a_table_is_never_written_and_committed_at_once(
    local_catalog: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``write_behind`` a write's data files are written while the previous write
    commits, but never those of the table being committed: pyiceberg fills cached
    properties of a table's metadata as it uses them while a commit deep-copies that
    metadata (``bench/lakehouse.py`` failed with "dictionary changed size during
    iteration"). Both steps are slowed down here so that they would overlap."""
    catalog, warehouse = local_catalog
    spans: list[tuple[str, str, float, float]] = []
    guard = threading.Lock()
    files_step, commit_step = IcebergOutput._write_data_files, IcebergOutput._commit_locked

    def timed(kind: str, step: Any) -> Any:
        def run(self: IcebergOutput, name: str, *args: Any) -> Any:
            start = time.perf_counter()
            time.sleep(0.01)
            try:
                return step(self, name, *args)
            finally:
                with guard:
                    spans.append((name, kind, start, time.perf_counter()))
        return run

    monkeypatch.setattr(IcebergOutput, "_write_data_files", timed("files", files_step))
    monkeypatch.setattr(IcebergOutput, "_commit_locked", timed("commit", commit_step))
    output = IcebergOutput(catalog, warehouse, GROUP, write_behind=True, commit_interval_s=0)
    try:
        for i in range(8):
            output.write(_run_batch("r", range(3 * i, 3 * i + 3), {("t", 0): 3 * i + 3},
                                    start=i == 0))
        assert output.settle(wait=True)
    finally:
        output.close()
    assert {kind for _, kind, _, _ in spans} == {"files", "commit"}
    for name in {n for n, _, _, _ in spans}:
        files = [(a, b) for n, k, a, b in spans if n == name and k == "files"]
        commits = [(a, b) for n, k, a, b in spans if n == name and k == "commit"]
        assert not [(f, c) for f in files for c in commits if f[0] < c[1] and c[0] < f[1]], name
    assert _keys(_reader(catalog, warehouse), columns=("run_id", "step")) == sorted(
        ("r", step) for step in range(24) for _ in range(LAYERS))


def test_two_writers_commit_to_the_same_tables_at_once(
    local_catalog: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Two outputs (two consumer groups, each its own runs and partition) write at the
    same moments to the same tables: the commits that find a table changed by the other
    are tried again, and every row is stored once, with both groups' offsets."""
    catalog, warehouse = local_catalog
    caplog.set_level(logging.INFO)
    IcebergOutput(catalog, warehouse, GROUP).close()  # the tables exist before the race
    writes = 6
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def write(group: str, run_id: str, partition: int) -> None:
        output = IcebergOutput(catalog, warehouse, group, write_behind=True,
                               commit_interval_s=0)
        try:
            for i in range(writes):
                batch = _run_batch(run_id, range(2 * i, 2 * i + 2), {("t", partition): i + 1},
                                   start=i == 0)
                start.wait(30)  # both writers' batches go to the tables together
                output.write(batch)
            output.settle(wait=True)
        except BaseException as exc:
            errors.append(exc)
            start.abort()
        finally:
            output.close()

    threads = [threading.Thread(target=write, args=(f"g{i}", f"run{i}", i)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
    retries = [r for r in caplog.records if "concurrent update" in r.getMessage()
               or "conflicted" in r.getMessage()]
    assert retries  # not vacuous: commits did meet the other writer's
    reader = _reader(catalog, warehouse)
    assert _keys(reader) == sorted((f"run{w}", s, i) for w in range(2)
                                   for s in range(2 * writes) for i in range(LAYERS))
    runs = reader.load_table(("gradstream", "runs")).scan().to_arrow()
    assert sorted(zip(runs["run_id"].to_pylist(), runs["frames"].to_pylist(),
                      strict=True)) == [("run0", 2 * writes), ("run1", 2 * writes)]
    offsets = reader.load_table(("gradstream", "kafka_offsets")).scan().to_arrow()
    assert sorted(offsets.select(["consumer_group", "kafka_partition", "next_offset"])
                  .to_pylist(), key=repr) == [
        {"consumer_group": "g0", "kafka_partition": 0, "next_offset": writes},
        {"consumer_group": "g1", "kafka_partition": 1, "next_offset": writes}]
    for i in range(2):
        output = IcebergOutput(catalog, warehouse, f"g{i}")
        try:
            assert output.stored_offsets(["t"]) == {("t", i): writes}
        finally:
            output.close()


def test_the_loop_writes_no_more_often_than_the_output_asks(
    local_catalog: tuple[str, str]
) -> None:
    """The checkpoint waits for the output's ``min_write_interval_s`` when it is longer
    than its own flush interval; ``max_batch_rows`` still makes a write due at once."""
    catalog, warehouse = local_catalog
    output = IcebergOutput(catalog, warehouse, GROUP, commit_interval_s=60.0)
    try:
        checkpoint = Checkpoint(flush_interval_s=0.01, max_batch_rows=1000)
        checkpoint.started(0)
        time.sleep(0.05)
        assert checkpoint.due(None, 10)  # the loop's own interval has passed
        assert not checkpoint.due(output, 10)
        assert checkpoint.due(output, 1000)
        checkpoint._last_commit -= 60.0  # a minute later
        assert checkpoint.due(output, 10)
    finally:
        output.close()


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


def test_an_s3_warehouse_holds_the_tables(
    tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3

    environment = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "gradstream",
                   "AWS_SECRET_ACCESS_KEY": "gradstream-secret", "AWS_REGION": "us-east-1"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                      aws_access_key_id="gradstream", aws_secret_access_key="gradstream-secret")
    s3.create_bucket(Bucket="lake")
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", "s3://lake/history"
    settings = ConsumerSettings(iceberg_catalog=catalog, iceberg_warehouse=warehouse,
                                group_id=GROUP)
    output = open_output(settings.output, settings)
    assert isinstance(output, IcebergOutput)
    io = output.tables["layer_stats"].io
    assert isinstance(io, WriterFileIO)  # a small file in one PutObject request
    _, (options,) = io.fs_by_scheme("s3", "lake").__reduce__()
    assert options["allow_delayed_open"] and options["endpoint_override"] == s3_endpoint
    assert isinstance(io.new_output("s3://lake/history/new.avro"), NewObjectFile)  # no HEAD
    for batch in _history():
        output.write(batch)
    output.close()

    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="lake")
            for o in page.get("Contents", [])]
    assert any(k.startswith("history/gradstream/layer_stats/data/run_id=r/")
               and k.endswith(".parquet") for k in keys)
    store = _duckdb_tables(_history(), tmp_path / "s.duckdb")
    reader = _reader(catalog, warehouse, **s3_properties(environment))
    _assert_same_store(_iceberg_tables(reader), store, 0.0)
    reopened = open_output(settings.output, settings)
    try:
        assert reopened.stored_offsets(["t"]) == {("t", 0): 15, ("t", 1): 3}
    finally:
        reopened.close()


WORKER_LAYERS = {"embed": 24, "hidden": 40, "head": 8}
"""Layers (name -> elements per rank) of the runs the workers consume."""


def _produce(bootstrap: str, topic: str, run_id: str, steps: int, nan_step: int) -> None:
    """Two ranks of ``run_id`` send ``steps`` steps of disjoint shards with their loss and
    learning rate (rank 1's gradient NaN at ``nan_step``: alerts), then finish."""
    from producer import GradientProducer

    producers = [GradientProducer(run_id, rank=r, world_size=2, bootstrap_servers=bootstrap,
                                  topic=topic) for r in range(2)]
    for p in producers:
        p.start_run({name: n * 2 for name, n in WORKER_LAYERS.items()})
    for step in range(steps):
        for rank, p in enumerate(producers):
            rng = np.random.default_rng(step * 10 + rank)
            grads = {name: rng.standard_normal(n).astype(np.float32) * 0.01
                     for name, n in WORKER_LAYERS.items()}
            if (step, rank) == (nan_step, 1):
                grads["hidden"][3] = np.nan
            p.record_step(step, grads, scalars={"loss": 1.0 / (step + 1), "lr": 0.1})
    for p in producers:
        p.finish_run()
        p.close()


def _run_workers(settings: list[ConsumerSettings], run_id: str, nan_step: int) -> list[int]:
    """Start a worker per settings, send ``run_id``, wait until every worker stored it,
    stop them; the records each read."""
    import threading

    from consumer.worker import Worker

    workers = [Worker(s) for s in settings]
    threads = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    try:
        assert all(w.wait_ready(60) for w in workers), [w.error for w in workers]
        _produce(settings[0].bootstrap_servers, settings[0].topic, run_id, 12, nan_step)
        for worker in workers:
            assert worker.wait_for_runs([run_id], 60), worker.error
    finally:
        for worker in workers:
            worker.stop()
        for thread in threads:
            thread.join(30)
    assert [w.error for w in workers] == [None] * len(workers)
    return [w.counters.messages for w in workers]


def test_a_worker_over_kafka_stores_what_the_duckdb_worker_stores(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, local_catalog: tuple[str, str]
) -> None:
    """A real worker with the Iceberg output beside one with the DuckDB output, on the same
    summaries topic; both stopped and restarted between two runs: the restarted Iceberg
    worker resumes from the offsets in the snapshot properties (it reads what the DuckDB
    worker reads, none of the first run again) and knows the first run (restore), and the
    tables hold the same rows."""
    catalog, warehouse = local_catalog
    common = {"bootstrap_servers": kafka_bootstrap, "topic": f"sum-{unique_name}",
              "dlq_topic": f"dlq-{unique_name}", "alerts_topic": f"alerts-{unique_name}",
              "shard_timeout_s": 60.0}
    settings = [
        ConsumerSettings(**common, group_id=f"ice-{unique_name}", iceberg_catalog=catalog,
                         iceberg_warehouse=warehouse),
        ConsumerSettings(**common, group_id=f"duck-{unique_name}",
                         db=str(tmp_path / "store.duckdb")),
    ]
    first = _run_workers(settings, f"a-{unique_name}", nan_step=4)
    assert first[0] == first[1] > 0
    second = _run_workers(settings, f"b-{unique_name}", nan_step=7)
    assert second[0] == second[1] > 0  # the Iceberg worker read none of run a again

    con = duckdb.connect(settings[1].db, read_only=True)
    store = {n: con.sql(f"SELECT * FROM {n}").to_arrow_table() for (n,) in
             con.execute("SELECT table_name FROM duckdb_tables()").fetchall()
             if n != ROLLUP_TABLE}  # derived from layer_stats; the Iceberg output has none
    con.close()
    iceberg = _iceberg_tables(_reader(catalog, warehouse))
    assert len(store["frames"]) == 24 and len(store["alerts"]) > 0
    names = store["rank_scalars"]["name"].to_pylist()
    assert names.count("loss") == 48 and "step_time_s" in names  # each rank's, every step
    for name, rows in store.items():
        # the workers' own clocks, and the offsets of their own consumer groups
        drop = {"frames": ("finalized_at",), "alerts": ("created_at",),
                "kafka_offsets": ("consumer_group",)}.get(name, ())
        assert _rows(iceberg[name], drop) == _rows(rows, drop), name


def test_an_older_table_gains_the_columns_the_store_writes_now(
    tmp_path: Path, local_catalog: tuple[str, str]
) -> None:
    """A table set written by an earlier gradstream (here: ``frames`` without
    ``layout_violations``) is brought to the store's columns when the output opens it, by
    Iceberg's rules: the column is added, optional; the rows written before read it as
    null, the rows written after hold what the DuckDB store holds."""
    catalog, warehouse = local_catalog
    first, *rest = _history()
    output = IcebergOutput(catalog, warehouse, GROUP)
    output.write(first)
    output.close()
    with _reader(catalog, warehouse).load_table(("gradstream", "frames")).update_schema() as u:
        u.delete_column("layout_violations")
    reopened = IcebergOutput(catalog, warehouse, GROUP)
    for batch in rest:
        reopened.write(batch)
    reopened.close()
    table = _reader(catalog, warehouse).load_table(("gradstream", "frames"))
    assert not table.schema().find_field("layout_violations").required
    got = {(r["run_id"], r["step"]): r["layout_violations"]
           for r in table.scan().to_arrow().to_pylist()}
    stored = _duckdb_tables(_history(), tmp_path / "s.duckdb")["frames"].to_pylist()
    want = {(r["run_id"], r["step"]): r["layout_violations"] for r in stored}
    before = {("r", step) for step in range(4)} - {key for b in rest for key in b.frames}
    assert before and all(got[key] is None for key in before)
    after = {key for b in rest for key in b.frames}
    assert after and {k: got[k] for k in after} == {k: want[k] for k in after}
    assert any(want[k] is not None for k in after)  # not vacuous: values, not nulls


def test_a_column_type_iceberg_cannot_promote_is_refused(local_catalog: tuple[str, str]) -> None:
    """A table whose column has a type the store's cannot be promoted from stops the
    output at open, naming the table and the column."""
    from pyiceberg.schema import Schema
    from pyiceberg.types import NestedField, StringType

    catalog, warehouse = local_catalog
    IcebergOutput(catalog, warehouse, GROUP).close()
    reader = _reader(catalog, warehouse)
    reader.drop_table(("gradstream", "run_ranks"))
    reader.create_table(("gradstream", "run_ranks"), schema=Schema(
        NestedField(1, "run_id", StringType(), required=True),
        NestedField(2, "rank", StringType(), required=False)))
    with pytest.raises(ValueError, match=r"gradstream\.run_ranks column 'rank' is string"):
        IcebergOutput(catalog, warehouse, GROUP)
