"""A run's step scalars (the loss above all) binned on the heatmap's step columns, in SQL.

The loss curve drawn above the heatmap (``gradstream plot``, :meth:`analysis.notebook.Run.
plot`, the dashboard) shares the heatmap's step axis: its points are the heatmap's columns
(:func:`analysis.plots.grid.load_grid`: consecutive recorded frames, ``k`` per column, or
aligned step intervals, :func:`analysis.plots.grid.step_columns`).
Column ``c`` covers the steps from its first frame up to the step before column ``c + 1``'s
first frame (the last column: up to its last frame); every ``step_scalars`` row of a step
in it falls in that column's bin. A bin keeps, per scalar name, the mean, minimum and
maximum of its **finite** values (the mean is the curve, min..max its band when a column
covers several steps) and how many of its values are NaN/Inf (marked apart: a non-finite
loss has no place on the value axis). Scalar steps outside every column (before the first
frame of the range, after its last) are left out.

Two ways to get the columns, one SQL aggregation over them (:data:`BINNED_SQL`):

- :func:`load_scalar_bins` (the dashboard's ``GET /api/scalars``): the columns the grid
  makes of the range's recorded frames with the same ``max_steps``
  (:func:`analysis.plots.grid.range_steps`, :func:`analysis.plots.grid.step_columns`);
- :func:`grid_scalar_bins` (the PNG pictures): the columns of a grid already loaded,
  through a :class:`~analysis.read.reader.StoreReader`'s one-statement read, so the curve
  and the heatmap agree even while a run grows.

Either way the columns are sent as their first steps.

A store without the training-scalar tables (written before them and never opened by a newer
writer) gives empty bins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from analysis.read.connect import has_table, require_run
from analysis.read.query import QueryError
from analysis.read.sql import stats_params, step_range
from schemas.scalars import LOSS

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

    from analysis.plots.grid import GradientGrid
    from analysis.read.reader import StoreReader

SCALARS_TABLE = "step_scalars"
"""The table of the step scalars (``schemas.tables``)."""


def _binned_sql(edges: str) -> str:
    """The per-(column, name) aggregation of the run's ``step_scalars`` rows over the columns
    of the CTEs ``edges`` (which end in ``edges(bucket, start, stop, n_frames, k)``), plus
    one row with a NULL ``name`` per column holding no scalar (so the column count is known
    without scalars). Parameters: ``$run_id``, ``$from_step`` / ``$to_step``, ``$names``
    (VARCHAR[], NULL = every name)."""
    return f"""
    WITH {edges},
    v AS (
        SELECT step, name, value FROM step_scalars
        WHERE run_id = $run_id AND {step_range()}
          AND ($names IS NULL OR list_contains($names, name))
    )
    SELECT e.bucket, v.name,
           min(v.step) AS first_step, max(v.step) AS last_step,
           count(v.step) AS points,
           count(v.step) FILTER (WHERE NOT isfinite(v.value)) AS nonfinite,
           avg(v.value) FILTER (WHERE isfinite(v.value)) AS mean,
           min(v.value) FILTER (WHERE isfinite(v.value)) AS low,
           max(v.value) FILTER (WHERE isfinite(v.value)) AS high,
           any_value(e.n_frames) AS n_frames, any_value(e.k) AS k
    FROM edges AS e LEFT JOIN v ON v.step >= e.start AND v.step <= e.stop
    GROUP BY e.bucket, v.name
    ORDER BY v.name NULLS FIRST, e.bucket
    """


_EDGES_OF_STARTS = """
    cols AS (
        SELECT i AS bucket, list_extract($starts::BIGINT[], i + 1) AS start
        FROM range(len($starts::BIGINT[])) AS t(i)
    ),
    edges AS (
        SELECT bucket, start,
               coalesce(lead(start) OVER (ORDER BY bucket) - 1, $stop) AS stop,
               $n_frames::BIGINT AS n_frames, $k::BIGINT AS k
        FROM cols
    )"""
"""The columns of a loaded grid: ``$starts`` (each column's first step, ascending), ``$stop``
(the last column's last step), ``$n_frames`` and ``$k`` (its frames and frames per
column)."""

BINNED_SQL = _binned_sql(_EDGES_OF_STARTS)
"""The bins over given columns (parameters: ``$run_id``, ``$from_step``, ``$to_step``,
``$names``, ``$starts``, ``$stop``, ``$n_frames``, ``$k``)."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True)
class ScalarSeries:
    """One step scalar over the heatmap's columns (``B`` bins: the columns holding a value
    of it, ascending).

    Attributes:
        name: the scalar (``loss``, ``lr``, ...; ``schemas.scalars``).
        col: int64[B], the heatmap column of each bin (0-based).
        first_step / last_step: int64[B], the first / last step with a value in the bin.
        points: int64[B], values in the bin (steps holding this scalar).
        nonfinite: int64[B], of them NaN or +-Inf.
        mean / low / high: float64[B], mean, minimum and maximum of the bin's finite values
            (NaN when every value of the bin is non-finite); the scalar's own units.
    """

    name: str
    col: np.ndarray
    first_step: np.ndarray
    last_step: np.ndarray
    points: np.ndarray
    nonfinite: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray

    def dense(self, n_columns: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(mean, low, high)`` as float64[n_columns], NaN in the columns without a finite
        value (a line drawn from them breaks there)."""
        out = []
        for values in (self.mean, self.low, self.high):
            full = np.full(n_columns, np.nan)
            full[self.col] = values
            out.append(full)
        return out[0], out[1], out[2]

    def to_json(self) -> dict[str, object]:
        """The dashboard's dict, for :func:`analysis.plots.page_json.page_json`: every
        attribute (NumPy arrays; non-finite floats written as ``null``)."""
        return {
            "name": self.name, "col": self.col, "first_step": self.first_step,
            "last_step": self.last_step, "points": self.points, "nonfinite": self.nonfinite,
            "mean": self.mean, "low": self.low, "high": self.high,
        }


@dataclass(frozen=True)
class ScalarBins:
    """A run's step scalars binned on the heatmap's ``C`` step columns.

    Attributes:
        run_id: the run.
        n_columns: the heatmap's columns ``C`` (0 when the range has no frame).
        steps_per_col: recorded frames per column ``k`` (1: one step per column).
        n_frames: recorded frames in the range.
        series: scalar name -> :class:`ScalarSeries`, names in code-point order; only the
            names with a value in some column.
    """

    run_id: str
    n_columns: int
    steps_per_col: int
    n_frames: int
    series: dict[str, ScalarSeries]

    def caption(self, name: str = LOSS) -> str:
        """How the curve of ``name`` is drawn, e.g. ``"loss: mean of the finite values over
        each heatmap column's 10 recorded steps (band: min..max); NaN/Inf at 2 steps (magenta
        marks)"``."""
        series = self.series.get(name)
        if series is None:
            return f"{name}: none in the range"
        what = (f"{name}: the step's value, one point per heatmap column"
                if self.steps_per_col == 1 else
                f"{name}: mean of the finite values over each heatmap column's "
                f"{self.steps_per_col} recorded steps (band: min..max)")
        bad = int(series.nonfinite.sum())
        return what + (f"; NaN/Inf at {_plural(bad, 'step')} (magenta marks)" if bad else "")

    def to_json(self) -> dict[str, object]:
        """The dashboard's dict, for :func:`analysis.plots.page_json.page_json`: the
        attributes, ``series`` by name (:meth:`ScalarSeries.to_json`), ``names`` (the keys
        in order) and ``caption`` (of the loss)."""
        return {
            "run_id": self.run_id, "n_columns": self.n_columns,
            "steps_per_col": self.steps_per_col, "n_frames": self.n_frames,
            "names": list(self.series),
            "series": {name: s.to_json() for name, s in self.series.items()},
            "caption": self.caption(),
        }


def _bins(run_id: str, table: pa.Table, n_columns: int) -> ScalarBins:
    """:class:`ScalarBins` of the rows of :func:`_binned_sql` (sorted by name, NULL first,
    then column) over ``n_columns`` columns."""
    columns = {name: table.column(name).to_numpy(zero_copy_only=False)
               for name in table.column_names}
    if not table.num_rows:  # no frame in the range: no column
        return ScalarBins(run_id, 0, 1, 0, {})
    n_frames, k = int(columns["n_frames"][0]), int(columns["k"][0])
    empty = int(np.sum(np.asarray(table.column("name").is_null())))  # columns without any
    columns = {key: values[empty:] for key, values in columns.items()}
    names = np.asarray(columns["name"], dtype=object)
    starts = np.flatnonzero(np.r_[True, names[1:] != names[:-1]])[:len(names)]
    series: dict[str, ScalarSeries] = {}
    for a, b in zip(starts, np.r_[starts[1:], len(names)][:len(starts)], strict=True):

        def part(key: str, dtype: type, a: int = a, b: int = b) -> np.ndarray:
            return np.asarray(columns[key][a:b], dtype=dtype)

        series[str(names[a])] = ScalarSeries(
            str(names[a]), part("bucket", np.int64), part("first_step", np.int64),
            part("last_step", np.int64), part("points", np.int64), part("nonfinite", np.int64),
            part("mean", np.float64), part("low", np.float64), part("high", np.float64))
    return ScalarBins(run_id, n_columns, k, n_frames, series)


def _names(names: Sequence[str]) -> list[str] | None:
    return list(names) if names else None


def load_scalar_bins(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    max_steps: int = 1000,
    names: Sequence[str] = (),
    *,
    from_step: int | None = None,
    to_step: int | None = None,
) -> ScalarBins:
    """The run's step scalars on the columns :func:`analysis.plots.grid.load_grid` makes
    with the same ``max_steps`` and range (module doc for the bins).

    Args:
        con: a read-only connection or cursor of the store.
        run_id: the run.
        max_steps: most columns (>= 1), as the grid's.
        names: the scalar names to bin (``()``: every name).
        from_step / to_step: inclusive optimiser-step range, ``None`` = unbounded.

    Returns:
        The :class:`ScalarBins` (no series without scalars, frames, or the tables).

    Raises:
        ValueError: ``max_steps`` < 1.
        StoreError: unknown run or invalid step range.
    """
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    if not has_table(con, SCALARS_TABLE):
        return ScalarBins(run_id, 0, 1, 0, {})
    from analysis.plots.grid import range_steps, step_columns

    steps = range_steps(con, params)
    if not len(steps):
        return ScalarBins(run_id, 0, 1, 0, {})
    columns = step_columns(steps, max_steps)
    table = con.sql(BINNED_SQL, params=params | {
        "names": _names(names), "starts": steps[columns.first_frames()].tolist(),
        "stop": int(steps[-1]), "n_frames": len(steps), "k": columns.k}).to_arrow_table()
    return _bins(run_id, table, columns.count)


def grid_scalar_bins(reader: StoreReader, grid: GradientGrid,
                     names: Sequence[str] = (LOSS,)) -> ScalarBins:
    """The run's step scalars on the columns of ``grid`` (one read-only statement through
    ``reader``; module doc for the bins).

    Args:
        reader: the store's reader (the file, or the endpoint of the process writing it).
        grid: the heatmap's grid (:meth:`StoreReader.grid`).
        names: the scalar names to bin (``()``: every name).

    Returns:
        The :class:`ScalarBins` with ``grid``'s column count (no series when the grid has
        no column, the run no such scalar, or the store no ``step_scalars`` table).

    Raises:
        StoreError: the store cannot be read.
    """
    n_columns = grid.shape[1]
    if not n_columns:
        return ScalarBins(grid.run_id, 0, grid.steps_per_col, grid.n_frames, {})
    params = {"run_id": grid.run_id, "from_step": None, "to_step": None,
              "names": _names(names), "starts": grid.col_first_step.tolist(),
              "stop": int(grid.col_last_step[-1]), "n_frames": grid.n_frames,
              "k": grid.steps_per_col}
    try:
        table = reader.sql(BINNED_SQL, params)
    except QueryError:
        if reader.has_table(SCALARS_TABLE):
            raise
        return ScalarBins(grid.run_id, n_columns, grid.steps_per_col, grid.n_frames, {})
    return _bins(grid.run_id, table, n_columns)
