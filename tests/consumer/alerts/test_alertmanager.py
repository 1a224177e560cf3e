"""The Alertmanager sink: postable alerts (Alertmanager API v2) built from real engine
events, and the sink's firing / re-send / resolve protocol against a real local HTTP
server. (A real Alertmanager receives them in tests/integration/test_alert_routing.py.)"""

from __future__ import annotations

import itertools
import time
from datetime import datetime

import pytest

from consumer.alerts.alertmanager import (
    ANNOTATION_LIMIT,
    AlertmanagerSink,
    alertmanager_annotations,
    alertmanager_labels,
    postable_alert,
)
from consumer.alerts.engine import AlertEngine
from consumer.alerts.sinks import dashboard_run_url, rfc3339
from schemas.alert import Alert
from tests.consumer.alerts.helpers import Run, only
from tests.consumer.alerts.webhook_server import WebhookReceiver

DASHBOARD = "http://gradstream.example:8765"


def incident(run_id: str = "run-1") -> tuple[Alert, Alert]:
    """The firing and the resolved event of one real nonfinite incident: NaN in rank 1's
    'ffn.out' at step 0, then in rank 2's 'embed' at step 1 (the incident grows), then
    two clean steps resolve it."""
    run = Run(AlertEngine(only("nonfinite", resolve_after=2)), world=3, run_id=run_id)
    run.step(0, nan={1: ["ffn.out"]})
    run.step(1, nan={2: ["embed"]})
    run.step(2)
    run.step(3)
    firing, resolved = run.events
    return firing, resolved


