"""``gradstream store``: the one process that writes DuckDB in scale-out mode
(:class:`StoreWriter`).

Workers (``gradstream consume --frames-topic T``, on any hosts, one consumer group) merge the
ranks of each step and publish the finished frame's merged sums (:class:`MergedFrame`) to
the frames topic, with each run's RunStarted / RunFinished. The store writer is a
:class:`consumer.loop.ConsumerLoop` on that topic that joins no consumer group (it is the
only reader and keeps its offsets in DuckDB, so a restart reads at once): it recomputes
every frame's fields with :func:`consumer.frames.compute_frame` (the function a
single-process worker uses, so both shapes store identical rows), updates the run health
and writes rows and offsets in one DuckDB transaction. It also stores the workers' alert
events from the alerts topic (run statuses there are skipped).

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

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from consumer.frames import LocalRows, MergedShards, compute_frame
from consumer.loop import ConsumerLoop, LoopCounters
from consumer.merge import check_layout, merge_shard, not_yet_counted
from consumer.outputs.duckdb import DuckDBOutput
from consumer.outputs.frames_topic import message_to_merged, message_violations
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


@dataclass(slots=True)
class StoreWriterCounters(LoopCounters):
    """Running totals of the store writer (since start), besides the loop's."""

    merged_late: int = 0
    ignored_replays: int = 0
    alerts: int = 0


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
    output: DuckDBOutput | None
    partial_cache_size = 4096
    """Merged sums of partial frames kept in memory for late ranks (else read back)."""

    def __init__(self, settings: StoreWriterSettings, on_open: Any = None) -> None:
        super().__init__(settings, on_open)
        self._ranks: dict[tuple[str, int], frozenset[int]] = {}
        # (run, step) -> merged sums, the worker's layout-violation rows and refused ranks
        self._partial: OrderedDict[tuple[str, int], _PartialFrame] = OrderedDict()

    def topics(self) -> list[str]:
        """The frames topic, and the alerts topic when alerts are stored."""
        s = self.settings
        return [s.frames_topic] + ([s.alerts_topic] if s.alerts_topic else [])

    def open_output(self) -> DuckDBOutput:
        """The DuckDB file (offsets kept under ``group_id``).

        Raises:
            duckdb.IOException: the DuckDB file is locked by another process.
        """
        return DuckDBOutput.from_settings(self.settings)

    def restore(self) -> None:
        """Runs, health and each stored step's rank set from DuckDB."""
        assert self.output is not None
        stored = self.output.restore(self.book).frames
        for run_id, (steps, _complete, ranks) in stored.items():
            for step, seen in zip(steps.tolist(), ranks, strict=True):
                self._ranks[(run_id, step)] = frozenset(seen)

    def closing(self) -> None:
        """Log the totals."""
        c = self.counters
        log.info("store stopped: %d frames, %d late merges, %d replays ignored",
                 c.frames, c.merged_late, c.ignored_replays)

    # -- records -------------------------------------------------------------------------

    def handle(self, record: Any) -> None:
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
                self.book.finish(message)
                self.batch.runs_finished.append(message)
        elif isinstance(message, MergedFrame):
            self._on_frame(message, record)
        elif isinstance(message, LocalSummary):  # checked by the worker
            if message.run_id not in self.runs:
                self.dead_letter(record, f"local summary of unknown run {message.run_id!r}",
                                 "unknown_run")
                return
            self.batch.local_summaries.append(message)

    def _on_frame(self, msg: MergedFrame, record: Any) -> None:
        run = self.runs.get(msg.run_id)
        if run is None or int(np.max(msg.layer_indices)) >= run.num_layers:
            self.dead_letter(record, f"frame of unknown run {msg.run_id!r} or with a layer "
                             "out of range", "unknown_run")
            return
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
        self.book.record(frame, self.batch)
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
        refused, misfit_layers = self.output.sink.load_frame_verdict(run.run_id, step)
        # the rows themselves are not stored: one row per misfit layer keeps the verdict
        rows = np.zeros((misfit_layers, 5), np.int64)
        rows[:, 0] = -1 - np.arange(misfit_layers)
        rows[:, 1] = VIOLATION_STORED
        return _PartialFrame(sums, rows, set(refused))


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
