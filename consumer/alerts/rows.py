"""Alert events <-> the DuckDB ``alerts`` table (``schemas.tables``), in bulk via Arrow.

The worker's sink writes a batch's events in the same transaction as its frames and
offsets (:func:`write_alerts`); ``alert_id`` is the primary key and replaced on conflict,
so an event replayed after a crash is stored once. :func:`load_active_incidents` reads
back the incidents whose last event is ``firing`` when a worker starts, and
:func:`alerts_query` and :func:`alerts_from_rows` serve ``gradstream alerts`` (through the
store's reader); :func:`read_alerts` reads them on a connection.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import duckdb
import pyarrow as pa

from consumer.alerts.incident import ActiveIncident
from consumer.alerts.rules import find_rule
from schemas.alert import Alert

ALERTS_COLUMNS: tuple[str, ...] = (
    "alert_id", "run_id", "step", "rule", "severity", "state", "layers", "ranks", "message",
    "created_at", "incident_id", "first_step", "frame_values", "wall_time",
)
"""Columns of ``alerts`` written by :func:`write_alerts` (``frame_values`` is JSON)."""


def alerts_table(alerts: list[Alert]) -> pa.Table:
    """Arrow table of ``alerts`` with the columns :data:`ALERTS_COLUMNS` (``frame_values``
    as JSON text, non-finite numbers as null)."""
    return pa.table({
        "alert_id": pa.array([a.alert_id for a in alerts], pa.string()),
        "run_id": pa.array([a.run_id for a in alerts], pa.string()),
        "step": pa.array([a.step for a in alerts], pa.int64()),
        "rule": pa.array([str(a.rule) for a in alerts], pa.string()),
        "severity": pa.array([a.severity.value for a in alerts], pa.string()),
        "state": pa.array([a.state.value for a in alerts], pa.string()),
        "layers": pa.array([a.layers for a in alerts], pa.list_(pa.string())),
        "ranks": pa.array([a.ranks for a in alerts], pa.list_(pa.int32())),
        "message": pa.array([a.message for a in alerts], pa.string()),
        "created_at": pa.array([a.created_at for a in alerts], pa.float64()),
        "incident_id": pa.array([a.incident_id for a in alerts], pa.string()),
        "first_step": pa.array([a.first_step for a in alerts], pa.int64()),
        "frame_values": pa.array(
            [json.dumps(a.model_dump(mode="json")["values"]) for a in alerts], pa.string()
        ),
        "wall_time": pa.array([a.wall_time for a in alerts], pa.float64()),
    })


def write_alerts(con: duckdb.DuckDBPyConnection, alerts: list[Alert]) -> None:
    """Upsert ``alerts`` into the ``alerts`` table with one bulk statement (inside the
    caller's transaction, if any).

    Raises:
        duckdb.Error: the insert failed.
    """
    if not alerts:
        return
    con.register("gs_alerts", alerts_table(alerts))
    try:
        cols = ", ".join(ALERTS_COLUMNS)
        select = ", ".join(
            "frame_values::JSON" if c == "frame_values" else c for c in ALERTS_COLUMNS
        )
        con.execute(f"INSERT OR REPLACE INTO alerts ({cols}) SELECT {select} FROM gs_alerts")
    finally:
        con.unregister("gs_alerts")


def load_active_incidents(con: duckdb.DuckDBPyConnection) -> list[ActiveIncident]:
    """Incidents whose latest stored event (per run and rule) is ``firing``.

    Rows without ``incident_id`` and rows of rules not
    in the registry (``consumer.alerts.rules.RULES``) are ignored.
    """
    rows = con.execute(
        "SELECT run_id, rule, incident_id, coalesce(first_step, step), layers, ranks "
        "FROM alerts WHERE incident_id IS NOT NULL "
        "QUALIFY row_number() OVER (PARTITION BY run_id, rule "
        "ORDER BY created_at DESC, state = 'resolved' DESC) = 1 AND state = 'firing'"
    ).fetchall()
    out = []
    for run_id, rule, incident, first, layers, ranks in rows:
        known = find_rule(rule)
        if known is not None:
            out.append(ActiveIncident(run_id, known.name, incident, int(first),
                                      list(layers or []), list(ranks or [])))
    return out


def alerts_query(
    run_id: str | None = None, rule: str | None = None, state: str | None = None,
    limit: int | None = None,
) -> tuple[str, list[object]]:
    """The SQL (positional ``?`` parameters) of the stored alert events matching the
    filters, newest first, and its parameters; rows as :func:`alerts_from_rows` reads them.

    Args:
        run_id / rule / state: optional filters (None: any).
        limit: keep only the newest ``limit`` events (None or 0: all).
    """
    where, params = [], []
    for column, value in (("run_id", run_id), ("rule", rule), ("state", state)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    sql = (
        "SELECT alert_id, coalesce(incident_id, alert_id), run_id, step, "
        "coalesce(first_step, step), rule, severity, state, layers, ranks, message, "
        "coalesce(frame_values, '{}')::VARCHAR, created_at, wall_time FROM alerts"
        + (f" WHERE {' AND '.join(where)}" if where else "")
        + " ORDER BY created_at DESC, alert_id"
        + (f" LIMIT {int(limit)}" if limit else "")
    )
    return sql, params


def alerts_from_rows(rows: Iterable[Sequence[Any]]) -> list[Alert]:
    """:class:`~schemas.alert.Alert` models of the rows of :func:`alerts_query` (newest
    first), returned oldest first."""
    out = []
    for row in reversed(list(rows)):
        (alert_id, incident, run, step, first, rule_, severity, state_, layers, ranks, msg,
         values, created, wall) = row
        out.append(Alert(
            alert_id=alert_id, incident_id=incident, run_id=run, step=step, first_step=first,
            rule=rule_, severity=severity, state=state_, layers=list(layers or []),
            ranks=list(ranks or []), message=msg, values=json.loads(values),
            created_at=created, wall_time=wall,
        ))
    return out


def read_alerts(
    con: duckdb.DuckDBPyConnection, run_id: str | None = None, rule: str | None = None,
    state: str | None = None, limit: int | None = None,
) -> list[Alert]:
    """Stored alert events, oldest first (the newest ``limit`` when given), read on ``con``
    (:func:`alerts_query`, :func:`alerts_from_rows`).

    Args:
        con: a connection to the store. run_id / rule / state: optional filters.
        limit: keep only the newest ``limit`` events (None or 0: all).

    Returns:
        The events as :class:`~schemas.alert.Alert` models.
    """
    sql, params = alerts_query(run_id, rule, state, limit)
    return alerts_from_rows(con.execute(sql, params).fetchall())
