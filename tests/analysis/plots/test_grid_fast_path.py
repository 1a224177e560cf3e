"""load_grid's fast path (the recorded steps, then one aggregation binning by arithmetic on
the step or by a join on the listed frames) equals the straightforward full-scan
computation of the same bins: one statement numbering the distinct steps and taking, per
(bin of layers, bin of frames), the maximum norm and flow intensity and each flag OR-ed,
over random stores (real DuckDB files) and random step ranges: stores crafted without
``frames`` rows (the steps scanned from ``layer_stats``) and stores written by the real
DuckDB writer (``DuckDBSink``: the steps listed by ``frames``), with frames out of step
order and late ranks rewriting stored frames with other layers."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.plots import grid as grid_module
from analysis.plots.grid import (
    FLAG_EXPLODING,
    FLAG_NO_DATA,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    FLAG_ZERO,
    GradientGrid,
    load_grid,
)
from analysis.read.connect import open_store
from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from schemas.stats import GradientSums
from schemas.wire import RunStarted
from tests.analysis.crafted import write_run
from tests.analysis.plots.test_plots import reference_columns

REFERENCE_SQL = """
    WITH s AS (
        SELECT step, layer_index, grad_norm, flow_intensity, is_vanishing, is_exploding,
               nonfinite
        FROM layer_stats
        WHERE run_id = $run_id AND ($from_step IS NULL OR step >= $from_step)
          AND ($to_step IS NULL OR step <= $to_step)
    ),
    steps AS (
        SELECT unnest($frame_steps::BIGINT[]) AS step, unnest($frame_cols::BIGINT[]) AS col
    )
    SELECT s.layer_index // $m AS row_no, steps.col AS col_no,
           max(s.grad_norm) AS max_norm, max(s.flow_intensity) AS max_flow,
           bool_or(s.is_vanishing) AS van, bool_or(s.is_exploding) AS exp,
           bool_or(s.nonfinite > 0) AS bad, min(s.step) AS first, max(s.step) AS last
    FROM s JOIN steps USING (step)
    GROUP BY row_no, col_no
