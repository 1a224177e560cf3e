"""consumer.duckdb_maintenance.upgrade_store gives a store written before the frame
summaries and the grid rollup existed exactly what the real DuckDB writer (``DuckDBSink``,
a real file) stores with the rows, after which the report and the heatmap read those and
answer as the row scans did."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import numpy as np

from analysis.plots.grid import _rollup_fresh, load_grid
from analysis.report import build_report, frames_summarise
from consumer.duckdb_maintenance import stale_rollup_runs, upgrade_store
from schemas.frame_summary import SUMMARY_COLUMNS
from schemas.grid_rollup import ROLLUP_TABLE
from tests.analysis.test_report_frame_summary import _frame, _write

LAYERS = 3
STEPS = 40  # more than two 16-step blocks of the finest rollup level


def written_store(path: Path) -> None:
    """A run of :data:`STEPS` frames by the real writer, a late rank rewriting step 5."""
    rng = np.random.default_rng(7)
    means = np.exp(rng.normal(size=(STEPS, LAYERS))).tolist()
    means[9][1] = float("nan")
    means[20][2] = 1e-9  # vanishing
    batches = [[_frame(s, LAYERS, list(range(LAYERS)), means[s])] for s in range(STEPS)]
    batches.append([_frame(5, LAYERS, [0, 2], [0.2, 3e3])])
    _write(path, LAYERS, ["float32"] * LAYERS, [], batches)


def as_written_before(path: Path) -> None:
    """The store as an older gradstream left it: no summary columns, no rollup table."""
    con = duckdb.connect(str(path))
    for column in SUMMARY_COLUMNS:
        con.execute(f"ALTER TABLE frames DROP COLUMN {column}")
    con.execute(f"DROP TABLE {ROLLUP_TABLE}")
    con.close()


def test_upgrade_gives_what_the_writer_keeps(tmp_path: Path) -> None:
    new, old = tmp_path / "new.duckdb", tmp_path / "old.duckdb"
    written_store(new)
    shutil.copy(new, old)
    as_written_before(old)

    con = duckdb.connect(str(old))
    assert not _rollup_fresh(con)
    report_before = build_report(con, "r")
    grid_before = load_grid(con, "r", max_steps=4)
    con.close()

    con = duckdb.connect(str(old))
    seen: list[str] = []
    done = upgrade_store(con, progress=lambda what, _done, _total: seen.append(what))
    assert done.summaries_filled == STEPS and done.runs_rolled_up == ("r",)
    assert "summarising frames" in seen and "rolling up run r" in seen
    assert frames_summarise(con, "r", None) and _rollup_fresh(con)
    assert build_report(con, "r") == report_before
    grid = load_grid(con, "r", max_steps=4)
    for name in ("max_norm", "max_flow", "flags", "col_first_step", "col_last_step"):
        np.testing.assert_array_equal(getattr(grid, name), getattr(grid_before, name))
    columns = ", ".join(SUMMARY_COLUMNS)
    upgraded = con.execute(f"SELECT step, {columns} FROM frames ORDER BY step").fetchall()
    rollup = con.execute(f"SELECT * FROM {ROLLUP_TABLE} ORDER BY ALL").fetchall()
    again = upgrade_store(con)
    assert (again.summaries_filled, again.runs_rolled_up) == (0, ())
    assert again.summary() == "frame summaries: up to date; grid rollup: up to date"
    con.close()

    con = duckdb.connect(str(new), read_only=True)
    assert upgraded == con.execute(f"SELECT step, {columns} FROM frames ORDER BY step").fetchall()
    assert rollup == con.execute(f"SELECT * FROM {ROLLUP_TABLE} ORDER BY ALL").fetchall()
    con.close()


def test_a_rollup_short_of_the_rows_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    written_store(path)
    con = duckdb.connect(str(path))
    want = con.execute(f"SELECT * FROM {ROLLUP_TABLE} ORDER BY ALL").fetchall()
    assert stale_rollup_runs(con) == []
    # A block of the coarsest level lost (rows deleted by hand, another program).
    con.execute(f"DELETE FROM {ROLLUP_TABLE} WHERE level = 12")
    assert stale_rollup_runs(con) == ["r"] and stale_rollup_runs(con, "other") == []
    done = upgrade_store(con, "r")
    assert done.runs_rolled_up == ("r",) and done.rollup_rows == len(want)
    assert "grid rollup: 1 run rebuilt" in done.summary()
    assert con.execute(f"SELECT * FROM {ROLLUP_TABLE} ORDER BY ALL").fetchall() == want
    # Rows of a run that has no layer_stats rows left: the rollup of a run deleted by hand.
    con.execute(f"INSERT INTO {ROLLUP_TABLE} VALUES ('gone', 4, 0, 0, 1, 1.0, 1.0, 0)")
    assert stale_rollup_runs(con) == ["gone"]
    upgrade_store(con)
    assert con.execute(f"SELECT count(*) FROM {ROLLUP_TABLE} WHERE run_id = 'gone'"
                       ).fetchone() == (0,)
    con.close()
