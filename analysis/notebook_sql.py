"""The SQL of the notebook API's tables (:mod:`analysis.notebook`) and the binding of its
``steps=`` and ``layers=`` arguments to that SQL's named parameters.

Each statement reads one run (``$run_id``); the step range and the layer selection reach
DuckDB as bound parameters (:func:`step_params`, :func:`layer_params`), never inside the
SQL text. Columns and their types are documented on the :class:`~analysis.notebook.Run`
method that returns them.
"""

from __future__ import annotations

from collections.abc import Sequence

from analysis.read.connect import StoreError, check_step_range
from analysis.read.sql import layer_name, step_range

Steps = tuple[int | None, int | None] | None
"""An inclusive optimiser-step range ``(first, last)``; ``None`` (or a ``None`` bound) is
open."""

Layers = str | Sequence[str] | None
"""Layers to keep: an ``fnmatch`` pattern, a list of exact names, or ``None`` (all)."""


def step_params(steps: Steps) -> dict[str, object]:
    """``$from_step`` / ``$to_step`` of an inclusive ``steps`` range.

    Raises:
        StoreError: ``steps`` is not a pair, a bound is negative or not an integer, or the
            range is reversed.
    """
    if steps is None:
        return {"from_step": None, "to_step": None}
    if isinstance(steps, (str, bytes)) or len(steps) != 2:
        raise StoreError(f"steps must be an inclusive (first, last) pair, got {steps!r}")
    first, last = steps
    for bound in (first, last):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise StoreError(f"step bounds must be integers or None, got {steps!r}")
    check_step_range(first, last)
    return {"from_step": first, "to_step": last}


def _glob(pattern: str) -> str:
    """An ``fnmatch`` pattern as a DuckDB ``GLOB`` pattern with the same matches.

    DuckDB's ``GLOB`` reads ``*``, ``?``, ``[seq]`` and ``[!seq]`` as
    :func:`fnmatch.fnmatchcase` does, but ``\\`` escapes the next character, where fnmatch
    reads it literally; doubling it restores the literal backslash."""
    return pattern.replace("\\", "\\\\")


def layer_params(layers: Layers) -> dict[str, object]:
    """``$layer_glob`` / ``$layer_names`` of a ``layers`` argument (see :data:`Layers`).

    Raises:
        StoreError: ``layers`` is neither a string, a sequence of strings nor ``None``.
    """
    if layers is None:
        return {"layer_glob": None, "layer_names": None}
    if isinstance(layers, str):
        return {"layer_glob": _glob(layers), "layer_names": None}
    names = list(layers)
    if not all(isinstance(name, str) for name in names):
        raise StoreError(f"layers must be a pattern, a list of layer names or None, "
                         f"got {layers!r}")
    return {"layer_glob": None, "layer_names": names}


ScalarNames = str | Sequence[str] | None
"""Training scalars to keep: an ``fnmatch`` pattern (``"lr*"``), a list of exact names, or
``None`` (all)."""


def scalar_name_params(names: ScalarNames) -> dict[str, object]:
    """``$name_glob`` / ``$name_list`` of a ``names`` argument (see :data:`ScalarNames`).

    Raises:
        StoreError: ``names`` is neither a string, a sequence of strings nor ``None``.
    """
    if names is None:
        return {"name_glob": None, "name_list": None}
    if isinstance(names, str):
        return {"name_glob": _glob(names), "name_list": None}
    chosen = list(names)
    if not all(isinstance(name, str) for name in chosen):
        raise StoreError(f"names must be a pattern, a list of scalar names or None, "
                         f"got {names!r}")
    return {"name_glob": None, "name_list": chosen}


_LAYER_FILTER = """($layer_glob IS NULL OR {name} GLOB $layer_glob)
      AND ($layer_names IS NULL OR list_contains($layer_names, {name}))"""
"""Layer selection on the name expression ``{name}``, bound by :func:`layer_params`."""


