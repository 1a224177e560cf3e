"""The PagerDuty sink: Events API v2 events built from real engine events, checked against
the Events API v2 schema (tests/consumer/alerts/pagerduty_server.py), and the sink against
a real local HTTP server that answers as PagerDuty does."""

from __future__ import annotations

import json
import time

import pytest

from consumer.alerts.engine import AlertEngine
from consumer.alerts.pagerduty import (
    EVENT_BYTES_LIMIT,
    GROUP,
    PAGERDUTY_SEVERITY,
    SUMMARY_LIMIT,
    PagerDutySink,
    pagerduty_component,
    pagerduty_event,
    pagerduty_summary,
)
from schemas.alert import Alert, AlertSeverity
from tests.consumer.alerts.helpers import Run, only
from tests.consumer.alerts.pagerduty_server import PagerDutyReceiver, events_v2_violations

KEY = "R0UT1NGKEY0123456789abcdefABCDEF"  # 32 characters, as PagerDuty's integration keys
DASHBOARD = "https://gradstream.example"


def incident(run_id: str = "run-1") -> tuple[Alert, Alert]:
    """Firing and resolved event of a real nonfinite incident (rank 1, 'ffn.out')."""
    run = Run(AlertEngine(only("nonfinite", resolve_after=1)), world=3, run_id=run_id)
    run.step(0, nan={1: ["ffn.out"]})
    run.step(1)
    firing, resolved = run.events
    return firing, resolved


def valid(event: dict) -> list[str]:
    return events_v2_violations(json.dumps(event).encode())


def test_the_schema_check_finds_what_pagerduty_refuses():
    """The checker the tests rely on flags each kind of invalid event."""
    firing, _ = incident()
    good = pagerduty_event(firing, KEY, DASHBOARD)
    assert valid(good) == []
    bad = {
        "routing_key": ("short", "routing_key"),
        "event_action": ("fire", "event_action"),
        "dedup_key": ("k" * 256, "dedup_key"),
    }
    for field, (value, word) in bad.items():
        assert any(word in e for e in valid({**good, field: value})), field
    for field, value in (("severity", "fatal"), ("summary", "s" * 1025), ("source", ""),
                         ("timestamp", "yesterday"), ("custom_details", "text")):
        event = {**good, "payload": {**good["payload"], field: value}}
        assert any(field in e for e in valid(event)), field
    no_payload = {k: v for k, v in good.items() if k != "payload"}
    assert any("payload" in e for e in valid(no_payload))
    assert any("dedup_key" in e for e in valid({"routing_key": KEY, "event_action": "resolve"}))
    assert any("link" in e for e in valid({**good, "links": [{"text": "no href"}]}))
    assert any("unknown" in e for e in valid({**good, "dedupkey": "typo"}))


def test_trigger_event():
    firing, _ = incident()
    event = pagerduty_event(firing, KEY, DASHBOARD)
    assert valid(event) == []
    assert (event["event_action"], event["dedup_key"], event["routing_key"]) == (
        "trigger", firing.incident_id, KEY)
    payload = event["payload"]
    assert payload["summary"] == pagerduty_summary(firing)
    assert payload["summary"].startswith("[CRITICAL] non-finite gradients in run run-1 since "
                                         "step 0: ")
    assert firing.message in payload["summary"]
    assert (payload["source"], payload["severity"], payload["class"]) == (
        "run-1", "critical", "nonfinite")
    assert (payload["component"], payload["group"]) == ("ffn.out", GROUP)
    details = payload["custom_details"]
    assert details["incident_id"] == firing.incident_id and details["ranks"] == [1]
    assert details["layers"] == ["ffn.out"] and details["first_step"] == 0
    assert details["values"]["layers"]["ffn.out"]["nonfinite"] == 1
    assert event["links"] == [{"href": f"{DASHBOARD}/?run=run-1",
                               "text": "gradstream dashboard: run run-1"}]
    assert event["client"] == "gradstream" and event["client_url"] == f"{DASHBOARD}/?run=run-1"
    assert "links" not in pagerduty_event(firing, KEY) and "client_url" not in pagerduty_event(
        firing, KEY)


