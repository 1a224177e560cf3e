"""The summaries worker: StepSummary records -> shard merge -> frames -> health -> output.

A :class:`consumer.loop.ConsumerLoop` in a consumer group on the summaries topic. Each
record is decoded and validated (an unusable one goes to the dead-letter topic with the
reason and the loop goes on); the ranks of each (run, step) are merged
(:class:`consumer.merge.ShardMerger`); a finished frame updates the run's health
(:class:`consumer.runbook.RunBook`) and the alert rules, and goes into the batch. The
batch goes to a DuckDB file (single-process mode) or to the frames topic (scale-out mode,
``frames_topic`` set, read by ``gradstream store``). The offsets stored never pass the
first record of a frame still waiting for ranks, so a crash or a rebalance rebuilds
pending frames from Kafka. A LocalSummary (a rank's flight recorder,
``producer.flight_recorder``) is checked against its run (known, same world size, layers
within the run's, no more elements than the layer has) and its rows go into the batch for
``local_layer_stats``, never into a frame; the alert rules learn from it where NaN/Inf or
an explosion started.

Nothing that does not fit the run is merged. A RunStarted that contradicts the run's
(another layer list, another world size) is dead-lettered and its rank is *refused*: every
later summary of that rank is dead-lettered too (error ``refused_rank``, the reason naming
the refused RunStarted), never merged by layer index into layers that are not its own,
and the run's frames stop waiting for it (partial, the ``missing_ranks`` alert saying the
rank's data was refused). A summary whose pieces cannot belong to the run's parameters
(:func:`consumer.merge.check_shard`) is dead-lettered; a frame whose merged pieces do not
add up to the parameters' sizes is stored as partial with the ``shard_layout`` alert
(:mod:`consumer.merge`). A refusal is stored with the rows of its batch, in the same
transaction (DuckDB table ``refused_ranks``), and reloaded by :meth:`Worker.restore`: a
worker restarted on the file keeps dead-lettering the refused rank's summaries.

Scale-out mode (the frames-topic output). The steps of one run may be spread over the
workers (producers with ``partition_key="step"``: a StepSummary keyed ``run_id/step``), so
a worker may read a step summary of a run whose RunStarted (keyed by run id, in another
partition) it has not seen: such a summary is *held* (at most
:data:`HELD_SUMMARIES_MAX`, oldest dead-lettered first), the offsets stored never pass it
(:meth:`Worker.pending_offsets`, as for a pending frame), and the compacted runs topic is
read again, at most every :data:`RUNS_RELOAD_INTERVAL_S`, until the run is known (the
summaries are then merged in the order they came) or ``shard_timeout_s`` passed (dead
letter ``unknown_run``, as when no RunStarted exists). A RunFinished finalises only this
worker's own pending frames of the run (none, when the run's steps went to other workers);
the other workers finalise theirs when complete or after ``shard_timeout_s``. The alert
rules are not evaluated here (:attr:`consumer.outputs.base.Output.frame_rules`): the store
writer evaluates them over the merged frames, in step order.

In scale-out mode the refusal goes to the compacted runs topic with the batch
(:class:`consumer.outputs.frames_topic.RankRefused`, acknowledged before the offsets are
committed); a restarted worker or a partition's new owner reads it there with the runs
(:meth:`Worker.assigned`) and keeps refusing the rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consumer.alerts.service import AlertService
from consumer.frames import GradientFrame
from consumer.loop import ConsumerLoop, LoopCounters
from consumer.merge import ShardMerger, check_shard
from consumer.outputs.base import Output, PartitionKey
from consumer.outputs.registry import open_output
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from schemas.wire import (
    LocalSummary,
    RunFinished,
    RunStarted,
    StepSummary,
    WireError,
)
from schemas.wire_batch import decode_messages, decode_one

log = logging.getLogger("gradstream.consumer")

HELD_SUMMARIES_MAX = 4096
"""Step summaries of not-yet-known runs a scale-out worker holds at most (a memory bound:
about a poll's worth of records, ``max_poll_records`` 2000, twice). Beyond it the oldest is
dead-lettered ``unknown_run``."""

RUNS_RELOAD_INTERVAL_S = 0.5
"""While summaries of unknown runs are held, the runs topic is read again at most this
often (each read opens a consumer and reads the compacted topic to its end)."""


@dataclass(slots=True)
class _Held:
    """A step summary of a run not known yet, with its record and when it was first held
    (monotonic s)."""

    message: StepSummary
    record: Any
    since: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class WorkerCounters(LoopCounters):
    """Running totals of one worker (since start), besides the loop's."""

    step_summaries: int = 0
    partial_frames: int = 0
    local_summaries: int = 0


class Worker(ConsumerLoop):
    """A consumer-group member on the summaries topic.

    Args:
        settings: ConsumerSettings (bootstrap servers, topics, group, DB path, timeouts).
        on_open: called on the worker thread with what the output offers readers
            (:meth:`consumer.outputs.base.Output.on_open`: the DuckDB output's sink) right
            after it is opened, before consuming (``gradstream serve`` takes a read cursor
            there); never called for an output that offers nothing (the frames topic).

    Use ``run()`` (blocks until ``stop()``), on the main thread of ``gradstream consume``
    or on a background thread in the demo and tests.
    """

    process_name = "worker"
    Counters = WorkerCounters
    counters: WorkerCounters
    settings: ConsumerSettings

    def __init__(self, settings: ConsumerSettings, on_open: Any = None) -> None:
        super().__init__(settings, on_open)
        self.merger: ShardMerger | None = None
        self.alerts: AlertService | None = None
        self._started_by: dict[str, int] = {}
        """run id -> rank of the RunStarted that defined the run (runs started here)."""
        self._held: list[_Held] = []
        """Step summaries of runs not known yet, in arrival order (scale-out mode)."""
        self._learns_runs = False
        """The output tells runs recorded by other processes (scale-out: the runs topic)."""
        self._runs_read_at = 0.0

    # -- loop hooks ----------------------------------------------------------------------

    def topics(self) -> list[str]:
        """The summaries topic."""
        return [self.settings.topic]

    def open_output(self) -> Output:
        """Open the output ``settings.output`` names (:mod:`consumer.outputs.registry`),
        then create the alerts topic if absent, and the alert service.

        Raises:
            duckdb.IOException: the DuckDB file is locked by another process.
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        s = self.settings
        output = open_output(s.output, s)  # a locked file is the first thing to say
        try:
            ensure_topics(s, [s.alerts_topic])
        except BaseException:
            output.close()
            raise
        return output

    def restore(self) -> None:
        """Runs, health, finalised steps, refused ranks and open incidents from what the
        output keeps (the DuckDB file; nothing for the frames topic, where a late shard
        whose partial frame left the cache is published alone and merged by the store
        writer, and runs and open incidents are read when partitions are assigned)."""
        assert self.output is not None
        self.merger = ShardMerger(self.settings.shard_timeout_s, self.output.load_sums)
        state = self.output.restore(self.book)
        for run_id, (steps, complete, ranks) in state.frames.items():
            self.merger.restore_finalised(run_id, steps, complete, ranks)
        for run_id, rank, reason in state.refusals:
            self.merger.refuse(run_id, rank, reason)
        if self.runs:
            log.info("restored %d runs from %s", len(self.runs), self.output.describe())
        if self.output.frame_rules:  # else the store writer evaluates them
            self.alerts = AlertService.from_settings(
                self.settings, active=state.incidents, is_finished=self.book.is_finished,
            )
            self.alerts.start()

    def assigned(self, partitions: list[Any]) -> None:
        """Learn what the output holds that another process recorded (scale-out: the runs
        and the refused ranks in the compacted runs topic) and, when the output keeps no
        incidents, re-open those still firing on the alerts topic."""
        assert self.output is not None and self.merger is not None
        state = self.output.assign()
        if state is None:
            return
        self._learns_runs = True
        self._runs_read_at = time.monotonic()
        self._learn(state)
        if state.incidents is None:
            self._restore_incidents()

    def _learn(self, state: Any) -> None:
        """Start the runs and refuse the ranks of ``state`` (a
        :class:`consumer.outputs.base.KnownState`) that this worker does not know yet."""
        assert self.merger is not None
        for message in state.runs_started:
            if message.run_id not in self.runs:
                self.book.start(message)
        for run_id, rank, reason in state.refusals:
            if self.merger.refusal(run_id, rank) is None:
                self.merger.refuse(run_id, rank, reason)

    def _restore_incidents(self) -> None:
        """Re-open the incidents still firing on the alerts topic for the runs this worker
        has not evaluated a frame of (a restart, or partitions taken over): replayed
        frames then neither fire them again nor lose their resolution."""
        if self.alerts is not None and (n := self.alerts.restore_from_topic(
                self.settings, lambda r: r in self.trackers and not self.trackers[r].frames)):
            log.info("re-opened %d firing incident(s) from %s", n, self.settings.alerts_topic)

    def revoked(self, keys: set[PartitionKey]) -> None:
        """Forget the revoked partitions' pending frames and held summaries."""
        assert self.merger is not None
        self.merger.drop_partitions(keys)
        self._held = [h for h in self._held
                      if (h.record.topic, h.record.partition) not in keys]

    def tick(self) -> None:
        """Release or expire held summaries of unknown runs; finalise frames whose ranks
        timed out; stalled / finished run alerts."""
        assert self.merger is not None
        if self._held:
            self._retry_held(time.monotonic())
        if self.merger.pending_count:
            for frame in self.merger.expire(self.runs, time.monotonic()):
                self._emit(frame)
        if self.alerts is not None:
            self.batch.alerts.extend(self.alerts.tick())

    def pending_offsets(self) -> dict[PartitionKey, int]:
        """First offset of each partition's earliest pending frame or held summary."""
        offsets = self.merger.earliest_pending_offsets() if self.merger else {}
        for h in self._held:
            key = (h.record.topic, h.record.partition)
            offsets[key] = min(offsets.get(key, h.record.offset), h.record.offset)
        return offsets

    def pending_count(self) -> int:
        """Frames waiting for ranks, and summaries waiting for their run."""
        return (self.merger.pending_count if self.merger else 0) + len(self._held)

    def closing(self) -> None:
        """Flush the alert sinks and log the totals."""
        if self.alerts is not None:
            self.alerts.close()
        c = self.counters
        log.info("worker stopped: %d messages, %d frames (%d partial), %d dead letters",
                 c.messages, c.frames, c.partial_frames, c.dead_letters)

    # -- records -------------------------------------------------------------------------

    def decode(self, records: list[Any]) -> list[Any]:
        """Decode a poll's summaries records together
        (:func:`schemas.wire_batch.decode_messages`: the binary step summaries of one shape
        in one NumPy pass, each record's result the one it gets alone)."""
        return decode_messages([record.value for record in records])

    def handle(self, record: Any, message: Any = None) -> None:
        """Dispatch one summaries record by message type (decoded here unless
        :meth:`decode` gave ``message``); a refused one goes to the dead-letter topic."""
        if message is None:
            message = decode_one(record.value)
        if isinstance(message, WireError):
            self.dead_letter(record, message.reason, "invalid")
            return
        if isinstance(message, StepSummary):
            self._on_step(message, record)
        elif isinstance(message, RunStarted):
            self._on_run_started(message, record)
        elif isinstance(message, LocalSummary):
            self._on_local(message, record)
        else:
            self._on_finished(message, record)

    def _on_run_started(self, msg: RunStarted, record: Any) -> None:
        known = self.runs.get(msg.run_id)
        if known is not None:
            conflict = known.conflict_with(msg)
            if conflict:
                origin = self._started_by.get(msg.run_id)
                if origin is not None and origin != msg.rank:
                    conflict += f" (the run was started by rank {origin})"
                self.dead_letter(record, conflict, "conflicting_run")
                assert self.merger is not None
                if self.merger.refusal(msg.run_id, msg.rank) is None:
                    self.batch.refusals.append((msg.run_id, msg.rank, conflict))
                self.merger.refuse(msg.run_id, msg.rank, conflict)
                log.warning("run %s: rank %d refused, its summaries will be dead-lettered: "
                            "%s", msg.run_id, msg.rank, conflict)
                for frame in self.merger.settle(known):
                    self._emit(frame)
            return
        self._started_by[msg.run_id] = msg.rank
        run = self.book.start(msg)
        self.batch.runs_started.append(msg)
        log.info("run %s started: %d layers, world size %d", msg.run_id, run.num_layers,
                 run.world_size)
        if self._held:
            self._retry_held(time.monotonic(), read_runs=False)

    def _known_run(self, run_id: str, record: Any) -> Any:
        """The run's RunInfo, or None after dead-lettering ``record`` (no RunStarted seen)."""
        run = self.runs.get(run_id)
        if run is None:
            self.dead_letter(record, f"unknown run_id {run_id!r}: no RunStarted was seen "
                             "for it", "unknown_run")
        return run

    def _hold(self, msg: StepSummary, record: Any) -> None:
        """Keep a step summary of a run not known yet (scale-out mode, module doc); beyond
        :data:`HELD_SUMMARIES_MAX`, read the runs topic at once and dead-letter the oldest
        summary whose run is still unknown."""
        self._held.append(_Held(msg, record))
        if len(self._held) > HELD_SUMMARIES_MAX:
            self._retry_held(time.monotonic(), force=True)
        if len(self._held) > HELD_SUMMARIES_MAX:
            oldest = self._held.pop(0)
            self._known_run(oldest.message.run_id, oldest.record)  # dead-letters it

    def _retry_held(self, now: float, read_runs: bool = True, force: bool = False) -> None:
        """Re-read the runs topic (at most every :data:`RUNS_RELOAD_INTERVAL_S` unless
        ``force``; not at all unless ``read_runs``), then merge the held summaries whose
        run is now known, in arrival order, and dead-letter those held longer than
        ``shard_timeout_s``."""
        assert self.output is not None
        if read_runs and (force or now - self._runs_read_at >= RUNS_RELOAD_INTERVAL_S):
            self._runs_read_at = now
            try:
                state = self.output.assign()
            except TimeoutError as exc:
                log.warning("reading the runs topic again failed: %s", exc)
            else:
                if state is not None:
                    self._learn(state)
        held, self._held = self._held, []
        timeout = self.settings.shard_timeout_s
        for h in held:
            if h.message.run_id in self.runs:
                self._on_step(h.message, h.record)
            elif now - h.since > timeout:
                self._known_run(h.message.run_id, h.record)  # dead-letters it
            else:
                self._held.append(h)

    def _on_step(self, msg: StepSummary, record: Any) -> None:
        if self._learns_runs and msg.run_id not in self.runs:
            self._hold(msg, record)
            return
        run = self._run_of(msg, record)
        if run is None:
            return
        assert self.merger is not None
        unfit = self._unfit(msg, run, np.asarray(msg.layer_indices), "layer_indices")
        if unfit is not None:
            self._reject(record, msg, *unfit)
            return
        misfit = check_shard(msg, run.numel)
        if misfit is not None:
            self._reject(record, msg, misfit, "invalid")
            return
        self.counters.step_summaries += 1
        if self.alerts is not None:
            self.alerts.note_shard(run, msg)  # which rank's shard holds NaN/Inf
        frame = self.merger.add(run, msg, (record.topic, record.partition), record.offset,
                                time.monotonic())
        if frame is not None:
            self._emit(frame)

    def _on_local(self, msg: LocalSummary, record: Any) -> None:
        """A flight recorder's local-view entry: checked against the run, then its rows go
        into the batch (stored with the batch's offsets) and the alert rules learn where
        NaN/Inf or an explosion started. Never merged into a frame, never waited for."""
        run = self._run_of(msg, record)
        if run is None:
            return
        layers = np.asarray(msg.local_layer_indices, np.int64)
        unfit = self._unfit(msg, run, layers, "local_layer_indices")
        if unfit is not None:
            self.dead_letter(record, *unfit)
            return
        over = np.flatnonzero(np.asarray(msg.local_numel, np.int64) > run.numel[layers])
        if over.size:
            i = int(over[0])
            self.dead_letter(record, f"local_numel[{i}]={msg.local_numel[i]} exceeds the "
                             f"{int(run.numel[layers[i]])} elements of layer {int(layers[i])}",
                             "invalid")
            return
        self.counters.local_summaries += 1
        self.batch.local_summaries.append(msg)
        if self.alerts is not None:
            self.alerts.note_local(run, msg)

    def _run_of(self, msg: StepSummary | LocalSummary, record: Any) -> Any:
        """The RunInfo of ``msg``'s run, or None after dead-lettering ``record`` (no
        RunStarted seen, or another world size)."""
        run = self._known_run(msg.run_id, record)
        if run is not None and msg.world_size != run.world_size:
            self.dead_letter(record, f"world_size {msg.world_size} differs from the run's "
                             f"{run.world_size}", "invalid")
            return None
        return run

    def _unfit(self, msg: StepSummary | LocalSummary, run: Any, layers: np.ndarray,
               field_name: str) -> tuple[str, str] | None:
        """Why the rows of ``msg`` (a known run's) cannot be taken: its rank's RunStarted
        was refused, or its layer indices ``layers`` (int64[k], the field ``field_name``)
        reach past the run's layers; ``(reason, dead-letter error)`` or None."""
        assert self.merger is not None
        refused = self.merger.refusal(msg.run_id, msg.rank)
        if refused is not None:
            return f"rank {msg.rank}'s RunStarted was refused: {refused}", "refused_rank"
        top = int(np.maximum.reduce(layers))  # the ufunc: no wrapper
        if top >= run.num_layers:
            return (f"{field_name} reach {top} but run {msg.run_id!r} has {run.num_layers} "
                    "layers"), "invalid"
        return None

    def _reject(self, record: Any, msg: StepSummary, reason: str, error: str) -> None:
        """Dead-letter a summary of a known run and tell the merger: that frame stops
        waiting for the rank and says why it is missing."""
        self.dead_letter(record, reason, error)
        assert self.merger is not None
        self.merger.reject(msg.run_id, msg.step, msg.rank, reason)
        frame = self.merger.settle_step(self.runs[msg.run_id], msg.step)
        if frame is not None:
            self._emit(frame)

    def _on_finished(self, msg: RunFinished, record: Any) -> None:
        if self._known_run(msg.run_id, record) is None:
            return
        self.batch.runs_finished.append(msg)
        if self.book.finish(msg):
            # Every rank said it is done: nothing more will come for pending steps.
            assert self.merger is not None
            for frame in self.merger.expire_run(self.runs, msg.run_id):
                self._emit(frame)
            log.info("run %s finished (health %s)", msg.run_id,
                     self.trackers[msg.run_id].health.value)

    def _emit(self, frame: GradientFrame) -> None:
        before = self.book.record(frame, self.batch)
        tracker = self.trackers[frame.run_id]
        if self.alerts is not None:  # published now; stored with this batch
            self.batch.alerts.extend(self.alerts.on_frame(frame, self.runs[frame.run_id],
                                                           tracker))
        self.counters.frames += 1
        self.counters.layer_rows += len(frame.layer_index)
        self.counters.partial_frames += not frame.complete
        self.metrics.observe_frame(frame)
        if tracker.health.severity > before.severity:
            log.warning("run %s health %s -> %s at step %d", frame.run_id, before.value,
                        tracker.health.value, frame.step)
