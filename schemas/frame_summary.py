"""What a report needs of one frame, kept in its ``frames`` row: the summary written with it.

A report over a run (:func:`analysis.report.build_report`) is a handful of facts per layer
and per frame: which layers were vanishing, exploding or non-finite at which steps, and
which layers were at floating-point rounding level (:mod:`schemas.rounding`). Computed
from ``layer_stats`` that is a scan of every row of the run, with a window sort per step
for the rounding judgement: O(layers x steps) on every report. The writer already holds
each frame's rows when it stores them, so it also stores, in the frame's ``frames`` row
and in the same transaction (a rewritten frame's summary is replaced with its rows):

- ``vanishing_indices``, ``exploding_indices``, ``nonfinite_indices``: the layer indices
  of the frame's rows with ``is_vanishing``, ``is_exploding``, ``nonfinite > 0``
  (ascending, INTEGER[]; empty, never NULL, when there is none);
- ``inf_indices``: those with an Inf element, ``nonfinite > nan`` with ``nan`` known (the
  reference's exploding rule, ``schemas.health.NONFINITE_VERDICTS``);
- the inputs of the rounding judgement for every row that may be at rounding level under
  some dtype: ``top_magnitude`` (``A``, the largest magnitude of the frame) and, in layer
  order, ``rounding_candidates`` (layer indices of the rows meeting condition 1 and
  ``a <= LARGEST_ROUNDOFF * A``, condition 2 under the largest unit roundoff of any dtype),
  ``rounding_magnitudes`` (their ``a``) and ``rounding_gaps`` (their ``W``, condition 3;
  NULL for the frame's largest row, as SQL's ``lag`` gives);
- ``layer_index_max``: the frame's largest layer index. A frame whose ``num_layers`` is
  ``layer_index_max + 1`` holds every layer from 0 to it (layer indices are distinct and
  >= 0), so which layers it holds is known without reading its rows.

The judgement itself needs the layer's dtype, which a reader takes from ``layers`` as the
full scan does, and evaluates :func:`schemas.rounding.at_rounding_sql` over these stored
doubles: the expression :func:`schemas.rounding.rounding_rows_sql` evaluates over the same
doubles, so the two agree row for row. A row not among the candidates fails condition 1
or 2 for every dtype (``u * A <= LARGEST_ROUNDOFF * A``), so it is at rounding level under
none.

The values are computed here in NumPy over a whole batch at once (one sort of the batch's
rows by frame and magnitude, no loop over frames or layers), reproducing DuckDB's
semantics of the full scan's SQL bit for bit: IEEE arithmetic, and NaN ordered above
every number (``NaN > 0``, ``x <= NaN`` and ``max`` returning NaN are all true there).
``tests/analysis/test_report_frame_summary.py`` checks reports from these summaries
against the SQL scan on random runs written by the real writer. The writer
(:class:`consumer.outputs.duckdb.DuckDBSink`, which the Iceberg output stages through
too) calls :func:`summarize_frames` on each batch; :func:`fill_frame_summaries` gives the
summary to ``frames`` rows stored before the columns existed or written by another
program. A ``frames`` row whose summary is NULL is one nobody summarised; a reader then
scans the rows instead.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from schemas.rounding import LARGEST_ROUNDOFF

if TYPE_CHECKING:
    import duckdb

SUMMARY_COLUMNS: tuple[str, ...] = (
    "vanishing_indices", "exploding_indices", "nonfinite_indices", "inf_indices",
    "top_magnitude", "rounding_candidates", "rounding_magnitudes", "rounding_gaps",
    "layer_index_max",
)
"""The ``frames`` columns of the summary (module doc), in table order."""

FILL_CHUNK_ROWS = 1 << 21
"""``layer_stats`` rows :func:`fill_frame_summaries` holds at once (whole frames; about
100 MB of columns): bounded memory whatever the store's size."""


def _above_zero(x: np.ndarray) -> np.ndarray:
    """``x > 0`` as DuckDB evaluates it on DOUBLE (NaN is above every number)."""
    return np.isnan(x) | (x > 0)


