"""Routing incidents to a Prometheus Alertmanager (Alertmanager API v2).

Protocol ("Sending alerts" and the API v2 OpenAPI specification of Alertmanager): a client
POSTs a JSON list of *postable alerts* to ``<alertmanager>/api/v2/alerts``; each has
``labels`` (the alert's identity: Alertmanager deduplicates, groups, routes, silences and
inhibits by them; ``alertname`` is required), ``annotations`` (information, the latest
received wins), ``startsAt`` / ``endsAt`` (RFC 3339) and a ``generatorURL`` (a back-link
to what raised it). Alertmanager holds an alert as firing until its ``endsAt``; a client
therefore re-sends its firing alerts every 30 s to 3 min, each time with ``endsAt`` a
*lease* ahead, and on resolution sends it once more with ``endsAt`` = the resolution
time. Prometheus does this (re-send every ``--rules.alert.resend-delay``, 1 m by
default, with ``endsAt = now + 4 x max(resend delay, evaluation interval)``), and so does
:class:`AlertmanagerSink`, with ``AlertingSettings.alertmanager_resend_interval_s`` and
``alertmanager_lease`` (default 4 re-send intervals).

One gradstream incident is one Alertmanager alert. Its labels (:func:`alertmanager_labels`)
are fixed for the incident's whole life, so every re-send and the resolution update the
same alert: ``alertname`` (the rule), ``run_id``, ``severity``, ``incident_id`` and, when
the firing event names exactly one, ``layer`` and ``rank``. Nothing that changes from step
to step (a step, a value, a growing list of layers) is a label: it would make a new alert
of each re-send and a new series in Alertmanager's metrics; those go in the annotations.

Limits: the sink knows the incidents it saw fire. A process restarted while an incident is
firing re-opens it without sending it again (``AlertEngine.restore`` emits no event), so
Alertmanager resolves it when its last lease ends, and the resolution gradstream sends
later repeats that. An incident gradstream never resolves (e.g. ``run_health`` of a run
that finished Critical) stays firing in Alertmanager while the process runs: silence it
there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from consumer.alerts.rules import rule_title
from consumer.alerts.sinks import (
    DeliveryError,
    HttpSink,
    SinkCounters,
    dashboard_run_url,
    rfc3339,
)
from schemas.alert import Alert, AlertState

if TYPE_CHECKING:
    from consumer.settings import AlertingSettings

ALERTS_PATH = "/api/v2/alerts"
"""Where alerts are POSTed, below the Alertmanager's base URL (Alertmanager API v2)."""

ANNOTATION_LIMIT = 4096
"""Longest annotation value sent (characters; longer ones are cut with "…"). Alertmanager
sets no limit, but its notifications carry every annotation (Slack, e-mail, PagerDuty
templates); 4096 keeps a message whole (gradstream's messages are one line, their layer
lists are previews) while a run with thousands of involved layers cannot bloat each
re-send."""


@dataclass(slots=True)
class AlertmanagerCounters(SinkCounters):
    """:class:`~consumer.alerts.sinks.SinkCounters` (per event: each firing and resolved
    event's own POST), plus the periodic re-sends.

    Attributes:
        resent: firing alerts re-sent (one per firing incident per re-send).
        resend_failed: firing alerts whose re-send failed (re-sent again next time).
    """

    resent: int = 0
    resend_failed: int = 0


def alertmanager_labels(alert: Alert) -> dict[str, str]:
    """The identifying labels of ``alert``'s incident, fixed for the incident's life.

    Returns:
        ``alertname`` (the rule's name), ``run_id``, ``severity`` (``info`` / ``warning``
        / ``critical``), ``incident_id``, plus ``layer`` when the event names exactly one
        layer and ``rank`` when it names exactly one rank. Compute them from the firing
        event: a resolved event names every layer involved during the incident.
    """
    labels = {
        "alertname": str(alert.rule),
        "run_id": alert.run_id,
        "severity": alert.severity.value,
        "incident_id": alert.incident_id,
    }
    if len(alert.layers) == 1:
        labels["layer"] = alert.layers[0]
    if len(alert.ranks) == 1:
        labels["rank"] = str(alert.ranks[0])
    return labels


