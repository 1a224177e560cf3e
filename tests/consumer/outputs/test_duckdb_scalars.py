"""Training scalars in the DuckDB store: per-rank rows, step scalars, and the step's value
of each per-rank scalar recomputed over every stored rank when a late rank's frame carries
only its own rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from consumer.merge import frame_scalars
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from schemas.scalars import RankScalars
from tests.consumer.outputs.test_duckdb_replay import LAYERS, _frame, _started


def _with_scalars(step: int, ranks: tuple[int, ...], losses: dict[int, float],
                  times: dict[int, float], rewrite: bool = False) -> Batch:
    frame = _frame(step, np.arange(LAYERS), 1.0, ranks)
    frame.rewrite = rewrite
    rows = [RankScalars.of_rank(r, {"loss": losses[r], "compute_time_s": times[r]})
            for r in ranks]
    frame.scalars, frame.rank_scalars = frame_scalars(
        [(r, {"lr": 0.1 * (r + 1), "loss_scale": 1024.0}) for r in ranks], rows)
    batch = Batch()
    batch.frames[("r", step)] = (frame, "Healthy")
    return batch


def _step_values(sink: DuckDBSink, step: int) -> dict[str, float]:
    return dict(sink.con.execute(
        "SELECT name, value FROM step_scalars WHERE run_id = 'r' AND step = ?",
        [step]).fetchall())


def test_step_and_rank_scalars_are_stored(tmp_path: Path) -> None:
    sink = DuckDBSink(tmp_path / "s.duckdb", write_behind=False)
    batch = _with_scalars(0, (0, 1), {0: 2.0, 1: math.nan}, {0: 0.5, 1: 0.9})
    batch.runs_started.append(_started())
    sink.write(batch, "g")
    values = _step_values(sink, 0)
    assert values["lr"] == 0.1  # the lowest rank's step scalar
    assert values["loss_scale"] == 1024.0
    assert math.isnan(values["loss"])  # a NaN loss on one rank makes the step's NaN
    assert values["compute_time_s"] == 0.9  # the slowest rank
    ranks = sink.con.execute(
        "SELECT rank, name, value FROM rank_scalars ORDER BY rank, name").fetchall()
    assert ranks[:2] == [(0, "compute_time_s", 0.5), (0, "loss", 2.0)]
    assert ranks[2][:2] == (1, "compute_time_s") and math.isnan(ranks[3][2])
    sink.close()


def test_late_rank_recomputes_the_step_values_over_every_stored_rank(tmp_path: Path) -> None:
    sink = DuckDBSink(tmp_path / "s.duckdb", write_behind=False)
    first = _with_scalars(3, (0,), {0: 2.0}, {0: 0.5})
    first.runs_started.append(_started())
    sink.write(first, "g")
    assert _step_values(sink, 3)["loss"] == 2.0
    # The late rank's frame carries only its own rows (the earlier ones were not cached).
    sink.write(_with_scalars(3, (1,), {1: 4.0}, {1: 0.25}, rewrite=True), "g")
    values = _step_values(sink, 3)
    assert values["loss"] == 3.0 and values["compute_time_s"] == 0.5
    assert values["lr"] == 0.1  # a step scalar stored first stays
    # Written again (a replay): the same rows, the same values.
    sink.write(_with_scalars(3, (1,), {1: 4.0}, {1: 0.25}, rewrite=True), "g")
    assert sink.con.execute("SELECT count(*) FROM rank_scalars").fetchone() == (4,)
    assert _step_values(sink, 3)["loss"] == 3.0
    sink.close()
