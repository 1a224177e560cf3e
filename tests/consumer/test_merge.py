"""Shard merge: completion, duplicates, timeouts, late shards and offset holding."""

import numpy as np
import pytest

from consumer.frames import MergedShards
from consumer.merge import ShardMerger
from consumer.runs import RunInfo
from schemas.wire import StepSummary

RUN = RunInfo("r", 3, ("a", "b"), np.array([2, 2]), 1e-7, 1e3)
P = ("topic", 0)


def shard(step: int, rank: int, value: float = 1.0) -> StepSummary:
    return StepSummary(
        run_id="r", step=step, rank=rank, world_size=3, wall_time=float(rank),
        layer_indices=[0, 1], numel=[2, 2], sum_abs=[2 * value, 2 * value],
        sum_sq=[2 * value**2, 2 * value**2], max_abs=[value, value], nonfinite=[0, 0],
    )


class StoreStub:
    """Stands in for the sink's stored sums (a pure function of what was stored)."""

    def __init__(self) -> None:
        self.sums: dict[int, MergedShards] = {}

    def load(self, run: RunInfo, step: int) -> MergedShards | None:
        return self.sums.get(step)


def test_complete_when_every_rank_reported():
    m = ShardMerger(10.0, StoreStub().load)
    assert m.add(RUN, shard(0, 0), P, 5, 0.0) is None
    assert m.add(RUN, shard(0, 2, 3.0), P, 6, 0.0) is None
    frame = m.add(RUN, shard(0, 1, 2.0), P, 7, 0.0)
    assert frame is not None and frame.complete and frame.ranks_seen == (0, 1, 2)
    assert frame.max_abs_grad.tolist() == [3.0, 3.0]
    assert frame.mean_abs_grad.tolist() == [2.0, 2.0]  # (2+4+6)/6
    assert frame.wall_time == 2.0
    assert m.pending_count == 0


def test_duplicates_change_nothing():
    m = ShardMerger(10.0, StoreStub().load)
    m.add(RUN, shard(0, 0), P, 1, 0.0)
    assert m.add(RUN, shard(0, 0, 100.0), P, 2, 0.0) is None  # duplicate while pending
    m.add(RUN, shard(0, 1), P, 3, 0.0)
    frame = m.add(RUN, shard(0, 2), P, 4, 0.0)
    assert frame.max_abs_grad.tolist() == [1.0, 1.0]
    assert m.add(RUN, shard(0, 1, 100.0), P, 9, 0.0) is None  # duplicate after completion
    assert m.duplicates == 2 and m.pending_count == 0


def test_timeout_gives_partial_frame_then_late_shard_rewrites_it():
    m = ShardMerger(5.0, StoreStub().load)
    m.add(RUN, shard(4, 0), P, 10, 100.0)
    m.add(RUN, shard(4, 2), P, 11, 101.0)
    assert m.expire({"r": RUN}, 104.9) == []
    (partial,) = m.expire({"r": RUN}, 105.0)
    assert not partial.complete and partial.missing_ranks == (1,)
    late = m.add(RUN, shard(4, 1, 4.0), P, 50, 200.0)
    assert late is not None and late.complete and late.max_abs_grad.tolist() == [4.0, 4.0]
    assert m.add(RUN, shard(4, 1, 4.0), P, 51, 200.0) is None


def test_late_shard_after_restart_reads_stored_sums():
    store = StoreStub()
    stored = MergedShards.empty(2)
    stored.add(np.array([0, 1]), np.array([4, 4]), np.array([4.0, 4.0]),
               np.array([4.0, 4.0]), np.array([1.0, 1.0]), np.array([0, 0]))
    store.sums[7] = stored
    m = ShardMerger(5.0, store.load)
    m.restore_finalised("r", np.array([6, 7]), np.array([True, False]), [[0, 1, 2], [0, 2]])
    assert m.add(RUN, shard(6, 1), P, 1, 0.0) is None  # complete frame: duplicate
    frame = m.add(RUN, shard(7, 1, 2.0), P, 2, 0.0)
    assert frame.complete and frame.numel.tolist() == [6, 6]
    assert frame.sum_abs.tolist() == [8.0, 8.0]


