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
- ``inf_indices``: those with an Inf element, ``coalesce(nonfinite > nan, false)`` (the
  reference's exploding rule, ``schemas.health.NONFINITE_VERDICTS``);
- the inputs of the rounding judgement for every row that may be at rounding level under
  some dtype: ``top_magnitude`` (``A``, the largest magnitude of the frame) and, in layer
  order, ``rounding_candidates`` (layer indices of the rows meeting condition 1 and
  ``a <= LARGEST_ROUNDOFF * A``, condition 2 under the largest unit roundoff of any dtype),
  ``rounding_magnitudes`` (their ``a``) and ``rounding_gaps`` (their ``W``, condition 3).

The judgement itself needs the layer's dtype, which a reader takes from ``layers`` as the
full scan does: :func:`schemas.rounding.at_rounding_sql` over these stored doubles is the
expression :func:`schemas.rounding.rounding_rows_sql` evaluates over the same doubles, so
the two agree row for row. A row not among the candidates fails condition 1 or 2 for every
dtype (``u * A <= LARGEST_ROUNDOFF * A``), so it is at rounding level under none.

Everything is one SQL statement over a relation with ``layer_stats``'s columns
(:func:`frame_summary_sql`), run by the DuckDB writer on the batch it inserts
(:class:`consumer.outputs.duckdb.DuckDBSink`, which the Iceberg output stages through too)
and by :func:`fill_frame_summaries` on rows stored before the columns existed or written
by another program. A ``frames`` row whose summary is NULL is one the writer did not
summarise; a reader then scans the rows instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.rounding import LARGEST_ROUNDOFF, gap_sql, magnitude_sql, widest_gap_sql

if TYPE_CHECKING:
    import duckdb

SUMMARY_COLUMNS: tuple[str, ...] = (
    "vanishing_indices", "exploding_indices", "nonfinite_indices", "inf_indices",
    "top_magnitude", "rounding_candidates", "rounding_magnitudes", "rounding_gaps",
)
"""The ``frames`` columns of the summary (module doc), in table order."""


def frame_summary_sql(rows: str) -> str:
    """One row per frame (``run_id``, ``step``) of ``rows`` with its summary.

    Args:
        rows: a relation (table name or parenthesised query) with ``layer_stats``'s columns
            ``run_id``, ``step``, ``layer_index``, ``numel``, ``sum_sq``, ``mean_abs_grad``,
            ``nonfinite``, ``nan``, ``is_vanishing``, ``is_exploding``, holding every row of
            each frame it holds (the judgement compares a frame's rows with each other).

    Returns:
        A query with columns ``run_id``, ``step`` and :data:`SUMMARY_COLUMNS` (module doc).
        Cost: one hash aggregate over ``rows``; the window sort of the rounding judgement
        runs only over the frames holding a candidate row.
    """
    frame = "run_id, step"
    return f"""
    WITH fs_rows AS (
        SELECT run_id, step, layer_index, nonfinite, nan, is_vanishing, is_exploding,
               {magnitude_sql()} AS magnitude
        FROM {rows}
    ),
    fs_top AS (
        SELECT {frame}, max(magnitude) AS top FROM fs_rows GROUP BY {frame}
    ),
    fs_candidate AS (
        SELECT r.*, t.top,
               r.nonfinite = 0 AND t.top > 0
                   AND r.magnitude <= {LARGEST_ROUNDOFF!r}::DOUBLE * t.top AS candidate
        FROM fs_rows AS r JOIN fs_top AS t USING ({frame})
    ),
    fs_judged AS (
        SELECT *, {widest_gap_sql(frame)} AS widest
        FROM (
            SELECT *, {gap_sql("fs_w")} AS gap
            FROM fs_candidate
            WHERE ({frame}) IN (SELECT {frame} FROM fs_candidate WHERE candidate)
            WINDOW fs_w AS (PARTITION BY {frame} ORDER BY magnitude DESC, layer_index)
        )
    ),
    fs_rounding AS (
        SELECT {frame},
               list(layer_index ORDER BY layer_index) AS rounding_candidates,
               list(magnitude ORDER BY layer_index) AS rounding_magnitudes,
               list(widest ORDER BY layer_index) AS rounding_gaps
        FROM fs_judged WHERE candidate GROUP BY {frame}
    ),
    fs_flags AS (
        SELECT {frame}, max(magnitude) AS top_magnitude,
               list(layer_index ORDER BY layer_index) FILTER (WHERE is_vanishing)
                   AS vanishing_indices,
               list(layer_index ORDER BY layer_index) FILTER (WHERE is_exploding)
                   AS exploding_indices,
               list(layer_index ORDER BY layer_index) FILTER (WHERE nonfinite > 0)
                   AS nonfinite_indices,
               list(layer_index ORDER BY layer_index)
                   FILTER (WHERE coalesce(nonfinite > nan, false)) AS inf_indices
        FROM fs_rows GROUP BY {frame}
    )
    SELECT {frame},
           coalesce(f.vanishing_indices, []::INTEGER[]) AS vanishing_indices,
           coalesce(f.exploding_indices, []::INTEGER[]) AS exploding_indices,
           coalesce(f.nonfinite_indices, []::INTEGER[]) AS nonfinite_indices,
           coalesce(f.inf_indices, []::INTEGER[]) AS inf_indices,
           f.top_magnitude,
           coalesce(r.rounding_candidates, []::INTEGER[]) AS rounding_candidates,
           coalesce(r.rounding_magnitudes, []::DOUBLE[]) AS rounding_magnitudes,
           coalesce(r.rounding_gaps, []::DOUBLE[]) AS rounding_gaps
    FROM fs_flags AS f LEFT JOIN fs_rounding AS r USING ({frame})
    """


def fill_frame_summaries(con: duckdb.DuckDBPyConnection, run_id: str | None = None) -> int:
    """Compute the summary of every ``frames`` row that has none (NULL
    ``vanishing_indices``) from its ``layer_stats`` rows: stores written before the
    summary existed, or built by another program.

    Args:
        con: a writable connection to a store at the current schema
            (``schemas.tables.SCHEMA_DDL`` run on it).
        run_id: only this run's frames; None: every run's.

    Returns:
        The number of ``frames`` rows given a summary (a frame without any ``layer_stats``
        row keeps none).

    Raises:
        duckdb.Error: the store lacks the tables or columns (run the DDL first).
    """
    where = "vanishing_indices IS NULL" + ("" if run_id is None else " AND run_id = $run_id")
    params = {} if run_id is None else {"run_id": run_id}
    rows = (f"(SELECT s.* FROM layer_stats AS s SEMI JOIN "
            f"(SELECT run_id, step FROM frames WHERE {where}) AS k USING (run_id, step))")
    sets = ", ".join(f"{c} = x.{c}" for c in SUMMARY_COLUMNS)
    row = con.execute(
        f"UPDATE frames SET {sets} FROM ({frame_summary_sql(rows)}) AS x "
        "WHERE frames.run_id = x.run_id AND frames.step = x.step "
        "AND frames.vanishing_indices IS NULL", params,
    ).fetchone()
    return 0 if row is None else int(row[0])
