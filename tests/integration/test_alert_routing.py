"""Alert routing end to end: real Kafka broker, real worker and DuckDB file, a real
Prometheus Alertmanager, and a local server answering as PagerDuty's Events API v2.

Two runs stream through the worker; a NaN on one rank makes each fire ``nonfinite``
(and ``run_health``, which stays firing: a run that had NaN stays Critical). Alertmanager
(grouping by ``[alertname, run_id]``) holds each incident as one alert with its labels,
annotations and link to the run, in one group per rule and run, and keeps it firing
because the worker re-sends it (its ``endsAt`` moves on); when run A's ``nonfinite``
resolves in gradstream, Alertmanager resolves that alert (its API stops listing it and its
notification says ``resolved`` with gradstream's resolution time) while the others stay
firing. PagerDuty receives one valid trigger per incident and a resolve with the same
``dedup_key`` for the resolved one. ``gradstream demo`` given the routing flags routes its
incidents the same way: the demo's loss spike and straggler arrive and resolve there.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

from consumer.alerts.rows import read_alerts
from consumer.alerts.rules import rule_names, rule_title
from consumer.settings import ConsumerSettings
from deploy.cli import app
from deploy.serve import ServedStore
from schemas.alert import Alert
from tests.chromium import chromium_page
from tests.consumer.alerts.pagerduty_server import PagerDutyReceiver
from tests.consumer.alerts.webhook_server import WebhookReceiver
from tests.integration.alertmanager import ALERTMANAGER, Alertmanager, wait_until
from tests.integration.test_alerts import produce, read_topic, start_worker

DASHBOARD = "http://gradstream.example:8765"
KEY = "0123456789abcdef0123456789abcdef"  # a PagerDuty routing key is 32 characters
RESEND_S = 1.0
"""The worker re-sends its firing incidents every second, so the test sees re-sends."""
LEASE_S = 120.0
"""Far beyond the test's length: an alert that ends during the test was ended by
gradstream's resolution, not by its lease running out."""
RULES = ("nonfinite", "run_health")
"""The rules this test is about; the others (a spike or a stall would be real, but noise)
are turned off."""