def test_stored_offset_is_held_at_earliest_pending_frame():
    m = ShardMerger(5.0, StoreStub().load)
    m.add(RUN, shard(1, 0), P, 40, 0.0)
    m.add(RUN, shard(2, 0), P, 42, 0.0)
    other = RunInfo("other", 3, ("a", "b"), np.array([2, 2]), 1e-7, 1e3)
    m.add(other, shard(2, 1).model_copy(update={"run_id": "other"}), ("topic", 1), 7, 0.0)
    assert m.earliest_pending_offsets() == {P: 40, ("topic", 1): 7}
    m.add(RUN, shard(1, 1), P, 43, 0.0)
    m.add(RUN, shard(1, 2), P, 44, 0.0)
    assert m.earliest_pending_offsets()[P] == 42
    assert m.drop_partitions({P}) == 1
    assert m.earliest_pending_offsets() == {("topic", 1): 7}


def test_expire_run_finalises_everything_pending():
    m = ShardMerger(1e9, StoreStub().load)
    m.add(RUN, shard(1, 0), P, 1, 0.0)
    m.add(RUN, shard(2, 1), P, 2, 0.0)
    frames = m.expire_run({"r": RUN}, "r")
    assert sorted(f.step for f in frames) == [1, 2] and m.pending_count == 0


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_rank_order_does_not_matter(order):
    m = ShardMerger(5.0, StoreStub().load)
    frames = [m.add(RUN, shard(3, r, r + 1.0), P, i, 0.0) for i, r in enumerate(order)]
    assert frames[-1].sum_sq.tolist() == [28.0, 28.0]


# -- replicas (schema 1.3 shard layout) ---------------------------------------------------

DDP = RunInfo("d", 3, ("a", "b"), np.array([2, 2]), 1e-7, 1e3)


def replica(step: int, rank: int, value: float = 1.0, index: int = 0, count: int = 1,
            numel: int = 2, world_size: int = 3) -> StepSummary:
    """A rank's statistics of ``value`` in every element of its piece of each layer."""
    return StepSummary(
        run_id="d", step=step, rank=rank, world_size=world_size, wall_time=1.0,
        layer_indices=[0, 1],
        numel=[numel, numel], sum_abs=[numel * value] * 2, sum_sq=[numel * value**2] * 2,
        max_abs=[value, value], nonfinite=[0, 0], shard_index=[index, index],
        shard_count=[count, count],
    )


def test_replicas_count_once_and_agree():
    m = ShardMerger(10.0, StoreStub().load)
    for rank in range(2):
        assert m.add(DDP, replica(0, rank, 3.0), P, rank, 0.0) is None
    frame = m.add(DDP, replica(0, 2, 3.0), P, 2, 0.0)
    assert frame.numel.tolist() == [2, 2]  # the parameter's size, not 3 copies
    assert frame.grad_norm.tolist() == pytest.approx([np.sqrt(18.0)] * 2, rel=1e-15)
    assert frame.replica_divergence.shape == (0, 3)


def test_replica_that_disagrees_is_recorded_not_added():
    m = ShardMerger(10.0, StoreStub().load)
    m.add(DDP, replica(0, 0, 3.0), P, 0, 0.0)
    m.add(DDP, replica(0, 1, 3.0 * (1 + 1e-12)), P, 1, 0.0)  # within REPLICA_RTOL: agrees
    frame = m.add(DDP, replica(0, 2, 3.5), P, 2, 0.0)
    assert frame.max_abs_grad.tolist() == [3.0, 3.0]  # the first replica's values
    assert frame.replica_divergence.tolist() == [[0, 2, 0], [1, 2, 0]]


