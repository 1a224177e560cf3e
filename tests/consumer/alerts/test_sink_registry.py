"""The queued-sink registry and the alert-routing settings: which sinks the settings
(flags or GRADSTREAM_* variables) configure, with which parameters, and the errors that
say what to fix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from consumer.alerts.alertmanager import AlertmanagerSink
from consumer.alerts.pagerduty import PagerDutySink
from consumer.alerts.service import AlertService
from consumer.alerts.sink_registry import SINKS, sinks_from_settings
from consumer.alerts.sinks import QueuedSink
from consumer.settings import PAGERDUTY_EVENTS_URL, ConsumerSettings

KEY = "0123456789abcdef0123456789ABCDEF"

ROUTING_ENV = ("GRADSTREAM_WEBHOOK_URL", "GRADSTREAM_ALERTMANAGER_URL",
               "GRADSTREAM_ALERTMANAGER_RESEND_INTERVAL_S", "GRADSTREAM_ALERTMANAGER_LEASE_S",
               "GRADSTREAM_PAGERDUTY_ROUTING_KEY", "GRADSTREAM_PAGERDUTY_URL",
               "GRADSTREAM_DASHBOARD_URL")


@pytest.fixture(autouse=True)
def _no_routing_environment(monkeypatch):
    for name in ROUTING_ENV:
        monkeypatch.delenv(name, raising=False)


def test_every_registered_sink_builds_itself_from_settings():
    assert SINKS and all(issubclass(s, QueuedSink) for s in SINKS)
    assert all("from_settings" in vars(s) for s in SINKS)
    assert len({s.__name__ for s in SINKS}) == len(SINKS)


def test_by_default_only_the_log():
    assert [s.name for s in sinks_from_settings(ConsumerSettings())] == ["log"]


def test_each_route_given_adds_its_sink_with_its_settings():
    settings = ConsumerSettings(
        webhook_url="http://127.0.0.1:1/hook", alertmanager_url="http://am.example:9093/",
        alertmanager_resend_interval_s=15, pagerduty_routing_key=KEY,
        dashboard_url="http://gradstream.example:8765/", webhook_timeout_s=2,
        webhook_retries=1, alert_queue_size=7,
    )
    sinks = {s.name: s for s in sinks_from_settings(settings)}
    assert list(sinks) == ["log", "webhook", "alertmanager", "pagerduty"]
    am = sinks["alertmanager"]
    assert isinstance(am, AlertmanagerSink)
    assert am.url == "http://am.example:9093/api/v2/alerts"
    assert (am.resend_interval_s, am.lease_s) == (15, 60)  # 4 re-send intervals
    assert am.dashboard_url == "http://gradstream.example:8765"
    assert (am.timeout_s, am.retries) == (2, 1)
    pd = sinks["pagerduty"]
    assert isinstance(pd, PagerDutySink) and pd.url == PAGERDUTY_EVENTS_URL
    assert pd.dashboard_url == "http://gradstream.example:8765"
    assert all(s._queue.maxsize == 7 for s in sinks.values())


def test_routes_from_the_environment(monkeypatch):
    monkeypatch.setenv("GRADSTREAM_ALERTMANAGER_URL", "https://am.example")
    monkeypatch.setenv("GRADSTREAM_ALERTMANAGER_RESEND_INTERVAL_S", "30")
    monkeypatch.setenv("GRADSTREAM_ALERTMANAGER_LEASE_S", "300")
    monkeypatch.setenv("GRADSTREAM_PAGERDUTY_ROUTING_KEY", KEY)
    monkeypatch.setenv("GRADSTREAM_PAGERDUTY_URL", "http://127.0.0.1:9/v2/enqueue")
    monkeypatch.setenv("GRADSTREAM_DASHBOARD_URL", "http://dash.example")
    settings = ConsumerSettings()
    assert (settings.alertmanager_url, settings.alertmanager_lease) == ("https://am.example", 300)
    sinks = {s.name: s for s in sinks_from_settings(settings)}
    assert sinks["alertmanager"].resend_interval_s == 30
    assert sinks["pagerduty"].url == "http://127.0.0.1:9/v2/enqueue"
    assert KEY not in repr(settings)  # the routing key is a secret


@pytest.mark.parametrize(("fields", "says"), [
    ({"alertmanager_url": "alertmanager:9093"}, "GRADSTREAM_ALERTMANAGER_URL must be an http"),
    ({"pagerduty_url": "ftp://events.pagerduty.com"}, "GRADSTREAM_PAGERDUTY_URL"),
    ({"dashboard_url": "http://"}, "with a host"),
    ({"pagerduty_routing_key": "abc"}, "32-character Integration Key"),
    ({"alertmanager_resend_interval_s": 60, "alertmanager_lease_s": 30}, "must exceed"),
    ({"alertmanager_resend_interval_s": 0}, "greater than 0"),
])
def test_invalid_routing_settings_say_what_to_fix(fields, says):
    with pytest.raises(ValidationError, match=says):
        ConsumerSettings(**fields)


def test_the_service_runs_the_registered_sinks():
    settings = ConsumerSettings(alertmanager_url="http://127.0.0.1:9", pagerduty_routing_key=KEY)
    service = AlertService.from_settings(  # no alerts topic: no Kafka needed
        settings.model_copy(update={"alerts_topic": None}), is_finished=lambda _r: False)
    assert [s.name for s in service.sinks] == ["log", "alertmanager", "pagerduty"]
    summary = service.summary()
    assert summary["alertmanager"]["resent"] == 0 and summary["pagerduty"]["delivered"] == 0
    service.close(0.1)
