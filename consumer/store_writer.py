"""``gradstream store``: the one process that writes DuckDB in scale-out mode
(:class:`StoreWriter`).

Workers (``gradstream consume --frames-topic T``, on any hosts, one consumer group) merge the
ranks of each step and publish the finished frame's merged sums (:class:`MergedFrame`) to
the frames topic, with each run's RunStarted / RunFinished. The store writer is a
:class:`consumer.loop.ConsumerLoop` on that topic that joins no consumer group (it is the
only reader and keeps its offsets in DuckDB, so a restart reads at once): it recomputes
every frame's fields with :func:`consumer.frames.compute_frame` (the function a
single-process worker uses, so both shapes store identical rows), updates the run health
and writes rows and offsets in one DuckDB transaction. It also stores the alert events read
from the alerts topic (run statuses there are skipped).

Per-run ordered work in step order. With ``partition_key="step"`` producers the steps of
one run are merged by several workers, each publishing with its own lag, so a run's
frames may arrive out of step order. The store writer holds each run's frames in a small
reorder buffer (:class:`_RunOrder`) and takes them (reconcile, health window, run state,
rows, alert rules) in step order: a frame that follows the run's last taken step (by one,
or by the run's last stride, for producers sending every n-th step) is taken at once, any
other waits until the oldest held frame of the run waited ``reorder_delay_s`` (then the
smallest step is taken), and a frame of a step at or before the last taken one (a late
rank, a replay) is taken at once. A held frame is not written: the offsets stored never
pass it (:meth:`StoreWriter.pending_offsets`), so a restart reads it again.

The alert rules (:mod:`consumer.alerts`) are evaluated here, on the frames in that order,
and their events published to the alerts topic at once and stored with the batch (the
workers of the frames topic evaluate none: ``consumer.outputs.base.Output.frame_rules``).
Each (run, step) is evaluated once: a republished frame or one replayed after a restart
finds its step stored (``_ranks``, restored from DuckDB) and is not evaluated again; a
late rank's rewrite of a partial frame is skipped by the engine as in a worker. The
incidents still firing are restored from the store's ``alerts`` table, and incident ids are
deterministic (``schemas.alert.incident_id``), so a frame evaluated again after a crash
between publishing and committing gives the same alert ids (upserted, published again).
What only a worker sees travels in the MergedFrame (wire 1.11): the ranks whose own
summaries held NaN/Inf (``nonfinite_pieces``) and the disagreeing replicas
(``replica_divergence``), so the ``nonfinite`` and ``replica_divergence`` alerts evaluated
here name them as a single-process worker's do; the ranks whose local view held NaN/Inf
come from the flight recorders' ``LocalSummary`` messages, republished on the frames topic.
The frame's training scalars travel too (wire 1.12), for the scalar rules and the store.

A frame for (run, step) that is already stored is reconciled by its rank set:

- same ranks: replaces the stored frame (a republished frame, identical values);
- a subset of the stored ranks: ignored (a worker replayed part of a step after a restart);
- disjoint from the stored ranks: merged into it, sums add, maxima take the max (a late
  rank finalised after the step was stored as partial);
- overlapping otherwise: the frame with more ranks wins (logged; exact merging would need
  per-rank sums).

A frame is stored as partial, never complete, when a rank is missing, when its merged
element counts do not add up to the parameters (checked here again) or when the worker
found pieces that do not fit (``MergedFrame.layout_violations``: a replica of
another size or another shard count, left out of the sums, so the sums alone would look
whole). A late rank merged into a partial frame keeps the violations of both; when the
partial frame is no longer in memory (``partial_cache_size``) it is read back from DuckDB
with its stored ``layout_violations`` count, and a non-zero count keeps it partial.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consumer.alerts.service import AlertService
from consumer.frames import LocalRows, MergedShards, compute_frame
from consumer.loop import ConsumerLoop, LoopCounters
from consumer.merge import check_layout, merge_shard, not_yet_counted
from consumer.outputs.base import Output
from consumer.outputs.frames_topic import message_to_merged, message_violations
from consumer.outputs.registry import open_output
from consumer.runs import RunInfo
from consumer.store_writer_settings import StoreWriterSettings
from schemas.alert import Alert, decode_alert_record
from schemas.wire import (
    LocalSummary,
    MergedFrame,
    RunFinished,
    RunStarted,
    WireError,
    decode_frame_message,
)

log = logging.getLogger("gradstream.store")

REORDER_FRAMES_MAX = 4096
"""Frames held per run at most (a memory bound); beyond it the smallest step is taken."""


@dataclass(slots=True)
class StoreWriterCounters(LoopCounters):
    """Running totals of the store writer (since start), besides the loop's."""

    merged_late: int = 0
    ignored_replays: int = 0
    alerts: int = 0
    reordered: int = 0
    """Frames that arrived before a smaller step of their run and were held for it."""


