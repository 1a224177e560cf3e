"""The grid rollup (schemas.grid_rollup): the blocks the DuckDB writer keeps with the rows
are the blocks recomputed from the stored rows (``fill_rollup``), whatever the order the
frames came in and however often they were rewritten; and the grid read from them is the
full scan's (real DuckDB files written by ``DuckDBSink``)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.plots import grid as grid_module
from analysis.plots.grid import load_grid
from analysis.read.connect import open_store
from schemas.grid_rollup import ROLLUP_LEVELS, ROLLUP_TABLE, fill_rollup
from tests.analysis.plots.test_grid_fast_path import reference_cells, write_with_sink

BLOCKS = f"SELECT * FROM {ROLLUP_TABLE} ORDER BY run_id, level, block, layer_index"


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[int], int, int]:
    """(steps in write order, rewrites, seed): runs of consecutive or strided steps with
    gaps, partly shuffled (frames out of step order), around the blocks' boundaries."""
    start = draw(st.integers(0, 40))
    stride = draw(st.sampled_from([1, 1, 2, 3]))
    count = draw(st.integers(1, 300))
    steps = [start + stride * j for j in range(count)]
    dropped = set(draw(st.lists(st.integers(0, count - 1), max_size=count // 4)))
    steps = [s for j, s in enumerate(steps) if j not in dropped or j == 0]
    swaps = draw(st.lists(st.tuples(st.integers(0, len(steps) - 1),
                                    st.integers(0, len(steps) - 1)), max_size=6))
    for a, b in swaps:
        steps[a], steps[b] = steps[b], steps[a]
    return steps, draw(st.integers(0, 6)), draw(st.integers(0, 2**16))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(history=histories(), n_layers=st.integers(1, 4), max_steps=st.integers(1, 12),
       max_layers=st.integers(1, 4), data=st.data())
def test_written_rollup_is_the_rows_and_gives_the_full_scan_grid(
        tmp_path_factory, history, n_layers, max_steps, max_layers, data) -> None:
    steps, rewrites, seed = history
    path = tmp_path_factory.mktemp("rollup") / "s.duckdb"
    write_with_sink(path, "r", n_layers, steps, rewrites, np.random.default_rng(seed),
                    batch_frames=20)
    con = duckdb.connect(str(path))
    written = con.execute(BLOCKS).fetchall()
    assert {row[1] for row in written} == set(ROLLUP_LEVELS)
    assert fill_rollup(con) == len(written)
    assert con.execute(BLOCKS).fetchall() == written  # NaN compares equal as DuckDB sorts
    con.close()

    lo = data.draw(st.none() | st.integers(0, max(steps)))
    hi = data.draw(st.none() | st.integers(lo or 0, max(steps) + 1))
    con = open_store(path)
    try:
        assert grid_module._rollup_fresh(con)
        grid = load_grid(con, "r", max_steps, max_layers, from_step=lo, to_step=hi)
        truth = reference_cells(con, "r", n_layers, max_steps, max_layers, lo, hi)
        listed = grid_module._listed_frames(con, {"run_id": "r", "from_step": lo,
                                                  "to_step": hi})
    finally:
        con.close()
    assert grid.n_frames == truth["n_frames"]
    if grid.n_frames == 0:
        return
    np.testing.assert_array_equal(grid.max_norm, truth["norm"])  # NaN == NaN here
    np.testing.assert_array_equal(grid.max_flow, truth["flow"])
    np.testing.assert_array_equal(grid.flags, truth["flags"])
    np.testing.assert_array_equal(grid.col_first_step, truth["first"])
    np.testing.assert_array_equal(grid.col_last_step, truth["last"])
    assert listed is not None
    frames = listed[0]
    columns = grid_module.step_columns(frames, max_steps)
    query = grid_module._rollup_query(frames, columns, {"run_id": "r", "layers_per_row": 1})
    if columns.k >= 64:  # columns of 64+ frames: their edges are under half the frames
        assert query is not None and query[1]["blocks"]  # the rollup is what was read
    if columns.aligned and query is not None:  # whole blocks: rows only at the range's ends
        edge = np.array(query[1]["edge_steps"], dtype=np.int64)
        assert ((edge < (frames[0] | 15) + 1) | (edge > (frames[-1] & ~15) - 1)).all()


def test_a_store_without_a_fresh_rollup_is_read_from_its_rows(tmp_path: Path) -> None:
    """Rollup rows missing (a store filled by another program) or rows the rollup does not
    hold: the grid is the rows', and ``fill_rollup`` brings the rollup back."""
    path = tmp_path / "s.duckdb"
    write_with_sink(path, "r", 2, list(range(200)), 0, np.random.default_rng(3))
    con = duckdb.connect(str(path))
    con.execute(f"DELETE FROM {ROLLUP_TABLE} WHERE level = {ROLLUP_LEVELS[0]} AND block = 3")
    assert not grid_module._rollup_fresh(con)
    truth = reference_cells(con, "r", 2, 2, 2, None, None)
    np.testing.assert_array_equal(load_grid(con, "r", 2, 2).max_norm, truth["norm"])
    fill_rollup(con, "r")
    assert grid_module._rollup_fresh(con)
    # a row written by another program (no frame, no block): counted, so the rows are read
    con.execute("INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_sq, "
                "max_abs_grad, nonfinite, grad_norm, flow_intensity, is_vanishing, "
                "is_exploding) VALUES ('r', 50, 1, 100, 1e16, 5e3, 0, 1e8, 1.0, false, true)")
    grid = load_grid(con, "r", 2, 2)
    assert grid.max_norm[1, 0] == 1e8
    np.testing.assert_array_equal(grid.max_norm,
                                  reference_cells(con, "r", 2, 2, 2, None, None)["norm"])
    con.execute(f"DROP TABLE {ROLLUP_TABLE}")  # a store older than the rollup
    assert not grid_module._rollup_fresh(con)
    np.testing.assert_array_equal(load_grid(con, "r", 2, 2).max_norm, grid.max_norm)
    con.close()
