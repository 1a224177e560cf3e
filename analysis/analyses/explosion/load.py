"""The SQL of the explosion analysis: per-layer peaks and run totals over a step range,
both over one relation (``layer_stats`` of the run in the range, each row marked
``excluded`` when the report's exclusion matches its layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from analysis.read.sql import layer_name, step_range

if TYPE_CHECKING:
    import duckdb

_ROWS_CTE = f"""
    WITH s AS (
        SELECT *, list_contains($excluded::INTEGER[], layer_index) AS excluded
        FROM layer_stats
        WHERE run_id = $run_id AND {step_range()}
    )"""

_LAYERS_SQL = _ROWS_CTE + f"""
    SELECT s.layer_index,
           any_value({layer_name("s")}),
           max(s.grad_norm) AS peak,
           min(s.step) FILTER (WHERE s.grad_norm = peak_norm) AS peak_step,
           count(*) FILTER (WHERE s.grad_norm > $threshold AND NOT s.excluded)
               AS exploding_steps,
           count(*) FILTER (WHERE s.nonfinite > 0) AS nonfinite_steps,
           min(s.step) FILTER (WHERE (s.grad_norm > $threshold AND NOT s.excluded)
                               OR s.nonfinite > 0) AS first_step
    FROM s
    JOIN (SELECT layer_index, max(grad_norm) AS peak_norm FROM s GROUP BY layer_index) AS p
      USING (layer_index)
    LEFT JOIN layers AS l ON l.run_id = $run_id AND l.layer_index = s.layer_index
    GROUP BY s.layer_index
    ORDER BY s.layer_index
"""

_TOTALS_SQL = _ROWS_CTE + """,
    per_step AS (
        SELECT step, sqrt(sum(sum_sq)) AS global_norm,
               bool_or((grad_norm > $threshold AND NOT excluded) OR nonfinite > 0) AS bad
        FROM s GROUP BY step
    ),
    first_bad AS (SELECT min(step) AS step FROM per_step WHERE bad)
    SELECT (SELECT max(grad_norm) FROM s),
           (SELECT avg(grad_norm) FROM s),
           (SELECT stddev_pop(grad_norm) FROM s),
           (SELECT count(*) FROM per_step),
           (SELECT step FROM first_bad),
           (SELECT max(global_norm) FROM per_step WHERE step < (SELECT step FROM first_bad)),
           (SELECT coalesce(max(grad_norm), 0.0) FROM s WHERE NOT excluded)
"""


def layer_peaks(
    con: duckdb.DuckDBPyConnection, params: dict[str, object]
) -> list[tuple[int, str, float, int, int, int, int | None]]:
    """Per layer with rows in the range, model order: ``(layer_index, name, peak grad_norm,
    step of the peak (earliest on ties), steps above $threshold not excluded, steps with
    NaN/Inf elements, first step with either)``.

    Args:
        con: a store connection or cursor.
        params: :func:`analysis.read.sql.stats_params` plus ``threshold`` (L2 norm) and
            ``excluded`` (the excluded layer indices, a list of int).
    """
    return con.execute(_LAYERS_SQL, params).fetchall()


def run_totals(
    con: duckdb.DuckDBPyConnection, params: dict[str, object]
) -> tuple[float, float, float | None, int, int | None, float | None, float]:
    """Over every row of the range: ``(max grad_norm, mean, population std, steps, first
    step with a norm above $threshold (not excluded) or NaN/Inf, largest whole-model norm
    sqrt(sum sum_sq) before that step, largest grad_norm of the rows not excluded (0.0 if
    none))``.

    Args:
        con, params: as :func:`layer_peaks`.
    """
    return con.execute(_TOTALS_SQL, params).fetchall()[0]