def test_resolve_event_names_the_same_alert():
    firing, resolved = incident()
    event = pagerduty_event(resolved, KEY, DASHBOARD)
    assert valid(event) == []
    assert event == {"routing_key": KEY, "event_action": "resolve",
                     "dedup_key": firing.incident_id}


@pytest.mark.parametrize("severity", list(AlertSeverity))
def test_every_severity_maps_to_a_pagerduty_severity(severity):
    firing, _ = incident()
    event = pagerduty_event(firing.model_copy(update={"severity": severity}), KEY)
    assert event["payload"]["severity"] == severity.value == PAGERDUTY_SEVERITY[severity]
    assert valid(event) == []


def test_summary_is_cut_to_pagerdutys_limit():
    firing, _ = incident()
    long = firing.model_copy(update={"message": "m" * 5000})
    event = pagerduty_event(long, KEY)
    assert len(event["payload"]["summary"]) == SUMMARY_LIMIT
    assert event["payload"]["summary"].endswith("…") and valid(event) == []


def test_component_names_the_single_layer_or_rank_else_the_run():
    firing, _ = incident()
    assert pagerduty_component(firing) == "ffn.out"
    assert pagerduty_component(firing.model_copy(update={"layers": []})) == "rank 1"
    assert pagerduty_component(firing.model_copy(update={"layers": ["a", "b"],
                                                         "ranks": [0, 1]})) == "run"


def test_oversized_values_are_left_out_to_fit_pagerdutys_event_limit():
    firing, _ = incident()
    huge = {"layers": {f"layer.{i}": {"note": "v" * 1000} for i in range(EVENT_BYTES_LIMIT // 900)}}
    event = pagerduty_event(firing.model_copy(update={"values": huge}), KEY)
    assert event["payload"]["custom_details"]["values"] is None
    assert "alerts table" in event["payload"]["custom_details"]["values_left_out"]
    assert len(json.dumps(event).encode()) <= EVENT_BYTES_LIMIT and valid(event) == []


def test_sink_triggers_then_resolves_with_one_dedup_key_after_a_rate_limit():
    firing, resolved = incident()
    with PagerDutyReceiver(fail_first=1, fail_status=429) as pd:
        sink = PagerDutySink(KEY, pd.url, dashboard_url=DASHBOARD, timeout_s=2, retries=2,
                             backoff_s=0.05)
        sink.start()
        sink.submit(firing)
        sink.submit(resolved)
        assert pd.wait_for(2, 10), pd.invalid
        sink.close(5)
    assert pd.invalid == []
    assert [e["event_action"] for e in pd.events] == ["trigger", "resolve"]
    assert {e["dedup_key"] for e in pd.events} == {firing.incident_id}
    assert (sink.counters.delivered, sink.counters.failed, sink.counters.retries) == (2, 0, 1)


def test_sink_does_not_retry_an_event_pagerduty_refuses():
    firing, _ = incident()
    with PagerDutyReceiver() as pd:
        sink = PagerDutySink("too-short-a-key", pd.url, timeout_s=2, retries=3, backoff_s=0.05)
        sink.start()
        sink.submit(firing)
        deadline = time.monotonic() + 5
        while sink.counters.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        sink.close(5)
    assert pd.requests == 1 and len(pd.invalid) == 1
    assert sink.counters.failed == 1 and sink.counters.retries == 0


def test_a_dead_endpoint_never_blocks_submit():
    events = list(incident())
    with PagerDutyReceiver() as pd:
        url = pd.url
    sink = PagerDutySink(KEY, url, timeout_s=0.2, retries=1, backoff_s=0.05, queue_size=1)
    sink.start()
    t0 = time.perf_counter()
    accepted = [sink.submit(e) for e in events * 50]
    assert time.perf_counter() - t0 < 0.5
    sink.close(1)
    assert accepted.count(False) >= 90
    assert sink.counters.delivered == 0 and sink.counters.dropped >= 90
