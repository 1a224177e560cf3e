"""Routing incidents to PagerDuty (PagerDuty Events API v2, "Send an Alert Event").

Protocol: a client POSTs one JSON event to ``https://events.pagerduty.com/v2/enqueue``
(``AlertingSettings.pagerduty_url``) and gets 202 when it is accepted, 400 when it is
invalid (not retried), 429 or 5xx when it should retry later. An event has the
``routing_key`` (the 32-character integration key of an Events API v2 integration), an
``event_action`` (``trigger``, ``acknowledge`` or ``resolve``) and a ``dedup_key`` (at
most 255 characters) naming the PagerDuty alert it triggers or resolves; a ``trigger``
also has a ``payload``: ``summary`` (at most 1024 characters), ``source``, ``severity``
(``critical``, ``error``, ``warning`` or ``info``), and optionally ``timestamp`` (ISO
8601), ``component``, ``group``, ``class`` and ``custom_details``; plus optional
``client``, ``client_url`` and ``links``.

One gradstream incident is one PagerDuty alert: its firing event triggers it, its
resolved event resolves it, both with ``dedup_key`` = the incident id
(``schemas.alert.incident_id``: deterministic, so a replayed firing deduplicates in
PagerDuty, and a process restarted mid-incident still resolves the right alert).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from consumer.alerts.rules import rule_title
from consumer.alerts.sinks import HttpSink, dashboard_run_url, rfc3339
from schemas.alert import Alert, AlertSeverity, AlertState

if TYPE_CHECKING:
    from consumer.settings import AlertingSettings

SUMMARY_LIMIT = 1024
"""Longest ``payload.summary`` PagerDuty accepts (characters; Events API v2)."""

DEDUP_KEY_LIMIT = 255
"""Longest ``dedup_key`` PagerDuty accepts (characters; Events API v2). Incident ids are
24 characters (``schemas.alert.incident_id``)."""

EVENT_BYTES_LIMIT = 512 * 1024
"""Largest event PagerDuty accepts (bytes of JSON; Events API v2). An event whose
``custom_details`` would pass it is sent without the frame values (``values``), which stay
in gradstream's ``alerts`` table."""

PAGERDUTY_SEVERITY: dict[AlertSeverity, str] = {
    AlertSeverity.CRITICAL: "critical",
    AlertSeverity.WARNING: "warning",
    AlertSeverity.INFO: "info",
}
"""gradstream severity -> ``payload.severity`` (one of PagerDuty's ``critical``, ``error``,
``warning``, ``info``). Each gradstream level has PagerDuty's level of the same name;
``error`` (between warning and critical) has no gradstream counterpart and is not used."""

CLIENT = "gradstream"
"""``client``: the monitoring tool that sends the events, shown by PagerDuty."""

GROUP = "gradstream"
"""``payload.group`` (PagerDuty: the logical grouping of components of a service): every
gradstream event shares it, so that a PagerDuty service fed by several monitoring tools
groups and filters gradstream's events together."""


def pagerduty_summary(alert: Alert) -> str:
    """``payload.summary``: severity, rule title, run, the step the incident began, then
    the event's message; cut to :data:`SUMMARY_LIMIT` characters (the last one "…")."""
    text = (f"[{alert.severity.value.upper()}] {rule_title(alert.rule)} in run "
            f"{alert.run_id} since step {alert.first_step}: {alert.message}")
    return text if len(text) <= SUMMARY_LIMIT else text[: SUMMARY_LIMIT - 1] + "…"


def pagerduty_component(alert: Alert) -> str:
    """``payload.component`` (PagerDuty: the part of the source responsible): the layer
    when the incident names exactly one, else ``rank <r>`` when it names exactly one rank,
    else ``run`` (the run as a whole, or several layers: ``custom_details.layers`` lists
    them)."""
    if len(alert.layers) == 1:
        return alert.layers[0]
    if len(alert.ranks) == 1:
        return f"rank {alert.ranks[0]}"
    return "run"


