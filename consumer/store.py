"""``gradstream store``: the one process that writes DuckDB in scale-out mode.

Workers (``gradstream consume --frames-topic T``, on any hosts, one consumer group) merge the
ranks of each step and publish the finished frame's merged sums (:class:`MergedFrame`) to
the frames topic, with each run's RunStarted / RunFinished. The store consumes that topic,
recomputes every frame's seed-001 fields with :func:`consumer.frames.compute_frame` (the
same function a single-process worker uses, so both shapes store identical rows), updates
the run health incrementally, and writes rows and consumed offsets in one DuckDB
transaction (:class:`consumer.sink.DuckDBSink`); on assignment it seeks to the stored
offsets, so every frame is stored exactly once whatever crashes. It also consumes the
alerts topic the workers publish to and writes its alert events into the ``alerts`` table
in the same transactions (run statuses on that topic are skipped), so the DuckDB file has
the alerts in scale-out mode too.

A frame for (run, step) that is already stored is reconciled by its rank set (the key is
(run, step); layer rows are keyed (run, step, layer)):

- same ranks: replaces the stored frame (a republished frame, identical values);
- a subset of the stored ranks: ignored (a worker replayed part of a step after a restart);
- disjoint from the stored ranks: merged into it, sums add, maxima take the max (a late
  rank finalised after the step was stored as partial);
- overlapping otherwise: the frame with more ranks wins (logged; exact merging would need
  per-rank sums).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from consumer.frame_codec import message_to_merged
from consumer.frames import LocalRows, MergedShards, compute_frame
from consumer.health import RunHealthTracker, restore_tracker
from consumer.merge import merge_shard, not_yet_counted
from consumer.rounding import gradient_magnitude
from consumer.runs import RunInfo
from consumer.sink import DuckDBSink, RunState, SinkBatch
from consumer.store_settings import StoreSettings
from consumer.topic_admin import ensure_topics
from schemas.alert import Alert, decode_alert_record
from schemas.wire import (
    GradientHealth,
    MergedFrame,
    RunFinished,
    RunStarted,
    WireError,
    decode_frame_message,
)

log = logging.getLogger("gradstream.store")


@dataclass(slots=True)
class StoreCounters:
    """Running totals of the store process (since start)."""

    messages: int = 0
    frames: int = 0
    layer_rows: int = 0
    merged_late: int = 0
    ignored_replays: int = 0
    invalid: int = 0
    writes: int = 0
    alerts: int = 0


class Store:
    """Consumes the frames topic and owns the DuckDB file.

    Args:
        settings: StoreSettings (bootstrap servers, frames topic, group, DB path).
        on_open: called with the DuckDBSink right after the store is opened.

    ``run()`` blocks until ``stop()``.
    """

    def __init__(
        self, settings: StoreSettings, on_open: Callable[[DuckDBSink], None] | None = None
    ) -> None:
        self.settings = settings
        self._on_open = on_open
        self.counters = StoreCounters()
        self.runs: dict[str, RunInfo] = {}
        self.trackers: dict[str, RunHealthTracker] = {}
        self._ranks: dict[tuple[str, int], frozenset[int]] = {}
        self._partial: OrderedDict[tuple[str, int], MergedShards] = OrderedDict()
        self.partial_cache_size = 4096
        self._finished: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._lock = threading.RLock()
        self._batch = SinkBatch()
        self._positions: dict[tuple[str, int], int] = {}
        self._stored_positions: dict[tuple[str, int], int] = {}
        self._last_flush = time.monotonic()
        self._sink: DuckDBSink | None = None
        self._consumer: Any = None
        self.error: BaseException | None = None

    def stop(self) -> None:
        """Finish the batch, write it, stop."""
        self._stop.set()

    def wait_ready(self, timeout: float) -> bool:
        """Block until the store has been assigned the frames topic's partitions."""
        return self._ready.wait(timeout)

    def run(self) -> None:
        """Consume the frames topic until ``stop()``.

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
        from kafka import KafkaConsumer

        s = self.settings
        self._sink = DuckDBSink(s.db)
        try:
            if self._on_open is not None:
                self._on_open(self._sink)
            self._restore()
            ensure_topics(s, self._topics)
            # No consumer group: the store is the only reader of its topics and keeps its
            # offsets in DuckDB, so it assigns itself every partition and needs no group
            # join. A restart after SIGKILL therefore reads at once instead of waiting for
            # the dead member's session to expire.
            self._consumer = KafkaConsumer(
                **s.kafka_kwargs(), group_id=None, enable_auto_commit=False,
                auto_offset_reset="earliest", max_poll_records=s.max_poll_records,
                max_partition_fetch_bytes=s.max_partition_fetch_bytes,
                fetch_max_bytes=max(s.max_partition_fetch_bytes, 64 * 1024 * 1024),
            )
            partitions = self._all_partitions()
            self._consumer.assign(partitions)
            self.on_assigned(partitions)
        except BaseException:
            if self._consumer is not None:
                self._consumer.close()
            self._sink.close()
            raise
        log.info("store reads %s (offsets kept under %r), writing %s",
                 ", ".join(self._topics), s.group_id, s.db)
        try:
            while not self._stop.is_set():
                records = self._consumer.poll(timeout_ms=s.poll_timeout_ms)
                with self._lock:
                    for batch in records.values():
                        for record in batch:
                            self._handle(record)
                    if self._due():
                        self._flush()
        finally:
            with self._lock:
                self._flush()
            try:
                self._consumer.close()
            finally:
                self._sink.close()
            log.info("store stopped: %d frames, %d late merges, %d replays ignored",
                     self.counters.frames, self.counters.merged_late,
                     self.counters.ignored_replays)

    def _all_partitions(self, timeout_s: float = 60.0) -> list[Any]:
        """Every partition of the store's topics, waiting (up to ``timeout_s``) until the
        cluster's metadata lists them.

        Raises:
            TimeoutError: a topic has no partition in the metadata after ``timeout_s``.
        """
        from kafka import TopicPartition

        deadline = time.monotonic() + timeout_s
        while True:
            found = {t: self._consumer.partitions_for_topic(t) for t in self._topics}
            if all(found.values()):
                return [TopicPartition(t, p) for t in self._topics for p in sorted(found[t])]
            if time.monotonic() > deadline:
                missing = [t for t, parts in found.items() if not parts]
                raise TimeoutError(f"no partitions known for topic(s) {missing} after "
                                   f"{timeout_s:g} s: is the broker reachable?")
            time.sleep(0.2)

    @property
    def _topics(self) -> list[str]:
        s = self.settings
        return [s.frames_topic] + ([s.alerts_topic] if s.alerts_topic else [])

    def _restore(self) -> None:
        assert self._sink is not None
        for run in self._sink.load_runs():
            self.runs[run.run_id] = run
            steps, _complete, ranks = self._sink.load_frames(run.run_id)
            for step, seen in zip(steps.tolist(), ranks, strict=True):
                self._ranks[(run.run_id, step)] = frozenset(seen)
            flags = self._sink.load_flags(run.run_id)
            seen, ordinary = self._sink.load_gradient_state(run.run_id, run.num_layers)
            self.trackers[run.run_id] = restore_tracker(
                run.num_layers, self.settings.max_frames, steps, flags["step"],
                flags["layer_index"], flags["is_vanishing"].astype(bool),
                flags["is_exploding"].astype(bool), flags["nonfinite"].astype(bool),
                roundoff=run.roundoff, seen=seen, ordinary=ordinary,
            )

    # -- records -------------------------------------------------------------------------

    def _handle(self, record: Any) -> None:
        self._positions[(record.topic, record.partition)] = record.offset + 1
        if record.topic == self.settings.alerts_topic:
            alert = self._decode(record, decode_alert_record)
            if isinstance(alert, Alert):  # upserted by alert_id: a replay changes nothing
                self._batch.alerts.append(alert)
                self.counters.alerts += 1
            return  # run statuses are not stored
        self.counters.messages += 1
        message = self._decode(record, decode_frame_message)
        if isinstance(message, RunStarted):
            if message.run_id not in self.runs:
                run = RunInfo.from_message(message)
                self.runs[run.run_id] = run
                self.trackers[run.run_id] = RunHealthTracker(run.num_layers,
                                                             self.settings.max_frames,
                                                             run.roundoff)
                self._batch.runs_started.append(message)
        elif isinstance(message, RunFinished):
            if message.run_id in self.runs:
                self._finished.setdefault(message.run_id, set()).add(message.rank)
                self._batch.runs_finished.append(message)
        elif isinstance(message, MergedFrame):
            self._on_frame(message)

    def _decode(self, record: Any, decode: Callable[[bytes], Any]) -> Any:
        """``decode(record.value)``, or None (counted and logged) for an unusable record."""
        try:
            return decode(record.value)
        except WireError as exc:
            self.counters.invalid += 1
            log.error("unusable record %s[%d]@%d: %s", record.topic, record.partition,
                      record.offset, exc.reason)
            return None

    def _on_frame(self, msg: MergedFrame) -> None:
        run = self.runs.get(msg.run_id)
        if run is None or max(msg.layer_indices) >= run.num_layers:
            self.counters.invalid += 1
            log.error("frame of unknown run %r or layer out of range: skipped", msg.run_id)
            return
        key = (msg.run_id, msg.step)
        new = frozenset(msg.ranks_seen)
        stored = self._ranks.get(key)
        merged: MergedShards
        if stored is None or new == stored:
            merged = message_to_merged(msg, run.num_layers)
            ranks = new
        elif new < stored:
            self.counters.ignored_replays += 1
            return
        elif new.isdisjoint(stored) and (base := self._stored_sums(run, msg.step)) is not None:
            merged = base
            merge_shard(merged, msg, not_yet_counted(merged, msg, run.numel))
            ranks = stored | new
            self.counters.merged_late += 1
        elif len(new) > len(stored):
            log.warning("frame %s step %d: ranks %s overlap the stored %s; keeping the larger",
                        msg.run_id, msg.step, sorted(new), sorted(stored))
            merged = message_to_merged(msg, run.num_layers)
            ranks = new
        else:
            self.counters.ignored_replays += 1
            return
        self._ranks[key] = ranks
        if len(ranks) < run.world_size:
            self._partial[key] = merged
            while len(self._partial) > self.partial_cache_size:
                self._partial.popitem(last=False)
        else:
            self._partial.pop(key, None)
        frame = compute_frame(
            run.run_id, msg.step, merged, vanishing_threshold=run.vanishing_threshold,
            exploding_threshold=run.exploding_threshold, ranks_seen=tuple(sorted(ranks)),
            world_size=run.world_size, wall_time=msg.wall_time,
        )
        if msg.has_local:
            frame.local = LocalRows.from_shard(msg)
        tracker = self.trackers[run.run_id]
        health = tracker.update(frame.step, frame.layer_index, frame.is_vanishing,
                                frame.is_exploding, frame.nonfinite,
                                gradient_magnitude(frame.mean_abs_grad, frame.sum_sq,
                                                   frame.numel))
        frame_health = GradientHealth.CRITICAL if frame.has_nonfinite else health
        self._batch.frames[key] = (frame, frame_health.value)
        self._batch.run_states[run.run_id] = RunState(
            health.value, tracker.frames, tracker.issue_frames, tracker.last_step,
            tracker.first_nonfinite_step,
        )
        self.counters.frames += 1
        self.counters.layer_rows += len(frame.layer_index)

    def _stored_sums(self, run: RunInfo, step: int) -> MergedShards | None:
        """Merged sums of a stored (or batched) partial frame, or None if unavailable."""
        cached = self._partial.get((run.run_id, step))
        if cached is not None:
            return cached
        if (run.run_id, step) in self._batch.frames:
            self._flush()
        assert self._sink is not None
        return self._sink.load_sums(run, step)

    # -- writes --------------------------------------------------------------------------

    def _due(self) -> bool:
        if self._batch.layer_rows() >= self.settings.max_batch_rows:
            return True
        return time.monotonic() - self._last_flush >= self.settings.flush_interval_s

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        if self._sink is None:
            return
        offsets = {k: v for k, v in self._positions.items()
                   if self._stored_positions.get(k) != v}
        batch = self._batch
        batch.offsets = offsets
        if not batch:
            return
        self._sink.write(batch, self.settings.group_id)
        self._stored_positions.update(offsets)
        self.counters.writes += 1
        self._batch = SinkBatch()

    # -- partitions ----------------------------------------------------------------------

    def on_assigned(self, partitions: list[Any]) -> None:
        """Seek every assigned partition to its stored offset (or the beginning): the
        offsets in DuckDB, written with the rows they cover, are the only positions."""
        with self._lock:
            assert self._sink is not None
            stored = {topic: self._sink.load_offsets(self.settings.group_id, topic)
                      for topic in {tp.topic for tp in partitions}}
            for tp in partitions:
                offset = stored[tp.topic].get(tp.partition)
                if offset is not None:
                    self._consumer.seek(tp, offset)
                    self._stored_positions[(tp.topic, tp.partition)] = offset
                else:
                    self._consumer.seek_to_beginning(tp)
            if partitions:
                self._ready.set()

    # -- introspection -------------------------------------------------------------------

    def runs_done(self, run_ids: list[str]) -> bool:
        """True when every given run has all ranks finished and everything is written."""
        with self._lock:
            for run_id in run_ids:
                run = self.runs.get(run_id)
                if run is None or len(self._finished.get(run_id, ())) < run.world_size:
                    return False
            return not self._batch
