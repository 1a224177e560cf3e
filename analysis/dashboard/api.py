"""Data of the dashboard's own JSON routes (runs, alerts, a layer's series, the run's step
scalars, the analyses list), read with a read-only cursor.

Each function takes a cursor (from :class:`analysis.read.cursors.ReadCursors`) and
returns a JSON-ready dict; non-finite floats become ``None`` (JSON has no NaN). The layer
series comes from :mod:`analysis.plots.grid` and the step scalars from
:mod:`analysis.plots.scalars`, so the live page and ``gradstream plot`` downsample the same
way. The reads a :class:`~analysis.read.reader.StoreReader` makes too
(grid, report, heatmap, an analysis) are routes of :data:`analysis.read.routes.READS`,
answered by the server's one read handler.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from analysis import registry
from analysis.plots.grid import load_layer_series
from analysis.plots.scalars import load_scalar_bins

if TYPE_CHECKING:
    import duckdb


_RUNS_SQL = """
    SELECT r.run_id, r.health, r.frames, r.issue_frames, r.last_step, r.world_size,
           r.num_layers, r.host, r.start_time, r.end_time, r.first_nonfinite_step,
           coalesce(f.partial_frames, 0) AS partial_frames,
           f.last_wall_time,
           coalesce(a.alerts, 0) AS alerts
    FROM runs AS r
    LEFT JOIN (
        SELECT run_id, count(*) FILTER (WHERE NOT complete) AS partial_frames,
               max(wall_time) AS last_wall_time
        FROM frames GROUP BY run_id
    ) AS f USING (run_id)
    LEFT JOIN (SELECT run_id, count(*) AS alerts FROM alerts GROUP BY run_id) AS a
        USING (run_id)
    ORDER BY coalesce(r.start_time, 0) DESC, r.run_id
"""

_ALERTS_SQL = """
    SELECT alert_id, run_id, step, rule, severity, state, layers, ranks, message, created_at
    FROM alerts
    WHERE $run_id IS NULL OR run_id = $run_id
    ORDER BY created_at DESC, alert_id
    LIMIT $limit
"""


def _clean(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _rows(cur: duckdb.DuckDBPyConnection, sql: str, params: dict[str, object]) -> list[dict]:
    result = cur.execute(sql, params)
    names = [d[0] for d in result.description]
    return [
        {name: _clean(value) for name, value in zip(names, row, strict=True)}
        for row in result.fetchall()
    ]


def runs(cur: duckdb.DuckDBPyConnection) -> dict[str, object]:
    """Every run with its health badge data, newest first.

    Returns:
        ``{"runs": [{run_id, health, frames, issue_frames, issue_ratio, last_step,
        world_size, num_layers, host, start_time, end_time, first_nonfinite_step,
        partial_frames, last_wall_time, alerts, finished}]}``; ``issue_ratio =
        issue_frames / frames`` (the health rule's ratio, 0 with no frame); ``finished``
        when every rank sent RunFinished (``end_time`` set).
    """
    out = _rows(cur, _RUNS_SQL, {})
    for run in out:
        frames = run["frames"] or 0
        run["issue_ratio"] = (run["issue_frames"] or 0) / frames if frames else 0.0
        run["finished"] = run["end_time"] is not None
    return {"runs": out}


def alerts(
    cur: duckdb.DuckDBPyConnection, run_id: str | None, limit: int
) -> dict[str, object]:
    """The newest ``limit`` alerts (all runs, or one run).

    Returns:
        ``{"alerts": [{alert_id, run_id, step, rule, severity, state, layers, ranks,
        message, created_at}]}``, newest first.
    """
    return {"alerts": _rows(cur, _ALERTS_SQL, {"run_id": run_id, "limit": limit})}


def layer(
    cur: duckdb.DuckDBPyConnection,
    run_id: str,
    layer: int,
    max_points: int,
    from_step: int | None = None,
    to_step: int | None = None,
) -> dict[str, object]:
    """One layer's binned norm series (:meth:`LayerSeries.to_json`).

    Raises:
        StoreError: unknown run or layer, invalid range. ValueError: ``max_points`` < 1.
    """
    return load_layer_series(
        cur, run_id, layer, max_points, from_step=from_step, to_step=to_step
    ).to_json()


def scalars(
    cur: duckdb.DuckDBPyConnection,
    run_id: str,
    max_steps: int,
    names: tuple[str, ...] = (),
    from_step: int | None = None,
    to_step: int | None = None,
) -> dict[str, object]:
    """The run's step scalars binned on the heatmap's columns of the same ``max_steps``
    and range (:func:`analysis.plots.scalars.load_scalar_bins`,
    :meth:`~analysis.plots.scalars.ScalarBins.to_json`); ``names``: the scalars wanted
    (``()``: all).

    Returns:
        ``{run_id, n_columns, steps_per_col, n_frames, names, series: {name: {col,
        first_step, last_step, points, nonfinite, mean, low, high}}, caption}``: no series
        when the run sent no scalars (or the store predates them).

    Raises:
        StoreError: unknown run, invalid range. ValueError: ``max_steps`` < 1.
    """
    return load_scalar_bins(cur, run_id, max_steps, names, from_step=from_step,
                            to_step=to_step).to_json()


def analyses() -> dict[str, object]:
    """The registered analyses (:data:`analysis.registry.ANALYSES` order).

    Returns:
        ``{"analyses": [{name, help, options}]}``; ``options`` is the JSON Schema of the
        analysis's options model (field names, types, defaults, bounds).
    """
    return {
        "analyses": [
            {"name": a.name, "help": a.help, "options": a.options.model_json_schema()}
            for a in registry.all_analyses()
        ]
    }
