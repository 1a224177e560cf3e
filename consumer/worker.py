"""The consumer worker: Kafka -> validate -> shard merge -> frames -> health -> DuckDB.

One loop, one thread: poll a batch of records, decode and validate each (unusable ones go
to the dead-letter topic with the reason and the loop goes on), merge the ranks of each
(run, step), compute frames (NumPy over layers), update the run's health incrementally,
and write finalised frames together with the consumed offsets in one DuckDB transaction.
On partition assignment the worker seeks to the offsets stored in DuckDB, so the store is
exactly-once. Stored offsets never pass the first message of a frame still waiting for
ranks, so a crash or a rebalance rebuilds pending frames from Kafka.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import ConsumerRebalanceListener

from consumer.alerts.rows import load_active_incidents
from consumer.alerts.service import AlertService
from consumer.dlq import dead_letter_headers, dead_letter_value
from consumer.frame_publisher import FramePublisher, load_runs_topic
from consumer.frames import GradientFrame
from consumer.health import RunHealthTracker, restore_tracker
from consumer.merge import PartitionKey, ShardMerger
from consumer.metrics import WorkerMetrics
from consumer.rounding import gradient_magnitude
from consumer.runs import RunInfo
from consumer.settings import ConsumerSettings
from consumer.sink import DuckDBSink, RunState, SinkBatch
from consumer.topic_admin import ensure_topics, subscribe_with_metadata
from schemas.wire import (
    GradientHealth,
    RunFinished,
    RunStarted,
    StepSummary,
    WireError,
    decode_message,
)

log = logging.getLogger("gradstream.consumer")


@dataclass(slots=True)
class WorkerCounters:
    """Running totals of one worker (since start)."""

    messages: int = 0
    step_summaries: int = 0
    frames: int = 0
    partial_frames: int = 0
    layer_rows: int = 0
    dead_letters: int = 0
    writes: int = 0
    dead_letter_reasons: list[str] = field(default_factory=list)


class Worker:
    """A consumer-group member that owns a DuckDB file.

    Args:
        settings: ConsumerSettings (bootstrap servers, topics, group, DB path, timeouts).
        on_open: called on the worker thread with the DuckDBSink right after the store is
            opened, before consuming (``gradstream serve`` takes a read cursor there).

    Use ``run()`` (blocks until ``stop()``), typically on the main thread of
    ``gradstream consume`` or on a background thread in the demo and tests.
    """

    def __init__(
        self, settings: ConsumerSettings, on_open: Callable[[DuckDBSink], None] | None = None
    ) -> None:
        self.settings = settings
        self._on_open = on_open
        self.counters = WorkerCounters()
        self.runs: dict[str, RunInfo] = {}
        self.trackers: dict[str, RunHealthTracker] = {}
        self._finished: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.RLock()
        self._batch = SinkBatch()
        self._positions: dict[PartitionKey, int] = {}
        self._stored_positions: dict[PartitionKey, int] = {}
        self._last_flush = time.monotonic()
        self._sink: DuckDBSink | None = None
        self._frames_out: FramePublisher | None = None  # scale-out mode
        self._consumer: Any = None
        self._dlq: Any = None
        self._merger: ShardMerger | None = None
        self.error: BaseException | None = None
        self.alerts: AlertService | None = None  # rules + sinks, built in _run
        self.metrics = WorkerMetrics(lambda: self._merger.pending_count if self._merger else 0)

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the loop to finish its batch, write, leave the group and return."""
        self._stop.set()

    def wait_ready(self, timeout: float) -> bool:
        """Block until the worker has joined the group and been assigned partitions."""
        return self._ready.wait(timeout)

    def run(self) -> None:
        """Consume until ``stop()``. Opens the store, restores state, joins the group.

        Raises:
            duckdb.IOException: the DuckDB file is locked by another process.
            kafka.errors.KafkaError: Kafka unreachable at start-up.
        """
        try:
            self._run()
        except BaseException as exc:
            self.error = exc
            raise

    def _run(self) -> None:
        from kafka import KafkaConsumer, KafkaProducer
        from kafka.errors import KafkaConnectionError

        s = self.settings
        scale_out = s.frames_topic is not None
        self._sink = None if scale_out else DuckDBSink(s.db)
        try:
            if self._on_open is not None and self._sink is not None:
                self._on_open(self._sink)
            if self._sink is not None:
                self._merger = ShardMerger(s.shard_timeout_s, self._sink.load_sums)
                self._restore()
            else:
                # Scale-out: no store in this process; a late shard whose partial frame
                # left the cache is published alone and merged by the store.
                self._merger = ShardMerger(s.shard_timeout_s, lambda _run, _step: None)
            self.metrics.serve(s.metrics_port)
            topics = [s.topic, s.dlq_topic, s.alerts_topic]
            ensure_topics(s, topics + ([s.frames_topic] if scale_out else []))
            if scale_out:
                ensure_topics(s, [s.runs_topic], compacted=True)
                self._frames_out = FramePublisher(s)
            self._dlq = KafkaProducer(**s.kafka_kwargs(), acks=-1, linger_ms=0,
                                      max_request_size=2 * 1024 * 1024 + 65536)
            self.alerts = AlertService.from_settings(
                s, active=load_active_incidents(self._sink.con) if self._sink else None,
                is_finished=lambda r: len(self._finished.get(r, ())) >= self.runs[r].world_size,
            )
            self.alerts.start()
        except BaseException:
            self.metrics.close()
            if self._dlq is not None:
                self._dlq.close(timeout=5)
            if self._frames_out is not None:
                self._frames_out.close()
            if self._sink is not None:
                self._sink.close()
            raise
        self._consumer = KafkaConsumer(
            **s.kafka_kwargs(),
            group_id=s.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=s.max_poll_records,
            max_partition_fetch_bytes=s.max_partition_fetch_bytes,
            fetch_max_bytes=max(s.max_partition_fetch_bytes, 64 * 1024 * 1024),
            **s.membership_kwargs(),
        )
        subscribe_with_metadata(self._consumer, [s.topic], _Rebalance(self))
        log.info("worker joined group %s on %s, %s", s.group_id, s.topic,
                 f"publishing frames to {s.frames_topic}" if scale_out else f"writing {s.db}")
        try:
            while not self._stop.is_set():
                try:
                    records = self._consumer.poll(timeout_ms=s.poll_timeout_ms)
                except KafkaConnectionError as exc:  # a broker restarting: retry, lose nothing
                    log.warning("Kafka unreachable while polling (%s); retrying in 1 s", exc)
                    self._stop.wait(1.0)
                    continue
                with self._lock:
                    for batch in records.values():
                        for record in batch:
                            self._handle(record)
                    self.metrics.on_poll(records, self._consumer)  # messages; lag <= 1/s
                    self._expire()
                    if self.alerts is not None:  # stalled / finished runs
                        self._batch.alerts.extend(self.alerts.tick())
                    if self._due():
                        self._flush()
        finally:
            with self._lock:
                self._flush(force=True)
            try:
                self._consumer.close()
            finally:
                if self.alerts is not None:
                    self.alerts.close()
                self.metrics.close()
                self._dlq.close(timeout=10)
                if self._frames_out is not None:
                    self._frames_out.close()
                if self._sink is not None:
                    self._sink.close()
            log.info(
                "worker stopped: %d messages, %d frames (%d partial), %d dead letters",
                self.counters.messages, self.counters.frames,
                self.counters.partial_frames, self.counters.dead_letters,
            )

    def _restore(self) -> None:
        assert self._sink is not None and self._merger is not None
        for run in self._sink.load_runs():
            self.runs[run.run_id] = run
            steps, complete, ranks = self._sink.load_frames(run.run_id)
            self._merger.restore_finalised(run.run_id, steps, complete, ranks)
            flags = self._sink.load_flags(run.run_id)
            seen, ordinary = self._sink.load_gradient_state(run.run_id, run.num_layers)
            self.trackers[run.run_id] = restore_tracker(
                run.num_layers, self.settings.max_frames, steps, flags["step"],
                flags["layer_index"], flags["is_vanishing"].astype(bool),
                flags["is_exploding"].astype(bool), flags["nonfinite"].astype(bool),
                roundoff=run.roundoff, seen=seen, ordinary=ordinary,
            )
        if self.runs:
            log.info("restored %d runs from %s", len(self.runs), self.settings.db)

    # -- records -------------------------------------------------------------------------

    def _handle(self, record: Any) -> None:
        key = (record.topic, record.partition)
        self._positions[key] = record.offset + 1
        self.counters.messages += 1
        try:
            message = decode_message(record.value)
        except WireError as exc:
            self._dead_letter(record, exc.reason, "invalid")
            return
        if isinstance(message, StepSummary):
            self._on_step(message, record)
        elif isinstance(message, RunStarted):
            self._on_run_started(message, record)
        else:
            self._on_finished(message, record)

    def _on_run_started(self, msg: RunStarted, record: Any) -> None:
        known = self.runs.get(msg.run_id)
        if known is not None:
            conflict = known.conflict_with(msg)
            if conflict:
                self._dead_letter(record, conflict, "conflicting_run")
            return
        run = self._register_run(msg)
        self._batch.runs_started.append(msg)
        log.info("run %s started: %d layers, world size %d", msg.run_id, run.num_layers,
                 run.world_size)

    def _register_run(self, msg: RunStarted) -> RunInfo:
        run = RunInfo.from_message(msg)
        self.runs[msg.run_id] = run
        self.trackers[msg.run_id] = RunHealthTracker(run.num_layers, self.settings.max_frames,
                                                     run.roundoff)
        return run

    def _known_run(self, run_id: str, record: Any) -> RunInfo | None:
        """The run's RunInfo, or None after dead-lettering ``record`` (no RunStarted seen)."""
        run = self.runs.get(run_id)
        if run is None:
            self._dead_letter(
                record, f"unknown run_id {run_id!r}: no RunStarted was seen for it",
                "unknown_run",
            )
        return run

    def _on_step(self, msg: StepSummary, record: Any) -> None:
        run = self._known_run(msg.run_id, record)
        if run is None:
            return
        if msg.world_size != run.world_size:
            self._dead_letter(
                record, f"world_size {msg.world_size} differs from the run's {run.world_size}",
                "invalid",
            )
            return
        if max(msg.layer_indices) >= run.num_layers:
            self._dead_letter(
                record,
                f"layer_indices reach {max(msg.layer_indices)} but run {msg.run_id!r} has "
                f"{run.num_layers} layers",
                "invalid",
            )
            return
        self.counters.step_summaries += 1
        assert self._merger is not None
        if self.alerts is not None:
            self.alerts.note_shard(run, msg)  # which rank's shard holds NaN/Inf
        frame = self._merger.add(
            run, msg, (record.topic, record.partition), record.offset, time.monotonic()
        )
        if frame is not None:
            self._emit(frame)

    def _on_finished(self, msg: RunFinished, record: Any) -> None:
        run = self._known_run(msg.run_id, record)
        if run is None:
            return
        ranks = self._finished.setdefault(msg.run_id, set())
        ranks.add(msg.rank)
        self._batch.runs_finished.append(msg)
        if len(ranks) >= run.world_size:
            # Every rank said it is done: nothing more will come for pending steps.
            assert self._merger is not None
            for frame in self._merger.expire_run(self.runs, msg.run_id):
                self._emit(frame)
            log.info("run %s finished (health %s)", msg.run_id,
                     self.trackers[msg.run_id].health.value)

    def _emit(self, frame: GradientFrame) -> None:
        tracker = self.trackers[frame.run_id]
        before = tracker.health
        health = tracker.update(
            frame.step, frame.layer_index, frame.is_vanishing, frame.is_exploding,
            frame.nonfinite,
            gradient_magnitude(frame.mean_abs_grad, frame.sum_sq, frame.numel),
        )
        frame_health = GradientHealth.CRITICAL if frame.has_nonfinite else health
        self._batch.frames[(frame.run_id, frame.step)] = (frame, frame_health.value)
        self._batch.run_states[frame.run_id] = RunState(
            health.value, tracker.frames, tracker.issue_frames, tracker.last_step,
            tracker.first_nonfinite_step,
        )
        if self.alerts is not None:  # published now; stored with this batch
            self._batch.alerts.extend(self.alerts.on_frame(frame, self.runs[frame.run_id],
                                                           tracker))
        self.counters.frames += 1
        self.metrics.observe_frame(frame)
        self.counters.layer_rows += len(frame.layer_index)
        if not frame.complete:
            self.counters.partial_frames += 1
        if health.severity > before.severity:
            log.warning("run %s health %s -> %s at step %d", frame.run_id, before.value,
                        health.value, frame.step)

    def _dead_letter(self, record: Any, reason: str, error: str) -> None:
        self.counters.dead_letters += 1
        self.metrics.dead_letter(error)
        if len(self.counters.dead_letter_reasons) < 100:
            self.counters.dead_letter_reasons.append(reason)
        log.warning("dead letter %s[%d]@%d: %s", record.topic, record.partition,
                    record.offset, reason)
        value, truncated = dead_letter_value(record.value)
        headers = dead_letter_headers(reason, record.topic, record.partition, record.offset,
                                      error)
        if truncated:
            headers.append(("truncated", b"true"))
        self._dlq.send(self.settings.dlq_topic, key=record.key, value=value, headers=headers)

    def _expire(self) -> None:
        assert self._merger is not None
        if self._merger.pending_count:
            for frame in self._merger.expire(self.runs, time.monotonic()):
                self._emit(frame)

    # -- writes --------------------------------------------------------------------------

    def _due(self) -> bool:
        if self._batch.layer_rows() >= self.settings.max_batch_rows:
            return True
        return time.monotonic() - self._last_flush >= self.settings.flush_interval_s

    def _offsets_to_store(self) -> dict[PartitionKey, int]:
        assert self._merger is not None
        earliest = self._merger.earliest_pending_offsets()
        out = {}
        for key, pos in self._positions.items():
            target = min(pos, earliest.get(key, pos))
            if self._stored_positions.get(key) != target:
                out[key] = target
        return out

    def _flush(self, force: bool = False) -> None:
        self._last_flush = time.monotonic()
        if self._sink is None and self._frames_out is None:
            return
        offsets = self._offsets_to_store()
        batch = self._batch
        batch.offsets = offsets
        if not batch:
            return
        if self.counters.dead_letters and self._dlq is not None:
            self._dlq.flush(timeout=30)  # dead letters durable before offsets pass them
        if self._frames_out is not None:
            # Scale-out: frames durable on the frames topic, then the offsets committed
            # to Kafka (the source of truth of this group's positions in this mode).
            self._frames_out.publish(batch)
            self._stored_positions.update(offsets)
            self.counters.writes += 1
            self._batch = SinkBatch()
            if offsets and self._consumer is not None:
                self._commit_to_kafka(offsets, sync=True)
            return
        assert self._sink is not None
        self._sink.write(batch, self.settings.group_id)
        self._stored_positions.update(offsets)
        self.counters.writes += 1
        self._batch = SinkBatch()
        if offsets and self._consumer is not None:
            self._commit_to_kafka(offsets)

    def _commit_to_kafka(self, offsets: dict[PartitionKey, int], sync: bool = False) -> None:
        """Commit offsets to Kafka: in single-process mode a mirror of the offsets stored in
        DuckDB (for lag monitoring; DuckDB is the source of truth on restart), in scale-out
        mode (``sync``) the group's positions themselves.

        Raises:
            kafka.errors.KafkaError: a synchronous commit failed (scale-out mode); the
                frames are on the frames topic already, so a replay only republishes them.
        """
        from kafka import OffsetAndMetadata, TopicPartition

        commit = {
            TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()
        }
        if sync:
            self._consumer.commit(commit)
            return
        try:
            self._consumer.commit_async(commit)
        except Exception as exc:  # informational commit: never stop the worker for it
            log.debug("offset commit to Kafka failed: %s", exc)

    # -- rebalance -----------------------------------------------------------------------

    def on_assigned(self, partitions: list[Any]) -> None:
        """Seek every newly assigned partition to its stored offset (or the beginning).

        In scale-out mode the group's committed Kafka offsets are the positions (the
        consumer starts there by itself); the runs of the new partitions are loaded from
        the compacted runs topic.
        """
        with self._lock:
            if self._frames_out is not None:
                for message in load_runs_topic(self.settings):
                    if message.run_id not in self.runs:
                        self._register_run(message)
                log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in partitions))
                if partitions:
                    self._ready.set()
                return
            assert self._sink is not None
            stored = {}
            for topic in {tp.topic for tp in partitions}:
                for part, off in self._sink.load_offsets(self.settings.group_id, topic).items():
                    stored[(topic, part)] = off
            for tp in partitions:
                key = (tp.topic, tp.partition)
                if key in stored:
                    self._consumer.seek(tp, stored[key])
                    self._stored_positions[key] = stored[key]
                else:
                    self._consumer.seek_to_beginning(tp)
            log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in partitions))
            if partitions:
                self._ready.set()

    def on_revoked(self, partitions: list[Any]) -> None:
        """Write what is final, then forget the revoked partitions' pending frames (their
        next owner rebuilds them from the stored offsets)."""
        with self._lock:
            self._flush(force=True)
            keys = {(tp.topic, tp.partition) for tp in partitions}
            assert self._merger is not None
            self._merger.drop_partitions(keys)
            for key in keys:
                self._positions.pop(key, None)
                self._stored_positions.pop(key, None)

    # -- introspection -------------------------------------------------------------------

    def runs_done(self, run_ids: list[str]) -> bool:
        """True when every given run has all ranks finished, no pending frame, and all its
        frames written."""
        with self._lock:
            for run_id in run_ids:
                run = self.runs.get(run_id)
                if run is None or len(self._finished.get(run_id, ())) < run.world_size:
                    return False
                if any(r == run_id for r, _ in self._batch.frames):
                    return False
            return not self._batch.runs_finished

    def wait_for_runs(self, run_ids: list[str], timeout: float) -> bool:
        """Block until ``runs_done(run_ids)`` or timeout (s); False on timeout or if the
        worker died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                return False
            if self.runs_done(run_ids):
                return True
            time.sleep(0.05)
        return False


class _Rebalance(ConsumerRebalanceListener):
    """kafka-python rebalance listener delegating to the worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def on_partitions_revoked(self, revoked: list[Any]) -> None:
        self.worker.on_revoked(revoked)

    def on_partitions_assigned(self, assigned: list[Any]) -> None:
        self.worker.on_assigned(assigned)

    def on_partitions_lost(self, lost: list[Any]) -> None:
        self.worker.on_revoked(lost)
