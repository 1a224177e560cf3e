"""Shard merge: completion, duplicates, timeouts, late shards and offset holding; pieces
that do not fit their parameter; refused ranks."""

import numpy as np
import pytest

from consumer.frames import MergedShards
from consumer.merge import (
    VIOLATION_NUMEL,
    VIOLATION_REPLICA_NUMEL,
    VIOLATION_SHARD_COUNT,
    ShardMerger,
    check_layout,
    check_shard,
)
from consumer.runs import RunInfo
from schemas.wire import StepSummary

RUN = RunInfo("r", 3, ("a", "b"), np.array([6, 6]), 1e-7, 1e3)  # 3 disjoint shards of 2
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
    assert not partial.rewrite  # written first
    late = m.add(RUN, shard(4, 1, 4.0), P, 50, 200.0)
    assert late is not None and late.complete and late.max_abs_grad.tolist() == [4.0, 4.0]
    assert late.rewrite  # replaces the stored partial frame
    assert m.add(RUN, shard(4, 1, 4.0), P, 51, 200.0) is None


def test_frame_scalars_join_the_ranks_values_and_their_step_aggregates():
    """The lowest rank's step scalars, every rank's per-rank rows, the mean loss and the
    slowest compute time; a late rank's rewrite (cached sums) carries every rank's rows."""
    def scalar_shard(step: int, rank: int, loss: float, lr: float) -> StepSummary:
        return shard(step, rank).model_copy(update={
            "scalars": {"lr": lr}, "rank_scalar_names": ["loss", "compute_time_s"],
            "rank_scalar_values": [loss, 0.1 * (rank + 1)]})

    m = ShardMerger(5.0, StoreStub().load)
    m.add(RUN, scalar_shard(0, 2, 3.0, 0.3), P, 1, 0.0)
    m.add(RUN, scalar_shard(0, 0, 1.0, 0.1), P, 2, 0.0)
    (partial,) = m.expire({"r": RUN}, 10.0)
    assert partial.scalars == {"lr": 0.1, "loss": 2.0, "compute_time_s": pytest.approx(0.3)}
    late = m.add(RUN, scalar_shard(0, 1, 5.0, 0.2), P, 3, 20.0)
    assert late.scalars["loss"] == 3.0 and late.scalars["lr"] == 0.1
    assert sorted(late.rank_scalars.values_of("loss")[0].tolist()) == [0, 1, 2]


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


def test_replicas_count_their_nan_once_and_must_agree_on_it():
    """The NaN count of a replicated piece counts once; a replica whose NaN/Inf split
    differs from the counted one's is a divergence; one without a count (an older
    producer) is compared on the rest only."""
    def bad(rank: int, nan: list[int] | None) -> StepSummary:
        return replica(0, rank, 3.0).model_copy(update={"nonfinite": [1, 2], "nan": nan})

    m = ShardMerger(10.0, StoreStub().load)
    m.add(DDP, bad(0, [1, 1]), P, 0, 0.0)
    m.add(DDP, bad(1, None), P, 1, 0.0)
    frame = m.add(DDP, bad(2, [1, 2]), P, 2, 0.0)
    assert frame.nonfinite.tolist() == [1, 2] and frame.nan.tolist() == [1, 1]
    assert frame.replica_divergence.tolist() == [[1, 2, 0]]


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


# -- pieces that do not fit; refused ranks --------------------------------------------------

PAIR = RunInfo("p", 2, ("w", "b"), np.array([4096, 16]), 1e-7, 1e3)


def piece(step: int, rank: int, numel: list[int], value: float = 1.0,
          layout: tuple[list[int], list[int]] | None = None, world: int = 2) -> StepSummary:
    index, count = layout if layout is not None else (None, None)
    return StepSummary(
        run_id=PAIR.run_id, step=step, rank=rank, world_size=world, wall_time=1.0,
        layer_indices=list(range(len(numel))), numel=numel,
        sum_abs=[n * value for n in numel], sum_sq=[n * value**2 for n in numel],
        max_abs=[value] * len(numel), nonfinite=[0] * len(numel),
        shard_index=index, shard_count=count,
    )


