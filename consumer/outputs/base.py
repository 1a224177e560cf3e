"""The output protocol: where a consumer loop's batches go, and the batch itself.

A :class:`consumer.loop.ConsumerLoop` holds one :class:`Output` and never asks which one:
it opens it, lets it restore the loop's state, asks it for stored offsets when partitions
are assigned, hands it each :class:`Batch` (:meth:`Output.write`), asks whether the batches
are durable (:meth:`Output.settle`) and then lets it acknowledge the offsets to Kafka
(:meth:`Output.acknowledge`). The outputs are :mod:`consumer.outputs.duckdb` (rows and
offsets in one DuckDB transaction) and :mod:`consumer.outputs.frames_topic` (scale-out
workers: merged frames onto a Kafka topic); :mod:`consumer.outputs.registry` names them.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from consumer.topic_admin import PartitionKey
from schemas.alert import Alert
from schemas.wire import LocalSummary, RunFinished, RunStarted

if TYPE_CHECKING:
    from consumer.alerts.rows import ActiveIncident
    from consumer.frames import GradientFrame, MergedShards
    from consumer.runbook import RunBook
    from consumer.runs import RunInfo

StoredFrames = tuple[np.ndarray, np.ndarray, list[list[int]]]
"""A run's stored frames: steps int64[F], complete bool[F], ranks seen per frame."""

WriteObserver = Callable[[str, float, bool], None]
"""Told of each write: (output name, seconds it took, whether it committed)."""


@dataclass(slots=True)
class RunState:
    """A run's incremental health counters after a batch."""

    health: str
    frames: int
    issue_frames: int
    last_step: int | None
    first_nonfinite_step: int | None


@dataclass(slots=True)
class Batch:
    """Everything one write hands to an output.

    Attributes:
        runs_started: first RunStarted of each new run.
        runs_finished: RunFinished messages (one per run and rank).
        frames: (frame, run health after it) pairs; a later entry for the same
            (run, step) replaces an earlier one.
        run_states: run id -> counters after this batch.
        offsets: (topic, partition) -> next offset to consume.
        alerts: alert events (``schemas.alert.Alert``) raised by the frames of the batch.
        refusals: (run id, rank, reason) of ranks whose RunStarted was refused (the first
            reason of a (run, rank) is kept).
        local_summaries: validated LocalSummary messages (a flight recorder's local-view
            entries) of known runs, stored per rank in ``local_layer_stats``.
    """

    runs_started: list[RunStarted] = field(default_factory=list)
    runs_finished: list[RunFinished] = field(default_factory=list)
    frames: dict[tuple[str, int], tuple[GradientFrame, str]] = field(default_factory=dict)
    run_states: dict[str, RunState] = field(default_factory=dict)
    offsets: dict[PartitionKey, int] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    refusals: list[tuple[str, int, str]] = field(default_factory=list)
    local_summaries: list[LocalSummary] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.runs_started or self.runs_finished or self.frames or self.run_states
            or self.offsets or self.alerts or self.refusals or self.local_summaries
        )

    def layer_rows(self) -> int:
        """Number of layer rows (one per frame and layer) in the batch."""
        return sum(len(f.layer_index) for f, _ in self.frames.values())


@dataclass(slots=True)
class KnownState:
    """What an output holds for a loop to rebuild its state from (:meth:`Output.restore`,
    :meth:`Output.assign`).

    Attributes:
        frames: run id -> the run's stored frames, for runs the output restored into the
            loop's :class:`consumer.runbook.RunBook`.
        runs_started: runs the loop registers if it does not know them yet.
        refusals: (run id, rank, reason) of refused ranks.
        incidents: the incidents still firing; None when the output keeps none (they
            are read back from the alerts topic instead).
    """

    frames: dict[str, StoredFrames] = field(default_factory=dict)
    runs_started: list[RunStarted] = field(default_factory=list)
    refusals: list[tuple[str, int, str]] = field(default_factory=list)
    incidents: list[ActiveIncident] | None = None