def parse(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_rfc3339_is_utc_with_milliseconds():
    assert rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(1_700_000_000.25) == "2023-11-14T22:13:20.250Z"


def test_labels_identify_the_incident_from_its_firing_event():
    firing, resolved = incident()
    assert alertmanager_labels(firing) == {
        "alertname": "nonfinite", "run_id": "run-1", "severity": "critical",
        "incident_id": firing.incident_id, "layer": "ffn.out", "rank": "1",
    }
    # the resolved event names every layer and rank involved: no single layer or rank
    assert resolved.layers == ["embed", "ffn.out"] and resolved.ranks == [1, 2]
    assert alertmanager_labels(resolved) == {
        "alertname": "nonfinite", "run_id": "run-1", "severity": "critical",
        "incident_id": firing.incident_id,
    }
    assert all(isinstance(v, str) for v in alertmanager_labels(firing).values())


def test_annotations_carry_the_message_and_are_bounded():
    firing, resolved = incident()
    notes = alertmanager_annotations(firing, DASHBOARD)
    assert notes["summary"] == "[CRITICAL] non-finite gradients in run run-1 since step 0"
    assert notes["description"] == firing.message
    assert notes["layers"] == "ffn.out" and notes["ranks"] == "1"
    assert (notes["step"], notes["first_step"], notes["state"]) == ("0", "0", "firing")
    assert notes["dashboard"] == f"{DASHBOARD}/?run=run-1"
    resolved_notes = alertmanager_annotations(resolved)
    assert resolved_notes["description"] == resolved.message
    assert "resolved" in resolved.message and resolved_notes["state"] == "resolved"
    assert resolved_notes["layers"] == "embed, ffn.out" and "dashboard" not in resolved_notes
    long = firing.model_copy(update={"message": "x" * (3 * ANNOTATION_LIMIT)})
    description = alertmanager_annotations(long)["description"]
    assert len(description) == ANNOTATION_LIMIT and description.endswith("…")


def test_postable_alert_shape():
    firing, resolved = incident("run/ä b")
    body = postable_alert(firing, ends_at=firing.created_at + 240, starts_at=firing.created_at,
                          dashboard_url=DASHBOARD + "/")
    assert set(body) == {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}
    assert parse(body["endsAt"]) - parse(body["startsAt"]) == pytest.approx(240, abs=1e-3)
    assert body["generatorURL"] == f"{DASHBOARD}/?run=run%2F%C3%A4%20b"
    assert body["generatorURL"] == dashboard_run_url(DASHBOARD, "run/ä b")
    # a resolution keeps the firing event's labels; endsAt never precedes startsAt
    done = postable_alert(resolved, ends_at=firing.created_at - 5, starts_at=firing.created_at,
                          labels=alertmanager_labels(firing))
    assert done["labels"]["layer"] == "ffn.out" and done["endsAt"] == done["startsAt"]
    assert "generatorURL" not in done
    # without a known start, startsAt is left to Alertmanager
    assert "startsAt" not in postable_alert(resolved, ends_at=resolved.created_at)


def wait_for(receiver: WebhookReceiver, count: int) -> None:
    assert receiver.wait_for(count, 10), receiver.bodies


def test_sink_fires_resends_while_firing_then_resolves_once():
    firing, resolved = incident()
    with WebhookReceiver() as am:
        sink = AlertmanagerSink(am.url.removesuffix("/hook"), resend_interval_s=0.3,
                                lease_s=30.0, dashboard_url=DASHBOARD, timeout_s=2, retries=0)
        assert sink.url == am.url.removesuffix("/hook") + "/api/v2/alerts"
        sink.start()
        sink.submit(firing)
        wait_for(am, 3)  # the firing POST, then two re-sends 0.3 s apart
        assert sink.firing == 1
        sink.submit(resolved)
        deadline = time.monotonic() + 10
        while sink.counters.delivered < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        sent = len(am.bodies)
        time.sleep(1.0)  # three re-send intervals: nothing more is sent
        sink.close(5)
    assert len(am.bodies) == sent and sink.firing == 0
    alerts = [body[0] for body in am.bodies]
    assert all(len(body) == 1 for body in am.bodies)
    labels = alertmanager_labels(firing)
    assert all(a["labels"] == labels for a in alerts)  # one alert throughout
    firing_sends, last = alerts[:-1], alerts[-1]
    ends = [parse(a["endsAt"]) for a in firing_sends]  # each send: its time + the lease
    assert all(b - a >= 0.3 - 0.01 for a, b in itertools.pairwise(ends))  # one per interval
    assert all(e - parse(a["startsAt"]) > 29 for e, a in zip(ends, firing_sends, strict=True))
    assert parse(last["startsAt"]) == pytest.approx(firing.created_at, abs=1e-3)
    assert parse(last["endsAt"]) == pytest.approx(resolved.created_at, abs=1e-3)
    assert last["annotations"]["state"] == "resolved"
    assert last["generatorURL"] == f"{DASHBOARD}/?run=run-1"
    assert sink.counters.delivered == 2 and sink.counters.resent == len(firing_sends) - 1


def test_a_firing_alert_refused_at_first_reaches_alertmanager_by_its_resend():
    firing, _ = incident()
    with WebhookReceiver(fail_first=2, fail_status=503) as am:
        sink = AlertmanagerSink(am.url.removesuffix("/hook"), resend_interval_s=0.2,
                                lease_s=10.0, timeout_s=2, retries=0)
        sink.start()
        sink.submit(firing)
        wait_for(am, 1)
        sink.close(5)
    assert am.requests >= 3
    assert sink.counters.failed == 1 and sink.counters.resend_failed == 1
    assert sink.counters.resent >= 1
    assert am.bodies[0][0]["labels"]["incident_id"] == firing.incident_id


def test_resolution_of_an_incident_fired_before_the_sink_started():
    """A restarted process resolves an incident it did not see fire: the resolved event's
    own labels, no startsAt (Alertmanager keeps the alert's earlier start)."""
    firing, resolved = incident()
    with WebhookReceiver() as am:
        sink = AlertmanagerSink(am.url.removesuffix("/hook"), resend_interval_s=0.2,
                                lease_s=10.0, timeout_s=2, retries=0)
        sink.start()
        sink.submit(resolved)
        wait_for(am, 1)
        time.sleep(0.5)
        sink.close(5)
    assert len(am.bodies) == 1
    (alert,) = am.bodies[0]
    assert "startsAt" not in alert and alert["labels"] == alertmanager_labels(resolved)
    assert alert["labels"]["incident_id"] == firing.incident_id


def test_lease_must_exceed_the_resend_interval():
    with pytest.raises(ValueError, match="lease"):
        AlertmanagerSink("http://127.0.0.1:9093", resend_interval_s=60, lease_s=60)
    with pytest.raises(ValueError, match="http"):
        AlertmanagerSink("unix:///am.sock", resend_interval_s=60, lease_s=240)