"""
"""The straightforward computation: every row of the range read and binned in one
statement by the frames' columns of :func:`tests.analysis.plots.test_plots.
reference_columns` (the columns' first / last steps taken over the cells too)."""


def reference_cells(con, run_id: str, n_layers: int, max_steps: int, max_layers: int,
                    from_step: int | None, to_step: int | None) -> dict[str, np.ndarray]:
    """The dense cells of the reference computation (module doc)."""
    steps = [r[0] for r in con.execute(
        "SELECT DISTINCT step FROM layer_stats WHERE run_id = $run_id AND "
        "($from_step IS NULL OR step >= $from_step) AND ($to_step IS NULL OR step <= $to_step) "
        "ORDER BY step", {"run_id": run_id, "from_step": from_step, "to_step": to_step}
    ).fetchall()]
    n_frames = len(steps)
    frame_cols, k, _ = reference_columns(steps, max_steps) if steps else ([], 1, 0)
    m = max(1, -(-n_layers // max_layers))
    rows, cols = -(-n_layers // m), (frame_cols[-1] + 1 if steps else 0)
    out = con.execute(REFERENCE_SQL, {"run_id": run_id, "from_step": from_step,
                                      "to_step": to_step, "m": m, "frame_steps": steps,
                                      "frame_cols": frame_cols}).fetchall()
    norm = np.full((rows, cols), np.nan)
    flow = np.full((rows, cols), np.nan)
    flags = np.full((rows, cols), FLAG_NO_DATA, np.uint8)
    first = np.full(cols, np.iinfo(np.int64).max)
    last = np.full(cols, np.iinfo(np.int64).min)
    for r, c, max_norm, max_flow, van, exp, bad, lo, hi in out:
        norm[r, c] = np.nan if max_norm is None else max_norm
        flow[r, c] = np.nan if max_flow is None else max_flow
        flags[r, c] = (FLAG_VANISHING * bool(van) | FLAG_EXPLODING * bool(exp)
                       | FLAG_NONFINITE * bool(bad))
        first[c], last[c] = min(first[c], lo), max(last[c], hi)
    flags[norm == 0] |= FLAG_ZERO
    return {"norm": norm, "flow": flow, "flags": flags, "first": first, "last": last,
            "k": np.int64(k), "m": np.int64(m), "n_frames": np.int64(n_frames),
            "frames": np.bincount(frame_cols, minlength=cols)}


def write_random_run(path: Path, run_id: str, n_layers: int, steps: list[int],
                     rng: np.random.Generator) -> None:
    """A run whose rows hold random norms (some 0, NaN or +Inf), intensities (some NaN)
    and flags, each layer present at ~85% of the steps (every step has a row)."""
    grid = [(step, layer) for step in steps for layer in range(n_layers)]
    present = rng.random(len(grid)) < 0.85
    for j in range(len(steps)):  # every frame has a row
        present[j * n_layers + int(rng.integers(n_layers))] = True
    kept = [g for g, p in zip(grid, present, strict=True) if p]
    n = len(kept)
    norm = 10.0 ** rng.uniform(-5, 3, n)
    special = rng.random(n)
    norm[special < 0.05] = 0.0
    norm[(special >= 0.05) & (special < 0.08)] = np.nan
    norm[(special >= 0.08) & (special < 0.1)] = np.inf
    flow = rng.random(n)
    flow[rng.random(n) < 0.05] = np.nan
    stats = pa.table({
        "run_id": [run_id] * n,
        "step": pa.array([s for s, _ in kept], pa.int64()),
        "layer_index": pa.array([li for _, li in kept], pa.int32()),
        "numel": pa.array([100] * n, pa.int64()),
        "sum_sq": norm**2,
        "nonfinite": pa.array((rng.random(n) < 0.07).astype(np.int64) * 3, pa.int64()),
        "grad_norm": norm,
        "flow_intensity": flow,
        "is_vanishing": rng.random(n) < 0.08,
        "is_exploding": rng.random(n) < 0.08,
    })
    write_run(path, run_id, [f"l{i}" for i in range(n_layers)], [100] * n_layers,
              stats=stats, frames=None)


steps_strategy = st.one_of(
    st.builds(lambda start, stride, count: [start + stride * j for j in range(count)],
              st.integers(0, 50), st.integers(1, 6), st.integers(1, 45)),
    st.lists(st.integers(0, 400), min_size=1, max_size=45, unique=True).map(sorted),
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=steps_strategy,
    n_layers=st.integers(1, 7),
    max_steps=st.integers(1, 50),
    max_layers=st.integers(1, 8),
    bounds=st.tuples(st.none() | st.integers(0, 420), st.none() | st.integers(0, 420)),
    seed=st.integers(0, 2**16),
)
def test_fast_grid_equals_the_full_scan(tmp_path_factory, steps, n_layers, max_steps,
                                        max_layers, bounds, seed) -> None:
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("fast") / "s.duckdb"
    write_random_run(path, "r", n_layers, steps, rng)
    write_random_run(path, "other", n_layers + 1, [s + 1 for s in steps], rng)  # not read
    from_step, to_step = bounds
    if from_step is not None and to_step is not None and from_step > to_step:
        from_step, to_step = to_step, from_step
    con = open_store(path)
    try:
        grid = load_grid(con, "r", max_steps, max_layers, from_step=from_step,
                         to_step=to_step)
        truth = reference_cells(con, "r", n_layers, max_steps, max_layers, from_step, to_step)
    finally:
        con.close()
    assert isinstance(grid, GradientGrid)
    in_range = [s for s in steps if (from_step is None or s >= from_step)
                and (to_step is None or s <= to_step)]
    assert grid.n_frames == truth["n_frames"] == len(in_range)
    if not in_range:
        assert grid.shape == (truth["norm"].shape[0], 0)
        return
    assert grid.steps_per_col == truth["k"] and grid.layers_per_row == truth["m"]
    assert grid.shape == truth["norm"].shape
    np.testing.assert_array_equal(grid.max_norm, truth["norm"])  # NaN == NaN here
    np.testing.assert_array_equal(grid.max_flow, truth["flow"])
    np.testing.assert_array_equal(grid.flags, truth["flags"])
    np.testing.assert_array_equal(grid.col_first_step, truth["first"])
    np.testing.assert_array_equal(grid.col_last_step, truth["last"])
    assert grid.col_frames.tolist() == truth["frames"].tolist()


VANISHING, EXPLODING = 1e-3, 1e2
"""Thresholds of the written runs: the random means below cross both."""


def _frame(run_id: str, step: int, n_layers: int, present: list[int],
           rng: np.random.Generator) -> GradientFrame:
    """A merged frame of ``present`` layers with random mean |g| (some 0, NaN or Inf)."""
    n = len(present)
    mean = 10.0 ** rng.uniform(-5, 3, n)
    special = rng.random(n)
    mean[special < 0.05] = 0.0
    mean[(special >= 0.05) & (special < 0.08)] = np.nan
    mean[(special >= 0.08) & (special < 0.1)] = np.inf
    nan, inf = np.isnan(mean), np.isinf(mean)
    finite = np.where(nan | inf, 1.0, mean)
    sums = GradientSums.from_columns(
        np.full(n, 100, np.int64), finite * 100, finite * finite * 100, finite * 2,
        np.where(nan | inf, 3, 0).astype(np.int64), nan=np.where(nan, 3, 0).astype(np.float64))
    merged = MergedShards.empty(n_layers).merge_at(np.array(present, np.int64),
                                                   MergedShards(sums))
    return compute_frame(run_id, step, merged, vanishing_threshold=VANISHING,
                         exploding_threshold=EXPLODING, ranks_seen=(0,), world_size=1,
                         wall_time=float(step))


def write_with_sink(path: Path, run_id: str, n_layers: int, steps: list[int], rewrites: int,
                    rng: np.random.Generator, batch_frames: int = 3) -> None:
    """Write a run through the real DuckDB writer: ``steps`` in the given order (maybe not
    ascending), 1 to ``batch_frames`` frames a batch, then ``rewrites`` stored frames
    written again with another set of layers (a late rank)."""
    names = [f"l{i}" for i in range(n_layers)]
    sink = DuckDBSink(path, write_behind=False)
    try:
        order = [*steps, *(int(s) for s in rng.choice(steps, rewrites))]
        i = 0
        while i < len(order):
            batch = Batch()
            if i == 0:
                batch.runs_started.append(RunStarted(
                    run_id=run_id, rank=0, world_size=1, layer_names=names,
                    numel=[100] * n_layers, vanishing_threshold=VANISHING,
                    exploding_threshold=EXPLODING, host="h", start_time=0.0, config={}))
            for step in order[i:i + int(rng.integers(1, batch_frames + 1))]:
                present = sorted(rng.choice(n_layers, int(rng.integers(1, n_layers + 1)),
                                            replace=False).tolist())
                batch.frames[(run_id, step)] = (_frame(run_id, step, n_layers, present, rng),
                                                "Healthy")
                i += 1
            batch.offsets[(run_id, 0)] = i
            sink.write(batch, "g")
    finally:
        sink.close()


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    steps=st.lists(st.integers(0, 300), min_size=1, max_size=30, unique=True),
    ordered=st.booleans(),
    rewrites=st.integers(0, 4),
    n_layers=st.integers(1, 6),
    max_steps=st.integers(1, 40),
    max_layers=st.integers(1, 7),
    bounds=st.tuples(st.none() | st.integers(0, 320), st.none() | st.integers(0, 320)),
    seed=st.integers(0, 2**16),
)
def test_grid_of_a_written_store_equals_the_full_scan(
        tmp_path_factory, steps, ordered, rewrites, n_layers, max_steps, max_layers, bounds,
        seed) -> None:
    """The recorded steps come from ``frames`` (the writer summarised every frame) and the
    grid is the full scan's, frames out of order and rewritten ones included."""
    rng = np.random.default_rng(seed)
    path = tmp_path_factory.mktemp("sink") / "s.duckdb"
    write_with_sink(path, "r", n_layers, sorted(steps) if ordered else steps, rewrites, rng)
    from_step, to_step = bounds
    if from_step is not None and to_step is not None and from_step > to_step:
        from_step, to_step = to_step, from_step
    con = open_store(path)
    try:
        listed = grid_module._listed_frames(
            con, {"run_id": "r", "from_step": from_step, "to_step": to_step})
        grid = load_grid(con, "r", max_steps, max_layers, from_step=from_step,
                         to_step=to_step)
        truth = reference_cells(con, "r", n_layers, max_steps, max_layers, from_step, to_step)
    finally:
        con.close()
    in_range = sorted(s for s in steps if (from_step is None or s >= from_step)
                      and (to_step is None or s <= to_step))
    assert grid.n_frames == truth["n_frames"] == len(in_range)
    if not in_range:
        assert listed is None and grid.shape == (truth["norm"].shape[0], 0)
        return
    assert listed is not None and listed[0].tolist() == in_range  # the frames' list is read
    assert grid.shape == truth["norm"].shape
    np.testing.assert_array_equal(grid.max_norm, truth["norm"])
    np.testing.assert_array_equal(grid.max_flow, truth["flow"])
    np.testing.assert_array_equal(grid.flags, truth["flags"])
    np.testing.assert_array_equal(grid.col_first_step, truth["first"])
    np.testing.assert_array_equal(grid.col_last_step, truth["last"])


def test_rows_the_frames_do_not_list_are_scanned(tmp_path: Path) -> None:
    """A ``layer_stats`` row written by another program at a step ``frames`` does not list
    makes the frames' count disagree with the rows: the grid is read from the rows and
    shows that step."""
    path = tmp_path / "s.duckdb"
    write_with_sink(path, "r", 3, [0, 1, 2, 3], 0, np.random.default_rng(7))
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_sq, "
                "max_abs_grad, nonfinite, grad_norm, flow_intensity, is_vanishing, "
                "is_exploding) VALUES ('r', 9, 1, 100, 1e8, 5e3, 0, 1e4, 1.0, false, true)")
    grid = load_grid(con, "r", 10, 10)
    truth = reference_cells(con, "r", 3, 10, 10, None, None)
    con.close()
    assert grid.col_first_step.tolist() == [0, 1, 2, 3, 9]
    assert grid.max_norm[1, 4] == 1e4 and grid.flags[1, 4] & FLAG_EXPLODING
    np.testing.assert_array_equal(grid.max_norm, truth["norm"])
    np.testing.assert_array_equal(grid.flags, truth["flags"])
