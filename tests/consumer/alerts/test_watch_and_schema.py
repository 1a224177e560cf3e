"""The alerts-topic records (schema), the watch view's state and rendering, and the
`gradstream alert-rules` command."""

from __future__ import annotations

import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from consumer.alerts.engine import AlertEngine
from consumer.alerts.watch import WatchState
from deploy.cli import app
from schemas.alert import (
    Alert,
    RunStatus,
    decode_alert_record,
    encode_alert_record,
    incident_id,
)
from schemas.wire import WireError
from tests.consumer.alerts.helpers import Run, only


def run_with_incident():
    engine = AlertEngine(only("nonfinite", resolve_after=2), status_interval_s=0.0)
    run = Run(engine, world=2)
    run.step(0, now=0.0)
    run.step(1, now=1.0, nan={1: ["head"]})
    return engine, run


def test_records_round_trip_and_bad_ones_are_refused():
    engine, run = run_with_incident()
    (alert,) = run.events
    for record in [alert, *engine.take_statuses()]:
        assert decode_alert_record(encode_alert_record(record)) == record
    raw = json.loads(encode_alert_record(alert))
    with pytest.raises(WireError, match="schema major version 2"):
        decode_alert_record(json.dumps({**raw, "schema_version": "2.0"}))
    with pytest.raises(WireError, match="state"):
        decode_alert_record(json.dumps({**raw, "state": "pending"}))
    with pytest.raises(WireError, match="empty"):
        decode_alert_record(b"")
    newer = decode_alert_record(json.dumps({**raw, "schema_version": "1.7", "extra": 1}))
    assert isinstance(newer, Alert) and newer.alert_id == alert.alert_id


def test_incident_ids_are_deterministic():
    assert incident_id("r", "nonfinite", 5) == incident_id("r", "nonfinite", 5)
    assert incident_id("r", "nonfinite", 5) != incident_id("r", "nonfinite", 6)
    assert incident_id("r", "nonfinite", 5) != incident_id("r", "exploding", 5)


def test_watch_state_tracks_runs_open_incidents_and_recent_events():
    engine, run = run_with_incident()
    state = WatchState(max_alerts=5)
    for record in [*engine.take_statuses(), *run.events]:
        state.apply(record)
    status = state.runs["run-1"]
    assert isinstance(status, RunStatus) and status.step == 1
    assert status.health.value == "Critical"
    assert list(state.open) == [("run-1", "nonfinite")]
    run.step(2, now=2.0)
    run.step(3, now=3.0)  # resolves
    for record in [*engine.take_statuses(), run.events[-1]]:
        state.apply(record)
    assert state.open == {} and len(state.recent) == 2
    console = Console(width=160, record=True)
    console.print(state.render(now=status.emitted_at + 3))
    text = console.export_text()
    assert "run-1" in text and "running" in text and "Critical" in text and "2/2" in text
    assert "non-finite gradients" in text and "resolved" in text and "firing" in text


def test_watch_marks_stalled_running_and_finished_runs():
    finished: set[str] = set()
    engine = AlertEngine(only("stalled", after_s=5), is_finished=finished.__contains__,
                         status_interval_s=0.0)
    run = Run(engine)
    state = WatchState()

    def feed(records):
        for record in [*engine.take_statuses(), *records]:
            state.apply(record)
        return state.run_state(state.runs["run-1"])[0]

    assert feed(run.step(0, now=0.0)) == "running"
    assert feed(engine.tick(now=10.0)) == "stalled"
    assert list(state.open) == [("run-1", "stalled")]
    assert feed(run.step(1, now=11.0)) == "running" and state.open == {}
    finished.add("run-1")
    assert feed(engine.tick(now=12.0)) == "finished"
    console = Console(width=160, record=True)
    console.print(state.render(show_finished=False))
    assert "no run has reported yet" in console.export_text()


def test_alert_rules_command_checks_files(tmp_path):
    good = tmp_path / "rules.toml"
    good.write_text("[exploding]\nconsecutive = 4\n")
    result = CliRunner().invoke(app, ["alert-rules", str(good), "--alert-set",
                                      "stalled.after_s=60"])
    assert result.exit_code == 0, result.output
    assert "consecutive: 4" in result.output and "after_s: 60.0" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("exploding:\n  consecutive: -1\n")
    result = CliRunner().invoke(app, ["alert-rules", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2: exploding.consecutive" in result.output