def _bigint(*columns: str) -> str:
    """``CAST(s.<c> AS BIGINT) AS <c>`` for each column, comma-separated."""
    return ", ".join(f"CAST(s.{c} AS BIGINT) AS {c}" for c in columns)


def _run_rows_sql(table: str, columns: str, order: str, by_layer: bool = False) -> str:
    """One run's rows of ``table`` (alias ``s``) in the step range: ``run_id``, ``step``
    (BIGINT), then ``columns``, sorted by ``order``. ``by_layer``: joined to its ``layers``
    row ``l`` (``{layer}`` in ``columns`` is the layer name) and filtered by the layer
    selection."""
    name = layer_name("s")
    join = ("LEFT JOIN layers AS l ON l.run_id = s.run_id AND l.layer_index = s.layer_index"
            if by_layer else "")
    layer_filter = f"AND {_LAYER_FILTER.format(name=name)}" if by_layer else ""
    return f"""
    SELECT s.run_id, CAST(s.step AS BIGINT) AS step, {columns.format(layer=name)}
    FROM {table} AS s
    {join}
    WHERE s.run_id = $run_id
      AND {step_range("s")}
      {layer_filter}
    ORDER BY {order}
    """


LAYER_STATS_SQL = _run_rows_sql("layer_stats", f"""
        {_bigint("layer_index")},
        {{layer}} AS layer,
        {_bigint("numel")},
        CAST(s.grad_norm AS DOUBLE) AS grad_norm,
        CAST(sqrt(s.sum_sq / nullif(s.numel, 0)) AS DOUBLE) AS rms_grad,
        CAST(s.mean_abs_grad AS DOUBLE) AS mean_abs_grad,
        CAST(s.max_abs_grad AS DOUBLE) AS max_abs_grad,
        {_bigint("nonfinite")},
        CAST(s.flow_intensity AS DOUBLE) AS flow_intensity,
        s.is_vanishing, s.is_exploding,
        CAST(s.sum_abs AS DOUBLE) AS sum_abs,
        CAST(s.sum_sq AS DOUBLE) AS sum_sq,
        CAST(sqrt(s.weight_sum_sq) AS DOUBLE) AS weight_norm,
        CAST(s.update_to_weight AS DOUBLE) AS update_to_weight""",
    "s.step, s.layer_index", by_layer=True)
"""One run's ``layer_stats`` rows as a long table (see :meth:`Run.layer_stats`)."""

RANK_STATS_SQL = _run_rows_sql("local_layer_stats", f"""
        {_bigint("rank", "layer_index")},
        {{layer}} AS layer,
        {_bigint("numel")},
        CAST(sqrt(s.sum_sq) AS DOUBLE) AS grad_norm,
        CAST(sqrt(s.sum_sq / nullif(s.numel, 0)) AS DOUBLE) AS rms_grad,
        CAST(s.sum_abs / nullif(s.numel, 0) AS DOUBLE) AS mean_abs_grad,
        CAST(s.max_abs_grad AS DOUBLE) AS max_abs_grad,
        {_bigint("nonfinite")},
        CAST(s.sum_abs AS DOUBLE) AS sum_abs,
        CAST(s.sum_sq AS DOUBLE) AS sum_sq""",
    "s.step, s.rank, s.layer_index", by_layer=True)
"""One run's per-rank local view (``local_layer_stats``) as a long table (see
:meth:`Run.rank_stats`)."""

FRAMES_SQL = _run_rows_sql("frames", f"""
        s.health,
        {_bigint("num_layers", "vanishing_layers", "exploding_layers", "nonfinite_layers")},
        s.complete, s.ranks_seen, s.missing_ranks, s.wall_time, s.finalized_at""",
    "s.step")
"""One run's ``frames`` rows in step order (see :meth:`Run.frames`)."""

ALERTS_SQL = _run_rows_sql("alerts", f"""
        {_bigint("first_step")},
        s.rule, s.severity, s.state, s.layers, s.ranks, s.message, s.alert_id,
        s.incident_id, s.created_at, s.wall_time,
        CAST(s.frame_values AS VARCHAR) AS frame_values""",
    "s.step, s.created_at, s.alert_id")
