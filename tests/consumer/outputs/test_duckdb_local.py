"""Flight-recorder rows (``LocalSummary``) in the DuckDB output: stored with their trigger
and the batch's offsets, one row per (run, step, rank, layer) however often a batch is
replayed, and stores created before the trigger columns get them on opening."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from schemas.wire import LocalSummary, RunStarted


def _local(step: int, rank: int, layers: list[int], scale: float, trigger_step: int,
           trigger: str = "nonfinite") -> LocalSummary:
    n = len(layers)
    return LocalSummary(
        run_id="r", step=step, rank=rank, world_size=2, wall_time=float(step),
        trigger=trigger, trigger_step=trigger_step, local_layer_indices=layers,
        local_numel=[10] * n, local_sum_abs=[scale] * n, local_sum_sq=[scale * scale] * n,
        local_max_abs=[scale / 2] * n, local_nonfinite=[int(step == trigger_step)] * n)


def _batch(messages: list[LocalSummary], offset: int, start: bool = False) -> Batch:
    batch = Batch()
    if start:
        batch.runs_started.append(RunStarted(
            run_id="r", rank=0, world_size=2, layer_names=["a", "b", "c"],
            numel=[10, 10, 10], start_time=0.0))
    batch.local_summaries.extend(messages)
    batch.offsets[("t", 0)] = offset
    return batch


@pytest.mark.parametrize("write_behind", [False, True])
def test_recorder_rows_are_stored_once_with_their_trigger(tmp_path: Path,
                                                          write_behind: bool) -> None:
    sink = DuckDBSink(tmp_path / "s.duckdb", write_behind=write_behind)
    dump = [_local(s, 1, [0, 1, 2], 1.0, 4) for s in range(2, 5)]
    sink.write(_batch(dump, 10, start=True), "g")
    # a replay of the same records, and one of them split by layers and changed, twice in
    # one batch: the last one wins
    again = [*dump, _local(3, 1, [1], 5.0, 4), _local(3, 1, [1], 6.0, 4)]
    sink.write(_batch(again, 12), "g")
    sink.write(_batch([_local(7, 0, [2], 2.0, 7, "norm_spike")], 13), "g")
    sink.wait()
    rows = sink.con.execute(
        "SELECT step, rank, layer_index, sum_abs, nonfinite, trigger, trigger_step "
        "FROM local_layer_stats ORDER BY step, rank, layer_index").fetchall()
    assert rows == [
        *[(s, 1, i, 6.0 if (s, i) == (3, 1) else 1.0, int(s == 4), "nonfinite", 4)
          for s in range(2, 5) for i in range(3)],
        (7, 0, 2, 2.0, 1, "norm_spike", 7),
    ]
    assert sink.load_offsets("g", "t") == {0: 13}
    sink.close()


def test_store_without_trigger_columns_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("""CREATE TABLE local_layer_stats (
        run_id VARCHAR NOT NULL, step BIGINT NOT NULL, rank INTEGER NOT NULL,
        layer_index INTEGER NOT NULL, numel BIGINT NOT NULL, sum_abs DOUBLE NOT NULL,
        sum_sq DOUBLE NOT NULL, max_abs_grad DOUBLE NOT NULL, nonfinite BIGINT NOT NULL)""")
    con.execute("INSERT INTO local_layer_stats VALUES ('old', 0, 0, 0, 4, 1, 1, 1, 0)")
    con.close()
    sink = DuckDBSink(path, write_behind=False)
    sink.write(_batch([_local(1, 0, [0], 1.0, 1)], 1, start=True), "g")
    rows = sink.con.execute("SELECT run_id, step, trigger, trigger_step FROM "
                            "local_layer_stats ORDER BY run_id").fetchall()
    assert rows == [("old", 0, None, None), ("r", 1, "nonfinite", 1)]
    sink.close()
