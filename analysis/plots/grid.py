"""A run's layers x steps grid and one layer's series, downsampled by DuckDB in SQL.

Every picture and the dashboard draw from these two reductions of ``layer_stats``:

- :func:`load_grid`: rows are layers in model order (``layer_index``), columns are the
  recorded frames in step order. When a run has more frames than ``max_steps`` (or more
  layers than ``max_layers``), consecutive frames (layers) are grouped into bins of
  ``k = ceil(frames / max_steps)`` (``m = ceil(layers / max_layers)``) and each cell keeps
  the **maximum** gradient norm and flow intensity over its bin, and a flag when **any**
  entry of the bin was vanishing, exploding or non-finite. The SQL returns at most
  ``max_steps x max_layers`` cells, so the work in Python is bounded whatever the run's
  length. :meth:`GradientGrid.caption` says how the grid was downsampled; every picture
  prints it. Two statements (one snapshot: a file read alone, or a served read's
  ``BEGIN TRANSACTION READ ONLY`` cursor): the range's recorded steps (the columns' steps
  and ``k``), then one aggregation over the seven columns the cells need, each row's column
  found by arithmetic on its step when the frames are evenly spaced, else by a join on the
  listed frames (no CTE of the rows, no per-cell step bookkeeping). The recorded steps
  come from ``frames`` (one row per frame, not one per layer) when its rows stand for the
  range's ``layer_stats`` rows, the check ``analysis.report``'s ``frames_summarise``
  makes: every frame of the range has its summary (``schemas.frame_summary``: the writer
  stores it with the rows, in one transaction) and the frames' ``num_layers`` add up to
  the rows the cells aggregation counts (the count comes with the cells, so the check
  costs no scan of its own). Otherwise (a store written by another program, or before
  the summaries existed) they come from a scan of the range's distinct ``layer_stats``
  steps, and the cells are aggregated again over those. With the steps from ``frames``
  and a store whose grid rollup (``schemas.grid_rollup``: per layer, the same maxima and
  flags over aligned blocks of 16, 256 and 4,096 steps, kept by the writer with the rows)
  stands for its rows, the aggregation reads the blocks each column covers and the rows
  of only the frames at the columns' edges that no block covers (:func:`_rollup_query`):
  the same cells from about a tenth of the rows.
- :func:`load_layer_series`: one layer's norms over its recorded steps, binned the same
  way (maximum and minimum per bin).

Bins are taken over recorded frames, not step numbers, so a run that logs every 10th step
has no empty columns. When the frames are evenly spaced (every step, or every N-th) and a
column spans 16 steps or more, the columns are aligned step intervals instead
(:func:`step_columns`): their span is rounded up to a multiple of 16 (and of the stride)
and they start at multiples of it, as time buckets do, so each column is whole blocks of
the grid rollup (the rows are read only at the range's two ends) and a column keeps its
steps as the run grows; the first and last column of a range may then hold fewer frames,
and the caption says so. Maximum over a bin (not mean) keeps a single exploding step
visible after downsampling.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from analysis.read.connect import StoreError, has_column, has_table, require_run
from analysis.read.sql import stats_params, step_buckets, step_range

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

# Cell flag bits, defined once (schemas.flags): a cell has FLAG_VANISHING / FLAG_EXPLODING /
# FLAG_NONFINITE when some row of it has that stored flag; FLAG_NO_DATA, FLAG_ZERO as there.
from schemas.flags import FLAG_EXPLODING as FLAG_EXPLODING
from schemas.flags import FLAG_NO_DATA as FLAG_NO_DATA
from schemas.flags import FLAG_NONFINITE as FLAG_NONFINITE
from schemas.flags import FLAG_VANISHING as FLAG_VANISHING
from schemas.flags import FLAG_ZERO as FLAG_ZERO
from schemas.flags import predicate
from schemas.grid_rollup import ROLLUP_LEVELS, ROLLUP_TABLE, row_flag_bits_sql

_FRAMES_SQL = f"""
    SELECT DISTINCT step FROM layer_stats
    WHERE run_id = $run_id AND {step_range()}
    ORDER BY step
"""
"""The recorded frames of the range (the steps of the grid's columns), ascending: a scan of
``step`` alone."""

_SUMMARISED_SQL = f"""
    SELECT count(*) FILTER (WHERE vanishing_indices IS NULL OR rounding_gaps IS NULL),
           coalesce(sum(num_layers), 0)
    FROM frames WHERE run_id = $run_id AND {step_range()}
"""
"""The range's frames without their summary, and the ``layer_stats`` rows the frames say
the range holds (the sum of their ``num_layers``)."""

_LISTED_FRAMES_SQL = f"""
    SELECT step FROM frames
    WHERE run_id = $run_id AND {step_range()} AND num_layers > 0
    ORDER BY step
"""
"""The recorded frames of the range as ``frames`` lists them, ascending."""

_CELL_FLAGS = row_flag_bits_sql("s")
"""A row's FLAG_VANISHING | FLAG_EXPLODING | FLAG_NONFINITE bits (a NULL flag counts as
unset, as ``bool_or`` ignores NULL); ``bit_or`` over a cell gives "any row of the cell".
The rollup's ``flags`` are the same bits OR-ed over its blocks."""