"""One run's alert events in step order (see :meth:`Run.alerts`)."""

_SCALAR_FILTER = f"""s.run_id = $run_id AND {step_range("s")}
      AND ($name_glob IS NULL OR s.name GLOB $name_glob)
      AND ($name_list IS NULL OR list_contains($name_list, s.name))"""
"""One run's training-scalar rows (alias ``s``) in the step range, of the names chosen
(:func:`step_params`, :func:`scalar_name_params`)."""

STEP_SCALARS_SQL = f"""
    SELECT CAST(s.step AS BIGINT) AS step, s.name, CAST(s.value AS DOUBLE) AS value
    FROM step_scalars AS s
    WHERE {_SCALAR_FILTER}
    ORDER BY s.step, s.name
"""
"""One run's step scalars (``step_scalars``) long, by step then name; pivoted to one column
per name by :meth:`analysis.notebook.Run.scalars`."""

RANK_SCALARS_SQL = f"""
    SELECT CAST(s.step AS BIGINT) AS step, CAST(s.rank AS BIGINT) AS rank, s.name,
           CAST(s.value AS DOUBLE) AS value
    FROM rank_scalars AS s
    WHERE {_SCALAR_FILTER}
    ORDER BY s.step, s.rank, s.name
"""
"""One run's per-rank scalars (``rank_scalars``) long, by step, rank, name (see
:meth:`analysis.notebook.Run.scalars` with ``ranks=True``)."""

RUNS_SQL = """
    WITH frame_counts AS (
        SELECT run_id, count(*) FILTER (WHERE NOT complete) AS partial_frames
        FROM frames GROUP BY run_id
    ),
    rank_counts AS (
        SELECT run_id, count(*) AS ranks_finished, sum(dropped) AS dropped_summaries
        FROM run_ranks GROUP BY run_id
    ),
    incidents AS (
        SELECT run_id, coalesce(incident_id, alert_id) AS incident,
               bool_or(state = 'firing') AS fired, bool_or(state = 'resolved') AS resolved
        FROM alerts GROUP BY ALL
    ),
    alert_counts AS (
        SELECT run_id, count(*) FILTER (WHERE fired) AS alerts,
               count(*) FILTER (WHERE fired AND NOT resolved) AS open_alerts
        FROM incidents GROUP BY run_id
    )
    SELECT r.run_id,
           r.health,
           CAST(r.frames AS BIGINT) AS frames,
           CAST(r.issue_frames AS BIGINT) AS issue_frames,
           CAST(coalesce(r.issue_frames / nullif(r.frames, 0), 0.0) AS DOUBLE) AS issue_ratio,
           CAST(coalesce(f.partial_frames, 0) AS BIGINT) AS partial_frames,
           CAST(r.last_step AS BIGINT) AS last_step,
           CAST(r.first_nonfinite_step AS BIGINT) AS first_nonfinite_step,
           CAST(r.world_size AS BIGINT) AS world_size,
           CAST(r.num_layers AS BIGINT) AS num_layers,
           CAST(coalesce(k.ranks_finished, 0) AS BIGINT) AS ranks_finished,
           CAST(coalesce(k.dropped_summaries, 0) AS BIGINT) AS dropped_summaries,
           CAST(coalesce(a.alerts, 0) AS BIGINT) AS alerts,
           CAST(coalesce(a.open_alerts, 0) AS BIGINT) AS open_alerts,
           r.vanishing_threshold,
           r.exploding_threshold,
           r.host,
           r.start_time,
           r.end_time
    FROM runs AS r
    LEFT JOIN frame_counts AS f USING (run_id)
    LEFT JOIN rank_counts AS k USING (run_id)
    LEFT JOIN alert_counts AS a USING (run_id)
    ORDER BY r.run_id
"""
"""One row per run (see :meth:`Store.runs`)."""