def _at_most(x: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """``x <= bound`` as DuckDB evaluates it on DOUBLE (NaN <= NaN; x <= NaN)."""
    return np.isnan(bound) | (~np.isnan(x) & (x <= bound))


def _segmented_running_max(values: np.ndarray, known: np.ndarray,
                           lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SQL's ``max(values) OVER (PARTITION BY <segment> ORDER BY <row order> ROWS UNBOUNDED
    PRECEDING)`` over consecutive segments of ``lengths`` rows: NULLs (``~known``) ignored,
    NaN above every number (DuckDB's ``max``, as ``np.maximum`` propagates NaN).

    The segments are laid out as the rows of a ``[segments, longest]`` matrix padded with
    -inf (below every value here: the gaps are >= 0, inf or NaN), so one
    ``np.maximum.accumulate`` along the rows restarts at every segment.

    Returns:
        (running max float64[n], known bool[n]: some non-NULL value so far in the segment).
    """
    n = values.size
    width = int(lengths.max(initial=0))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    row = np.repeat(np.arange(lengths.size), lengths)
    col = np.arange(n) - np.repeat(starts, lengths)
    grid = np.full((lengths.size, width), -np.inf)
    grid[row, col] = np.where(known, values, -np.inf)
    seen = np.zeros((lengths.size, width), bool)
    seen[row, col] = known
    running = np.maximum.accumulate(grid, axis=1)[row, col]
    return running, np.logical_or.accumulate(seen, axis=1)[row, col]


def _by_magnitude(magnitude: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """The order of rows grouped in consecutive segments (``segment`` ascending) that sorts
    each segment by magnitude, largest first, NaN above +inf (DuckDB's ``ORDER BY a
    DESC``), ties in their given order (a stable sort).

    Returns:
        int64[n] positions into the given rows.
    """
    nan = np.isnan(magnitude)
    key = np.where(nan, -np.inf, -magnitude)
    if nan.any():  # rare: NaN and +inf would tie on the key; a three-key sort
        return np.lexsort((key, ~nan, segment))
    # One stable argsort along the rows of a [segments, longest] matrix of the keys,
    # padded with +inf (after every key: magnitudes are >= 0, so keys are <= 0).
    lengths = np.diff(np.flatnonzero(np.concatenate([[True], segment[1:] != segment[:-1],
                                                     [True]])))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    width = int(lengths.max())
    grid = np.full((lengths.size, width), np.inf)
    row = np.repeat(np.arange(lengths.size), lengths)
    col = np.arange(magnitude.size) - np.repeat(starts, lengths)
    grid[row, col] = key
    order = np.argsort(grid, axis=1, kind="stable")
    real = np.arange(width)[None, :] < lengths[:, None]  # pads sort last in each row
    return (order + starts[:, None])[real]


def _index_lists(mask: np.ndarray, layer_index: np.ndarray, offsets: np.ndarray,
                 values: np.ndarray | None = None, dtype: pa.DataType | None = None,
                 ) -> pa.Array:
    """Per frame (rows ``offsets[i]:offsets[i+1]``), the list of ``values`` (default the
    layer indices) of its rows in ``mask``, in row order."""
    counts = np.diff(np.concatenate([[0], np.cumsum(mask)])[offsets])
    list_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    picked = (layer_index if values is None else values)[mask]
    return pa.ListArray.from_arrays(pa.array(list_offsets),
                                    pa.array(picked, type=dtype or pa.int32()))


def _masked_max(values: np.ndarray, offsets: np.ndarray, nonempty: np.ndarray) -> pa.Array:
    """Per segment ``offsets[i]:offsets[i+1]`` the largest of ``values`` (int32), NULL for
    an empty segment."""
    out = np.zeros(nonempty.size, np.int32)
    if nonempty.any():
        out[nonempty] = np.maximum.reduceat(values, offsets[:-1][nonempty])
    return pa.array(out, pa.int32(), mask=~nonempty)


def summarize_frames(
    lengths: np.ndarray,
    layer_index: np.ndarray,
    numel: np.ndarray,
    sum_sq: np.ndarray,
    mean_abs_grad: np.ndarray,
    nonfinite: np.ndarray,
    nan: np.ndarray | None,
    is_vanishing: np.ndarray,
    is_exploding: np.ndarray,
) -> dict[str, pa.Array]:
    """The summary (module doc) of consecutive frames whose rows are concatenated.

    Args:
        lengths: int[F] rows of each frame (0 allowed: its summary is empty lists and a
            NULL ``top_magnitude``).
        layer_index: int[n] (n = ``lengths.sum()``), each frame's rows in ascending layer
            order. numel: int64[n] (> 0). sum_sq: float64[n]. mean_abs_grad: float64[n],
            NaN where unknown (stored NULL: the magnitude is then the RMS). nonfinite:
            int64[n]. nan: int64[n] NaN counts, negative where unknown, or None (all
            unknown). is_vanishing, is_exploding: bool[n].

    Returns:
        :data:`SUMMARY_COLUMNS` -> Arrow array of F entries (INTEGER[] / DOUBLE / DOUBLE[]
        / INTEGER).

    Raises:
        ValueError: the arrays do not have ``lengths.sum()`` entries.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = int(lengths.sum())
    layer_index = np.asarray(layer_index, dtype=np.int32)
    if any(np.shape(a)[0] != n for a in (layer_index, numel, sum_sq, mean_abs_grad,
                                           nonfinite, is_vanishing, is_exploding)):
        raise ValueError(f"the row arrays must have {n} entries (the frames' lengths)")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    frame = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    nonfinite = np.asarray(nonfinite, dtype=np.int64)
    mean_abs = np.asarray(mean_abs_grad, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        rms = np.sqrt(np.asarray(sum_sq, np.float64) / np.asarray(numel, np.float64))
    magnitude = np.where(np.isnan(mean_abs), rms, mean_abs)  # coalesce(mean_abs_grad, rms)
    # A (top): max over the frame, NaN when any row is NaN (DuckDB's max)
    nonempty = lengths > 0
    top = np.full(lengths.size, np.nan)
    if n:
        top[nonempty] = np.maximum.reduceat(magnitude, offsets[:-1][nonempty])
    top_row = top[frame]
    candidate = ((nonfinite == 0) & _above_zero(top_row)
                 & _at_most(magnitude, LARGEST_ROUNDOFF * top_row))
    widest = np.full(n, np.nan)
    widest_known = np.zeros(n, bool)
    judged = np.repeat(np.add.reduceat(candidate, offsets[:-1]) > 0 if n else
                       np.zeros(0, bool), lengths) if n else np.zeros(0, bool)
    if judged.any():
        # W over the frames holding a candidate: their rows by magnitude, largest first
        # (NaN first, then +inf), ties in layer order (the rows' order: the sort is stable)
        rows = np.flatnonzero(judged)
        order = _by_magnitude(magnitude[rows], frame[rows])
        m = magnitude[rows][order]
        seg = frame[rows][order]
        first = np.ones(m.size, bool)
        first[1:] = seg[1:] != seg[:-1]
        prev = np.concatenate([[np.nan], m[:-1]])
        with np.errstate(divide="ignore", invalid="ignore"):
            # CASE WHEN a > 0 THEN lag(a) / a WHEN lag(a) > 0 THEN inf ELSE 1.0 END, where
            # lag(a) is NULL on a frame's first row (NULL / a is NULL; NULL > 0 is not true)
            gap = np.where(_above_zero(m), prev / m,
                           np.where(~first & _above_zero(prev), np.inf, 1.0))
        gap_known = ~(first & _above_zero(m))
        seg_lengths = np.diff(np.flatnonzero(np.concatenate([first, [True]])))
        running, known = _segmented_running_max(gap, gap_known, seg_lengths)
        widest[rows[order]] = running
        widest_known[rows[order]] = known
    gaps = pa.array(widest[candidate], pa.float64(), mask=~widest_known[candidate])
    counts = np.diff(np.concatenate([[0], np.cumsum(candidate)])[offsets])
    gap_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    nan_known = np.zeros(n, bool) if nan is None else np.asarray(nan) >= 0
    inf = nan_known & (nonfinite > np.where(nan_known, nan if nan is not None else 0, 0))
    return {
        "vanishing_indices": _index_lists(np.asarray(is_vanishing, bool), layer_index, offsets),
        "exploding_indices": _index_lists(np.asarray(is_exploding, bool), layer_index, offsets),
        "nonfinite_indices": _index_lists(nonfinite > 0, layer_index, offsets),
        "inf_indices": _index_lists(inf, layer_index, offsets),
        "top_magnitude": pa.array(top, pa.float64(), mask=~nonempty),
        "rounding_candidates": _index_lists(candidate, layer_index, offsets),
        "rounding_magnitudes": _index_lists(candidate, layer_index, offsets, magnitude,
                                            pa.float64()),
        "rounding_gaps": pa.ListArray.from_arrays(pa.array(gap_offsets), gaps),
        "layer_index_max": _masked_max(layer_index, offsets, nonempty),
    }


_MISSING_SQL = """
    SELECT run_id, step FROM frames
    WHERE (vanishing_indices IS NULL OR layer_index_max IS NULL AND num_layers > 0) {run}
    ORDER BY run_id, step
"""

_ROWS_SQL = """
    SELECT s.run_id, s.step, s.layer_index, s.numel, s.sum_sq,
           coalesce(s.mean_abs_grad, 'NaN'::DOUBLE) AS mean_abs_grad, s.nonfinite,
           coalesce(s.nan, -1) AS nan, s.is_vanishing, s.is_exploding
    FROM layer_stats AS s
    SEMI JOIN gs_fill_keys AS k ON k.run_id = s.run_id AND k.step = s.step
    ORDER BY s.run_id, s.step, s.layer_index
"""


def fill_frame_summaries(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> int:
    """Give every ``frames`` row without a summary (NULL ``vanishing_indices``, or the
    ``layer_index_max`` of a frame with rows) the one its
    ``layer_stats`` rows make (:func:`summarize_frames`): stores written before the
    summary existed, or built by another program. Frames are taken in step order, about
    :data:`FILL_CHUNK_ROWS` rows at a time, each chunk one ``UPDATE``.

    Args:
        con: a writable connection to a store at the current schema
            (``schemas.tables.SCHEMA_DDL`` run on it).
        run_id: only this run's frames; None: every run's.

    Returns:
        The number of ``frames`` rows given a summary (a frame without any ``layer_stats``
        row gets empty lists and a NULL ``top_magnitude``).

    Raises:
        duckdb.Error: the store lacks the tables or columns (run the DDL first).
    """
    run = "" if run_id is None else "AND run_id = $run_id"
    params = {} if run_id is None else {"run_id": run_id}
    keys = con.sql(_MISSING_SQL.format(run=run), params=params).to_arrow_table()
    if keys.num_rows == 0:
        return 0
    con.register("gs_fill_keys", keys)
    try:  # each frame's row count, so that a chunk holds whole frames
        sizes = con.sql(
            "SELECT k.run_id, k.step, count(s.step) AS n FROM gs_fill_keys AS k "
            "LEFT JOIN layer_stats AS s ON s.run_id = k.run_id AND s.step = k.step "
            "GROUP BY k.run_id, k.step ORDER BY k.run_id, k.step").to_arrow_table()
    finally:
        con.unregister("gs_fill_keys")
    before = np.concatenate([[0], np.cumsum(sizes["n"].to_numpy())[:-1]])
    chunk_of = before // FILL_CHUNK_ROWS
    bounds = [0, *np.flatnonzero(np.diff(chunk_of)) + 1, sizes.num_rows]
    filled = 0
    for lo, hi in itertools.pairwise(bounds):
        chunk = sizes.slice(int(lo), int(hi - lo))
        con.register("gs_fill_keys", chunk.select(["run_id", "step"]))
        try:
            stats = con.sql(_ROWS_SQL).to_arrow_table()
        finally:
            con.unregister("gs_fill_keys")
        columns = summarize_frames(
            chunk["n"].to_numpy(),
            *(stats[c].to_numpy(zero_copy_only=False) for c in (
                "layer_index", "numel", "sum_sq", "mean_abs_grad", "nonfinite", "nan",
                "is_vanishing", "is_exploding")),
        )
        summary = pa.table({"run_id": chunk["run_id"], "step": chunk["step"], **columns})
        con.register("gs_fill_summary", summary)
        try:
            sets = ", ".join(f"{c} = x.{c}" for c in SUMMARY_COLUMNS)
            row = con.execute(
                f"UPDATE frames SET {sets} FROM gs_fill_summary AS x "
                "WHERE frames.run_id = x.run_id AND frames.step = x.step").fetchone()
        finally:
            con.unregister("gs_fill_summary")
        filled += 0 if row is None else int(row[0])
    return filled