def stamp(text: str) -> float:
    """An RFC 3339 time from Alertmanager as unix seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def by_rule_and_run(alerts: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(a["labels"]["alertname"], a["labels"]["run_id"]): a for a in alerts}


@pytest.fixture
def stack(tmp_path: Path):
    """A real Alertmanager notifying a local recorder, and a local PagerDuty."""
    assert Path(ALERTMANAGER).is_file(), "install Debian's prometheus-alertmanager (make test)"
    with WebhookReceiver() as notifications, PagerDutyReceiver() as pagerduty, \
            Alertmanager(tmp_path / "alertmanager", notifications.url) as alertmanager:
        yield alertmanager, notifications, pagerduty


def test_incidents_reach_alertmanager_and_pagerduty_and_resolve_there(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, stack,
) -> None:
    alertmanager, notifications, pagerduty = stack
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{unique_name}",
        dlq_topic=f"dlq-{unique_name}", group_id=f"grp-{unique_name}",
        alerts_topic=f"alerts-{unique_name}", db=str(tmp_path / "store.duckdb"),
        shard_timeout_s=60.0,
        alert_set=[f"{r}.enabled=false" for r in rule_names() if r not in RULES],
        alertmanager_url=alertmanager.url, alertmanager_resend_interval_s=RESEND_S,
        alertmanager_lease_s=LEASE_S, pagerduty_routing_key=KEY, pagerduty_url=pagerduty.url,
        dashboard_url=DASHBOARD,
    )
    run_a, run_b = f"run-a-{unique_name}", f"run-b-{unique_name}"
    worker, thread = start_worker(settings)
    try:
        # Both runs get a NaN at step 8 (run A on rank 2, run B on rank 0) and stop at
        # step 9: one clean step, fewer than the 5 that resolve nonfinite.
        produce(settings.bootstrap_servers, settings.topic, run_a, range(10), nan={(8, 2)},
                finish=False)
        produce(settings.bootstrap_servers, settings.topic, run_b, range(10), nan={(8, 0)},
                finish=False)
        firing = wait_until("four active alerts in Alertmanager", lambda: (
            by_rule_and_run(alertmanager.alerts())
            if len(alertmanager.alerts(active="true", unprocessed="false")) == 4 else None))
        groups = alertmanager.groups()
        # the worker keeps them alive: each re-send pushes endsAt on
        first_ends = {k: stamp(a["endsAt"]) for k, a in firing.items()}
        wait_until("a re-send", lambda: all(
            stamp(a["endsAt"]) > first_ends[k] + 0.5 * RESEND_S
            for k, a in by_rule_and_run(alertmanager.alerts()).items()), timeout_s=10)

        # run A comes clean: nonfinite resolves at step 13 (5 clean steps: 9..13)
        produce(settings.bootstrap_servers, settings.topic, run_a, range(10, 16), nan=set(),
                start=False)
        assert worker.wait_for_runs([run_a], 60), worker.error
        left = wait_until("run A's nonfinite alert to leave Alertmanager", lambda: (
            by_rule_and_run(alertmanager.alerts())
            if ("nonfinite", run_a) not in by_rule_and_run(alertmanager.alerts()) else None))
        resolved_note = wait_until("Alertmanager's resolved notification", lambda: next(
            (n for n in notifications.bodies if n["status"] == "resolved"), None), 15)
        assert pagerduty.wait_for(5, 15), (pagerduty.events, pagerduty.invalid)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None and worker.alerts is not None
    events = [r for r in read_topic(settings) if isinstance(r, Alert)]
    fired = {(str(e.rule), e.run_id): e for e in events if e.state.value == "firing"}
    (resolution,) = [e for e in events if e.state.value == "resolved"]
    assert sorted(fired) == sorted(firing) == sorted(
        (rule, run) for rule in RULES for run in (run_a, run_b))
    assert (str(resolution.rule), resolution.run_id) == ("nonfinite", run_a)

    # each incident arrived with its labels, annotations, start and link to the run
    for key, alert in firing.items():
        event = fired[key]
        rule, run = key
        labels = alert["labels"]
        assert {k: labels[k] for k in ("alertname", "run_id", "severity", "incident_id")} == {
            "alertname": rule, "run_id": run, "severity": "critical",
            "incident_id": event.incident_id}
        assert alert["annotations"]["description"] == event.message
        assert alert["annotations"]["summary"].startswith(f"[CRITICAL] {rule_title(rule)} in "
                                                          f"run {run} since step 8")
        assert alert["generatorURL"] == f"{DASHBOARD}/?run={run}"
        assert stamp(alert["startsAt"]) == pytest.approx(event.created_at, abs=1e-3)
        assert stamp(alert["endsAt"]) > event.created_at + LEASE_S - 30
        assert alert["status"]["state"] == "active"
        assert alert["receivers"] == [{"name": "recorder"}]
    assert (firing[("nonfinite", run_a)]["labels"]["layer"],
            firing[("nonfinite", run_a)]["labels"]["rank"]) == ("ffn.out", "2")
    assert firing[("nonfinite", run_b)]["labels"]["rank"] == "0"
    assert firing[("nonfinite", run_a)]["annotations"]["ranks"] == "2"

    # grouped by rule and run: one group per (alertname, run_id), holding that run's alert
    assert sorted((g["labels"]["alertname"], g["labels"]["run_id"]) for g in groups) == sorted(
        firing)
    for group in groups:
        assert set(group["labels"]) == {"alertname", "run_id"}
        assert [a["labels"]["incident_id"] for a in group["alerts"]] == [
            fired[(group["labels"]["alertname"], group["labels"]["run_id"])].incident_id]

    # resolved in Alertmanager when gradstream resolved it; the others still fire
    assert sorted(left) == sorted(k for k in firing if k != ("nonfinite", run_a))
    assert all(a["status"]["state"] == "active" for a in left.values())
    assert resolved_note["groupLabels"] == {"alertname": "nonfinite", "run_id": run_a}
    (note,) = resolved_note["alerts"]
    assert note["status"] == "resolved"
    assert note["labels"] == firing[("nonfinite", run_a)]["labels"]
    assert stamp(note["endsAt"]) == pytest.approx(resolution.created_at, abs=1e-3)
    assert note["annotations"]["description"] == resolution.message
    firing_notes = {(n["groupLabels"]["alertname"], n["groupLabels"]["run_id"])
                    for n in notifications.bodies if n["status"] == "firing"}
    assert firing_notes == set(firing)

    summary = worker.alerts.summary()
    assert summary["alertmanager"]["delivered"] == 5 and summary["alertmanager"]["failed"] == 0
    assert summary["alertmanager"]["resent"] >= 4 and summary["alertmanager"]["resend_failed"] == 0

    # PagerDuty: every event valid; one trigger per incident, a resolve with its dedup_key
    assert pagerduty.invalid == []
    actions: dict[str, list[str]] = {}
    for event in pagerduty.events:
        actions.setdefault(event["dedup_key"], []).append(event["event_action"])
    assert actions == {e.incident_id: ["trigger", "resolve"] if e is fired[("nonfinite", run_a)]
                       else ["trigger"] for e in fired.values()}
    trigger = next(e for e in pagerduty.events
                   if e["dedup_key"] == fired[("nonfinite", run_a)].incident_id)
    assert trigger["payload"]["source"] == run_a and trigger["payload"]["severity"] == "critical"
    assert trigger["payload"]["component"] == "ffn.out"
    assert trigger["links"][0]["href"] == f"{DASHBOARD}/?run={run_a}"
    assert summary["pagerduty"]["delivered"] == 5 and summary["pagerduty"]["failed"] == 0

    # the generatorURL opens that run in gradstream's dashboard (served here from the store)
    served = ServedStore(Path(settings.db), port=0)
    served.start()
    try:
        with chromium_page() as page:
            page.goto(served.dashboard_url)  # the token URL: the browser gets its cookie
            shown = page.wait_for_selector("#runs li.selected").get_attribute("data-run-id")
            other = run_b if shown == run_a else run_a  # a link must select the other run
            link = firing[("nonfinite", other)]["generatorURL"]
            page.goto(link.replace(DASHBOARD, served.url))  # the link carries no token
            page.wait_for_function(
                "id => document.querySelector('#runs li.selected')?.dataset.runId === id",
                arg=other, timeout=20_000)
            page.wait_for_function(
                "id => document.getElementById('grid-title').textContent.includes(id)",
                arg=other, timeout=20_000)
    finally:
        served.stop()


def received_total(alertmanager: Alertmanager, status: str) -> float:
    """Alertmanager's own count of alerts it received with ``status`` (``firing`` or
    ``resolved``), from its ``/metrics`` (``alertmanager_alerts_received_total``)."""
    with urllib.request.urlopen(f"{alertmanager.url}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("alertmanager_alerts_received_total{")
               and f'status="{status}"' in line)


def test_demo_routes_its_incidents(kafka_bootstrap: str, tmp_path: Path, stack) -> None:
    """`gradstream demo` with the routing flags: the loss-spike and straggler scenarios'
    incidents reach Alertmanager with their labels and a link to the run in the dashboard,
    and resolve there when gradstream resolves them (Alertmanager counts the resolved
    alerts it received and stops listing them; it sends no notification for an alert that
    resolved within its group wait); PagerDuty gets a trigger and a resolve for each."""
    alertmanager, _notifications, pagerduty = stack
    seen: dict[str, dict[str, Any]] = {}
    demo_done = threading.Event()

    def watch() -> None:  # what Alertmanager lists while the demo runs
        while not demo_done.is_set():
            seen.update({a["labels"]["incident_id"]: a for a in alertmanager.alerts()})
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = CliRunner().invoke(app, [
            "demo", "--scenario", "loss-spike", "--scenario", "straggler", "--ranks", "2",
            "--out", str(tmp_path / "out"), "--no-heatmap", "--no-read-endpoint",
            "--bootstrap-servers", kafka_bootstrap, "--alertmanager-url", alertmanager.url,
            "--pagerduty-url", pagerduty.url, "--dashboard-url", DASHBOARD,
        ], env={"GRADSTREAM_PAGERDUTY_ROUTING_KEY": KEY, "COLUMNS": "200"})
    finally:
        demo_done.set()
        watcher.join(10)
    assert result.exit_code == 0, result.output
    assert "routed to alertmanager" in result.output and "routed to pagerduty" in result.output
    db = tmp_path / "out" / "demo.duckdb"
    con = duckdb.connect(str(db), read_only=True)
    stored = read_alerts(con)
    con.close()
    fired = {a.incident_id: a for a in stored if a.state.value == "firing"}
    resolved = {a.incident_id: a for a in stored if a.state.value == "resolved"}
    rules = {str(a.rule): a for a in fired.values()}
    assert {"loss_spike", "straggler"} <= set(rules)
    assert rules["loss_spike"].run_id.startswith("demo-loss-spike-")
    assert rules["straggler"].ranks == [1]
    # both resolve within their runs (the spike passes, the slow rank recovers)
    assert {rules["loss_spike"].incident_id, rules["straggler"].incident_id} <= set(resolved)
    # Every incident arrived in Alertmanager (its own count), the straggler's for long
    # enough (10 slow steps) to be listed with the labels that identify it; one that fired
    # and resolved between two polls may not have been listed.
    assert received_total(alertmanager, "firing") >= len(fired)
    assert rules["straggler"].incident_id in seen
    assert set(seen) <= set(fired)
    for incident, alert in seen.items():
        assert alert["labels"]["alertname"] == str(fired[incident].rule)
        assert alert["labels"]["run_id"] == fired[incident].run_id
        assert alert["generatorURL"] == f"{DASHBOARD}/?run={fired[incident].run_id}"
    assert seen[rules["straggler"].incident_id]["labels"]["rank"] == "1"
    # the resolved ones were received as resolved and are no longer held
    assert received_total(alertmanager, "resolved") >= len(resolved)
    held = {a["labels"]["incident_id"] for a in alertmanager.alerts()}
    assert held == set(fired) - set(resolved)
    assert pagerduty.invalid == []
    triggers = {e["dedup_key"] for e in pagerduty.events if e["event_action"] == "trigger"}
    resolves = {e["dedup_key"] for e in pagerduty.events if e["event_action"] == "resolve"}
    assert triggers == set(fired) and resolves == set(resolved)