class Output(ABC):
    """Where a loop's batches go. The loop runs, in order: :meth:`on_open`,
    :meth:`restore`, then per assignment :meth:`assign` and :meth:`stored_offsets`, per
    flush :meth:`write`, :meth:`settle` and :meth:`acknowledge`, and :meth:`close`.

    An output that keeps nothing to restore from leaves the defaults of :meth:`on_open`,
    :meth:`restore`, :meth:`assign` and :meth:`load_sums`.
    """

    name: ClassVar[str] = "output"
    """The output's name in ``consumer.outputs.registry.OUTPUTS`` (the ``output`` label of
    the store-write metrics, ``consumer.metrics``)."""

    write_observer: WriteObserver | None = None
    """Told of every write once it committed or failed (:meth:`timed_write`); set by the
    loop (its metrics); None: nobody."""

    frame_rules: ClassVar[bool] = True
    """Whether the worker writing to this output evaluates the alert rules on its frames
    (the DuckDB output: the worker owns whole runs, in step order). False for the frames
    topic: there the steps of one run may be spread over several workers, so the store
    writer evaluates the rules over the merged frames, put back in step order
    (:mod:`consumer.store_writer`)."""

    min_write_interval_s: float = 0.0
    """Least seconds the output asks the loop to leave between two writes
    (:meth:`consumer.checkpoint.Checkpoint.due` waits for the larger of this and
    ``flush_interval_s``; ``max_batch_rows`` still makes a write due at once); 0: the
    loop's own interval. Set by an output whose every write has a fixed cost that larger,
    rarer writes spread (the Iceberg output: a snapshot per table and write)."""

    def describe(self) -> str:
        """Where batches go, for the start-up log line."""
        return type(self).__name__

    @contextmanager
    def timed_write(self) -> Iterator[None]:
        """Time the write done inside the ``with`` block (``time.perf_counter``, s) and
        tell :attr:`write_observer` its duration and whether it committed (the block
        returned) or failed (it raised; the exception goes on). An output wraps the step
        that makes a batch durable in it, on whichever thread runs that step."""
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            observer = self.write_observer
            if observer is not None:
                observer(self.name, time.perf_counter() - start, ok)

    def on_open(self, hook: Callable[[Any], None]) -> None:
        """Call ``hook`` with what a reader attaches to while the loop writes (the DuckDB
        output: its :class:`consumer.outputs.duckdb.DuckDBSink`); default: nothing to
        attach to, ``hook`` is not called."""
        return None

    def restore(self, book: RunBook) -> KnownState:
        """Restore the runs the output stored into ``book`` (runs, health trackers,
        finished ranks) and return the rest of what it keeps (default: nothing)."""
        return KnownState()

    def assign(self) -> KnownState | None:
        """What the output holds that a loop learns when partitions are assigned to it
        (runs and refusals another process recorded); None: nothing (default)."""
        return None

    def load_sums(self, run: RunInfo, step: int) -> MergedShards | None:
        """The merged sums stored for (run, step), to merge a late rank into; None when
        the output keeps none (default) or the frame is not stored."""
        return None

    def load_frame_verdict(self, run_id: str, step: int) -> tuple[list[int], int]:
        """(refused ranks, number of layers whose pieces do not fit) of the stored frame
        (run, step), for a late rank merged into it; ([], 0) when the output keeps none
        (default) or the frame is not stored."""
        return [], 0

    @abstractmethod
    def stored_offsets(self, topics: Iterable[str]) -> dict[PartitionKey, int] | None:
        """Next offset to consume per partition as stored with the rows, or None when
        the output keeps none (the consumer group's committed offsets are the positions)."""

    @abstractmethod
    def write(self, batch: Batch) -> None:
        """Make ``batch`` (rows and ``batch.offsets``) durable in one step; an output that
        writes behind may return before it is, having waited for the batch before it."""

    @abstractmethod
    def settle(self, wait: bool) -> bool:
        """Whether every batch given to :meth:`write` is durable (its offsets may be
        acknowledged); ``wait``: block until it is (then True).

        Raises:
            Exception: the write that failed (its offsets must never be acknowledged).
        """

    @abstractmethod
    def acknowledge(self, consumer: Any, offsets: dict[PartitionKey, int],
                    blocking: bool = True) -> None:
        """Commit ``offsets`` to Kafka once :meth:`settle` said they are durable;
        ``blocking=False`` inside a rebalance callback, where kafka-python 3 refuses
        blocking calls."""

    @abstractmethod
    def close(self) -> None:
        """Finish what is pending and release the output."""


def commit_offsets(consumer: Any, offsets: dict[PartitionKey, int], sync: bool) -> None:
    """Commit ``offsets`` (next offset to consume per (topic, partition)) to the Kafka
    consumer's group: synchronously, or with ``commit_async``.

    Raises:
        kafka.errors.KafkaError: the synchronous commit failed.
    """
    from kafka import OffsetAndMetadata, TopicPartition

    commit = {
        TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()
    }
    if sync:
        consumer.commit(commit)
    else:
        consumer.commit_async(commit)
