"""The consumer loop, written once: Kafka records in, batches of frames out, offsets stored
with the rows they cover.

:class:`ConsumerLoop` owns everything a gradstream consumer process does around its
records: the lifecycle (open the output, restore, connect, consume until ``stop()``, write
what is left, close), the poll -> handle -> commit cycle, rebalances, the dead-letter
queue, the Prometheus metrics and a graceful stop. Two small subclasses supply what is
theirs: :class:`consumer.worker.Worker` (summaries -> merged frames) and
:class:`consumer.store_writer.StoreWriter` (the frames topic -> DuckDB, in scale-out mode).
Where a batch goes is an :class:`consumer.outputs.base.Output`, which the loop never asks
the kind of; when and how a batch is committed with its offsets is the
:class:`consumer.checkpoint.Checkpoint` (the commit protocol, numbered steps).

A commit runs when the checkpoint says it is due (``max_batch_rows`` layer rows wait, or
``flush_interval_s`` has passed and the output has no write in flight), before partitions
are revoked and at stop.

Rebalances: the listener writes before a revocation and rewinds the revoked partitions
(:meth:`consumer.checkpoint.Checkpoint.rewind`), seeks on assignment, and keeps the group's
rejoin needed until a poll applies the join (:func:`keep_rejoin_needed`: with kafka-python
3.0.12 a leader's rebalance could otherwise lose its assignment and leave every partition
unfetched when the revocation outlasted the poll timeout).

Stuck-partition watchdog (:mod:`consumer.stuck_partition`, ``stuck_partition_timeout_s``):
at most every ``stuck_partition_timeout_s / 4`` the loop reads the end offset of every
assigned partition; a partition with records to read whose position has not moved for
``stuck_partition_timeout_s`` is stuck: logged, counted
(``gradstream_consumer_stuck_partitions_total``) and recovered: first re-sought to its own
position (the offset after the last record the loop handled) and resumed; if it still does
not move within ``stuck_partition_timeout_s``, the Kafka consumer is re-created: the batch
is committed (settled), the partitions are given up as in a rebalance, the consumer is
closed and a new one assigned or subscribed, which seeks to the stored offsets as on any
assignment. Either way no record is skipped or stored twice.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import repeat
from typing import TYPE_CHECKING, Any

from kafka import ConsumerRebalanceListener

from consumer.checkpoint import Checkpoint
from consumer.dlq import DeadLetterQueue
from consumer.metrics import WorkerMetrics
from consumer.outputs.base import Batch, Output, PartitionKey
from consumer.runbook import RunBook
from consumer.stuck_partition import StuckPartition, StuckPartitionWatchdog
from consumer.topic_admin import ensure_topics, subscribe_with_metadata

if TYPE_CHECKING:
    from consumer.alerts.service import AlertService

log = logging.getLogger("gradstream.consumer")


@cache
def freeze_startup_heap() -> None:
    """Take every object alive now out of the garbage collector's scans, once per process.

    A consumer process starts with about 120,000 objects the cyclic garbage collector
    tracks (the imported modules, DuckDB's and pydantic's, the store's schema, the restored
    run state), and they live as long as the process. Each full (generation 2) collection
    would walk them all again; after ``gc.collect()`` (so that no garbage is kept)
    ``gc.freeze()`` moves them to the permanent generation, and a full collection walks
    only what the loop made since (CPython's ``gc`` documentation recommends this for
    long-running servers). ``bench/message_cost.py``: about 5 µs less worker CPU per
    message. An object frozen here is never collected as part of a cycle, so this runs
    once per process, from :meth:`ConsumerLoop.run` after the output is open and restored.
    """
    gc.collect()
    gc.freeze()

@dataclass(slots=True)
class LoopCounters:
    """Running totals of one loop (since start): records read, frames and layer rows put
    into batches, dead letters, writes."""

    messages: int = 0
    frames: int = 0
    layer_rows: int = 0
    dead_letters: int = 0
    writes: int = 0


class ConsumerLoop(ABC):
    """A Kafka consumer that turns records into batches and writes them with their offsets.

    Args:
        settings: the process's settings: ``kafka_kwargs()``, ``group_id``, ``dlq_topic``,
            ``poll_timeout_ms``, ``max_poll_records``, ``max_partition_fetch_bytes``,
            ``flush_interval_s``, ``max_batch_rows``, ``max_frames``, ``ignore_layers``,
            ``exclude_rounding_level``, ``nonfinite_rule``, ``metrics_port``.
        on_open: called on the loop's thread right after the output is opened, before
            consuming, with what a reader attaches to (:meth:`Output.on_open
            <consumer.outputs.base.Output.on_open>`; ``gradstream serve`` takes a read
            cursor on the DuckDB file).

    Subclasses set ``process_name``, ``Counters`` (a LoopCounters subclass) and
    ``join_group`` (True: a consumer-group member with rebalances; False: assign every
    partition of ``topics()`` to itself, for a single reader that keeps its offsets in its
    output and must not wait for a group), and implement :meth:`open_output`,
    :meth:`topics` and :meth:`handle`; the other hooks are optional.

    ``run()`` blocks until ``stop()``; ``error`` holds what ended it abnormally. The
    stuck-partition watchdog (:attr:`watchdog`) reads ``settings.stuck_partition_timeout_s``.
    """

    join_group = True
    Counters: type[LoopCounters] = LoopCounters
    alerts: AlertService | None = None
    """The alert rules this loop evaluates, if any (set by a subclass on restore)."""
    process_name = "consumer"
    """What the process is called in its log lines (``worker``, ``store``)."""

    def __init__(self, settings: Any, on_open: Callable[[Any], None] | None = None) -> None:
        self.settings = settings
        self._on_open = on_open
        self.book = RunBook(settings.max_frames, tuple(settings.ignore_layers),
                            settings.exclude_rounding_level, settings.nonfinite_rule)
        self.counters = self.Counters()
        self.metrics = WorkerMetrics(self.pending_count, runs=self.runs_by_health,
                                     incidents=self.firing_incidents)
        self.watchdog = StuckPartitionWatchdog(settings.stuck_partition_timeout_s)
        self.error: BaseException | None = None
        self.output: Output | None = None
        self.checkpoint = Checkpoint(settings.flush_interval_s, settings.max_batch_rows)
        self.dlq = DeadLetterQueue(settings.dlq_topic, None)
        self._consumer: Any = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.RLock()
        self._started = time.monotonic()
        self._resumed = False

    # -- hooks ---------------------------------------------------------------------------

    @property
    def batch(self) -> Batch:
        """The batch being filled (:attr:`Checkpoint.batch
        <consumer.checkpoint.Checkpoint.batch>`)."""
        return self.checkpoint.batch

    @abstractmethod
    def open_output(self) -> Output:
        """Open where batches go (before connecting to Kafka)."""

    @abstractmethod
    def topics(self) -> list[str]:
        """Topics to consume."""

    @abstractmethod
    def handle(self, record: Any, message: Any = None) -> None:
        """Use one record: decode it (unless :meth:`decode` gave ``message``, its
        decoded value or the WireError refusing it) and put what it yields into
        :attr:`batch`."""

    def decode(self, records: list[Any]) -> list[Any] | None:
        """Decode one partition's records of a poll together, before they are handled
        one by one: one entry per record (the message, or the WireError refusing it); or
        None, the default, to leave each record's decoding to :meth:`handle`."""
        return None

    def read_partitions(self, partitions: list[Any]) -> list[Any]:
        """Of every partition of the topics (``TopicPartition``), those a loop that joins
        no group reads (default: all)."""
        return partitions

    def restore(self) -> None:
        """Rebuild state from the output (default: the runs and their health)."""
        assert self.output is not None
        self.output.restore(self.book)

    def tick(self) -> None:
        """After each poll: expire what waited too long (default: nothing)."""
        return None

    def pending_offsets(self) -> dict[PartitionKey, int]:
        """First offset per partition of a frame still pending (default: none)."""
        return {}

    def pending_count(self) -> int:
        """Frames waiting (the ``gradstream_pending_frames`` gauge; default 0)."""
        return 0

    def runs_by_health(self) -> dict[tuple[str, bool], int] | None:
        """Runs by (health, every rank finished) for the ``gradstream_runs`` gauge, read on
        the metrics server's thread; None when the output does not see whole runs (a
        scale-out worker, :attr:`Output.frame_rules
        <consumer.outputs.base.Output.frame_rules>` False: its share of each run's steps
        is no run's health)."""
        output = self.output
        if output is None or not output.frame_rules:
            return None
        return self.book.health_counts()

    def firing_incidents(self) -> list[tuple[str, str, int]] | None:
        """(rule, severity, open incidents) per rule for the
        ``gradstream_firing_incidents`` gauge, read on the metrics server's thread; None
        when this loop evaluates no alert rules (:attr:`alerts` None)."""
        alerts = self.alerts
        return None if alerts is None else alerts.firing_incidents()

    def assigned(self, partitions: list[Any]) -> None:
        """Partitions were assigned, before seeking (default: nothing)."""
        return None

    def revoked(self, keys: set[PartitionKey]) -> None:
        """Partitions were revoked after the final write (default: nothing)."""
        return None

    def closing(self) -> None:
        """The loop stops after its last write (default: nothing)."""
        return None

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to finish its batch, write it, leave and return."""
        self._stop.set()

    def wait_ready(self, timeout: float) -> bool:
        """Block until partitions were assigned (False on timeout)."""
        return self._ready.wait(timeout)

    def run(self) -> None:
        """Consume until ``stop()``.

        Raises:
            duckdb.IOException: the DuckDB file is locked by another process.
            kafka.errors.KafkaError: Kafka unreachable at start-up.
            TimeoutError: a topic has no partition in the cluster's metadata.
        """
        try:
            self._run()
        except BaseException as exc:
            self.error = exc
            raise

    def open(self) -> None:
        """Open the output and restore state from it (``run()`` does this first; tests
        that feed records with :meth:`consume` call it themselves)."""
        self.output = self.open_output()
        self.metrics.watch_output(self.output.name)
        self.output.write_observer = self.metrics.observe_write
        if self._on_open is not None:
            self.output.on_open(self._on_open)
        self.restore()

    def _run(self) -> None:
        self._started = time.monotonic()
        try:
            self.open()
            freeze_startup_heap()
            self.metrics.serve(self.settings.metrics_port)
            self.dlq = DeadLetterQueue.connect(self.settings)
            self.connect()
        except BaseException:
            self._close()
            raise
        log.info("%s reads %s, writing %s", self.process_name,
                 ", ".join(self.topics()), self.describe_output())
        try:
            self._consume()
        finally:
            try:
                with self._lock:
                    self.flush(settle=True)
            finally:
                self._close()

    def describe_output(self) -> str:
        """Where batches go, for the start-up log line."""
        return self.output.describe() if self.output is not None else ""

    def connect(self) -> None:
        """Create the topics read (and the dead-letter topic) if absent, then the Kafka
        consumer: join the group, or assign every partition.

        Raises:
            kafka.errors.KafkaError: the cluster cannot be reached.
            TimeoutError: a topic has no partition in the metadata after 60 s.
        """
        s = self.settings
        ensure_topics(s, [*self.topics(), s.dlq_topic])
        self._open_consumer()

    def _open_consumer(self) -> None:
        """Create the Kafka consumer and join the group, or assign every partition (and
        seek them, :meth:`on_assigned`).

        Raises:
            kafka.errors.KafkaError: the cluster cannot be reached.
            TimeoutError: a topic has no partition in the metadata after 60 s.
        """
        from kafka import KafkaConsumer

        s = self.settings
        kwargs: dict[str, Any] = dict(
            **s.kafka_kwargs(), enable_auto_commit=False, auto_offset_reset="earliest",
            max_poll_records=s.max_poll_records,
            max_partition_fetch_bytes=s.max_partition_fetch_bytes,
            fetch_max_bytes=max(s.max_partition_fetch_bytes, 64 * 1024 * 1024),
        )
        if self.join_group:
            self._consumer = KafkaConsumer(**kwargs, group_id=s.group_id,
                                           **s.membership_kwargs())
            subscribe_with_metadata(self._consumer, self.topics(), _Rebalance(self))
            log.info("joined group %s on %s", s.group_id, ", ".join(self.topics()))
            return
        # A single reader keeping its offsets in its output joins no group: a restart
        # after SIGKILL reads at once instead of waiting for the dead member's session.
        self._consumer = KafkaConsumer(**kwargs, group_id=None)
        partitions = self.read_partitions(_all_partitions(self._consumer, self.topics()))
        self._consumer.assign(partitions)
        self.on_assigned(partitions)

    def _consume(self) -> None:
        from kafka.errors import KafkaConnectionError

        while not self._stop.is_set():
            try:
                records = self._consumer.poll(timeout_ms=self.settings.poll_timeout_ms)
            except KafkaConnectionError as exc:  # a broker restarting: retry, lose nothing
                log.warning("Kafka unreachable while polling (%s); retrying in 1 s", exc)
                self._stop.wait(1.0)
                continue
            with self._lock:
                for batch in records.values():
                    decoded = self.decode(batch) or repeat(None)  # (None: handle decodes)
                    for record, message in zip(batch, decoded, strict=False):
                        self.consume(record, message)
                        if self._due():  # a poll may return seconds of work
                            self.flush()
                self.metrics.on_poll(records, self._consumer)  # messages; lag <= 1/s
                self.tick()
                if self._due():
                    self.flush()
                elif self.checkpoint.unacknowledged:
                    self._acknowledge(blocking=True, wait=False)
                if not self._resumed and not records:
                    self._log_resumed(self._caught_up(), "nothing left to read")
            if self.watchdog.due(time.monotonic()):
                self._watch()

    def _close(self) -> None:
        """Close everything opened, in reverse order, each even if another fails."""
        steps = [
            lambda: self._consumer is not None and self._consumer.close(),
            self.closing, self.metrics.close, self.dlq.close,
            lambda: self.output is not None and self.output.close(),
        ]
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("error while closing the %s", self.process_name)

    # -- records -------------------------------------------------------------------------

    def consume(self, record: Any, message: Any = None) -> None:
        """Note ``record``'s position and hand it to :meth:`handle` (with ``message``, its
        value decoded ahead by :meth:`decode`, if any)."""
        self.checkpoint.consumed(record.topic, record.partition, record.offset)
        self.counters.messages += 1
        self.handle(record, message)

    def dead_letter(self, record: Any, reason: str, error: str) -> None:
        """Send ``record`` to the dead-letter topic with ``reason`` (error class ``error``:
        ``invalid``, ``unknown_run``, ``conflicting_run``); the loop goes on."""
        self.counters.dead_letters += 1
        self.metrics.dead_letter(error)
        log.warning("dead letter %s[%d]@%d: %s", record.topic, record.partition,
                    record.offset, reason)
        self.dlq.send(record, reason, error)

    # -- writes --------------------------------------------------------------------------

    def _due(self) -> bool:
        """Whether to commit now (:meth:`consumer.checkpoint.Checkpoint.due`).

        Raises:
            duckdb.Error: the write in flight failed.
        """
        return self.checkpoint.due(self.output, self.counters.layer_rows)

    def flush(self, blocking: bool = True, settle: bool = False) -> None:
        """Commit the batch with its offsets (:meth:`consumer.checkpoint.Checkpoint.commit`,
        steps 1-6).

        Args:
            blocking: acknowledge synchronously; False inside a rebalance callback.
            settle: wait until the output has made every batch durable and acknowledge
                the offsets now (before a revocation and at stop).

        Raises:
            duckdb.Error / kafka.errors.KafkaError: the write failed (this one, or with
                write-behind the one before); its offsets were not stored, so the
                records are read again after a restart.
        """
        self.checkpoint.started(self.counters.layer_rows)
        if self.output is None:
            return
        written = self.checkpoint.commit(self.output, self._consumer, self.pending_offsets(),
                                         self.dlq.flush, blocking, settle)
        if written is not None:
            self.counters.writes += 1
            self._log_resumed(bool(written.frames), "first write")

    def _acknowledge(self, blocking: bool, wait: bool) -> None:
        """Step 5 of the commit protocol (:meth:`consumer.checkpoint.Checkpoint.acknowledge`).

        Raises:
            duckdb.Error / kafka.errors.KafkaError: a write failed (nothing acknowledged),
                or a blocking commit to the frames topic's group failed.
        """
        assert self.output is not None
        self.checkpoint.acknowledge(self.output, self._consumer, blocking, wait)

    def _log_resumed(self, now: bool, how: str) -> None:
        """Log, once, how long after start the loop first wrote frames or found nothing to
        read on its partitions: how long a restarted process leaves its partitions unread."""
        if now and not self._resumed:
            self._resumed = True
            log.info("resumed %.2f s after start (%s)", time.monotonic() - self._started, how)

    def _caught_up(self) -> bool:
        """Every assigned partition is read to its end offset (as of the last fetch)."""
        try:
            assigned = self._consumer.assignment()
            return bool(assigned) and all(
                (end := self._consumer.highwater(tp)) is not None
                and self._consumer.position(tp, timeout_ms=100) >= end for tp in assigned)
        except Exception:  # e.g. a position not known yet: not caught up
            return False

    # -- stuck partitions ----------------------------------------------------------------

    def _watch(self) -> None:
        """One stuck-partition check (:mod:`consumer.stuck_partition`): read every assigned
        partition's position and end offset, then act on the stuck partitions found. Called
        on the loop's thread without the lock (closing a group consumer runs the revocation
        callback on kafka-python's network thread, which takes it). A check that cannot read
        the figures (broker restarting) is skipped; the watchdog never stops the loop."""
        consumer = self._consumer
        timeout_ms = int(min(max(self.watchdog.interval_s, 0.1), 2.0) * 1000)
        try:
            assigned = list(consumer.assignment() or ())
            ends = consumer.end_offsets(assigned, timeout_ms=timeout_ms) if assigned else {}
            positions = {(tp.topic, tp.partition): consumer.position(tp, timeout_ms=timeout_ms)
                         for tp in assigned}
        except Exception as exc:
            log.debug("stuck-partition check skipped: %s", exc)
            return
        stuck, recovered = self.watchdog.observe(
            time.monotonic(), positions,
            {(tp.topic, tp.partition): end for tp, end in ends.items()})
        for r in recovered:
            log.info("partition %s[%d] moves again, %.1f s after it got stuck (recovered by %s)",
                     r.topic, r.partition, r.seconds, r.action)
        if not stuck:
            return
        for part in stuck:
            log.warning(
                "stuck partition %s[%d]: position %d, end offset %d (%d records waiting), "
                "no progress for %.1f s; %s", part.topic, part.partition, part.position,
                part.end_offset, part.end_offset - part.position, part.seconds,
                "re-seeking it to its position" if part.action == "seek"
                else "a re-seek did not help: re-creating the Kafka consumer")
            if part.action == "seek":
                self.metrics.stuck_partition(part.topic, part.partition)
        if any(part.action == "recreate" for part in stuck):
            self._recreate_consumer()
        else:
            self._reseek(stuck)

    def _reseek(self, stuck: list[StuckPartition]) -> None:
        """Seek each stuck partition to the offset after the last record the loop handled
        (else where the consumer stands), and resume it if paused (the loop never pauses
        a partition)."""
        from kafka import TopicPartition

        with self._lock:
            paused = set(self._consumer.paused())
            for part in stuck:
                tp = TopicPartition(part.topic, part.partition)
                key = (part.topic, part.partition)
                try:
                    self._consumer.seek(tp, self.checkpoint.positions.get(key, part.position))
                    if tp in paused:
                        self._consumer.resume(tp)
                except ValueError as exc:  # revoked meanwhile
                    log.info("stuck partition %s[%d] not re-sought: %s", part.topic,
                             part.partition, exc)
                    continue
                self.metrics.stuck_partition_recovery("seek")

    def _recreate_consumer(self) -> None:
        """Replace the Kafka consumer: write and settle the batch (the frames topic's
        offsets committed synchronously), give up every partition as in a rebalance
        (pending frames are forgotten, rebuilt from the stored offsets), close the
        consumer and open a new one, sought to the stored offsets on assignment.

        Raises:
            kafka.errors.KafkaError / TimeoutError: the new consumer cannot be created
                (the loop stops with the error, as at start-up).
            duckdb.Error: the write failed.
        """
        old = self._consumer
        with self._lock:
            self.flush(settle=True)
            assigned = list(old.assignment() or ())
            self.on_revoked(assigned)
        try:  # a group consumer calls on_revoked again (nothing left to write)
            old.close(autocommit=False)
        except Exception as exc:
            log.warning("closing the stuck Kafka consumer failed: %s", exc)
        self._consumer = None
        self.watchdog.reset()
        self._open_consumer()
        self.metrics.stuck_partition_recovery("recreate")
        log.warning("Kafka consumer re-created; %s",
                    f"re-joining group {self.settings.group_id}" if self.join_group
                    else "partitions re-assigned")

    # -- partitions ----------------------------------------------------------------------

    def on_assigned(self, partitions: list[Any]) -> None:
        """Seek every newly assigned partition to the offset its output stored (or the
        beginning; :meth:`consumer.checkpoint.Checkpoint.assign`); with an output that
        stores none, keep the group's positions."""
        with self._lock:
            self.assigned(partitions)
            assert self.output is not None
            self.checkpoint.assign(self.output, self._consumer, partitions)
            log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in partitions))
            if partitions:
                self._ready.set()

    def on_revoked(self, partitions: list[Any], lost: bool = False) -> None:
        """Write what is final, rewind the revoked partitions to their stored offsets
        (:meth:`consumer.checkpoint.Checkpoint.rewind`; not for ``lost`` partitions, which
        another member may own already), then forget them: their next owner, this loop
        included, rebuilds pending frames from the stored offsets."""
        with self._lock:
            self.flush(blocking=False, settle=True)  # on kafka-python's network thread
            keys = {(tp.topic, tp.partition) for tp in partitions}
            if not lost:
                self.checkpoint.rewind(self._consumer, partitions)
            self.revoked(keys)
            self.checkpoint.revoke(keys)

    # -- introspection -------------------------------------------------------------------

    def runs_done(self, run_ids: list[str]) -> bool:
        """True when every given run has all ranks finished and nothing of it waits in the
        batch (its frames, local rows, finished ranks and alerts are written)."""
        with self._lock:
            if not all(self.book.is_finished(r) for r in run_ids):
                return False
            batch = self.checkpoint.batch
            if any(r in run_ids for r, _ in batch.frames):
                return False
            return not (batch.runs_finished or batch.alerts or batch.local_summaries)

    def wait_for_runs(self, run_ids: list[str], timeout: float) -> bool:
        """Block until ``runs_done(run_ids)`` or ``timeout`` seconds; False on timeout or
        if the loop died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                return False
            if self.runs_done(run_ids):
                return True
            time.sleep(0.05)
        return False

    @property
    def runs(self) -> dict[str, Any]:
        """Run id -> RunInfo of every run known."""
        return self.book.runs

    @property
    def trackers(self) -> dict[str, Any]:
        """Run id -> RunHealthTracker."""
        return self.book.trackers


def _all_partitions(consumer: Any, topics: list[str], timeout_s: float = 60.0) -> list[Any]:
    """Every partition of ``topics``, waiting (up to ``timeout_s``) until the cluster's
    metadata lists them.

    Raises:
        TimeoutError: a topic has no partition in the metadata after ``timeout_s``.
    """
    from kafka import TopicPartition

    deadline = time.monotonic() + timeout_s
    while True:
        found = {t: consumer.partitions_for_topic(t) for t in topics}
        if all(found.values()):
            return [TopicPartition(t, p) for t in topics for p in sorted(found[t])]
        if time.monotonic() > deadline:
            missing = [t for t, parts in found.items() if not parts]
            raise TimeoutError(f"no partitions known for topic(s) {missing} after "
                               f"{timeout_s:g} s: is the broker reachable?")
        time.sleep(0.2)


def keep_rejoin_needed(consumer: Any) -> None:
    """Mark the group rejoin of ``consumer`` (a kafka-python ``KafkaConsumer``) as needed
    until a poll has applied its result; called when a rebalance starts (the revocation
    listener, before the join is sent).

    Work-around for kafka-python 3.0.12 (``kafka.coordinator``): a join runs as a task on
    the I/O thread, and only a poll that still finds ``need_rejoin()`` true awaits it and
    applies its assignment (``_on_join_complete``: the partitions' new state, the
    assignment listener). A rebalance the group leader starts because its metadata changed
    (a fresh group's leader always does, right after its first assignment) or because its
    subscription changed is needed only through those snapshots, and the join task itself
    brings them up to date (the leader's assignment takes the metadata snapshot, the
    JoinGroup request the subscription). When the revocation listener outlasts the poll's
    timeout (the loop's write before a revocation) and the join completes before the next
    poll, that poll finds no rejoin needed, so the assignment is never applied: every
    partition stays marked as being revoked (never fetched, its position where
    :meth:`consumer.checkpoint.Checkpoint.rewind` left it) and heartbeats stay off, until
    the consumer is re-created. ``request_rejoin`` keeps ``need_rejoin()`` true until a
    poll applies a join's result; a join that completed unawaited is then replaced by one
    more JoinGroup + SyncGroup round trip, which that poll applies. Without a coordinator
    (another client version) nothing is done.
    """
    coordinator = getattr(consumer, "_coordinator", None)
    request_rejoin = getattr(coordinator, "request_rejoin", None)
    if request_rejoin is not None:
        request_rejoin()


class _Rebalance(ConsumerRebalanceListener):
    """kafka-python rebalance listener delegating to a loop; at every revocation it keeps
    the group's rejoin needed until a poll applies the join (:func:`keep_rejoin_needed`)."""

    def __init__(self, loop: ConsumerLoop) -> None:
        self.loop = loop

    def on_partitions_revoked(self, revoked: list[Any]) -> None:
        keep_rejoin_needed(self.loop._consumer)
        self.loop.on_revoked(revoked)

    def on_partitions_assigned(self, assigned: list[Any]) -> None:
        self.loop.on_assigned(assigned)

    def on_partitions_lost(self, lost: list[Any]) -> None:
        keep_rejoin_needed(self.loop._consumer)
        self.loop.on_revoked(lost, lost=True)
