"""AlertService: a worker's (or, in scale-out mode, the store writer's) alert engine wired
to its sinks.

The process that evaluates the rules owns one (a worker writing DuckDB; in scale-out mode
the store writer, on the frames put back in step order, :mod:`consumer.store_writer`). It
calls :meth:`AlertService.note_shard` (a worker), :meth:`AlertService.note_local`,
:meth:`AlertService.on_frame` and :meth:`AlertService.tick` on its own thread and puts the
returned events in its DuckDB batch. Events are published to the alerts topic as soon as
the frame is finalised (not after the DuckDB flush) and queued for the other sinks. An
exception inside the engine is logged and counted, never raised: alerting must not stop
frames from being stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from consumer.alerts.config import load_alert_rules
from consumer.alerts.engine import AlertEngine
from consumer.alerts.incident import ActiveIncident, active_from_events
from consumer.alerts.sink_registry import sinks_from_settings
from consumer.alerts.sinks import KafkaAlertSink, QueuedSink
from consumer.frames import GradientFrame
from consumer.health_tracker import RunHealthTracker
from consumer.runs import RunInfo
from schemas.alert import Alert
from schemas.wire import LocalSummary, StepSummary

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings
    from consumer.store_writer_settings import StoreWriterSettings

log = logging.getLogger("gradstream.alerts")

TICK_INTERVAL_S = 0.1
"""Stall checks run at most this often (s): the worker's poll loop may spin faster."""


class AlertService:
    """Engine plus sinks.

    Args:
        engine: the rules. kafka: the alerts-topic sink (None: not published, tests).
        sinks: queued sinks (those of ``consumer.alerts.sink_registry.SINKS`` that the
            settings configure: the log, and the webhook, Alertmanager, PagerDuty when set).
    """

    def __init__(self, engine: AlertEngine, kafka: KafkaAlertSink | None,
                 sinks: list[QueuedSink]) -> None:
        self.engine = engine
        self.kafka = kafka
        self.sinks = sinks
        self.engine_errors = 0
        self._last_tick = 0.0

    @classmethod
    def from_settings(
        cls, settings: ConsumerSettings | StoreWriterSettings, *,
        is_finished: Callable[[str], bool],
        active: list[ActiveIncident] | None = None,
    ) -> AlertService:
        """Build from a worker's or the store writer's settings: rules from
        ``alert_rules`` / ``alert_set``, the alerts topic (none when ``alerts_topic`` is
        None), and the queued sinks the settings configure
        (:func:`consumer.alerts.sink_registry.sinks_from_settings`: the log; the webhook,
        Alertmanager and PagerDuty when their settings are given).

        Raises:
            consumer.alerts.config.AlertConfigError: invalid rule file or override.
            ValueError: a sink's settings are invalid (e.g. a URL that is not http(s)).
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        rules = load_alert_rules(settings.alert_rules, settings.alert_set)
        engine = AlertEngine(rules, status_interval_s=settings.status_interval_s,
                             is_finished=is_finished)
        engine.restore(active or [])
        sinks = sinks_from_settings(settings)
        kafka = (KafkaAlertSink(settings, settings.alerts_topic) if settings.alerts_topic
                 else None)
        return cls(engine, kafka, sinks)

    def start(self) -> None:
        """Start the sinks' delivery threads."""
        for sink in self.sinks:
            sink.start()

    def note_shard(self, run: RunInfo, shard: StepSummary) -> None:
        """See :meth:`AlertEngine.note_shard`."""
        try:
            self.engine.note_shard(run, shard)
        except Exception:
            self._engine_error("note_shard")

    def note_local(self, run: RunInfo, local: LocalSummary) -> None:
        """See :meth:`AlertEngine.note_local`."""
        try:
            self.engine.note_local(run, local)
        except Exception:
            self._engine_error("note_local")

    def on_frame(self, frame: GradientFrame, run: RunInfo,
                 tracker: RunHealthTracker) -> list[Alert]:
        """Evaluate a finalised frame, publish its events; returns them (for DuckDB)."""
        try:
            alerts = self.engine.on_frame(frame, run, tracker)
        except Exception:
            self._engine_error("on_frame")
            return []
        self._publish(alerts)
        return alerts

    def tick(self) -> list[Alert]:
        """Stall and finish checks (at most every ``TICK_INTERVAL_S``); publishes and
        returns the events."""
        now = time.monotonic()
        if now - self._last_tick < TICK_INTERVAL_S:
            return []
        self._last_tick = now
        try:
            alerts = self.engine.tick(now)
        except Exception:
            self._engine_error("tick")
            return []
        self._publish(alerts)
        return alerts

    def _engine_error(self, where: str) -> None:
        self.engine_errors += 1
        log.exception("alert engine error in %s (frames are still stored)", where)

    def _publish(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            if self.kafka is not None:
                self.kafka.publish(alert)
            for sink in self.sinks:
                sink.submit(alert)
        statuses = self.engine.take_statuses()
        if self.kafka is not None:
            for status in statuses:
                self.kafka.publish(status)

    def restore_from_topic(self, settings: ConsumerSettings,
                           keep: Callable[[str], bool]) -> int:
        """Re-open the incidents whose last event on the alerts topic is ``firing``, for
        the runs ``keep(run_id)`` accepts (a scale-out worker has no store to read them
        from: :func:`consumer.alerts.incident.active_from_events`). Reads the whole topic,
        which its retention bounds.

        Returns:
            The number of incidents re-opened.

        Raises:
            TimeoutError: the topic was not read to its end within 30 s.
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        from consumer.alerts.feed import AlertFeed

        feed = AlertFeed(settings, settings.alerts_topic, since=0)
        try:
            events = feed.read_to_end()
        finally:
            feed.close()
        active = [a for a in active_from_events(events) if keep(a.run_id)]
        self.engine.restore(active)
        return len(active)

    def close(self, timeout: float = 5.0) -> None:
        """Flush the alerts topic and give each queued sink at most ``timeout`` seconds to
        deliver what it holds."""
        if self.kafka is not None:
            self.kafka.close(timeout)
        for sink in self.sinks:
            sink.close(timeout)

    def firing_incidents(self) -> list[tuple[str, str, int]]:
        """(rule, severity, open incidents) for every rule of the engine
        (:meth:`AlertEngine.firing_by_rule`; severity from the rule's configuration):
        the ``gradstream_firing_incidents`` gauge of ``consumer.metrics``."""
        return [(rule, str(self.engine.rules.rule(rule).severity), count)
                for rule, count in self.engine.firing_by_rule().items()]

    def summary(self) -> dict[str, dict[str, int]]:
        """Counters per sink (``kafka``, ``log``, and ``webhook``, ``alertmanager``,
        ``pagerduty`` when configured: :class:`consumer.alerts.sinks.SinkCounters`, plus
        the Alertmanager sink's re-sends) and of the engine."""
        out = {s.name: asdict(s.counters) for s in self.sinks}
        if self.kafka is not None:
            out["kafka"] = asdict(self.kafka.counters)
        e = self.engine.counters
        out["engine"] = {"frames": e.frames, "skipped": e.skipped, "fired": e.fired,
                         "resolved": e.resolved, "errors": self.engine_errors}
        return out