class StoreWriter(ConsumerLoop):
    """Consumes the frames topic (and the alerts topic) and owns the DuckDB file.

    Args:
        settings: StoreWriterSettings (bootstrap servers, frames topic, offsets name, DB
            path).
        on_open: called with the DuckDBSink right after the file is opened.

    ``run()`` blocks until ``stop()``.
    """

    process_name = "store"
    join_group = False
    Counters = StoreWriterCounters
    counters: StoreWriterCounters
    settings: StoreWriterSettings
    output: Output | None
    partial_cache_size = 4096
    """Merged sums of partial frames kept in memory for late ranks (else read back)."""

    def __init__(self, settings: StoreWriterSettings, on_open: Any = None) -> None:
        super().__init__(settings, on_open)
        self._ranks: dict[tuple[str, int], frozenset[int]] = {}
        # (run, step) -> merged sums, the worker's layout-violation rows and refused ranks
        self._partial: OrderedDict[tuple[str, int], _PartialFrame] = OrderedDict()
        self._order: dict[str, _RunOrder] = {}
        self._finished_last_step: dict[str, int] = {}
        self.alerts: AlertService | None = None

    def topics(self) -> list[str]:
        """The frames topic, and the alerts topic when alerts are stored."""
        s = self.settings
        return [s.frames_topic] + ([s.alerts_topic] if s.alerts_topic else [])

    def open_output(self) -> Output:
        """The store (offsets kept under ``group_id``): the DuckDB file, or the Iceberg
        table set when ``iceberg_catalog`` is set (``settings.store_output``).

        Raises:
            duckdb.IOException: the DuckDB file is locked by another process.
        """
        return open_output(self.settings.store_output, self.settings)

    def read_partitions(self, partitions: list[Any]) -> list[Any]:
        """The partitions of ``assigned_partitions`` (every one when None).

        Raises:
            ValueError: an assigned partition number that no topic read has.
        """
        wanted = self.settings.assigned_partitions
        if wanted is None:
            return partitions
        missing = set(wanted) - {tp.partition for tp in partitions}
        if missing:
            raise ValueError(f"assigned_partitions {sorted(missing)} do not exist in the "
                             f"topics {', '.join(self.topics())}")
        return [tp for tp in partitions if tp.partition in wanted]

    def restore(self) -> None:
        """Runs, health, each stored step's rank set and the incidents still firing from
        DuckDB; then the alert service (rules, alerts topic, sinks).

        Raises:
            consumer.alerts.config.AlertConfigError: invalid rule file or override.
        """
        assert self.output is not None
        state = self.output.restore(self.book)
        for run_id, (steps, _complete, ranks) in state.frames.items():
            for step, seen in zip(steps.tolist(), ranks, strict=True):
                self._ranks[(run_id, step)] = frozenset(seen)
        for run_id, tracker in self.trackers.items():
            if tracker.last_step is not None and tracker.last_step >= 0:
                self._order[run_id] = _RunOrder(last=int(tracker.last_step))
        self.alerts = AlertService.from_settings(
            self.settings, active=state.incidents or [], is_finished=self._run_over)
        self.alerts.start()

    def tick(self) -> None:
        """Take the held frames whose wait is over; stalled / finished run alerts."""
        if self._order:
            now = time.monotonic()
            for run_id in [r for r, o in self._order.items() if o.held]:
                self._release(run_id, now)
        if self.alerts is not None:
            self.batch.alerts.extend(self.alerts.tick())

    def pending_offsets(self) -> dict[tuple[str, int], int]:
        """First offset of each partition's earliest held frame."""
        offsets: dict[tuple[str, int], int] = {}
        for order in self._order.values():
            for held in order.held:
                key = (held.record.topic, held.record.partition)
                offsets[key] = min(offsets.get(key, held.record.offset), held.record.offset)
        return offsets

    def pending_count(self) -> int:
        """Frames held for the steps before them."""
        return sum(len(o.held) for o in self._order.values())

    def runs_done(self, run_ids: list[str]) -> bool:
        """As :meth:`consumer.loop.ConsumerLoop.runs_done`, and no frame of the runs
        held for an earlier step."""
        with self._lock:
            if any(self._order[r].held for r in run_ids if r in self._order):
                return False
        return super().runs_done(run_ids)

    def _run_over(self, run_id: str) -> bool:
        """Whether the alert engine may retire a run: every rank finished, no frame of it
        held, and its last taken step reached the last step the ranks reported."""
        if not self.book.is_finished(run_id):
            return False
        order = self._order.get(run_id)
        if order is not None and order.held:
            return False
        last = self._finished_last_step.get(run_id)
        return last is None or (order is not None and order.last >= last)

    def closing(self) -> None:
        """Flush the alert sinks and log the totals."""
        if self.alerts is not None:
            self.alerts.close()
        c = self.counters
        log.info("store stopped: %d frames, %d late merges, %d replays ignored",
                 c.frames, c.merged_late, c.ignored_replays)

    # -- records -------------------------------------------------------------------------

    def handle(self, record: Any, message: Any = None) -> None:
        """Store an alert event, or register a run / reconcile a frame / store a flight
        recorder's local rows (a LocalSummary a worker republished)."""
        alerts = record.topic == self.settings.alerts_topic
        try:
            message = (decode_alert_record if alerts else decode_frame_message)(record.value)
        except WireError as exc:
            self.dead_letter(record, exc.reason, "invalid")
            return
        if isinstance(message, Alert):  # upserted by alert_id: a replay changes nothing
            self.batch.alerts.append(message)
            self.counters.alerts += 1
        elif isinstance(message, RunStarted):
            if message.run_id not in self.runs:
                self.book.start(message)
                self.batch.runs_started.append(message)
        elif isinstance(message, RunFinished):
            if message.run_id in self.runs:
                self._finished_last_step[message.run_id] = max(
                    message.last_step, self._finished_last_step.get(message.run_id, -1))
                self.book.finish(message)
                self.batch.runs_finished.append(message)
        elif isinstance(message, MergedFrame):
            self._arrive(message, record)
        elif isinstance(message, LocalSummary):  # checked by the worker
            if message.run_id not in self.runs:
                self.dead_letter(record, f"local summary of unknown run {message.run_id!r}",
                                 "unknown_run")
                return
            self.batch.local_summaries.append(message)
            if self.alerts is not None:
                self.alerts.note_local(self.runs[message.run_id], message)

    def _arrive(self, msg: MergedFrame, record: Any) -> None:
        """Check a frame against its run, put it in the run's reorder buffer and take what
        is in step order (module doc)."""
        run = self.runs.get(msg.run_id)
        if run is None or int(np.max(msg.layer_indices)) >= run.num_layers:
            self.dead_letter(record, f"frame of unknown run {msg.run_id!r} or with a layer "
                             "out of range", "unknown_run")
            return
        order = self._order.setdefault(msg.run_id, _RunOrder())
        order.push(msg, record, time.monotonic())
        self._release(msg.run_id, time.monotonic())

    def _release(self, run_id: str, now: float) -> None:
        """Take the run's held frames that are in step order, or whose wait is over."""
        order = self._order[run_id]
        delay = self.settings.reorder_delay_s
        while order.held:
            head = order.held[0]
            if not (order.follows(head.step) or len(order.held) > REORDER_FRAMES_MAX
                    or now - order.oldest() >= delay):
                break
            heapq.heappop(order.held)
            if head.waited:
                self.counters.reordered += 1
            order.taken(head.step)
            self._on_frame(head.message, head.record)
        for held in order.held:
            held.waited = True

    def _on_frame(self, msg: MergedFrame, record: Any) -> None:
        run = self.runs[msg.run_id]
        key = (msg.run_id, msg.step)
        new = frozenset(msg.ranks_seen)
        stored = self._ranks.get(key)
        ledger = message_violations(msg)
        refused = set(msg.refused_ranks or ())
        if stored is None or new == stored:
            merged, ranks = message_to_merged(msg, run.num_layers), new
        elif new < stored:
            self.counters.ignored_replays += 1
            return
        elif new.isdisjoint(stored) and (base := self._stored_sums(run, msg.step)) is not None:
            merged, ranks = base.merged, stored | new
            merge_shard(merged, msg, not_yet_counted(merged, msg, run.numel))
            ledger = np.concatenate([base.violations, ledger])
            refused |= base.refused
            self.counters.merged_late += 1
        elif len(new) > len(stored):
            log.warning("frame %s step %d: ranks %s overlap the stored %s; keeping the larger",
                        msg.run_id, msg.step, sorted(new), sorted(stored))
            merged, ranks = message_to_merged(msg, run.num_layers), new
        else:
            self.counters.ignored_replays += 1
            return
        refused -= ranks
        self._ranks[key] = ranks
        self._partial.pop(key, None)
        if len(ranks) < run.world_size:
            self._partial[key] = _PartialFrame(merged, ledger, refused)
            while len(self._partial) > self.partial_cache_size:
                self._partial.popitem(last=False)
        frame = compute_frame(
            run.run_id, msg.step, merged, vanishing_threshold=run.vanishing_threshold,
            exploding_threshold=run.exploding_threshold, ranks_seen=tuple(sorted(ranks)),
            world_size=run.world_size, wall_time=msg.wall_time,
        )
        # the worker's size check again, with the ledger rows it sent (pieces left out of
        # the sums): a frame whose pieces do not fit is stored as partial here too
        frame.layout_violations = np.concatenate([
            check_layout(merged.numel, run.numel, len(ranks) >= run.world_size), ledger])
        frame.refused_ranks = {r: "the worker refused its data (see the dead-letter topic)"
                               for r in sorted(refused)}
        if msg.has_local:
            frame.local = LocalRows.from_shard(msg)
        if msg.replica_divergence is not None and len(msg.replica_divergence):
            frame.replica_divergence = np.asarray(
                msg.replica_divergence, np.int64).reshape(-1, 3).astype(np.int32)
        if msg.nonfinite_pieces is not None and len(msg.nonfinite_pieces):
            frame.nonfinite_pieces = np.asarray(msg.nonfinite_pieces, np.int64).reshape(-1, 2)
        if msg.scalars:
            frame.scalars = dict(msg.scalars)
        frame.rank_scalars = msg.rank_scalar_rows()
        frame.rewrite = stored is not None  # stored before, or waiting in the batch
        self.book.record(frame, self.batch)
        if self.alerts is not None and (stored is None or ranks != stored):
            # each step once; a late rank's rewrite the engine skips (module doc)
            self.batch.alerts.extend(self.alerts.on_frame(frame, run, self.trackers[run.run_id]))
        self.counters.frames += 1
        self.counters.layer_rows += len(frame.layer_index)
        self.metrics.observe_frame(frame)

    def _stored_sums(self, run: RunInfo, step: int) -> _PartialFrame | None:
        """Merged sums (with the known violations and refused ranks) of a stored (or
        batched) partial frame, or None if unavailable."""
        cached = self._partial.get((run.run_id, step))
        if cached is not None:
            return cached
        if (run.run_id, step) in self.batch.frames:
            self.flush()
        assert self.output is not None
        sums = self.output.load_sums(run, step)
        if sums is None:
            return None
        refused, misfit_layers = self.output.load_frame_verdict(run.run_id, step)
        # the rows themselves are not stored: one row per misfit layer keeps the verdict
        rows = np.zeros((misfit_layers, 5), np.int64)
        rows[:, 0] = -1 - np.arange(misfit_layers)
        rows[:, 1] = VIOLATION_STORED
        return _PartialFrame(sums, rows, set(refused))