def test_hsdp_pieces_add_and_their_replicas_count_once():
    """4 ranks on a (replicate 2) x (shard 2) mesh: ranks 0, 2 hold piece 0, ranks 1, 3
    piece 1 (each half of a 4-element parameter)."""
    run = RunInfo("d", 4, ("a", "b"), np.array([4, 4]), 1e-7, 1e3)

    def piece(rank: int, value: float) -> StepSummary:
        return replica(0, rank, value, index=rank % 2, count=2, world_size=4)

    m = ShardMerger(10.0, StoreStub().load)
    for rank in range(3):
        assert m.add(run, piece(rank, 1.0 + rank % 2), P, rank, 0.0) is None
    frame = m.add(run, piece(3, 2.0), P, 3, 0.0)
    assert frame.numel.tolist() == [4, 4]
    assert frame.sum_abs.tolist() == [2 * 1.0 + 2 * 2.0] * 2
    assert frame.max_abs_grad.tolist() == [2.0, 2.0]


def test_late_replica_of_a_stored_partial_frame_is_not_added():
    store = StoreStub()
    stored = MergedShards.empty(2)
    stored.add(np.array([0, 1]), np.array([2, 2]), np.array([2.0, 2.0]),
               np.array([2.0, 2.0]), np.array([1.0, 1.0]), np.array([0, 0]))
    store.sums[5] = stored
    m = ShardMerger(5.0, store.load)
    m.restore_finalised("d", np.array([5]), np.array([False]), [[0, 1]])
    frame = m.add(DDP, replica(5, 2, 1.0), P, 9, 0.0)
    assert frame.complete and frame.numel.tolist() == [2, 2]  # not 4: counted once


# -- parts (schema 1.4): a rank's summary split over several messages -----------------------

def part(step: int, rank: int, index: int, count: int, value: float = 1.0) -> StepSummary:
    """Part ``index`` of ``count`` of rank ``rank``: layer ``index`` of RUN's two layers
    (count 2) or both layers (count 1)."""
    layers = [index] if count == 2 else [0, 1]
    k = len(layers)
    return StepSummary(
        run_id="r", step=step, rank=rank, world_size=3, wall_time=float(rank),
        layer_indices=layers, numel=[2] * k, sum_abs=[2 * value] * k,
        sum_sq=[2 * value**2] * k, max_abs=[value] * k, nonfinite=[0] * k,
        part_index=index, part_count=count,
    )


def test_rank_counts_once_all_its_parts_arrived():
    m = ShardMerger(10.0, StoreStub().load)
    assert m.add(RUN, shard(0, 0), P, 1, 0.0) is None
    assert m.add(RUN, part(0, 1, 0, 2, 2.0), P, 2, 0.0) is None
    assert m.add(RUN, shard(0, 2, 3.0), P, 3, 0.0) is None  # rank 1 still misses a part
    assert m.add(RUN, part(0, 1, 0, 2, 50.0), P, 4, 0.0) is None  # repeated part
    assert m.duplicates == 1
    frame = m.add(RUN, part(0, 1, 1, 2, 2.0), P, 5, 0.0)
    assert frame is not None and frame.complete and frame.ranks_seen == (0, 1, 2)
    assert frame.mean_abs_grad.tolist() == [2.0, 2.0]  # (2+4+6)/6 in each layer
    assert frame.numel.tolist() == [6, 6]


def test_missing_part_gives_partial_frame_then_late_part_completes_it():
    m = ShardMerger(5.0, StoreStub().load)
    m.add(RUN, shard(1, 0), P, 1, 100.0)
    m.add(RUN, shard(1, 2), P, 2, 100.0)
    m.add(RUN, part(1, 1, 1, 2, 2.0), P, 3, 100.0)
    (partial,) = m.expire({"r": RUN}, 106.0)
    assert not partial.complete and partial.ranks_seen == (0, 2)
    assert partial.numel.tolist() == [4, 6]  # rank 1's layer-1 part is in the sums
    assert m.add(RUN, part(1, 1, 1, 2, 9.0), P, 4, 107.0) is None  # repeated late part
    frame = m.add(RUN, part(1, 1, 0, 2, 2.0), P, 5, 107.0)
    assert frame is not None and frame.complete and frame.ranks_seen == (0, 1, 2)
    assert frame.numel.tolist() == [6, 6]
    assert frame.mean_abs_grad.tolist() == pytest.approx([8 / 6, 8 / 6])  # (2+4+2)/6
