"""Shard merge: the ranks of one (run, step) become one GradientFrame.

A frame is complete when every rank of ``world_size`` has reported. A frame still
incomplete ``shard_timeout_s`` after its first shard is finalised as *partial*, its
missing ranks recorded. A shard arriving later for a partial frame is merged into the
stored sums and the frame is finalised again (the store rewrites it). A duplicate shard
(same run, step, rank) changes nothing (DESIGN.md, "Shard merge").

The merger also tracks, per Kafka partition, the earliest offset of every pending frame:
a worker must never store or commit a position past it, so that a crash or a rebalance
rebuilds pending frames from Kafka instead of losing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from consumer.frames import GradientFrame, MergedShards, WeightDistribution, compute_frame
from consumer.runs import RunInfo
from schemas.wire import StepSummary

PartitionKey = tuple[str, int]
"""(topic, partition)."""

SumsLoader = Callable[[RunInfo, int], MergedShards | None]
"""Loads the stored merged sums of a finalised frame (run, step), or None if absent."""


@dataclass(slots=True)
class _Pending:
    merged: MergedShards
    ranks: set[int]
    partition: PartitionKey
    first_offset: int
    first_seen: float
    wall_time: float


@dataclass(slots=True)
class _RunFrames:
    """Finalised frames of one run: complete steps, and partial steps with their ranks."""

    complete: set[int] = field(default_factory=set)
    partial: dict[int, frozenset[int]] = field(default_factory=dict)


class ShardMerger:
    """Merges StepSummary shards into frames.

    Args:
        shard_timeout_s: seconds after a frame's first shard before it is finalised
            as partial.
        load_sums: how to fetch the stored sums of a partial frame when a late shard
            arrives (the DuckDB sink's loader in a worker).
    """

    def __init__(self, shard_timeout_s: float, load_sums: SumsLoader) -> None:
        self.shard_timeout_s = shard_timeout_s
        self._load_sums = load_sums
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._finalised: dict[str, _RunFrames] = {}
        # Sums of recently finalised partial frames, so that a late shard arriving before
        # the frame reached the store still merges with them; older ones come from the store.
        self._partial_sums: OrderedDict[tuple[str, int], MergedShards] = OrderedDict()
        self.partial_cache_size = 4096
        self.duplicates = 0

    # -- restore -------------------------------------------------------------------------

    def restore_finalised(
        self, run_id: str, steps: np.ndarray, complete: np.ndarray, ranks: list[list[int]]
    ) -> None:
        """Register a run's stored frames (worker restart).

        Args:
            run_id: the run. steps: int[F]. complete: bool[F].
            ranks: F lists of the ranks seen (used for partial frames).
        """
        record = self._finalised.setdefault(run_id, _RunFrames())
        record.complete.update(steps[complete].tolist())
        for i in np.flatnonzero(~complete).tolist():
            record.partial[int(steps[i])] = frozenset(ranks[i])

    # -- shards --------------------------------------------------------------------------

    def add(
        self,
        run: RunInfo,
        shard: StepSummary,
        partition: PartitionKey,
        offset: int,
        now: float,
    ) -> GradientFrame | None:
        """Merge one validated shard.

        Args:
            run: the run's description (layer count, thresholds, world size).
            shard: a StepSummary whose indices were checked against ``run``.
            partition: where the shard was read. offset: its Kafka offset.
            now: monotonic clock (s), for the shard timeout.

        Returns:
            The finalised frame when this shard completes it (or rewrites a partial frame
            with a late shard); None while the frame waits for more ranks or for a
            duplicate.
        """
        key = (run.run_id, shard.step)
        record = self._finalised.setdefault(run.run_id, _RunFrames())
        pending = self._pending.get(key)
        if pending is None:
            if shard.step in record.complete:
                self.duplicates += 1
                return None
            late_ranks = record.partial.get(shard.step)
            if late_ranks is not None:
                return self._late_shard(run, shard, late_ranks, record)
            pending = _Pending(
                MergedShards.empty(run.num_layers), set(), partition, offset, now,
                shard.wall_time,
            )
            self._pending[key] = pending
        if shard.rank in pending.ranks:
            self.duplicates += 1
            return None
        merge_shard(pending.merged, shard)
        pending.ranks.add(shard.rank)
        pending.wall_time = max(pending.wall_time, shard.wall_time)
        if len(pending.ranks) < run.world_size:
            return None
        del self._pending[key]
        record.complete.add(shard.step)
        return self._frame(run, shard.step, pending.merged, pending.ranks, pending.wall_time)

    def _late_shard(
        self, run: RunInfo, shard: StepSummary, ranks: frozenset[int], record: _RunFrames
    ) -> GradientFrame | None:
        if shard.rank in ranks:
            self.duplicates += 1
            return None
        merged = self._partial_sums.pop((run.run_id, shard.step), None)
        if merged is None:
            merged = self._load_sums(run, shard.step)
        if merged is None:
            merged = MergedShards.empty(run.num_layers)
            ranks = frozenset()
        merge_shard(merged, shard)
        new_ranks = ranks | {shard.rank}
        if len(new_ranks) == run.world_size:
            del record.partial[shard.step]
            record.complete.add(shard.step)
        else:
            record.partial[shard.step] = new_ranks
            self._remember_partial(run.run_id, shard.step, merged)
        return self._frame(run, shard.step, merged, set(new_ranks), shard.wall_time)

    def expire(self, runs: dict[str, RunInfo], now: float) -> list[GradientFrame]:
        """Finalise as partial every pending frame older than ``shard_timeout_s``.

        Args:
            runs: run id -> RunInfo. now: monotonic clock (s).

        Returns:
            The partial frames, missing ranks recorded in each.
        """
        limit = now - self.shard_timeout_s
        expired = [k for k, p in self._pending.items() if p.first_seen <= limit]
        frames = []
        for run_id, step in expired:
            pending = self._pending.pop((run_id, step))
            run = runs[run_id]
            self._finalised.setdefault(run_id, _RunFrames()).partial[step] = frozenset(
                pending.ranks
            )
            self._remember_partial(run_id, step, pending.merged)
            frames.append(self._frame(run, step, pending.merged, pending.ranks,
                                      pending.wall_time))
        return frames

    def _remember_partial(self, run_id: str, step: int, merged: MergedShards) -> None:
        self._partial_sums[(run_id, step)] = merged
        while len(self._partial_sums) > self.partial_cache_size:
            self._partial_sums.popitem(last=False)

    def expire_run(self, runs: dict[str, RunInfo], run_id: str) -> list[GradientFrame]:
        """Finalise every pending frame of ``run_id`` now (all its ranks finished)."""
        keys = [k for k in self._pending if k[0] == run_id]
        frames = []
        for key in keys:
            pending = self._pending[key]
            pending.first_seen = float("-inf")
        if keys:
            frames = self.expire(runs, now=float("inf"))
        return frames

    @staticmethod
    def _frame(
        run: RunInfo, step: int, merged: MergedShards, ranks: set[int], wall_time: float
    ) -> GradientFrame:
        return compute_frame(
            run.run_id,
            step,
            merged,
            vanishing_threshold=run.vanishing_threshold,
            exploding_threshold=run.exploding_threshold,
            ranks_seen=tuple(ranks),
            world_size=run.world_size,
            wall_time=wall_time,
        )

    # -- offsets -------------------------------------------------------------------------

    def earliest_pending_offsets(self) -> dict[PartitionKey, int]:
        """Per partition, the smallest first offset among pending frames."""
        out: dict[PartitionKey, int] = {}
        for p in self._pending.values():
            cur = out.get(p.partition)
            if cur is None or p.first_offset < cur:
                out[p.partition] = p.first_offset
        return out

    def drop_partitions(self, partitions: set[PartitionKey]) -> int:
        """Forget pending frames read from ``partitions`` (revoked in a rebalance; their
        new owner rebuilds them from Kafka). Returns how many were dropped."""
        doomed = [k for k, p in self._pending.items() if p.partition in partitions]
        for k in doomed:
            del self._pending[k]
        return len(doomed)

    @property
    def pending_count(self) -> int:
        """Frames waiting for ranks."""
        return len(self._pending)


def merge_shard(merged: MergedShards, shard: StepSummary) -> None:
    """Merge one validated shard (or MergedFrame) into ``merged`` in place: every
    statistic it carries (exactly mergeable: sums add, extremes min/max, counts add)."""
    idx = np.asarray(shard.layer_indices, dtype=np.int64)
    if shard.exp_hist_offsets is not None:
        merged.add_histogram(
            idx, np.asarray(shard.exp_hist_offsets, np.int64),
            np.asarray(shard.exp_hist_columns, np.int64),
            np.asarray(shard.exp_hist_counts, np.int64),
        )
    if shard.weight_sum_sq is not None or shard.update_sum_sq is not None:
        merged.add_weights(
            idx,
            None if shard.weight_sum_sq is None else np.asarray(shard.weight_sum_sq),
            None if shard.update_sum_sq is None else np.asarray(shard.update_sum_sq),
        )
    if shard.has_weight_distribution:
        if merged.weight_dist is None:
            merged.weight_dist = WeightDistribution.empty(len(merged.numel))
        merged.weight_dist.add(
            idx,
            np.array([shard.weight_sum, shard.weight_sum_cube, shard.weight_sum_quad],
                     np.float64),
            np.asarray(shard.weight_min, np.float64), np.asarray(shard.weight_max, np.float64),
            np.asarray(shard.weight_nonfinite, np.int64),
            np.asarray(shard.weight_exp_hist_offsets, np.int64),
            np.asarray(shard.weight_exp_hist_columns, np.int64),
            np.asarray(shard.weight_exp_hist_counts, np.int64),
        )
    merged.add(
        idx,
        np.asarray(shard.numel, dtype=np.int64),
        None if shard.sum_abs is None else np.asarray(shard.sum_abs, dtype=np.float64),
        np.asarray(shard.sum_sq, dtype=np.float64),
        None if shard.max_abs is None else np.asarray(shard.max_abs, dtype=np.float64),
        np.asarray(shard.nonfinite, dtype=np.int64),
    )