def test_disjoint_pieces_adding_up_to_more_than_the_parameter_mark_the_frame_partial():
    """Two ranks each claim all 4096 elements of `w` as their own disjoint piece (no
    layout): 8192 counted elements cannot be a 4096-element parameter."""
    m = ShardMerger(10.0, StoreStub().load)
    m.add(PAIR, piece(0, 0, [4096, 8]), P, 1, 0.0)
    frame = m.add(PAIR, piece(0, 1, [4096, 8], 2.0), P, 2, 0.0)
    assert frame is not None and frame.all_ranks_seen and not frame.complete
    assert frame.layout_violations.tolist() == [[0, VIOLATION_NUMEL, -1, 8192, 4096]]


def test_pieces_short_of_the_parameter_once_every_rank_reported_mark_the_frame_partial():
    m = ShardMerger(10.0, StoreStub().load)
    m.add(PAIR, piece(0, 0, [1024, 8]), P, 1, 0.0)
    frame = m.add(PAIR, piece(0, 1, [2048, 8]), P, 2, 0.0)
    assert not frame.complete
    assert frame.layout_violations.tolist() == [[0, VIOLATION_NUMEL, -1, 3072, 4096]]
    ok = ShardMerger(10.0, StoreStub().load)
    ok.add(PAIR, piece(0, 0, [2048, 8]), P, 1, 0.0)
    good = ok.add(PAIR, piece(0, 1, [2048, 8]), P, 2, 0.0)
    assert good.complete and good.layout_violations.shape == (0, 5)


def test_a_partial_frame_is_checked_for_excess_only():
    m = ShardMerger(5.0, StoreStub().load)
    m.add(PAIR, piece(0, 0, [2048, 8]), P, 1, 0.0)  # half of each parameter: may be fine
    (partial,) = m.expire({"p": PAIR}, 10.0)
    assert partial.missing_ranks == (1,) and partial.layout_violations.shape == (0, 5)


def test_replicas_of_another_size_and_other_cuts_are_violations_not_divergence():
    m = ShardMerger(10.0, StoreStub().load)
    m.add(PAIR, piece(0, 0, [4096, 16], layout=([0, 0], [1, 1])), P, 1, 0.0)
    # rank 1: a "replica" of w of another size, and b cut into 2 pieces where rank 0 cut 1
    frame = m.add(PAIR, piece(0, 1, [2048, 8], layout=([0, 1], [1, 2])), P, 2, 0.0)
    rows = sorted(frame.layout_violations.tolist())
    assert rows == [[0, VIOLATION_REPLICA_NUMEL, 1, 2048, 4096],
                    [1, VIOLATION_SHARD_COUNT, 1, 2, 1]]
    assert frame.replica_divergence.shape == (0, 3)  # the sizes are the violation
    assert frame.numel.tolist() == [4096, 16]  # only rank 0's pieces counted
    assert not frame.complete


def test_a_summary_that_cannot_be_a_piece_of_the_run_is_refused_from_the_message_alone():
    assert check_shard(piece(0, 0, [4096, 16], layout=([0, 0], [1, 1])), PAIR.numel) is None
    assert check_shard(piece(0, 1, [2048, 16]), PAIR.numel) is None  # a disjoint half
    over = check_shard(piece(3, 1, [8192, 16]), PAIR.numel)
    assert over is not None and "rank 1 step 3" in over and "8192" in over \
        and "exceeds the parameter's 4096" in over
    whole = check_shard(piece(0, 0, [4096, 8], layout=([0, 0], [1, 1])), PAIR.numel)
    assert whole is not None and "layer 1 holds 8 elements as the whole parameter" in whole
    single = StepSummary(run_id="p", step=0, rank=0, world_size=1, wall_time=1.0,
                         layer_indices=[0], numel=[100], sum_sq=[1.0], nonfinite=[0])
    assert "differs from the parameter's 4096" in check_shard(single, PAIR.numel)


def test_check_layout_is_vectorised_over_layers():
    numel = np.array([0, 10, 20, 40, 5])
    full = np.array([10, 10, 10, 40, 10])
    assert check_layout(numel, full, True)[:, [0, 3, 4]].tolist() == [
        [2, 20, 10], [4, 5, 10]]  # layer 0 had no gradient: not a violation
    assert check_layout(numel, full, False)[:, 0].tolist() == [2]


