"""Rebuilding the open incidents from alert events (the alerts topic): the same answer as
the store's, idempotent under replayed duplicates, and a worker restored from them neither
fires an open incident twice nor forgets to resolve it."""

from __future__ import annotations

import duckdb

from consumer.alerts.engine import AlertEngine
from consumer.alerts.incident import ActiveIncident, active_from_events
from consumer.alerts.rows import load_active_incidents, write_alerts
from schemas.alert import (
    Alert,
    AlertRule,
    AlertState,
    RunStatus,
    decode_alert_record,
    encode_alert_record,
)
from schemas.tables import SCHEMA_DDL
from tests.consumer.alerts.helpers import FIRING, RESOLVED, Run, only, states


def topic(events: list[Alert | RunStatus]) -> list[Alert | RunStatus]:
    """The records as a reader of the alerts topic gets them (encoded, decoded)."""
    return [decode_alert_record(encode_alert_record(e)) for e in events]


def two_incidents() -> tuple[list[Alert], list[RunStatus]]:
    """nonfinite fires at 0, resolves at 1, fires again at 2 (still open)."""
    engine = AlertEngine(only("nonfinite", resolve_after=1), status_interval_s=0.0)
    run = Run(engine, world=3)
    run.step(0, nan={2: ["head", "attn.q"]})
    run.step(1)
    run.step(2, nan={0: ["embed"]})
    return run.events, engine.take_statuses()


def test_fired_is_active_fired_then_resolved_is_not():
    events, _ = two_incidents()
    first_fired, first_resolved, second_fired = events
    assert [e.state for e in events] == [AlertState.FIRING, AlertState.RESOLVED,
                                         AlertState.FIRING]
    (only_first,) = active_from_events(topic([first_fired]))
    assert only_first == ActiveIncident("run-1", AlertRule.NONFINITE, first_fired.incident_id,
                                        0, ["attn.q", "head"], [2])
    assert only_first.rule is AlertRule.NONFINITE
    assert active_from_events(topic([first_fired, first_resolved])) == []
    (active,) = active_from_events(topic(events))
    assert (active.incident_id, active.first_step, active.layers, active.ranks) == (
        second_fired.incident_id, 2, ["embed"], [0])
    assert active_from_events([]) == []


def test_replayed_duplicates_change_nothing():
    events, statuses = two_incidents()
    expected = active_from_events(events)
    assert active_from_events(events + events) == expected  # the topic read twice
    assert active_from_events([e for e in events for _ in range(3)]) == expected
    # an open incident's firing delivered twice is one incident
    assert active_from_events([events[2], events[2]]) == expected
    # run statuses on the same topic are skipped
    assert active_from_events(topic([*statuses, *events, *statuses])) == expected


def test_same_answer_as_the_store(tmp_path):
    events, _ = two_incidents()
    other = Run(AlertEngine(only("missing_ranks", resolve_after=1)), world=2, run_id="run-2")
    other.step(0, ranks=[0])  # missing_ranks fires, stays open
    exploding = Run(AlertEngine(only("exploding", consecutive=1, resolve_after=1)),
                    run_id="run-3")
    exploding.step(0, scale={"head": 1e6})
    exploding.step(1)  # fired and resolved
    everything = [*events, *other.events, *exploding.events]
    con = duckdb.connect(str(tmp_path / "alerts.duckdb"))
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    write_alerts(con, everything)
    from_store = sorted(load_active_incidents(con), key=lambda a: a.run_id)
    from_topic = active_from_events(topic(everything))
    assert from_topic == from_store
    assert [(a.run_id, a.rule) for a in from_topic] == [
        ("run-1", AlertRule.NONFINITE), ("run-2", AlertRule.MISSING_RANKS)]
    # keep only some rules
    assert active_from_events(everything, rules=["missing_ranks"]) == [from_store[1]]
    assert active_from_events(everything, rules=[]) == []


def test_a_worker_restored_from_the_topic_does_not_fire_again():
    events, _ = two_incidents()
    engine = AlertEngine(only("nonfinite", resolve_after=2))
    engine.restore(active_from_events(topic(events)))
    run = Run(engine, world=3)
    assert run.step(3, nan={1: ["embed"]}) == []  # the open incident goes on: no firing
    run.step(4)
    resolved = run.step(5)
    assert states(resolved) == [(RESOLVED, 5)]
    assert resolved[0].incident_id == events[2].incident_id
    assert resolved[0].first_step == 2 and resolved[0].ranks == [0, 1]
    # the resolved incident is not restored: a new NaN is a new incident
    assert states(run.step(6, nan={0: ["head"]})) == [(FIRING, 6)]


def test_incidents_of_unknown_rules_are_not_restored():
    events, _ = two_incidents()
    newer = events[2].model_copy(update={"rule": "from_a_newer_worker"})
    assert isinstance(newer.rule, str)
    active = active_from_events([newer])
    assert [a.rule for a in active] == ["from_a_newer_worker"]
    engine = AlertEngine(only("nonfinite"))
    engine.restore(active)  # skipped: this engine has no such rule
    assert engine.active() == []