@dataclass(slots=True, order=True)
class _Held:
    """A frame held in its run's reorder buffer, ordered by (step, arrival)."""

    step: int
    seq: int
    since: float = field(compare=False)
    message: MergedFrame = field(compare=False)
    record: Any = field(compare=False)
    waited: bool = field(default=False, compare=False)


@dataclass(slots=True)
class _RunOrder:
    """One run's reorder buffer: the held frames (a heap by step) and the last step taken
    (-1: none yet, so a run's step 0 is taken at once) with the stride before it."""

    last: int = -1
    stride: int = 1
    held: list[_Held] = field(default_factory=list)
    _seq: itertools.count = field(default_factory=itertools.count)

    def push(self, message: MergedFrame, record: Any, now: float) -> None:
        """Hold ``message`` (read from ``record`` at monotonic time ``now``)."""
        heapq.heappush(self.held, _Held(message.step, next(self._seq), now, message, record))

    def follows(self, step: int) -> bool:
        """``step`` may be taken now: at or before the last step taken (a late rank, a
        replay), or the next one (last + 1, or last + the last stride)."""
        return step <= self.last + 1 or step == self.last + self.stride

    def taken(self, step: int) -> None:
        """Note that ``step`` was taken."""
        if step > self.last:
            if self.last >= 0:
                self.stride = step - self.last
            self.last = step

    def oldest(self) -> float:
        """Monotonic time the longest-held frame arrived."""
        return min(h.since for h in self.held)


VIOLATION_STORED = 0
"""Layout-violation kind of a row rebuilt from a stored frame's ``layout_violations`` count
(the stored frame had that many misfit layers; which ones is not stored, so the rows'
layer_index are -1, -2, ...: distinct, and no real layer)."""


@dataclass(slots=True)
class _PartialFrame:
    """A partial frame kept for a late rank: its merged sums, the layout-violation rows the
    worker sent (int64[v, 5]) and the ranks whose data was refused."""

    merged: MergedShards
    violations: np.ndarray
    refused: set[int]