def test_refused_rank_is_not_waited_for_and_named_in_the_frame():
    m = ShardMerger(1e9, StoreStub().load)
    m.refuse("p", 1, "its layer list differs from rank 0's")
    assert m.refusal("p", 1) == "its layer list differs from rank 0's"
    assert m.refusal("p", 0) is None
    frame = m.add(PAIR, piece(0, 0, [4096, 16], layout=([0, 0], [1, 1])), P, 1, 0.0)
    assert frame is not None and not frame.complete and frame.missing_ranks == (1,)
    assert frame.refused_ranks == {
        1: "its RunStarted was refused: its layer list differs from rank 0's"}
    assert frame.numel.tolist() == [4096, 16] and m.pending_count == 0


def test_refusal_settles_frames_that_waited_for_the_refused_rank():
    m = ShardMerger(1e9, StoreStub().load)
    assert m.add(PAIR, piece(0, 0, [2048, 8]), P, 1, 0.0) is None
    m.refuse("p", 1, "another layer list")
    (frame,) = m.settle(PAIR)
    assert frame.missing_ranks == (1,) and 1 in frame.refused_ranks
    assert m.pending_count == 0 and m.earliest_pending_offsets() == {}


def test_a_dead_lettered_summary_excuses_its_rank_for_that_step_only():
    m = ShardMerger(1e9, StoreStub().load)
    m.add(PAIR, piece(5, 0, [2048, 8]), P, 1, 0.0)
    m.add(PAIR, piece(6, 0, [2048, 8]), P, 2, 0.0)
    m.reject("p", 5, 1, "numel 8192 exceeds 4096")
    frame = m.settle_step(PAIR, 5)
    assert frame is not None and frame.refused_ranks == {
        1: "its summary was dead-lettered: numel 8192 exceeds 4096"}
    assert m.settle_step(PAIR, 6) is None and m.pending_count == 1  # step 6 still waits
    late = m.add(PAIR, piece(5, 1, [2048, 8]), P, 3, 0.0)  # a good re-send merges late
    assert late is not None and late.complete


# -- summaries reduced in-band over several ranks ------------------------------------------

DDP4 = RunInfo("r", 4, ("a", "b"), np.array([6, 6]), 1e-7, 1e3)


def reduced(step: int, rank: int = 0, ranges: tuple[int, ...] = (0, 4),
            divergence: list[int] | None = None, **parts: int) -> StepSummary:
    """A whole-parameter summary of both layers, reduced over ``ranges``."""
    return StepSummary(
        run_id="r", step=step, rank=rank, world_size=4, wall_time=1.0,
        layer_indices=[0, 1], numel=[6, 6], sum_abs=[6.0, 12.0], sum_sq=[6.0, 24.0],
        max_abs=[1.0, 2.0], nonfinite=[0, 0], shard_index=[0, 0], shard_count=[1, 1],
        reduced_ranks=list(ranges), replica_divergence=divergence, **parts,
    )


def test_a_reduced_summary_reports_for_every_rank_of_its_ranges():
    m = ShardMerger(10.0, StoreStub().load)
    frame = m.add(DDP4, reduced(0), P, 1, 0.0)
    assert frame is not None and frame.complete and frame.ranks_seen == (0, 1, 2, 3)
    assert frame.mean_abs_grad.tolist() == [1.0, 2.0]
    assert len(frame.layout_violations) == 0 and len(frame.replica_divergence) == 0
    assert m.add(DDP4, reduced(0), P, 2, 0.0) is None and m.duplicates == 1


def test_reduced_summaries_of_two_groups_complete_the_frame_together():
    # Two groups (e.g. pipeline stages) each reduced over their own ranks.
    m = ShardMerger(10.0, StoreStub().load)
    first = StepSummary(run_id="r", step=0, rank=0, world_size=4, wall_time=1.0,
                        layer_indices=[0], numel=[6], sum_abs=[6.0], sum_sq=[6.0],
                        max_abs=[1.0], nonfinite=[0], reduced_ranks=[0, 2])
    assert m.add(DDP4, first, P, 1, 0.0) is None
    second = StepSummary(run_id="r", step=0, rank=2, world_size=4, wall_time=1.0,
                         layer_indices=[1], numel=[6], sum_abs=[12.0], sum_sq=[24.0],
                         max_abs=[2.0], nonfinite=[0], reduced_ranks=[2, 4])
    frame = m.add(DDP4, second, P, 2, 0.0)
    assert frame is not None and frame.complete and frame.ranks_seen == (0, 1, 2, 3)
    assert frame.max_abs_grad.tolist() == [1.0, 2.0]


