"""Alert events in the DuckDB alerts table: bulk upsert, read back, active incidents."""

from __future__ import annotations

import duckdb

from consumer.alerts.engine import AlertEngine
from consumer.alerts.rows import load_active_incidents, read_alerts, write_alerts
from schemas.alert import AlertRule, AlertState
from schemas.tables import SCHEMA_DDL
from tests.consumer.alerts.helpers import Run, only


def store(tmp_path):
    con = duckdb.connect(str(tmp_path / "alerts.duckdb"))
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    return con


def incidents():
    run = Run(AlertEngine(only("nonfinite", resolve_after=1)), world=3)
    run.step(0, nan={2: ["head", "attn.q"]})
    run.step(1)                        # resolves the first
    run.step(2, nan={0: ["embed"]})    # second incident, still open
    return run.events


def test_round_trip_and_replay_is_idempotent(tmp_path):
    con = store(tmp_path)
    events = incidents()
    assert [e.state for e in events] == [AlertState.FIRING, AlertState.RESOLVED,
                                         AlertState.FIRING]
    write_alerts(con, events)
    write_alerts(con, events)  # a replay after a crash writes the same ids
    assert con.execute("SELECT count(*) FROM alerts").fetchone() == (3,)
    back = read_alerts(con)
    assert [a.alert_id for a in back] == [e.alert_id for e in events]
    assert back[0] == events[0]  # every field, values included
    assert con.execute(
        "SELECT frame_values->'$.nonfinite_by_rank'->>'$.\"2\"' FROM alerts WHERE step = 0"
    ).fetchone()[0] == '["attn.q","head"]'
    assert [a.step for a in read_alerts(con, rule="nonfinite", state="firing")] == [0, 2]
    assert [a.step for a in read_alerts(con, limit=1)] == [2]
    assert read_alerts(con, run_id="other") == []


def test_active_incidents_are_those_whose_last_event_fires(tmp_path):
    con = store(tmp_path)
    events = incidents()
    write_alerts(con, events)
    (active,) = load_active_incidents(con)
    assert (active.run_id, active.rule, active.first_step) == ("run-1", AlertRule.NONFINITE, 2)
    assert active.incident_id == events[2].incident_id
    assert active.layers == ["embed"] and active.ranks == [0]