_ROLLUP_CELLS_SQL = f"""
    SELECT row_no, col_no, max(max_norm) AS max_norm, max(max_flow) AS max_flow,
           bit_or(flags)::UTINYINT AS flags, sum(n_rows)::BIGINT AS n_rows
    FROM (
        SELECT s.layer_index // $layers_per_row AS row_no, e.col_no,
               s.grad_norm AS max_norm, s.flow_intensity AS max_flow,
               ({_CELL_FLAGS})::UTINYINT AS flags, 1::BIGINT AS n_rows
        FROM layer_stats AS s
        JOIN (SELECT unnest($edge_steps::BIGINT[]) AS step,
                     unnest($edge_cols::BIGINT[]) AS col_no) AS e ON e.step = s.step
        WHERE s.run_id = $run_id
        UNION ALL
        SELECT r.layer_index // $layers_per_row, b.col_no, r.max_norm, r.max_flow, r.flags,
               r.rows
        FROM {ROLLUP_TABLE} AS r
        JOIN (SELECT unnest($levels::UTINYINT[]) AS level, unnest($blocks::BIGINT[]) AS block,
                     unnest($block_cols::BIGINT[]) AS col_no) AS b
          ON b.level = r.level AND b.block = r.block
        WHERE r.run_id = $run_id
    )
    GROUP BY row_no, col_no
"""
"""Cells from the rollup (``schemas.grid_rollup``): the blocks each column covers, sent as
three lists (level, block, column), and the rows of the edge frames no block covers, sent
as two lists (step, column); the same maxima, OR and row count as over the rows."""

_ROLLUP_COUNTS_SQL = f"SELECT level, sum(rows) FROM {ROLLUP_TABLE} GROUP BY level"
"""The rows each rollup level holds (every level holds every row once)."""

_STORE_ROWS_SQL = """
    SELECT (SELECT count(*) FROM layer_stats),
           (SELECT coalesce(sum(num_layers), 0) FROM frames)
"""
"""The store's ``layer_stats`` rows (``count(*)`` without a filter: DuckDB answers it from
the table's row count, reading no row) and the rows its ``frames`` count."""

_ROLLUP_MAX_EDGE_SHARE = 0.5
"""Most share of a grid's frames read as rows beside the rollup's blocks: beyond it (a
run recording one step in many, whose blocks hold one frame each) the plain aggregation
with its column by arithmetic is as fast, and it is the one used."""


def _cells_sql(bucket: str, join: str = "") -> str:
    """The one aggregation of :func:`load_grid`: per (row, column) cell the maximum norm and
    flow intensity, the OR of the row flags and the number of rows (``n_rows``), reading
    only ``layer_index``, ``step``, ``grad_norm``, ``flow_intensity`` and the three flag
    columns.

    Args:
        bucket: the SQL of a row's column number (``s.step`` -> ``0..C-1``).
        join: a join bringing the relation ``bucket`` reads (``""``: none).
    """
    return f"""
    SELECT s.layer_index // $layers_per_row AS row_no,
           {bucket} AS col_no,
           max(s.grad_norm) AS max_norm,
           max(s.flow_intensity) AS max_flow,
           bit_or({_CELL_FLAGS})::UTINYINT AS flags,
           count(*) AS n_rows
    FROM layer_stats AS s {join}
    WHERE s.run_id = $run_id AND {step_range("s")}
    GROUP BY row_no, col_no
"""


_STRIDED_CELLS_SQL = _cells_sql("(s.step - $origin) // $col_span")
"""Cells when the columns are step intervals (:class:`StepColumns`, evenly spaced frames):
the column is arithmetic on the step, no join."""

_LISTED_CELLS_SQL = _cells_sql(
    "b.col_no",
    "JOIN (SELECT unnest($frame_steps::BIGINT[]) AS step, "
    "unnest($frame_cols::BIGINT[]) AS col_no) AS b ON b.step = s.step",
)
"""Cells for frames at any steps: each frame's column sent as two lists (steps, columns)
and joined on the step."""

_SERIES_SQL = f"""
    WITH s AS (
        SELECT step, grad_norm, mean_abs_grad, max_abs_grad, is_vanishing, is_exploding,
               nonfinite
        FROM layer_stats
        WHERE run_id = $run_id AND {step_range()} AND layer_index = $layer_index
    ),
    {step_buckets("s", "max_points")}
    SELECT b.bucket AS bin,
           min(s.step) AS first_step, max(s.step) AS last_step,
           max(grad_norm) AS max_norm, min(grad_norm) AS min_norm,
           max(mean_abs_grad) AS max_mean_abs, max(max_abs_grad) AS max_abs,
           bool_or({predicate("vanishing", "s")}) AS vanishing,
           bool_or({predicate("exploding", "s")}) AS exploding,
           bool_or({predicate("nonfinite", "s")}) AS nonfinite,
           any_value(b.n_frames) AS total, any_value(b.k) AS k
    FROM s JOIN bucketed AS b USING (step)
    GROUP BY bin ORDER BY bin
"""


def _f64(column: object) -> np.ndarray:
    """A fetched DuckDB column as float64 with NULL -> NaN (``fetchnumpy`` returns a masked
    array for a column with NULLs; a plain conversion would turn them into 0)."""
    return np.ma.filled(np.ma.asarray(column, dtype=np.float64), np.nan)


