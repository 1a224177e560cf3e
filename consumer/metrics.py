"""Prometheus metrics of a consumer worker, served over HTTP (``--metrics-port``).

Every :class:`WorkerMetrics` has its own ``CollectorRegistry``, so several workers in one
process (tests, ``--workers``) keep separate figures and each can serve its own port.

Exposed series (Prometheus naming: ``_total`` counters, base units seconds):

- ``gradstream_messages_total{topic, partition}``: records read from Kafka (counter; rate()
  gives messages per second).
- ``gradstream_frames_total{complete}``: frames finalised (``complete="false"``: partial,
  a rank missing after ``shard_timeout``; a late shard's rewrite counts again).
- ``gradstream_layer_rows_total``: layer rows of finalised frames, i.e. rows written to
  ``layer_stats`` (counter; rate() gives layer-rows per second).
- ``gradstream_dead_letters_total{reason}``: records sent to the dead-letter topic, by
  error class (``consumer.dlq.DEAD_LETTER_ERRORS``: ``invalid``, ``unknown_run``,
  ``conflicting_run``, ``refused_rank``; the ``error`` header of ``consumer.dlq``).
- ``gradstream_consumer_lag{topic, partition}``: log end offset minus the consumer's
  position (records not read yet), refreshed at most once per ``lag_interval_s``.
- ``gradstream_consumer_stuck_partitions_total{topic, partition}``: stuck partitions found
  by the watchdog (:mod:`consumer.stuck_partition`): the partition had records to read and
  its position did not move for ``stuck_partition_timeout_s``; counted once per stuck
  partition, when it is first acted on.
- ``gradstream_consumer_stuck_partition_recoveries_total{action}``: what was done about
  stuck partitions: ``seek`` (one partition re-sought to its position) or ``recreate``
  (the Kafka consumer closed and opened again, when a seek did not help within
  ``stuck_partition_timeout_s``).
- ``gradstream_pending_frames``: frames waiting for ranks (read at scrape time).
- ``gradstream_frame_latency_seconds``: histogram of ``now - frame.wall_time`` when a frame
  is finalised, ``wall_time`` being the latest producer wall clock among its shards
  (includes clock skew between hosts).
- ``gradstream_store_write_duration_seconds{output}``: histogram of the seconds one write of
  a batch with its offsets took (step 4 of ``consumer.checkpoint``: one DuckDB transaction,
  ``output="duckdb"``, timed on the writer thread; or every frame acknowledged by the
  frames topic, ``output="frames_topic"``), failed writes included.
- ``gradstream_store_write_failures_total{output}``: writes that failed (rolled back, or a
  frame not acknowledged). A failed write stops the process (its offsets are never
  acknowledged), so this counter is mostly seen together with the process restarting.
- ``gradstream_runs{health, finished}``: runs known to the process by their current health
  (``Healthy``, ``MinorIssues``, ``ProblemsDetected``, ``Critical``; every state present,
  0 when none) and whether every rank finished them (``true``/``false``); only from a
  process that sees whole runs (a worker writing DuckDB, the store writer; a scale-out
  worker exposes no samples, as it sees only its share of each run's steps).
- ``gradstream_firing_incidents{rule, severity}``: incidents open (their last event is
  ``firing``) per alert rule, for every rule (0 when none); only from the process that
  evaluates the alert rules. An incident of a finished run stays open until it resolves,
  as in ``gradstream alerts``.
- ``process_*`` / ``python_*``: the standard process and platform collectors.

Series whose label values are known in advance (every error class, both ``complete``
values, both recovery actions, the output's name, an assigned partition's counters) exist
from the start at 0: a series that appears with its first event hides that event from
``rate()`` and ``increase()``, which need two samples.

Labels are bounded: topic, partition, reason (error class), action, output, health,
finished, rule and severity take a few values each; runs, layers and ranks are never
labels (runs are unbounded). The ``*_created`` series prometheus_client adds to counters
and histograms in the text format (a gauge family each, holding the unix time the series
was created) are turned off (:func:`prometheus_client.disable_created_metrics`, process
wide): Prometheus ingests them as extra series nobody queries, and a name such as
``gradstream_frames_created`` reads like a count of created frames.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from consumer.dlq import DEAD_LETTER_ERRORS
from schemas.wire import GradientHealth

log = logging.getLogger("gradstream.consumer")

disable_created_metrics()  # module doc: no ``*_created`` series

RunCounts = Mapping[tuple[str, bool], int]
"""(health value, every rank finished) -> number of runs."""

IncidentCounts = Sequence[tuple[str, str, int]]
"""(rule, severity, open incidents), one entry per alert rule."""

LATENCY_BUCKETS: tuple[float, ...] = tuple(2.0**k for k in range(-8, 8))
"""Upper bounds (s) of the frame-latency histogram: powers of two from 1/256 s (4 ms,
about one poll round trip on a loopback broker) to 128 s (four times the default
``shard_timeout_s`` of 30 s, the latest a partial frame is normally finalised); the
``+Inf`` bucket catches the rest. Doubling buckets give a constant relative resolution,
the usual choice for latencies spanning orders of magnitude."""

WRITE_BUCKETS: tuple[float, ...] = tuple(2.0**k for k in range(-10, 7))
"""Upper bounds (s) of the store-write histogram: powers of two from 1/1024 s (about 1 ms,
a small DuckDB transaction or one frames-topic round trip on a loopback broker) to 64 s
(past the 60 s a frames-topic write waits for acknowledgements,
``consumer.outputs.frames_topic.FramePublisher.publish``); doubling, as
:data:`LATENCY_BUCKETS`, so quantiles keep a constant relative error."""


class WorkerMetrics:
    """Counters, gauges and the latency histogram of one worker.

    Args:
        pending_frames: called at scrape time; returns the number of frames waiting for
            ranks (the worker's ``ShardMerger.pending_count``).
        runs: called at scrape time, on the HTTP server's thread; returns the runs by
            (health, finished) for ``gradstream_runs``, or None when the process does not
            see whole runs (no samples).
        incidents: called at scrape time, on the HTTP server's thread; returns the open
            incidents per rule for ``gradstream_firing_incidents``, or None when the
            process evaluates no alert rules (no samples).
        lag_interval_s: smallest interval (s) between two lag refreshes in
            :meth:`on_poll` (each may cost one ListOffsets round trip to the broker).
        clock: wall clock in unix seconds (``time.time``), used for frame latency.

    The hooks (:meth:`on_poll`, :meth:`observe_frame`, :meth:`dead_letter`) are called on
    the worker thread, :meth:`observe_write` on the thread that wrote; the HTTP server
    reads on its own thread (prometheus_client metrics are thread-safe).
    """

    def __init__(
        self,
        pending_frames: Callable[[], int] = lambda: 0,
        *,
        runs: Callable[[], RunCounts | None] = lambda: None,
        incidents: Callable[[], IncidentCounts | None] = lambda: None,
        lag_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.lag_interval_s = lag_interval_s
        self._clock = clock
        self._last_lag = float("-inf")
        self._lag_keys: set[tuple[str, str]] = set()
        self._server: Any = None
        self._thread: Any = None
        self.port: int | None = None
        reg = self.registry
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        self.messages = Counter(
            "gradstream_messages", "Records read from Kafka.", ["topic", "partition"],
            registry=reg,
        )
        self.frames = Counter(
            "gradstream_frames", "Frames finalised (complete=false: ranks missing).",
            ["complete"], registry=reg,
        )
        self.layer_rows = Counter(
            "gradstream_layer_rows", "Layer rows of finalised frames (layer_stats rows).",
            registry=reg,
        )
        self.dead_letters = Counter(
            "gradstream_dead_letters", "Records sent to the dead-letter topic, by error class.",
            ["reason"], registry=reg,
        )
        self.lag = Gauge(
            "gradstream_consumer_lag",
            "Log end offset minus consumer position per assigned partition (records).",
            ["topic", "partition"], registry=reg,
        )
        self.stuck_partitions = Counter(
            "gradstream_consumer_stuck_partitions",
            "Stuck partitions: an assigned partition with records to read whose position did not "
            "move for stuck_partition_timeout_s.", ["topic", "partition"], registry=reg,
        )
        self.stuck_partition_recoveries = Counter(
            "gradstream_consumer_stuck_partition_recoveries",
            "Stuck-partition recoveries by action (seek: partition re-sought; recreate: Kafka "
            "consumer re-created).", ["action"], registry=reg,
        )
        self.pending = Gauge(
            "gradstream_pending_frames", "Frames waiting for ranks.", registry=reg,
        )
        self.pending.set_function(pending_frames)
        self.frame_latency = Histogram(
            "gradstream_frame_latency_seconds",
            "Seconds from the producer's wall time of a frame to its finalisation.",
            buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.store_write_duration = Histogram(
            "gradstream_store_write_duration_seconds",
            "Seconds one write of a batch with its offsets took (a DuckDB transaction, or "
            "every frame acknowledged by the frames topic), failed writes included.",
            ["output"], buckets=WRITE_BUCKETS, registry=reg,
        )
        self.store_write_failures = Counter(
            "gradstream_store_write_failures",
            "Writes of a batch with its offsets that failed (rolled back, or a frame not "
            "acknowledged).", ["output"], registry=reg,
        )
        reg.register(_StateCollector(runs, incidents))
        for complete in ("true", "false"):  # both series exist from the start (rate() = 0)
            self.frames.labels(complete=complete)
        for action in ("seek", "recreate"):
            self.stuck_partition_recoveries.labels(action=action)
        for error in DEAD_LETTER_ERRORS:  # the first dead letter is an increase from 0
            self.dead_letters.labels(error)

    # -- HTTP endpoint -------------------------------------------------------------------

    def serve(self, port: int | None, addr: str = "0.0.0.0") -> int | None:
        """Start the HTTP endpoint (any path answers, e.g. ``/metrics``) on a daemon thread.

        Args:
            port: TCP port; None or 0 leaves the endpoint off.
            addr: interface to bind (all interfaces by default, for a Prometheus server on
                another host).

        Returns:
            The port served, or None when off.

        Raises:
            OSError: the port is taken (the message says which).
        """
        if not port:
            return None
        try:
            self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror} "
                          "(another worker on this port? pass another --metrics-port)") from exc
        self.port = port
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return port

    def close(self) -> None:
        """Stop the HTTP endpoint (if started)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            if self._thread is not None:
                self._thread.join(5)

    # -- hooks ---------------------------------------------------------------------------

    def on_poll(self, records: Mapping[Any, Sequence[Any]], consumer: Any) -> None:
        """Count the records of one ``KafkaConsumer.poll`` result (TopicPartition ->
        records) and refresh the lag if ``lag_interval_s`` has passed."""
        for tp, batch in records.items():
            if batch:
                self.messages.labels(tp.topic, str(tp.partition)).inc(len(batch))
        now = time.monotonic()
        if now - self._last_lag >= self.lag_interval_s:
            self._last_lag = now
            self.refresh_lag(consumer)

    def refresh_lag(self, consumer: Any) -> None:
        """Set ``gradstream_consumer_lag`` for every partition assigned to ``consumer``
        (a kafka-python KafkaConsumer): end offset - position, both "next offset" values.

        The end offset is the highwater of the last fetch response (no round trip); for
        partitions not fetched yet, one ListOffsets request (``end_offsets``, at most
        0.5 s). Series of partitions no longer assigned are removed. Kafka errors are
        logged, not raised (metrics never stop the worker); the last figures stay.
        """
        try:
            assigned = list(consumer.assignment() or ())
            ends: dict[Any, int | None] = {tp: consumer.highwater(tp) for tp in assigned}
            missing = [tp for tp, end in ends.items() if end is None]
            if missing:
                ends.update(consumer.end_offsets(missing, timeout_ms=500))
            keys = set()
            for tp in assigned:
                position = consumer.position(tp, timeout_ms=500)
                end = ends.get(tp)
                if position is None or end is None:
                    continue
                key = (tp.topic, str(tp.partition))
                keys.add(key)
                self.lag.labels(*key).set(max(0, end - position))
                if key not in self._lag_keys:  # newly assigned: its counters start at 0,
                    self.messages.labels(*key)  # so rate() and increase() see the first
                    self.stuck_partitions.labels(*key)  # records and the first episode
        except Exception as exc:  # e.g. broker restarting: keep the last figures
            log.debug("consumer lag refresh failed: %s", exc)
            return
        for key in self._lag_keys - keys:
            self.lag.remove(*key)
        self._lag_keys = keys

    def observe_frame(self, frame: Any) -> None:
        """Count one finalised ``GradientFrame`` (frames, layer rows) and observe its
        latency ``clock() - frame.wall_time`` (s; negative skew is clamped to 0)."""
        self.frames.labels("true" if frame.complete else "false").inc()
        self.layer_rows.inc(len(frame.layer_index))
        self.frame_latency.observe(max(0.0, self._clock() - frame.wall_time))

    def stuck_partition(self, topic: str, partition: int) -> None:
        """Count one stuck episode of partition ``partition`` of ``topic``."""
        self.stuck_partitions.labels(topic, str(partition)).inc()

    def stuck_partition_recovery(self, action: str) -> None:
        """Count one recovery action: ``seek`` (per partition sought) or ``recreate`` (per
        consumer re-created)."""
        self.stuck_partition_recoveries.labels(action).inc()

    def dead_letter(self, error: str) -> None:
        """Count one dead letter of error class ``error`` (e.g. ``invalid``)."""
        self.dead_letters.labels(error).inc()

    def watch_output(self, output: str) -> None:
        """Create the store-write series of output ``output`` (e.g. ``duckdb``), so they
        exist, at 0, before its first write (``rate()`` and ``increase()`` then see the
        first write and the first failure)."""
        self.store_write_duration.labels(output)
        self.store_write_failures.labels(output)

    def observe_write(self, output: str, seconds: float, ok: bool) -> None:
        """Observe one write of output ``output`` that took ``seconds`` (s) and committed
        (``ok``) or failed (also counted in ``gradstream_store_write_failures_total``);
        called on the thread that wrote (DuckDB: the sink's writer thread)."""
        self.store_write_duration.labels(output).observe(seconds)
        if not ok:
            self.store_write_failures.labels(output).inc()


class _StateCollector(Collector):
    """The gauges read from the process's state at scrape time: ``gradstream_runs`` and
    ``gradstream_firing_incidents`` (module doc).

    Args:
        runs: returns the runs by (health, finished), or None (no samples).
        incidents: returns (rule, severity, open incidents) per rule, or None (no samples).
    """

    def __init__(self, runs: Callable[[], RunCounts | None],
                 incidents: Callable[[], IncidentCounts | None]) -> None:
        self._runs = runs
        self._incidents = incidents

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "gradstream_runs", "Runs known to the process by current health and whether "
                "every rank finished them.", labels=["health", "finished"]),
            GaugeMetricFamily(
                "gradstream_firing_incidents", "Open alert incidents (last event firing) per "
                "rule.", labels=["rule", "severity"]),
        )

    def describe(self) -> list[GaugeMetricFamily]:
        """The two families without samples (read at registration, before any state)."""
        return list(self._families())

    def collect(self) -> list[GaugeMetricFamily]:
        """Both families with the current figures; every health state and both
        ``finished`` values appear (0 when no run is in them)."""
        runs, incidents = self._families()
        counts = self._runs()
        if counts is not None:
            for health in GradientHealth:
                for finished in (False, True):
                    runs.add_metric([health.value, "true" if finished else "false"],
                                    counts.get((health.value, finished), 0))
        firing = self._incidents()
        if firing is not None:
            for rule, severity, count in firing:
                incidents.add_metric([rule, severity], count)
        return [runs, incidents]
