"""Where alert events go: the alerts Kafka topic, a webhook, the log.

The Kafka topic is the primary sink: records are handed to kafka-python's producer on the
worker thread (``send`` only appends to the client's buffer; its I/O thread delivers).
Every other sink is a :class:`QueuedSink`: the worker thread only appends the event to a
bounded queue (never blocking), and the sink's own thread delivers it. A slow or dead
sink therefore fills its queue, and events beyond ``queue_size`` are dropped and counted,
while consumption goes on. The DuckDB ``alerts`` table is written by the worker's sink in
its own transaction (``consumer.alerts.rows``), not here.

The queued sinks a process runs are those of the registry
:data:`consumer.alerts.sink_registry.SINKS` whose settings are given (each sink's
``from_settings``); HTTP sinks derive from :class:`HttpSink` (one retry policy). Besides
the log and the webhook here: Prometheus Alertmanager (``consumer.alerts.alertmanager``)
and PagerDuty (``consumer.alerts.pagerduty``).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import quote

from consumer.alerts.rules import rule_title
from schemas.alert import Alert, AlertSeverity, AlertState, RunStatus, encode_alert_record
from schemas.kafka_settings import KafkaClientSettings

if TYPE_CHECKING:
    from consumer.settings import AlertingSettings

log = logging.getLogger("gradstream.alerts")


@dataclass(slots=True)
class SinkCounters:
    """Totals of one sink since start.

    Attributes:
        submitted: events offered. delivered: events delivered. dropped: events refused
        because the queue was full, or still queued when the sink was closed.
        failed: events given up after every attempt. retries: extra attempts made.
    """

    submitted: int = 0
    delivered: int = 0
    dropped: int = 0
    failed: int = 0
    retries: int = 0


class QueuedSink:
    """A sink drained by its own daemon thread from a bounded queue.

    Args:
        name: for the thread name and log lines.
        queue_size: events waiting at most; more are dropped (counted).

    Subclasses implement :meth:`deliver` (an exception from it counts as a failure) and
    :meth:`from_settings` (to be listed in ``consumer.alerts.sink_registry.SINKS``), and may
    implement :meth:`periodic` (work on the sink's own schedule, e.g. re-sending).
    """

    IDLE_WAIT_S = 0.1
    """Longest wait for an event before the thread runs :meth:`periodic` again (s): bounds
    how late periodic work may run and how long :meth:`close` waits for an idle thread."""

    def __init__(self, name: str, queue_size: int) -> None:
        self.name = name
        self.counters = SinkCounters()
        self._queue: queue.Queue[Alert] = queue.Queue(maxsize=queue_size)
        self._closing = threading.Event()
        self._abandon = threading.Event()
        self._thread = threading.Thread(target=self._drain, name=f"gradstream-alert-{name}",
                                         daemon=True)
        self._started = False
        self._last_drop_log = 0.0

    @classmethod
    def from_settings(cls, settings: AlertingSettings) -> Self | None:  # pragma: no cover
        """The sink ``settings`` ask for, or None when they do not configure it (e.g. no
        URL given). Called once per process by
        ``consumer.alerts.sink_registry.sinks_from_settings``.

        Raises:
            ValueError: the settings configure it wrongly (the message says what to fix).
        """
        raise NotImplementedError

    def start(self) -> None:
        """Start the delivery thread (idempotent)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, alert: Alert) -> bool:
        """Queue ``alert`` without blocking. Returns False (and counts a drop) when full."""
        self.counters.submitted += 1
        try:
            self._queue.put_nowait(alert)
            return True
        except queue.Full:
            self.counters.dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log > 10.0:
                self._last_drop_log = now
                log.warning("alert sink %s is not keeping up: queue full, %d event(s) dropped "
                            "so far", self.name, self.counters.dropped)
            return False

    @property
    def pending(self) -> int:
        """Events waiting in the queue."""
        return self._queue.qsize()

    def close(self, timeout: float) -> None:
        """Deliver what is queued for at most ``timeout`` seconds, then stop; events still
        queued then are counted as dropped."""
        self._closing.set()
        if self._started:
            self._thread.join(timeout)
        if self._thread.is_alive() or not self._started:
            self._abandon.set()
            left = self._queue.qsize()
            if left:
                self.counters.dropped += left
                log.warning("alert sink %s closed with %d undelivered event(s)", self.name, left)

    def _drain(self) -> None:
        while not self._abandon.is_set():
            try:
                self.periodic(time.monotonic())
            except Exception as exc:
                if not self._abandon.is_set():
                    log.warning("alert sink %s: periodic work failed: %s", self.name, exc)
            try:
                alert = self._queue.get(timeout=self.IDLE_WAIT_S)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            try:
                self.deliver(alert)
                self.counters.delivered += 1
            except Exception as exc:
                self.counters.failed += 1
                if not self._abandon.is_set():  # after close() nobody reads the log
                    log.warning("alert sink %s failed to deliver %s: %s", self.name,
                                alert.alert_id, exc)

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the sink is being abandoned; True if it was."""
        return self._abandon.wait(seconds)

    def deliver(self, alert: Alert) -> None:  # pragma: no cover - abstract
        """Deliver one event (runs on the sink's thread); raise on failure."""
        raise NotImplementedError

    def periodic(self, now: float) -> None:
        """Work on the sink's own schedule, run on the sink's thread before each wait for
        an event (at least every :attr:`IDLE_WAIT_S` s while idle, between events while
        busy); ``now`` is ``time.monotonic()``. Nothing by default. An exception is logged
        and the thread goes on."""


class LogSink(QueuedSink):
    """Writes each event to the ``gradstream.alerts`` logger: firing critical events at
    ERROR, other firing events at WARNING, resolved events at INFO."""

    def __init__(self, queue_size: int = 1000) -> None:
        super().__init__("log", queue_size)

    @classmethod
    def from_settings(cls, settings: AlertingSettings) -> LogSink:
        """Always a log sink, holding ``settings.alert_queue_size`` events."""
        return cls(settings.alert_queue_size)

    def deliver(self, alert: Alert) -> None:
        """Log one line: ``[severity] rule state: message``."""
        if alert.state is AlertState.RESOLVED:
            level = logging.INFO
        elif alert.severity is AlertSeverity.CRITICAL:
            level = logging.ERROR
        else:
            level = logging.WARNING
        log.log(level, "[%s] %s %s: %s", alert.severity.value, alert.rule,
                alert.state.value, alert.message)


class DeliveryError(RuntimeError):
    """An HTTP sink's endpoint refused the event or could not be reached after every
    attempt (:meth:`HttpSink.post_json`)."""


RETRY_AFTER_CAP_S = 60.0
"""Longest ``Retry-After`` (s) an HTTP sink honours: a longer wait would hold every event
behind it in the sink's queue; it retries after this instead."""


class HttpSink(QueuedSink):
    """A queued sink that POSTs JSON to an HTTP endpoint, retrying failed attempts.

    Args:
        name: the sink's name (thread, log lines, ``AlertService.summary``).
        url: where to POST (``http://`` or ``https://``).
        timeout_s: per attempt, for connecting and for the response.
        retries: extra attempts after a failed one (connection error, timeout, HTTP 408,
            429 or 5xx; the PagerDuty Events API v2 asks clients to retry 429 and 5xx);
            other 4xx answers (an invalid event) are not retried.
        backoff_s: wait before retry n (1-based) is ``backoff_s * 2**(n-1)`` (exponential
            backoff), or the server's ``Retry-After`` seconds when it sends one (capped at
            :data:`RETRY_AFTER_CAP_S`).
        queue_size: events waiting at most.

    Raises:
        ValueError: ``url`` is not http(s).
    """

    def __init__(self, name: str, url: str, *, timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.5, queue_size: int = 1000) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{name} URL must start with http:// or https://, got {url!r}")
        super().__init__(name, queue_size)
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def post_json(self, body: Any, *, retries: int | None = None) -> bytes:
        """POST ``body`` as JSON to :attr:`url`, retrying with backoff (runs on the sink's
        thread; a sink being abandoned stops waiting).

        Args:
            body: JSON-serialisable value.
            retries: extra attempts (None: :attr:`retries`); each counted in
                ``counters.retries``.

        Returns:
            The first 64 KiB of the response body.

        Raises:
            DeliveryError: refused (non-retryable 4xx) or every attempt failed.
        """
        data = json.dumps(body).encode()
        retries = self.retries if retries is None else retries
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                self.counters.retries += 1
            retry_after: float | None = None
            request = urllib.request.Request(
                self.url, data=data, method="POST",
                headers={"Content-Type": "application/json", "User-Agent": "gradstream-alerts"},
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return response.read(65536)
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code} {exc.reason}"
                if exc.code not in (408, 429) and exc.code < 500:
                    detail = _error_body(exc)
                    raise DeliveryError(f"{self.url} refused the event: {last}"
                                        + (f": {detail}" if detail else "")) from None
                header = exc.headers.get("Retry-After") if exc.headers else None
                if header and header.strip().isdigit():
                    retry_after = min(float(header), RETRY_AFTER_CAP_S)
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                last = str(getattr(exc, "reason", exc))
            if attempt < retries:
                delay = retry_after if retry_after is not None else self.backoff_s * 2**attempt
                if self.sleep(delay):
                    break
        raise DeliveryError(f"{self.url}: {retries + 1} attempt(s) failed, last: {last}")


def _error_body(exc: urllib.error.HTTPError, limit: int = 500) -> str:
    """The start of a refusal's body (e.g. the PagerDuty Events API v2's ``errors`` list,
    Alertmanager's validation message), one line, for the log; "" when unreadable."""
    try:
        text = exc.read(limit).decode("utf-8", "replace")
    except Exception:
        return ""
    return " ".join(text.split())


_EMOJI = {
    AlertSeverity.CRITICAL: ":rotating_light:",
    AlertSeverity.WARNING: ":warning:",
    AlertSeverity.INFO: ":information_source:",
}


def _mrkdwn(text: str, limit: int) -> str:
    """Escape Slack's control characters (&, <, >) and cut to ``limit`` characters."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def slack_payload(alert: Alert) -> dict[str, Any]:
    """The JSON body POSTed for ``alert``: a Slack incoming-webhook message.

    ``text`` (the notification fallback), ``blocks`` (a section with the title and
    message, a section of fields: run, step, layers, ranks; a context line with the
    incident), and ``metadata`` (``event_type="gradstream_alert"``, ``event_payload`` =
    the full :class:`~schemas.alert.Alert` as JSON) for receivers other than Slack. Section
    texts are cut to Slack's 3000 characters and fields to 2000.
    """
    icon = ":white_check_mark:" if alert.state is AlertState.RESOLVED else _EMOJI[alert.severity]
    title = (f"{icon} [{alert.severity.value.upper()}] {rule_title(alert.rule)} "
             f"{alert.state.value}: run {alert.run_id}, step {alert.step}")
    layers = ", ".join(alert.layers) if alert.layers else "-"
    ranks = ", ".join(str(r) for r in alert.ranks) if alert.ranks else "-"
    fields = [
        ("Run", f"`{alert.run_id}`"), ("Step", str(alert.step)),
        ("Layers", layers), ("Ranks", ranks),
    ]
    return {
        "text": f"{title}\n{alert.message}",
        "blocks": [
            {"type": "section", "text": {
                "type": "mrkdwn", "text": _mrkdwn(f"*{title}*\n{alert.message}", 3000)}},
            {"type": "section", "fields": [
                {"type": "mrkdwn", "text": _mrkdwn(f"*{k}*\n{v}", 2000)} for k, v in fields
            ]},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": _mrkdwn(
                f"gradstream · incident {alert.incident_id} · began at step "
                f"{alert.first_step} · rule {alert.rule}", 3000)}]},
        ],
        "metadata": {
            "event_type": "gradstream_alert",
            "event_payload": alert.model_dump(mode="json"),
        },
    }


class WebhookSink(HttpSink):
    """POSTs each event as Slack-compatible JSON (:func:`slack_payload`) to ``url``.

    Args:
        url: the webhook (``http://`` or ``https://``).
        timeout_s / retries / backoff_s / queue_size: as :class:`HttpSink`.

    Raises:
        ValueError: ``url`` is not http(s).
    """

    def __init__(self, url: str, *, timeout_s: float = 5.0, retries: int = 3,
                 backoff_s: float = 0.5, queue_size: int = 1000) -> None:
        super().__init__("webhook", url, timeout_s=timeout_s, retries=retries,
                         backoff_s=backoff_s, queue_size=queue_size)

    @classmethod
    def from_settings(cls, settings: AlertingSettings) -> WebhookSink | None:
        """The webhook at ``settings.webhook_url`` (None when unset), with the settings'
        timeout, retries and queue size.

        Raises:
            ValueError: the URL is not http(s).
        """
        if not settings.webhook_url:
            return None
        return cls(settings.webhook_url, timeout_s=settings.webhook_timeout_s,
                   retries=settings.webhook_retries, queue_size=settings.alert_queue_size)

    def deliver(self, alert: Alert) -> None:
        """POST one event, retrying with backoff.

        Raises:
            DeliveryError: refused (non-retryable 4xx) or every attempt failed.
        """
        self.post_json(slack_payload(alert))


def rfc3339(unix_s: float) -> str:
    """``unix_s`` (seconds since the epoch) as an RFC 3339 UTC timestamp with milliseconds,
    e.g. ``2026-11-27T17:19:50.123Z``: what Alertmanager API v2 (``startsAt``/``endsAt``)
    and the PagerDuty Events API v2 (``payload.timestamp``, ISO 8601) take."""
    stamp = datetime.fromtimestamp(unix_s, tz=UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def dashboard_run_url(dashboard_url: str, run_id: str) -> str:
    """The link to one run in gradstream's dashboard: ``<dashboard_url>/?run=<run id>``
    (the page, ``analysis/dashboard/static/dashboard.js``, selects the run named by
    ``?run=``). It carries no token: whoever opens it is asked for one, as on any page.

    Args:
        dashboard_url: the dashboard's base URL (``AlertingSettings.dashboard_url``).
        run_id: the run; percent-encoded.
    """
    return f"{dashboard_url.rstrip('/')}/?run={quote(run_id, safe='')}"


class KafkaAlertSink:
    """Publishes alerts and run statuses to the alerts topic, keyed by run id, with a
    ``type`` header (``alert`` / ``run_status``).

    Args:
        settings: connection settings. topic: the alerts topic.
        max_block_ms: longest ``send`` may block for metadata or buffer space.

    Raises:
        kafka.errors.KafkaError: the cluster cannot be reached at start-up.
    """

    def __init__(self, settings: KafkaClientSettings, topic: str, max_block_ms: int = 10_000):
        from kafka import KafkaProducer

        self.topic = topic
        self.counters = SinkCounters()
        self._producer = KafkaProducer(
            **settings.kafka_kwargs(), acks=-1, linger_ms=0, max_block_ms=max_block_ms,
        )
        self._producer.partitions_for(topic)  # fetch metadata now, not on the first alert

    def publish(self, record: Alert | RunStatus) -> None:
        """Hand ``record`` to the producer (asynchronous); failures are counted and logged,
        never raised."""
        if isinstance(record, Alert):
            self.counters.submitted += 1
        try:
            future = self._producer.send(
                self.topic, key=record.run_id.encode(), value=encode_alert_record(record),
                headers=[("type", record.type.encode())],
            )
        except Exception as exc:
            self._failed(exc)
            return
        if isinstance(record, Alert):
            future.add_callback(self._sent)
        future.add_errback(self._failed)

    def _sent(self, _metadata: object) -> None:
        self.counters.delivered += 1

    def _failed(self, exc: BaseException) -> None:
        self.counters.failed += 1
        log.warning("publishing to the alerts topic %s failed: %s", self.topic, exc)

    def close(self, timeout: float) -> None:
        """Flush what is buffered (at most ``timeout`` s) and close the producer."""
        try:
            self._producer.flush(timeout=timeout)
        except Exception as exc:
            log.warning("alerts topic flush failed: %s", exc)
        self._producer.close(timeout=timeout)