def _bins(count: int, limit: int) -> int:
    """Smallest bin size ``b`` with ``ceil(count / b) <= limit`` (1 when it already fits)."""
    return max(1, -(-count // limit))


ALIGNED_SPAN = 1 << min(ROLLUP_LEVELS)
"""Columns of evenly spaced frames that span this many steps or more span a multiple of it
and start at a multiple of their span (:func:`step_columns`): 16, the finest block of the
grid rollup, so that each column is whole rollup blocks."""


@dataclass(frozen=True)
class StepColumns:
    """How :func:`load_grid` puts a range's ``F`` recorded frames into ``C`` columns.

    Attributes:
        k: recorded frames per column (a column at either end of the range may hold
            fewer when the columns are aligned).
        frame_cols: int64[F], each frame's column, non-decreasing from 0 to ``C - 1``,
            every column holding a frame.
        origin / span: the columns are step intervals, column ``c`` the steps
            ``[origin + c * span, origin + (c + 1) * span - 1]`` (``(step - origin) //
            span``); ``span == 0``: they are not (irregular frames, binned by ordinal).
        aligned: the span was rounded to a multiple of :data:`ALIGNED_SPAN` and the
            columns start at multiples of it (the caption says so).
    """

    k: int
    frame_cols: np.ndarray
    origin: int
    span: int
    aligned: bool = False

    @property
    def count(self) -> int:
        """Columns ``C``."""
        return int(self.frame_cols[-1]) + 1 if len(self.frame_cols) else 0

    def first_frames(self) -> np.ndarray:
        """int64[C]: the index of each column's first frame."""
        return np.flatnonzero(np.diff(self.frame_cols, prepend=-1))

    def column_of(self, steps: np.ndarray, first_steps: np.ndarray) -> np.ndarray:
        """int64: the column owning each step of ``steps`` (any steps, not only frames):
        its step interval, or for ordinal columns the column whose first frame
        (``first_steps``, int64[C]) is the last at or before the step."""
        if self.span:
            return (steps - self.origin) // self.span
        return np.searchsorted(first_steps, steps, side="right") - 1


def step_columns(steps: np.ndarray, max_steps: int) -> StepColumns:
    """The columns of the recorded frames ``steps`` (int64[F], ascending, distinct, F >= 1)
    for at most ``max_steps`` columns.

    ``k = ceil(F / max_steps)`` consecutive frames per column (1: a column per frame).
    Evenly spaced frames (stride ``s``) make step intervals of ``k * s`` steps from the
    first frame; when those span :data:`ALIGNED_SPAN` steps or more, the span is rounded
    up to a multiple of ``lcm(ALIGNED_SPAN, s)`` and the intervals start at multiples of
    it (as time buckets do), provided that still makes at most ``max_steps`` columns: the
    columns then cover whole blocks of the grid rollup, so the rollup alone gives their
    cells, and a column keeps its steps as the run grows. Irregular frames are binned by
    ordinal, ``k`` at a time.

    Raises:
        ValueError: ``steps`` is empty or ``max_steps`` < 1.

    >>> c = step_columns(np.arange(3, 1003), 10)   # 1000 frames, every step from 3
    >>> c.k, c.span, c.origin, c.count, np.bincount(c.frame_cols).tolist()[:3]
    (112, 112, 0, 9, [109, 112, 112])
    >>> step_columns(np.arange(0, 50, 5), 4).span   # 10 frames every 5 steps: 3 per column
    15
    >>> step_columns(np.array([0, 1, 5, 6, 20]), 2).frame_cols.tolist()   # irregular
    [0, 0, 0, 1, 1]
    """
    if len(steps) == 0 or max_steps < 1:
        raise ValueError("step_columns needs frames and max_steps >= 1")
    n_frames = len(steps)
    k = _bins(n_frames, max_steps)
    first, last = int(steps[0]), int(steps[-1])
    stride = int(steps[1] - steps[0]) if n_frames > 1 else 1
    if n_frames > 1 and not bool((np.diff(steps) == stride).all()):
        return StepColumns(k, np.arange(n_frames, dtype=np.int64) // k, 0, 0)
    span, origin = stride * k, first
    if k > 1 and span >= ALIGNED_SPAN:
        unit = math.lcm(ALIGNED_SPAN, stride)
        for aligned in (-(-span // unit) * unit, (-(-span // unit) + 1) * unit):
            if last // aligned - first // aligned + 1 <= max_steps:
                origin = first // aligned * aligned
                return StepColumns(aligned // stride, (steps - origin) // aligned, origin,
                                   aligned, aligned=True)
    return StepColumns(k, (steps - origin) // span, origin, span)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True)
class RunShape:
    """A run's layer names in model order and its thresholds (from ``runs``, ``layers``)."""

    run_id: str
    layer_names: list[str]
    vanishing_threshold: float
    exploding_threshold: float


def load_run_shape(con: duckdb.DuckDBPyConnection, run_id: str) -> RunShape:
    """Layer names (model order; ``layer[i]`` where a name is missing) and thresholds.

    Raises:
        StoreError: unknown run.
    """
    require_run(con, run_id)
    row = con.execute(
        "SELECT num_layers, vanishing_threshold, exploding_threshold FROM runs "
        "WHERE run_id = $run_id",
        {"run_id": run_id},
    ).fetchone()
    assert row is not None  # require_run checked it
    num_layers, van, exp = int(row[0]), float(row[1]), float(row[2])
    names = [f"layer[{i}]" for i in range(num_layers)]
    for index, name in con.execute(
        "SELECT layer_index, name FROM layers WHERE run_id = $run_id", {"run_id": run_id}
    ).fetchall():
        if 0 <= index < num_layers:
            names[index] = name
    return RunShape(run_id, names, van, exp)


@dataclass(frozen=True)
class GradientGrid:
    """A run's gradient flow as a layers x steps grid (``R`` rows, ``C`` columns).

    Attributes:
        run_id: the run drawn.
        row_labels: str[R], the layer name, or ``"first … last"`` for a bin of layers.
        row_first_layer / row_last_layer: int64[R], model-order indices each row covers.
        col_first_step / col_last_step: int64[C], optimiser steps each column covers.
        col_frames: int64[C], recorded frames in each column.
        max_norm: float64[R, C], maximum L2 gradient norm over the cell (NaN: no data).
        max_flow: float64[R, C], maximum flow intensity (grad_norm / max over layers of
            the step, in [0, 1]) over the cell (NaN: no data).
        flags: uint8[R, C], bit set of FLAG_VANISHING, FLAG_EXPLODING, FLAG_NONFINITE,
            FLAG_NO_DATA, FLAG_ZERO.
        steps_per_col: frames per column ``k`` (1 = every recorded step shown).
        layers_per_row: layers per row ``m`` (1 = every layer shown).
        n_frames / n_layers: recorded frames in the range, layers of the run.
        vanishing_threshold / exploding_threshold: the run's thresholds.
        aligned_span: ``S > 0`` when the columns are the aligned step intervals
            ``[c * S, (c + 1) * S - 1]`` (:func:`step_columns`; the first and last column
            of the range may hold fewer than ``k`` frames); 0 when each column is ``k``
            consecutive frames from the range's first (the last may hold fewer).
    """

    run_id: str
    row_labels: list[str]
    row_first_layer: np.ndarray
    row_last_layer: np.ndarray
    col_first_step: np.ndarray
    col_last_step: np.ndarray
    col_frames: np.ndarray
    max_norm: np.ndarray
    max_flow: np.ndarray
    flags: np.ndarray
    steps_per_col: int
    layers_per_row: int
    n_frames: int
    n_layers: int
    vanishing_threshold: float
    exploding_threshold: float
    aligned_span: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns)."""
        return (len(self.row_labels), len(self.col_first_step))

    @property
    def downsampled(self) -> bool:
        """Whether a column or a row covers more than one frame or layer."""
        return self.steps_per_col > 1 or self.layers_per_row > 1

    def require_frames(self) -> GradientGrid:
        """This grid, when it has a frame to draw.

        Raises:
            StoreError: no frame was recorded in the grid's step range.
        """
        if self.n_frames == 0:
            raise StoreError(
                f"run {self.run_id!r} has no gradient frame in the requested steps")
        return self

    def log_norm(self) -> np.ndarray:
        """float64[R, C]: log10 of :attr:`max_norm`; NaN where there is no data or the
        norm is 0 (see FLAG_NO_DATA, FLAG_ZERO)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.log10(self.max_norm)
        out[~np.isfinite(out)] = np.nan
        return out

    def caption(self) -> str:
        """One line saying what the grid shows and how it was downsampled, e.g.
        ``"2000 steps x 12 layers; downsampled: each column = max over 10 consecutive
        recorded steps (200 columns)"``."""
        rows, cols = self.shape
        head = f"{_plural(self.n_frames, 'recorded step')} x {_plural(self.n_layers, 'layer')}"
        if not self.downsampled:
            return f"{head}; every step and every layer shown"
        parts = []
        span = self.aligned_span
        if self.steps_per_col > 1 and span:
            parts.append(
                f"each column = max over the recorded steps of a {span}-step interval from "
                f"a multiple of {span} (up to {self.steps_per_col}; {_plural(cols, 'column')})"
            )
        elif self.steps_per_col > 1:
            parts.append(
                f"each column = max over {self.steps_per_col} consecutive recorded steps "
                f"({_plural(cols, 'column')})"
            )
        if self.layers_per_row > 1:
            parts.append(
                f"each row = max over {self.layers_per_row} consecutive layers "
                f"({_plural(rows, 'row')})"
            )
        return f"{head}; downsampled: " + "; ".join(parts) + "; flags: any in bin"

    def fields(self) -> dict[str, object]:
        """Every field except the three cell arrays, as JSON values (str, int, float, lists
        of them), keyed by field name: the part of the grid's codec shared by
        :meth:`to_json` and the endpoint's Arrow wire; :meth:`from_fields` inverts it."""
        return {
            "run_id": self.run_id,
            "row_labels": list(self.row_labels),
            "row_first_layer": self.row_first_layer.tolist(),
            "row_last_layer": self.row_last_layer.tolist(),
            "col_first_step": self.col_first_step.tolist(),
            "col_last_step": self.col_last_step.tolist(),
            "col_frames": self.col_frames.tolist(),
            "steps_per_col": self.steps_per_col,
            "layers_per_row": self.layers_per_row,
            "n_frames": self.n_frames,
            "n_layers": self.n_layers,
            "vanishing_threshold": self.vanishing_threshold,
            "exploding_threshold": self.exploding_threshold,
            "aligned_span": self.aligned_span,
        }

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any], max_norm: np.ndarray,
                    max_flow: np.ndarray, flags: np.ndarray) -> GradientGrid:
        """The grid of :meth:`fields` and its cells (``R x C`` float64, float64, uint8).

        Raises:
            KeyError: a field is missing. ValueError: a cell array is not ``R x C``.
        """
        shape = (len(fields["row_labels"]), len(fields["col_first_step"]))
        for cells in (max_norm, max_flow, flags):
            if cells.shape != shape:
                raise ValueError(f"grid cells of shape {cells.shape}, expected {shape}")

        def ints(name: str) -> np.ndarray:
            return np.asarray(fields[name], dtype=np.int64)

        return cls(
            run_id=str(fields["run_id"]), row_labels=list(fields["row_labels"]),
            row_first_layer=ints("row_first_layer"), row_last_layer=ints("row_last_layer"),
            col_first_step=ints("col_first_step"), col_last_step=ints("col_last_step"),
            col_frames=ints("col_frames"), max_norm=np.asarray(max_norm, np.float64),
            max_flow=np.asarray(max_flow, np.float64), flags=np.asarray(flags, np.uint8),
            steps_per_col=int(fields["steps_per_col"]),
            layers_per_row=int(fields["layers_per_row"]),
            n_frames=int(fields["n_frames"]), n_layers=int(fields["n_layers"]),
            vanishing_threshold=float(fields["vanishing_threshold"]),
            exploding_threshold=float(fields["exploding_threshold"]),
            aligned_span=int(fields.get("aligned_span", 0)),
        )

    def to_json(self) -> dict[str, object]:
        """The dashboard's and the animation's dict, for
        :func:`analysis.plots.page_json.page_json`: :meth:`fields` (the row labels under
        ``rows``), ``log_norm`` and ``flow`` (float64 ``R x C`` arrays rounded to 4
        decimals: 1e-4 in log10 is a 0.02% norm change; non-finite written as ``null``),
        ``flags`` (uint8 ``R x C``) and the ``caption``."""
        fields = self.fields()
        return {
            "rows": fields.pop("row_labels"),
            **fields,
            "log_norm": np.round(self.log_norm(), 4),
            "flow": np.round(self.max_flow, 4),
            "flags": self.flags,
            "caption": self.caption(),
        }

    def to_arrow(self) -> pa.Table:
        """The grid as one Arrow table, exact: columns ``max_norm``, ``max_flow`` (float64)
        and ``flags`` (uint8), each ``R x C`` cells row-major; :meth:`fields` as JSON in the
        schema metadata (key ``gradstream.grid``). :meth:`from_arrow` inverts it."""
        import pyarrow as pa

        table = pa.table({
            "max_norm": pa.array(np.ascontiguousarray(self.max_norm, np.float64).ravel()),
            "max_flow": pa.array(np.ascontiguousarray(self.max_flow, np.float64).ravel()),
            "flags": pa.array(np.ascontiguousarray(self.flags, np.uint8).ravel()),
        })
        return table.replace_schema_metadata(
            {_ARROW_META: json.dumps(self.fields(), allow_nan=True)})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> GradientGrid:
        """The grid of :meth:`to_arrow`'s table.

        Raises:
            ValueError: the table carries no grid metadata, or its cell count is not R x C.
        """
        raw = (table.schema.metadata or {}).get(_ARROW_META)
        if raw is None:
            raise ValueError("the table is not a gradstream grid (no grid metadata)")
        fields = json.loads(raw)
        shape = (len(fields["row_labels"]), len(fields["col_first_step"]))
        if table.num_rows != shape[0] * shape[1]:
            raise ValueError(f"grid of {table.num_rows} cells, expected {shape[0]} x {shape[1]}")

        def cells(name: str, dtype: type) -> np.ndarray:
            column = table.column(name).to_numpy(zero_copy_only=False)
            return np.asarray(column, dtype=dtype).reshape(shape).copy()

        return cls.from_fields(fields, cells("max_norm", np.float64),
                               cells("max_flow", np.float64), cells("flags", np.uint8))


_ARROW_META = b"gradstream.grid"
"""Schema-metadata key of :meth:`GradientGrid.to_arrow`'s fields (JSON)."""


def load_grid(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    max_steps: int = 1000,
    max_layers: int = 400,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
) -> GradientGrid:
    """Reduce a run's ``layer_stats`` to at most ``max_layers x max_steps`` cells, in SQL.

    Args:
        con: a DuckDB connection to the store (read-only connection or cursor).
        run_id: the run.
        max_steps: most columns (>= 1); more recorded frames are binned by ``k =
            ceil(frames / max_steps)`` consecutive frames (maximum over the bin), or by
            aligned step intervals of about as many frames (:func:`step_columns`).
        max_layers: most rows (>= 1); more layers are binned by ``m = ceil(layers /
            max_layers)`` consecutive layers in model order.
        from_step / to_step: inclusive optimiser-step range, ``None`` = unbounded.

    Returns:
        The :class:`GradientGrid`; with no frame in the range it has 0 columns.

    Raises:
        ValueError: ``max_steps`` or ``max_layers`` < 1.
        StoreError: unknown run or invalid step range.
    """
    if max_steps < 1 or max_layers < 1:
        raise ValueError(f"max_steps and max_layers must be >= 1, got {max_steps}, {max_layers}")
    params = stats_params(run_id, from_step, to_step)
    shape = load_run_shape(con, run_id)
    n_layers = len(shape.layer_names)
    m = _bins(n_layers, max_layers)
    n_rows = -(-n_layers // m) if n_layers else 0
    row_first = np.arange(n_rows, dtype=np.int64) * m
    row_last = np.minimum(row_first + m, n_layers) - 1
    labels = [
        shape.layer_names[a] if a == b else f"{shape.layer_names[a]} … {shape.layer_names[b]}"
        for a, b in zip(row_first.tolist(), row_last.tolist(), strict=True)
    ]
    cell_params = params | {"layers_per_row": m}
    cells: _Cells | None = None
    listed = _listed_frames(con, params)
    if listed is not None:  # frames' count checked against the rows the cells counted
        steps, stored_rows = listed
        cells = _load_cells(con, run_id, steps, max_steps, n_rows, n_layers, cell_params,
                            listed=True)
        if cells is not None and cells.n_rows != stored_rows:
            cells = None
    if cells is None:
        steps = np.asarray(con.execute(_FRAMES_SQL, params).fetchnumpy()["step"], np.int64)
        if len(steps) == 0:
            empty = np.zeros((n_rows, 0))
            return GradientGrid(
                run_id, labels, row_first, row_last, np.zeros(0, np.int64),
                np.zeros(0, np.int64), np.zeros(0, np.int64), empty, empty.copy(),
                np.zeros((n_rows, 0), np.uint8), 1, m, 0, n_layers,
                shape.vanishing_threshold, shape.exploding_threshold,
            )
        cells = _load_cells(con, run_id, steps, max_steps, n_rows, n_layers, cell_params)
        assert cells is not None  # not listed
    columns = cells.columns
    starts = columns.first_frames()
    col_frames = np.diff(starts, append=len(steps))
    return GradientGrid(
        run_id, labels, row_first, row_last, steps[starts], steps[starts + col_frames - 1],
        col_frames, cells.max_norm, cells.max_flow, cells.flags, columns.k, m, len(steps),
        n_layers, shape.vanishing_threshold, shape.exploding_threshold,
        aligned_span=columns.span if columns.aligned else 0,
    )


def range_steps(con: duckdb.DuckDBPyConnection, params: dict[str, object]) -> np.ndarray:
    """The recorded steps of a run's range (int64[F], ascending), where :func:`load_grid`
    takes them: from ``frames`` when every frame of the range carries its summary
    (:func:`_listed_frames`), else the distinct steps of its ``layer_stats`` rows.

    Args:
        con: a connection or cursor of the store.
        params: ``run_id``, ``from_step``, ``to_step`` (:func:`analysis.read.sql.stats_params`).
    """
    listed = _listed_frames(con, params)
    if listed is not None:
        return listed[0]
    return np.asarray(con.execute(_FRAMES_SQL, params).fetchnumpy()["step"], np.int64)


def _listed_frames(con: duckdb.DuckDBPyConnection,
                   params: dict[str, object]) -> tuple[np.ndarray, int] | None:
    """The range's recorded steps (int64[F], ascending) and the ``layer_stats`` rows they
    hold as ``frames`` lists them, when every frame of the range carries the summary the
    writer stores with its rows; None when one does not, the store predates the summary,
    or ``frames`` lists no frame in the range (:func:`load_grid` then scans the rows)."""
    if not has_column(con, "frames", "rounding_gaps"):
        return None
    row = con.execute(_SUMMARISED_SQL, params).fetchone()
    assert row is not None  # an aggregate
    if row[0]:
        return None
    steps = np.asarray(con.execute(_LISTED_FRAMES_SQL, params).fetchnumpy()["step"], np.int64)
    return (steps, int(row[1])) if len(steps) else None


@dataclass(frozen=True)
class _Cells:
    """:func:`load_grid`'s cells: the columns (:class:`StepColumns`), the ``R x C`` arrays of
    :class:`GradientGrid` (``flags`` with FLAG_NO_DATA and FLAG_ZERO set) and the number of
    ``layer_stats`` rows they were aggregated from."""

    columns: StepColumns
    max_norm: np.ndarray
    max_flow: np.ndarray
    flags: np.ndarray
    n_rows: int


def _load_cells(con: duckdb.DuckDBPyConnection, run_id: str, steps: np.ndarray,
                max_steps: int, n_rows: int, n_layers: int, params: dict[str, object],
                listed: bool = False) -> _Cells | None:
    """Aggregate the range's rows into the cells of the recorded frames ``steps`` (int64[F],
    ascending, distinct, F >= 1) in the columns of :func:`step_columns`.

    Args:
        listed: ``steps`` is the list of ``frames`` (:func:`_listed_frames`), not the rows'
            own: a row binned outside the columns means the list misses its step, and the
            result is None (the caller scans the rows' steps) instead of an error; and
            the rollup's blocks are read where they cover a column (:func:`_rollup_query`)
            when the store's rollup stands for its rows (:func:`_rollup_fresh`). The
            caller checks the row count.

    Raises:
        StoreError: a row's layer index is beyond the run's layers, or a row's step lies
            outside the frames (the run changed between the two statements).
    """
    columns = step_columns(steps, max_steps)
    n_cols = columns.count
    query = _rollup_query(steps, columns, params) if listed else None
    if query is not None and not _rollup_fresh(con):
        query = None
    cells = con.execute(*(query or _cells_query(steps, columns, params))).fetchnumpy()
    rows = np.asarray(cells["row_no"], dtype=np.int64)
    cols = np.asarray(cells["col_no"], dtype=np.int64)
    if len(rows) and rows.max() >= n_rows:
        raise StoreError(f"run {run_id!r} has layer_stats rows beyond its {n_layers} layers")
    if len(cols) and (cols.min() < 0 or cols.max() >= n_cols):  # frames of one snapshot
        if listed:
            return None
        raise StoreError(f"run {run_id!r} changed while its grid was read; read it again")
    max_norm = np.full((n_rows, n_cols), np.nan)
    max_flow = np.full((n_rows, n_cols), np.nan)
    max_norm[rows, cols] = _f64(cells["max_norm"])
    max_flow[rows, cols] = _f64(cells["max_flow"])
    flags = np.full((n_rows, n_cols), FLAG_NO_DATA, dtype=np.uint8)
    flags[rows, cols] = np.asarray(cells["flags"], dtype=np.uint8)
    flags[max_norm == 0] |= FLAG_ZERO
    n_stored = int(np.asarray(cells["n_rows"], np.int64).sum())
    return _Cells(columns, max_norm, max_flow, flags, n_stored)


def _rollup_fresh(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store's grid rollup (``schemas.grid_rollup``) stands for its rows: the
    table exists, and the ``layer_stats`` rows, the rows the ``frames`` count and the rows
    each rollup level holds are the same number, store-wide (a row written or deleted by
    another program, or a run whose rollup was not filled, breaks it: the cells are then
    read from the rows). The check the report makes of the frame summaries
    (``analysis.report.frames_summarise``), with the row count read from DuckDB's table
    metadata instead of a scan of the run's rows."""
    if not has_table(con, ROLLUP_TABLE):
        return False
    stored, framed = con.execute(_STORE_ROWS_SQL).fetchall()[0]
    levels = dict(con.execute(_ROLLUP_COUNTS_SQL).fetchall())
    return stored == framed and all(levels.get(level) == stored for level in ROLLUP_LEVELS)


def _rollup_query(steps: np.ndarray, columns: StepColumns,
                  params: dict[str, object]) -> tuple[str, dict[str, object]] | None:
    """The cells statement over the rollup's blocks (:data:`_ROLLUP_CELLS_SQL`) for the
    recorded frames ``steps`` (int64[F], ascending, distinct) in ``columns``.

    Column ``c`` owns its step interval, or for ordinal columns the steps from its first
    frame up to the next column's first frame (:meth:`StepColumns.column_of`); a block
    whose steps lie within the range and in one column's is covered by it. Per level,
    coarsest first, the covered blocks not inside a covered block of the level above are
    read; the frames in no covered block of the finest level (at most 2^L - 1 steps each
    side of a column; aligned columns are whole blocks of it, so only the range's ends)
    are read as rows.

    Returns:
        The statement and its parameters; None when more than
        :data:`_ROLLUP_MAX_EDGE_SHARE` of the frames would be read as rows.
    """
    frame_cols = columns.frame_cols
    starts = steps[columns.first_frames()]
    first, last = int(steps[0]), int(steps[-1])
    levels: list[np.ndarray] = []
    blocks: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    above: tuple[int, np.ndarray] | None = None  # the level above and its covered blocks
    for level in sorted(ROLLUP_LEVELS, reverse=True):
        held = np.unique(steps >> level)  # the blocks holding a frame
        lo = held << level
        hi = lo + ((1 << level) - 1)
        col = columns.column_of(lo, starts)
        covered = (lo >= first) & (hi <= last) & (col == columns.column_of(hi, starts))
        read = covered
        if above is not None:
            read = covered & ~np.isin(held >> (above[0] - level), above[1])
        levels.append(np.full(int(read.sum()), level, np.int64))
        blocks.append(held[read])
        cols.append(col[read])
        above = (level, held[covered])
    assert above is not None  # ROLLUP_LEVELS is not empty
    edge = ~np.isin(steps >> above[0], above[1])
    if edge.sum() > _ROLLUP_MAX_EDGE_SHARE * len(steps):
        return None
    run = {"run_id": params["run_id"], "layers_per_row": params["layers_per_row"]}
    return _ROLLUP_CELLS_SQL, run | {  # the lists hold the range: no bound of their own
        "edge_steps": steps[edge].tolist(), "edge_cols": frame_cols[edge].tolist(),
        "levels": np.concatenate(levels).tolist(), "blocks": np.concatenate(blocks).tolist(),
        "block_cols": np.concatenate(cols).tolist(),
    }


def _cells_query(steps: np.ndarray, columns: StepColumns,
                 params: dict[str, object]) -> tuple[str, dict[str, object]]:
    """The cells statement of :func:`load_grid` and its parameters for the recorded frames
    ``steps`` (int64[F], ascending, distinct) in ``columns``.

    Columns that are step intervals (evenly spaced frames: every step, every N-th step,
    the usual runs) give each row's column by arithmetic on its step
    (:data:`_STRIDED_CELLS_SQL`, ~1.5x faster than the join at 10 M rows); other frames
    send their columns as lists joined on the step (:data:`_LISTED_CELLS_SQL`). Both give
    the same cells: the columns of ``columns.frame_cols``.
    """
    if columns.span:
        return _STRIDED_CELLS_SQL, params | {"origin": columns.origin,
                                             "col_span": columns.span}
    return _LISTED_CELLS_SQL, params | {"frame_steps": steps.tolist(),
                                        "frame_cols": columns.frame_cols.tolist()}


@dataclass(frozen=True)
class LayerSeries:
    """One layer's gradient statistics over its recorded steps, binned (``B`` bins).

    Attributes:
        run_id / layer_index / layer_name: which layer.
        first_step / last_step: int64[B], steps each bin covers.
        max_norm / min_norm: float64[B], max and min L2 gradient norm over the bin.
        max_mean_abs / max_abs: float64[B], max of mean |g| and of max |g| over the bin
            (NaN when the run sends norms only: ``mean_abs_grad`` / ``max_abs_grad`` NULL).
        flags: uint8[B], FLAG_VANISHING | FLAG_EXPLODING | FLAG_NONFINITE (any in bin).
        steps_per_bin: recorded steps per bin (1 = every step).
        total: recorded steps of the layer in the range.
    """

    run_id: str
    layer_index: int
    layer_name: str
    first_step: np.ndarray
    last_step: np.ndarray
    max_norm: np.ndarray
    min_norm: np.ndarray
    max_mean_abs: np.ndarray
    max_abs: np.ndarray
    flags: np.ndarray
    steps_per_bin: int
    total: int

    def caption(self) -> str:
        """What the series shows and how it was downsampled."""
        head = f"{_plural(self.total, 'recorded step')}"
        if self.steps_per_bin == 1:
            return f"{head}; every step shown"
        return (
            f"{head}; downsampled: each point = max (band: min) over {self.steps_per_bin} "
            f"consecutive recorded steps ({_plural(len(self.first_step), 'point')})"
        )

    def to_json(self) -> dict[str, object]:
        """The dashboard's dict, for :func:`analysis.plots.page_json.page_json`: every
        attribute (the arrays as NumPy arrays, non-finite floats written as ``null``) and the
        ``caption``."""
        return {
            "run_id": self.run_id,
            "layer_index": self.layer_index,
            "layer_name": self.layer_name,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "max_norm": self.max_norm,
            "min_norm": self.min_norm,
            "max_mean_abs": self.max_mean_abs,
            "max_abs": self.max_abs,
            "flags": self.flags,
            "steps_per_bin": self.steps_per_bin,
            "total": self.total,
            "caption": self.caption(),
        }


def load_layer_series(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    layer_index: int,
    max_points: int = 1000,
    *,
    from_step: int | None = None,
    to_step: int | None = None,
) -> LayerSeries:
    """One layer's norm series, at most ``max_points`` bins of consecutive recorded steps.

    Args:
        con: a DuckDB connection to the store.
        run_id: the run.
        layer_index: the layer, in model order (0-based).
        max_points: most bins (>= 1).
        from_step / to_step: inclusive step range, ``None`` = unbounded.

    Raises:
        ValueError: ``max_points`` < 1.
        StoreError: unknown run, layer index outside the run, or invalid step range.
    """
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    params = stats_params(run_id, from_step, to_step)
    shape = load_run_shape(con, run_id)
    if not 0 <= layer_index < len(shape.layer_names):
        raise StoreError(
            f"run {run_id!r} has {len(shape.layer_names)} layers; no layer index {layer_index}"
        )
    cols = con.execute(
        _SERIES_SQL, params | {"layer_index": layer_index, "max_points": max_points}
    ).fetchnumpy()
    n = len(cols["bin"])

    def f64(name: str) -> np.ndarray:
        return _f64(cols[name])

    flags = (
        np.asarray(cols["vanishing"], bool) * FLAG_VANISHING
        | np.asarray(cols["exploding"], bool) * FLAG_EXPLODING
        | np.asarray(cols["nonfinite"], bool) * FLAG_NONFINITE
    ).astype(np.uint8)
    return LayerSeries(
        run_id, layer_index, shape.layer_names[layer_index],
        np.asarray(cols["first_step"], np.int64), np.asarray(cols["last_step"], np.int64),
        f64("max_norm"), f64("min_norm"), f64("max_mean_abs"), f64("max_abs"), flags,
        int(cols["k"][0]) if n else 1, int(cols["total"][0]) if n else 0,
    )
