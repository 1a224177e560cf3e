"""Webhook and log sinks: Slack-compatible payload, retries with backoff, a hanging or
dead webhook never blocks the caller, drops and failures are counted."""

from __future__ import annotations

import logging
import time

import pytest

from consumer.alerts.engine import AlertEngine
from consumer.alerts.sinks import LogSink, WebhookSink, slack_payload
from schemas.alert import Alert
from tests.consumer.alerts.helpers import Run, only
from tests.consumer.alerts.webhook_server import WebhookReceiver


def some_alerts(n: int = 1) -> list[Alert]:
    run = Run(AlertEngine(only("nonfinite", resolve_after=1)), world=3)
    events: list[Alert] = []
    step = 0
    while len(events) < n:
        events += run.step(step, nan={1: ['ffn.out']} if step % 2 == 0 else None)
        step += 1
    return events[:n]


def test_payload_is_slack_compatible_and_carries_the_alert():
    (alert,) = some_alerts(1)
    body = slack_payload(alert)
    assert body["text"].startswith(":rotating_light: [CRITICAL] non-finite gradients firing")
    assert alert.message in body["text"]
    section, fields, context = body["blocks"]
    assert section["type"] == "section" and section["text"]["type"] == "mrkdwn"
    assert [f["text"].split("\n")[0] for f in fields["fields"]] == [
        "*Run*", "*Step*", "*Layers*", "*Ranks*"]
    assert fields["fields"][3]["text"] == "*Ranks*\n1"
    assert alert.incident_id in context["elements"][0]["text"]
    assert body["metadata"]["event_type"] == "gradstream_alert"
    assert Alert.model_validate(body["metadata"]["event_payload"]) == alert


def test_webhook_receives_every_event():
    events = some_alerts(4)
    with WebhookReceiver() as receiver:
        sink = WebhookSink(receiver.url, timeout_s=2, retries=0)
        sink.start()
        for e in events:
            assert sink.submit(e)
        assert receiver.wait_for(4, 10)
        sink.close(5)
    got = [b["metadata"]["event_payload"]["alert_id"] for b in receiver.bodies]
    assert got == [e.alert_id for e in events]
    assert (sink.counters.delivered, sink.counters.failed, sink.counters.dropped) == (4, 0, 0)


def test_webhook_retries_with_backoff_then_delivers():
    (alert,) = some_alerts(1)
    with WebhookReceiver(fail_first=2, fail_status=503) as receiver:
        sink = WebhookSink(receiver.url, timeout_s=2, retries=3, backoff_s=0.1)
        sink.start()
        t0 = time.monotonic()
        sink.submit(alert)
        assert receiver.wait_for(1, 10)
        elapsed = receiver.arrivals[0] - t0
        sink.close(5)
    assert receiver.requests == 3 and sink.counters.retries == 2
    assert sink.counters.delivered == 1 and sink.counters.failed == 0
    assert elapsed >= 0.1 + 0.2  # waited backoff 0.1 s then 0.2 s


def test_webhook_client_error_is_not_retried():
    (alert,) = some_alerts(1)
    with WebhookReceiver(fail_first=10, fail_status=404) as receiver:
        sink = WebhookSink(receiver.url, timeout_s=2, retries=3, backoff_s=0.05)
        sink.start()
        sink.submit(alert)
        deadline = time.monotonic() + 5
        while sink.counters.failed == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        sink.close(5)
    assert receiver.requests == 1 and sink.counters.failed == 1 and sink.counters.retries == 0


def test_dead_webhook_counts_failures():
    (alert,) = some_alerts(1)
    receiver = WebhookReceiver()
    url = receiver.url
    receiver.close()  # nothing listens there any more
    sink = WebhookSink(url, timeout_s=0.5, retries=1, backoff_s=0.05)
    sink.start()
    sink.submit(alert)
    deadline = time.monotonic() + 5
    while sink.counters.failed == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    sink.close(1)
    assert sink.counters.failed == 1 and sink.counters.retries == 1


def test_hanging_webhook_never_blocks_submit_and_drops_when_full():
    events = some_alerts(6)
    with WebhookReceiver(hang=True) as receiver:
        sink = WebhookSink(receiver.url, timeout_s=30, retries=0, queue_size=2)
        sink.start()
        t0 = time.perf_counter()
        accepted = [sink.submit(e) for e in events]
        submit_s = time.perf_counter() - t0
        deadline = time.monotonic() + 5
        while receiver.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        t1 = time.perf_counter()
        sink.close(0.5)  # gives up on the hanging request
        close_s = time.perf_counter() - t1
    assert submit_s < 0.5  # the webhook holds each request 30 s
    assert close_s < 2.0
    # the thread took one event and hangs on it; 2 wait in the queue; the rest dropped
    assert accepted.count(False) >= 3
    assert sink.counters.dropped >= 3 + 2 - 1
    assert sink.counters.delivered == 0


def test_webhook_url_must_be_http():
    with pytest.raises(ValueError, match="http"):
        WebhookSink("ftp://example.org/hook")


def test_log_sink_levels(caplog):
    firing, resolved = some_alerts(2)
    sink = LogSink()
    sink.start()
    with caplog.at_level(logging.INFO, logger="gradstream.alerts"):
        sink.submit(firing)
        sink.submit(resolved)
        sink.close(5)
    records = [(r.levelno, r.getMessage()) for r in caplog.records
               if r.name == "gradstream.alerts"]
    assert records[0][0] == logging.ERROR and "nonfinite firing" in records[0][1]
    assert records[1][0] == logging.INFO and "nonfinite resolved" in records[1][1]
    assert sink.counters.delivered == 2