def test_reduced_summary_in_parts_counts_once_all_parts_arrived():
    m = ShardMerger(10.0, StoreStub().load)
    whole = reduced(3)
    from schemas.wire import split_step_summary

    first, second = split_step_summary(whole, [(0, 1), (1, 2)])
    assert m.add(DDP4, first, P, 1, 0.0) is None
    frame = m.add(DDP4, second, P, 2, 0.0)
    assert frame is not None and frame.complete and frame.ranks_seen == (0, 1, 2, 3)


def test_the_cross_check_rows_of_a_reduced_summary_reach_the_frame():
    m = ShardMerger(10.0, StoreStub().load)
    frame = m.add(DDP4, reduced(0, divergence=[1, 3, 2]), P, 1, 0.0)
    assert frame.replica_divergence.tolist() == [[1, 3, 2]]


def test_the_ranks_whose_summaries_held_nan_are_named_on_the_frame():
    m = ShardMerger(10.0, StoreStub().load)
    bad = shard(0, 1).model_copy(update={"nonfinite": [0, 1]})
    m.add(RUN, shard(0, 0), P, 1, 0.0)
    m.add(RUN, bad, P, 2, 0.0)
    frame = m.add(RUN, shard(0, 2), P, 3, 0.0)
    assert frame.nonfinite_pieces.tolist() == [[1, 1]]
    reduced_frame = ShardMerger(10.0, StoreStub().load).add(
        DDP4, reduced(0).model_copy(update={"nonfinite": [1, 0]}), P, 1, 0.0)
    assert reduced_frame.nonfinite_pieces.shape == (0, 2)  # a reduced summary names none


def test_pipeline_stages_queued_then_a_replica_is_checked_against_its_stage():
    """Disjoint stages (each summary reporting only new layers) are queued by the ledger;
    a later replica of a queued stage is compared with that stage's counted rank, a cut
    into pieces other than the stage's is a violation, and every stage counts once."""
    run = RunInfo("p", 4, ("a", "b", "c", "d"), np.array([2, 2, 4, 4]), 1e-7, 1e3)

    def stage(rank: int, layers: list[int], value: float, count: int = 1,
              index: int = 0) -> StepSummary:
        numel = [int(run.numel[i]) // count for i in layers]
        return StepSummary(
            run_id="p", step=0, rank=rank, world_size=4, wall_time=1.0,
            layer_indices=layers, numel=numel, sum_abs=[n * value for n in numel],
            sum_sq=[n * value**2 for n in numel], max_abs=[value] * len(layers),
            nonfinite=[0] * len(layers), shard_index=[index] * len(layers),
            shard_count=[count] * len(layers))

    m = ShardMerger(10.0, StoreStub().load)
    assert m.add(run, stage(0, [0, 1], 1.0), P, 0, 0.0) is None  # queued
    assert m.add(run, stage(1, [2, 3], 2.0, count=2, index=1), P, 1, 0.0) is None  # queued
    assert m.add(run, stage(2, [0, 1], 1.5), P, 2, 0.0) is None  # replica of rank 0: differs
    frame = m.add(run, stage(3, [2, 3], 2.0, count=2, index=0), P, 3, 0.0)  # the other piece
    assert frame.complete
    assert frame.numel.tolist() == [2, 2, 4, 4]
    assert frame.max_abs_grad.tolist() == [1.0, 1.0, 2.0, 2.0]  # rank 2 not added
    assert frame.replica_divergence.tolist() == [[0, 2, 0], [1, 2, 0]]
    assert len(frame.layout_violations) == 0

    m = ShardMerger(10.0, StoreStub().load)
    m.add(run, stage(0, [2], 2.0, count=2, index=1), P, 0, 0.0)  # queued: 2 pieces
    m.add(run, stage(1, [0, 1], 1.0), P, 1, 0.0)  # queued
    m.add(run, stage(2, [2, 3], 2.0), P, 2, 0.0)  # layer 2 whole: another cut
    frame = m.add(run, stage(3, [2], 2.0, count=2, index=0), P, 3, 0.0)
    rows = frame.layout_violations[frame.layout_violations[:, 1] == VIOLATION_SHARD_COUNT]
    assert rows.tolist() == [[2, VIOLATION_SHARD_COUNT, 2, 1, 2]]
    assert frame.numel.tolist() == [2, 2, 4, 4]  # layer 3 whole from rank 2, layer 2 halves
