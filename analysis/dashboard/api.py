"""Data of the dashboard's JSON endpoints, read with a read-only cursor.

Each function takes a cursor (from :class:`analysis.read.cursors.ReadCursors`) and
returns a JSON-ready dict; non-finite floats become ``None`` (JSON has no NaN). The
heatmap and the layer series come from :mod:`analysis.plots.grid`, so the live page and
``gradstream plot`` downsample the same way and print the same caption. The analyses come
from :mod:`analysis.registry`, so the dashboard serves every analysis that ``gradstream
analyze`` runs, with the same JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from analysis import registry
from analysis.plots.grid import load_grid, load_layer_series
from analysis.read.connect import StoreError

if TYPE_CHECKING:
    import duckdb
    from pydantic import BaseModel

    from analysis.plots.grid import GradientGrid
    from analysis.report import GradientFlowSummary

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


def grid(
    cur: duckdb.DuckDBPyConnection,
    run_id: str,
    max_steps: int,
    max_layers: int,
    from_step: int | None = None,
    to_step: int | None = None,
) -> dict[str, object]:
    """The run's downsampled heatmap grid (:meth:`GradientGrid.to_json`).

    Raises:
        StoreError: unknown run or invalid range. ValueError: a limit < 1.
    """
    return grid_model(cur, run_id, max_steps, max_layers, from_step, to_step).to_json()


def grid_model(
    cur: duckdb.DuckDBPyConnection,
    run_id: str,
    max_steps: int,
    max_layers: int,
    from_step: int | None = None,
    to_step: int | None = None,
) -> GradientGrid:
    """The run's downsampled heatmap grid (:func:`analysis.plots.grid.load_grid`).

    Raises:
        StoreError: unknown run or invalid range. ValueError: a limit < 1.
    """
    return load_grid(cur, run_id, max_steps, max_layers, from_step=from_step, to_step=to_step)


def layer(
    cur: duckdb.DuckDBPyConnection,
    run_id: str,
    layer_index: int,
    max_points: int,
    from_step: int | None = None,
    to_step: int | None = None,
) -> dict[str, object]:
    """One layer's binned norm series (:meth:`LayerSeries.to_json`).

    Raises:
        StoreError: unknown run or layer, invalid range. ValueError: ``max_points`` < 1.
    """
    return load_layer_series(
        cur, run_id, layer_index, max_points, from_step=from_step, to_step=to_step
    ).to_json()


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


def report(
    cur: duckdb.DuckDBPyConnection, run_id: str, from_step: int | None, to_step: int | None,
    ignore_layers: tuple[str, ...] = (), exclude_rounding: bool = False, order: str = "model",
    nonfinite_rule: str = "critical",
) -> GradientFlowSummary:
    """The run summary (:func:`analysis.report.build_report`) over an inclusive step range,
    with the report's own ``ignore_layers`` patterns, ``exclude_rounding`` option, layer
    ``order`` (``model`` or ``name``) and ``nonfinite_rule`` (``critical`` or
    ``reference``).

    Raises:
        StoreError: unknown run, invalid range, unknown order or rule, or the reference
            rule over NaN/Inf rows stored without their NaN count.
    """
    from analysis.report import build_report

    try:
        return build_report(cur, run_id, from_step, to_step, ignore_layers=ignore_layers,
                            exclude_rounding=exclude_rounding, order=order,
                            nonfinite_rule=nonfinite_rule)
    except ValueError as exc:
        raise StoreError(str(exc)) from None


def heatmap(
    cur: duckdb.DuckDBPyConnection, run_id: str, max_columns: int, from_step: int | None,
    to_step: int | None, style: str = "gradstream",
) -> str:
    """The ASCII flow-intensity heatmap (:func:`analysis.heatmap.ascii_heatmap`; ``style``
    ``"gradstream"`` or ``"reference"``).

    Raises:
        StoreError: unknown run, invalid range or unknown style.
    """
    from analysis.heatmap import ascii_heatmap

    try:
        return ascii_heatmap(cur, run_id, max_columns, from_step=from_step, to_step=to_step,
                             style=style)  # type: ignore[arg-type]
    except ValueError as exc:
        raise StoreError(str(exc)) from None


def analysis_report(
    cur: duckdb.DuckDBPyConnection,
    name: str,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    values: Mapping[str, str],
) -> BaseModel:
    """The report model of the registered analysis ``name``.

    Args:
        cur: read-only cursor on the store.
        name: a key of :data:`analysis.registry.ANALYSES`.
        run_id: the run; from_step, to_step: inclusive step range (``None`` = open).
        values: options by field name, as strings (converted by the options model).

    Raises:
        UnknownAnalysisError: no analysis ``name``.
        ValueError: an option the analysis does not declare, or an invalid value.
        StoreError: unknown run, invalid range, no data in the range.
    """
    entry = registry.get(name)
    unknown = sorted(set(values) - set(entry.option_names))
    if unknown:
        raise ValueError(
            f"{name} has no option {', '.join(unknown)}; its options: "
            f"{', '.join(entry.option_names) or 'none'}"
        )
    return entry.run(cur, run_id, from_step, to_step, values)


def analysis(
    cur: duckdb.DuckDBPyConnection,
    name: str,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    values: Mapping[str, str],
) -> dict[str, object]:
    """:func:`analysis_report` as ``gradstream analyze --kind name --format json`` prints it
    (NaN and infinities as ``null``).

    Raises:
        UnknownAnalysisError, ValueError, StoreError: as :func:`analysis_report`.
    """
    report = analysis_report(cur, name, run_id, from_step, to_step, values)
    return json.loads(report.model_dump_json())
