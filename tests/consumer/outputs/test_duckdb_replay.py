"""layer_stats stays unique per (run, step, layer) without an index: the sink deletes a
batch's (run, step) rows before appending them, so a replayed or rewritten frame replaces
its rows; stores created with the old primary key keep working with the same writes."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest

from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from schemas.stats import GradientSums
from schemas.tables import SCHEMA_DDL
from schemas.wire import RunStarted

LAYERS = 5


def _started() -> RunStarted:
    return RunStarted(
        run_id="r", rank=0, world_size=2, layer_names=[f"l{i}" for i in range(LAYERS)],
        numel=[100] * LAYERS, vanishing_threshold=1e-7, exploding_threshold=1e3,
        host="h", start_time=0.0, config={},
    )


def _frame(step: int, layers: np.ndarray, scale: float, ranks: tuple[int, ...]) -> GradientFrame:
    n = len(layers)
    merged = MergedShards.empty(LAYERS).merge_at(layers, MergedShards(GradientSums.from_columns(
        np.full(n, 100, np.int64), np.full(n, scale), np.full(n, scale * scale),
        np.full(n, scale / 10), np.zeros(n, np.int64))))
    frame = compute_frame("r", step, merged, vanishing_threshold=1e-7,
                          exploding_threshold=1e3, ranks_seen=ranks, world_size=2,
                          wall_time=float(step))
    return frame


def _batch(steps: range, scale: float, offset: int, layers: np.ndarray | None = None,
           ranks: tuple[int, ...] = (0, 1), start: bool = False) -> Batch:
    batch = Batch()
    if start:
        batch.runs_started.append(_started())
    idx = np.arange(LAYERS) if layers is None else layers
    for step in steps:
        batch.frames[("r", step)] = (_frame(step, idx, scale, ranks), "Healthy")
    batch.offsets[("t", 0)] = offset
    return batch


def _counts(con: duckdb.DuckDBPyConnection) -> tuple[int, int, int, float]:
    """(layer rows, distinct (run, step, layer), frames, sum of sum_abs)."""
    return con.execute(
        "SELECT count(*), count(DISTINCT (run_id, step, layer_index)), "
        "(SELECT count(*) FROM frames), sum(sum_abs) FROM layer_stats"
    ).fetchone()


def _legacy_store(path: Path) -> None:
    """A store as created before the key was dropped: layer_stats with its primary key."""
    con = duckdb.connect(str(path))
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    con.execute("ALTER TABLE layer_stats ADD PRIMARY KEY (run_id, step, layer_index)")
    con.close()


def _has_key(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(con.execute(
        "SELECT count(*) FROM duckdb_constraints() WHERE table_name = 'layer_stats' "
        "AND constraint_type = 'PRIMARY KEY'").fetchone()[0])


@pytest.mark.parametrize("legacy", [False, True], ids=["new-store", "store-with-key"])
@pytest.mark.parametrize("write_behind", [False, True])
def test_replayed_batch_keeps_one_row_per_layer(
    tmp_path: Path, legacy: bool, write_behind: bool
) -> None:
    path = tmp_path / "s.duckdb"
    if legacy:
        _legacy_store(path)
    sink = DuckDBSink(path, write_behind=write_behind)
    assert _has_key(sink.con) is legacy  # new stores get no index on layer_stats
    sink.write(_batch(range(0, 10), 1.0, 20, start=True), "g")
    sink.write(_batch(range(10, 20), 1.0, 40), "g")
    assert _counts(sink.con) == (20 * LAYERS, 20 * LAYERS, 20, 20 * LAYERS * 1.0)
    # A crash before the offsets were committed to Kafka: the same batches come again,
    # overlapping what is stored, one of them with new values (a rewrite).
    sink.write(_batch(range(5, 15), 2.0, 30), "g")
    sink.write(_batch(range(10, 20), 1.0, 40), "g")
    rows, distinct, frames, total = _counts(sink.con)
    assert (rows, distinct, frames) == (20 * LAYERS, 20 * LAYERS, 20)
    assert total == pytest.approx(LAYERS * (15 * 1.0 + 5 * 2.0))  # steps 5..9 rewritten
    assert sink.load_offsets("g", "t") == {0: 40}
    sink.close()
    con = duckdb.connect(str(path), read_only=True)
    assert _counts(con)[:3] == (20 * LAYERS, 20 * LAYERS, 20)
    con.close()


def test_rewrite_with_fewer_layers_drops_the_old_rows(tmp_path: Path) -> None:
    """A partial frame rewritten with other layers (late rank) leaves only the new rows."""
    sink = DuckDBSink(tmp_path / "s.duckdb", write_behind=False)
    sink.write(_batch(range(3), 1.0, 3, start=True), "g")
    sink.write(_batch(range(1, 2), 3.0, 4, layers=np.array([0, 2]), ranks=(0,)), "g")
    got = sink.con.execute(
        "SELECT step, list(layer_index ORDER BY layer_index) FROM layer_stats "
        "GROUP BY step ORDER BY step").fetchall()
    assert got == [(0, list(range(LAYERS))), (1, [0, 2]), (2, list(range(LAYERS)))]
    sink.close()


def test_failed_write_behind_is_never_settled_and_stores_no_offsets(tmp_path: Path) -> None:
    """A write-behind transaction that fails (a frame row breaking NOT NULL) rolls back
    with its offsets: ``settled()`` raises its error instead of saying it is durable, so
    the loop never acknowledges those offsets, and every later write is refused."""
    sink = DuckDBSink(tmp_path / "s.duckdb")
    sink.write(_batch(range(0, 2), 1.0, 2, start=True), "g")
    sink.wait()
    assert sink.settled()
    bad = _batch(range(2, 4), 1.0, 4)
    frame, _ = bad.frames[("r", 3)]
    bad.frames[("r", 3)] = (frame, None)  # type: ignore[assignment]  # frames.health NOT NULL
    sink.write(bad, "g")
    with pytest.raises(duckdb.Error):
        while not sink.settled():
            pass
    with pytest.raises(duckdb.Error):
        sink.write(_batch(range(4, 6), 1.0, 6), "g")
    with pytest.raises(duckdb.Error):
        sink.close()  # closes the file all the same
    con = duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True)
    assert con.execute("SELECT next_offset FROM kafka_offsets").fetchall() == [(2,)]
    assert _counts(con)[:3] == (2 * LAYERS, 2 * LAYERS, 2)
    con.close()