def _cut(text: str, limit: int = ANNOTATION_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, the last one "…" when cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def alertmanager_annotations(alert: Alert, dashboard_url: str | None = None) -> dict[str, str]:
    """The annotations of ``alert`` (information, not identity; each cut to
    :data:`ANNOTATION_LIMIT` characters).

    Returns:
        ``summary`` (one line: severity, rule title, run, the step the incident began),
        ``description`` (the event's message: what fired, or how it resolved), ``step``
        (of this event), ``first_step``, ``layers`` and ``ranks`` (comma-separated, when
        any), ``state`` (``firing`` / ``resolved``) and ``dashboard`` (the run in
        gradstream's dashboard, :func:`~consumer.alerts.sinks.dashboard_run_url`, when
        ``dashboard_url`` is given).
    """
    out = {
        "summary": _cut(f"[{alert.severity.value.upper()}] {rule_title(alert.rule)} in run "
                        f"{alert.run_id} since step {alert.first_step}"),
        "description": _cut(alert.message),
        "step": str(alert.step),
        "first_step": str(alert.first_step),
        "state": alert.state.value,
    }
    if alert.layers:
        out["layers"] = _cut(", ".join(alert.layers))
    if alert.ranks:
        out["ranks"] = _cut(", ".join(str(r) for r in alert.ranks))
    if dashboard_url:
        out["dashboard"] = dashboard_run_url(dashboard_url, alert.run_id)
    return out


def postable_alert(
    alert: Alert, *, ends_at: float, starts_at: float | None = None,
    labels: dict[str, str] | None = None, dashboard_url: str | None = None,
) -> dict[str, Any]:
    """One postable alert of Alertmanager API v2 (an element of the list POSTed to
    ``/api/v2/alerts``).

    Args:
        alert: the gradstream event whose annotations it carries.
        ends_at: unix time (s) of ``endsAt``: now + the lease while the incident fires,
            the resolution time once it resolved.
        starts_at: unix time (s) of ``startsAt``, when the incident fired (its firing
            event's ``created_at``); None leaves it out: Alertmanager then takes
            ``endsAt`` and, for an alert it already holds, keeps the earlier start.
        labels: the incident's labels (default :func:`alertmanager_labels` of ``alert``;
            pass the firing event's for a resolved one).
        dashboard_url: gradstream dashboard's base URL: ``generatorURL`` is the run's page
            there (left out when None).

    Returns:
        ``{"labels", "annotations", "startsAt"?, "endsAt", "generatorURL"?}`` with RFC
        3339 times; ``endsAt`` is never before ``startsAt`` (Alertmanager refuses such an
        alert).
    """
    body: dict[str, Any] = {
        "labels": dict(alertmanager_labels(alert) if labels is None else labels),
        "annotations": alertmanager_annotations(alert, dashboard_url),
    }
    if starts_at is not None:
        ends_at = max(ends_at, starts_at)
        body["startsAt"] = rfc3339(starts_at)
    body["endsAt"] = rfc3339(ends_at)
    if dashboard_url:
        body["generatorURL"] = dashboard_run_url(dashboard_url, alert.run_id)
    return body


@dataclass(slots=True)
class _Firing:
    """A firing incident the sink re-sends: its firing event and labels."""

    alert: Alert
    labels: dict[str, str]


class AlertmanagerSink(HttpSink):
    """Sends each incident to Alertmanager as one alert (Alertmanager API v2, see the
    module docstring): when it fires, every ``resend_interval_s`` while it fires (all
    firing incidents in one POST, ``endsAt`` = now + ``lease_s``), and once when it
    resolves (``endsAt`` = the resolution time).

    Delivery follows :class:`~consumer.alerts.sinks.HttpSink` (queue, retries, backoff;
    ``counters`` count the firing and resolved events' own POSTs). A periodic re-send is
    one attempt, counted in ``counters.resent`` / ``resend_failed``: the next re-send is
    its retry, so a firing event whose own POST failed still reaches Alertmanager once
    it answers again. Everything runs on the sink's thread: a dead Alertmanager never
    blocks the worker.

    Args:
        url: Alertmanager's base URL (``http(s)://host:9093``); alerts go to
            ``<url>/api/v2/alerts``.
        resend_interval_s: seconds between re-sends of the firing incidents.
        lease_s: ``endsAt`` of a firing incident, seconds ahead of each send; more than
            ``resend_interval_s``.
        dashboard_url: gradstream dashboard's base URL for ``generatorURL`` (None: none).
        timeout_s / retries / backoff_s / queue_size: as
            :class:`~consumer.alerts.sinks.HttpSink`.
        wall_clock: unix time (s), for ``endsAt``.

    Raises:
        ValueError: ``url`` is not http(s), or ``lease_s <= resend_interval_s``.
    """

    def __init__(
        self, url: str, *, resend_interval_s: float, lease_s: float,
        dashboard_url: str | None = None, timeout_s: float = 5.0, retries: int = 3,
        backoff_s: float = 0.5, queue_size: int = 1000,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not lease_s > resend_interval_s > 0:
            raise ValueError(f"the Alertmanager lease ({lease_s:g} s) must exceed the re-send "
                             f"interval ({resend_interval_s:g} s), which must be positive")
        super().__init__("alertmanager", url.rstrip("/") + ALERTS_PATH, timeout_s=timeout_s,
                         retries=retries, backoff_s=backoff_s, queue_size=queue_size)
        self.counters: AlertmanagerCounters = AlertmanagerCounters()
        self.resend_interval_s = resend_interval_s
        self.lease_s = lease_s
        self.dashboard_url = dashboard_url
        self._wall = wall_clock
        self._firing: dict[str, _Firing] = {}
        self._next_resend = 0.0

    @classmethod
    def from_settings(cls, settings: AlertingSettings) -> AlertmanagerSink | None:
        """The sink for ``settings.alertmanager_url`` (None when unset), re-sending every
        ``alertmanager_resend_interval_s`` with the lease ``alertmanager_lease``, linking to
        ``dashboard_url``, with the HTTP sinks' timeout and retries and the queue size.

        Raises:
            ValueError: see the class.
        """
        if not settings.alertmanager_url:
            return None
        return cls(settings.alertmanager_url,
                   resend_interval_s=settings.alertmanager_resend_interval_s,
                   lease_s=settings.alertmanager_lease, dashboard_url=settings.dashboard_url,
                   timeout_s=settings.webhook_timeout_s, retries=settings.webhook_retries,
                   queue_size=settings.alert_queue_size)

    @property
    def firing(self) -> int:
        """Firing incidents being re-sent."""
        return len(self._firing)

    def deliver(self, alert: Alert) -> None:
        """POST one event: a firing incident (then re-sent until it resolves) or its
        resolution (labels and ``startsAt`` of its firing event when this sink saw it).

        Raises:
            DeliveryError: refused (non-retryable 4xx) or every attempt failed.
        """
        if alert.state is AlertState.FIRING:
            if not self._firing:  # the first firing incident starts the re-send clock
                self._next_resend = time.monotonic() + self.resend_interval_s
            entry = self._firing[alert.incident_id] = _Firing(alert, alertmanager_labels(alert))
            body = self._firing_body(entry, self._wall())
        else:
            known = self._firing.pop(alert.incident_id, None)
            body = postable_alert(
                alert, ends_at=alert.created_at,
                starts_at=None if known is None else known.alert.created_at,
                labels=None if known is None else known.labels,
                dashboard_url=self.dashboard_url,
            )
        self.post_json([body])

    def periodic(self, now: float) -> None:
        """Re-send every firing incident once ``resend_interval_s`` has passed since the
        last re-send (one POST, one attempt).

        Raises:
            DeliveryError: the re-send failed (logged by the sink's thread).
        """
        if not self._firing or now < self._next_resend:
            return
        self._next_resend = now + self.resend_interval_s
        wall = self._wall()
        body = [self._firing_body(entry, wall) for entry in self._firing.values()]
        try:
            self.post_json(body, retries=0)
        except DeliveryError:
            self.counters.resend_failed += len(body)
            raise
        self.counters.resent += len(body)

    def _firing_body(self, entry: _Firing, wall: float) -> dict[str, Any]:
        """The postable alert of a firing incident, ``endsAt`` one lease after ``wall``."""
        return postable_alert(entry.alert, ends_at=wall + self.lease_s,
                              starts_at=entry.alert.created_at, labels=entry.labels,
                              dashboard_url=self.dashboard_url)