def pagerduty_event(alert: Alert, routing_key: str,
                    dashboard_url: str | None = None) -> dict[str, Any]:
    """The Events API v2 event for ``alert`` (the JSON object POSTed to ``/v2/enqueue``).

    Args:
        alert: a firing event (-> ``trigger``) or a resolved one (-> ``resolve``).
        routing_key: the integration key (32 characters).
        dashboard_url: gradstream dashboard's base URL: ``client_url`` and a link to the
            run's page there (:func:`~consumer.alerts.sinks.dashboard_run_url`); None: no
            link.

    Returns:
        A ``resolve``: ``routing_key``, ``event_action``, ``dedup_key`` (the incident id),
        all PagerDuty reads of it. A ``trigger`` adds ``payload`` = {``summary``
        (:func:`pagerduty_summary`), ``source`` (the run id: the affected system),
        ``severity`` (:data:`PAGERDUTY_SEVERITY`), ``timestamp`` (when the incident fired,
        ISO 8601), ``component`` (:func:`pagerduty_component`), ``group``
        (:data:`GROUP`), ``class`` (the rule's name), ``custom_details`` (the incident:
        id, rule and title, step, first step, layers, ranks, message, the frame values
        unless the event would exceed :data:`EVENT_BYTES_LIMIT`)}, ``client``, and with a
        dashboard ``client_url`` and ``links``.

    Raises:
        ValueError: the incident id is longer than :data:`DEDUP_KEY_LIMIT`.
    """
    if len(alert.incident_id) > DEDUP_KEY_LIMIT:
        raise ValueError(f"incident id of {len(alert.incident_id)} characters exceeds "
                         f"PagerDuty's dedup_key limit of {DEDUP_KEY_LIMIT}")
    event: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "resolve" if alert.state is AlertState.RESOLVED else "trigger",
        "dedup_key": alert.incident_id,
    }
    if alert.state is AlertState.RESOLVED:
        return event
    details: dict[str, Any] = {
        "incident_id": alert.incident_id, "alert_id": alert.alert_id, "run_id": alert.run_id,
        "rule": str(alert.rule), "rule_title": rule_title(alert.rule),
        "severity": alert.severity.value, "step": alert.step, "first_step": alert.first_step,
        "layers": list(alert.layers), "ranks": list(alert.ranks), "message": alert.message,
        "values": alert.model_dump(mode="json")["values"],
    }
    event["payload"] = {
        "summary": pagerduty_summary(alert),
        "source": alert.run_id,
        "severity": PAGERDUTY_SEVERITY[alert.severity],
        "timestamp": rfc3339(alert.created_at),
        "component": pagerduty_component(alert),
        "group": GROUP,
        "class": str(alert.rule),
        "custom_details": details,
    }
    event["client"] = CLIENT
    if dashboard_url:
        run_url = dashboard_run_url(dashboard_url, alert.run_id)
        event["client_url"] = run_url
        event["links"] = [{"href": run_url, "text": f"gradstream dashboard: run {alert.run_id}"}]
    if len(json.dumps(event).encode()) > EVENT_BYTES_LIMIT:
        details["values"] = None
        details["values_left_out"] = (
            f"the frame values would take the event past PagerDuty's {EVENT_BYTES_LIMIT} "
            "bytes; they are in gradstream's alerts table")
    return event


class PagerDutySink(HttpSink):
    """Triggers a PagerDuty alert when an incident fires and resolves it when the
    incident resolves (PagerDuty Events API v2, see the module docstring; events from
    :func:`pagerduty_event`).

    Delivery follows :class:`~consumer.alerts.sinks.HttpSink`: PagerDuty's 429 and 5xx
    answers and network errors are retried with backoff, a 400 (invalid event) is not;
    its own thread, so a dead endpoint never blocks the worker.

    Args:
        routing_key: the integration key (32 characters).
        url: the Events API v2 endpoint (``AlertingSettings.pagerduty_url``).
        dashboard_url: gradstream dashboard's base URL for links (None: none).
        timeout_s / retries / backoff_s / queue_size: as
            :class:`~consumer.alerts.sinks.HttpSink`.

    Raises:
        ValueError: ``url`` is not http(s), or ``routing_key`` is empty.
    """

    def __init__(self, routing_key: str, url: str, *, dashboard_url: str | None = None,
                 timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.5,
                 queue_size: int = 1000) -> None:
        if not routing_key:
            raise ValueError("a PagerDuty routing key (Events API v2 integration key) is "
                             "required")
        super().__init__("pagerduty", url, timeout_s=timeout_s, retries=retries,
                         backoff_s=backoff_s, queue_size=queue_size)
        self._routing_key = routing_key
        self.dashboard_url = dashboard_url

    @classmethod
    def from_settings(cls, settings: AlertingSettings) -> PagerDutySink | None:
        """The sink for ``settings.pagerduty_routing_key`` (None when unset), POSTing to
        ``pagerduty_url`` with links to ``dashboard_url``, with the HTTP sinks' timeout
        and retries and the queue size.

        Raises:
            ValueError: see the class.
        """
        if not settings.pagerduty_routing_key:
            return None
        return cls(settings.pagerduty_routing_key, settings.pagerduty_url,
                   dashboard_url=settings.dashboard_url, timeout_s=settings.webhook_timeout_s,
                   retries=settings.webhook_retries, queue_size=settings.alert_queue_size)

    def deliver(self, alert: Alert) -> None:
        """POST the event of ``alert`` (trigger or resolve), retrying with backoff.

        Raises:
            consumer.alerts.sinks.DeliveryError: refused (e.g. 400, an invalid event or
                routing key) or every attempt failed.
        """
        self.post_json(pagerduty_event(alert, self._routing_key, self.dashboard_url))
