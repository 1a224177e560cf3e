"""GradientFrame -> MergedFrame -> MergedShards recomputes the same frame (scale-out mode)."""

from __future__ import annotations

import numpy as np
import pytest

from consumer.frames import MergedShards, compute_frame
from consumer.merge import merge_shard
from consumer.outputs.frames_topic import frame_to_message, message_to_merged
from producer.summary import summarize
from schemas.wire import MergedFrame, StepSummary, decode_frame_message, encode_message


def _frame(norms_only: bool, histogram: bool, nan_from: tuple[int, ...] = (0, 1)):
    """A frame of two ranks (a NaN in l2 on each, an Inf in l1 on rank 1); the ranks of
    ``nan_from`` send their NaN counts (schema 1.7), the others do not."""
    rng = np.random.default_rng(1)
    merged = MergedShards.empty(3)
    for rank in range(2):
        g = {f"l{i}": rng.standard_normal(20 + i).astype(np.float32) * 10.0 ** (i - 1)
             for i in range(3)}
        g["l2"][3] = np.nan
        if rank == 1:
            g["l1"][0] = -np.inf
        s = summarize(g, histogram=histogram, norms_only=norms_only)
        rows, cols = np.nonzero(s.exp_hist) if histogram else (None, None)
        hist = {}
        if histogram:
            off = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=3))))
            hist = dict(exp_hist_offsets=off.tolist(), exp_hist_columns=cols.tolist(),
                        exp_hist_counts=s.exp_hist[rows, cols].tolist())
        merge_shard(merged, StepSummary(
            run_id="r", step=2, rank=rank, world_size=2, wall_time=3.0,
            layer_indices=[0, 1, 2], numel=s.numel.tolist(), sum_sq=s.sum_sq.tolist(),
            nonfinite=s.nonfinite.tolist(),
            sum_abs=None if norms_only else s.sum_abs.tolist(),
            max_abs=None if norms_only else s.max_abs.tolist(), **hist,
            nan=s.nan.tolist() if rank in nan_from and s.nan is not None else None,
        ))
    return compute_frame("r", 2, merged, vanishing_threshold=1e-3, exploding_threshold=1.0,
                         ranks_seen=(0, 1), world_size=2, wall_time=3.0)


@pytest.mark.parametrize(("norms_only", "histogram"), [(False, False), (True, True)])
def test_round_trip_recomputes_the_same_frame(norms_only, histogram):
    frame = _frame(norms_only, histogram)
    message = decode_frame_message(encode_message(frame_to_message(frame)))
    assert isinstance(message, MergedFrame) and message.ranks_seen == [0, 1]
    assert (message.sum_abs is None) == norms_only
    again = compute_frame("r", 2, message_to_merged(message, 3), vanishing_threshold=1e-3,
                          exploding_threshold=1.0, ranks_seen=(0, 1), world_size=2,
                          wall_time=3.0)
    for name in ("numel", "sum_sq", "grad_norm", "flow_intensity", "nonfinite", "nan",
                 "is_vanishing", "is_exploding"):
        assert np.array_equal(getattr(again, name), getattr(frame, name)), name
    assert frame.nan is not None and frame.nan.tolist() == [0, 0, 2]  # l1: 1 Inf, no NaN
    assert frame.nonfinite.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(again.mean_abs_grad, frame.mean_abs_grad)
    if histogram:
        assert np.array_equal(again.exp_hist, frame.exp_hist)


def test_local_view_rows_travel_with_the_frame():
    from consumer.frames import LocalRows

    frame = _frame(False, False)
    frame.local = LocalRows(
        np.array([0, 0, 1], np.int32), np.array([0, 2, 0], np.int32),
        np.array([20, 22, 20]), np.array([1.5, 2.0, 3.0]), np.array([0.5, 1.0, 4.0]),
        np.array([0.3, 0.9, 2.5]), np.array([0, 1, 0]))
    message = decode_frame_message(encode_message(frame_to_message(frame)))
    assert isinstance(message, MergedFrame) and message.local_ranks == [0, 0, 1]
    back = LocalRows.from_shard(message)
    for name in ("rank", "layer_index", "numel", "sum_abs", "sum_sq", "max_abs", "nonfinite"):
        np.testing.assert_array_equal(getattr(back, name), getattr(frame.local, name))


def test_message_merge_equals_merging_the_message_statistics():
    """MergedShards.merge_message (sparse histograms) == merge_at(from_message(...))."""
    frame = _frame(False, True)
    message = frame_to_message(frame)
    layers = np.asarray(message.layer_indices)
    dense = MergedShards.empty(5).merge_at(layers + 2, MergedShards.from_message(message))
    sparse = MergedShards.empty(5)
    sparse.merge_message(message.model_copy(update={"layer_indices": (layers + 2).tolist()}))
    for name in ("gradient", "histogram"):
        a, b = getattr(sparse, name).state(), getattr(dense, name).state()
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}.{key}")
    assert sparse.weight_moments is None and dense.weight_moments is None


@pytest.mark.parametrize(("norms_only", "histogram"), [(False, False), (True, True)])
def test_binary_frame_decodes_to_the_json_frame(norms_only, histogram):
    from consumer.outputs.frames_topic import encode_frame
    from schemas.wire import BINARY_MAGIC

    frame = _frame(norms_only, histogram)
    raw = encode_frame(frame)
    assert raw.startswith(BINARY_MAGIC)
    assert len(raw) < len(encode_frame(frame, "json")) + 1024
    assert decode_frame_message(raw) == decode_frame_message(encode_frame(frame, "json"))


def test_nan_count_unknown_when_a_rank_did_not_send_it():
    """A rank before schema 1.7 (no ``nan``): the merged count is unknown (-1) for every
    layer where it holds non-finite elements (l1, l2; l0 is finite everywhere: 0 NaN), and
    the MergedFrame leaves ``nan`` out (unknown downstream too)."""
    frame = _frame(False, False, nan_from=(0,))
    assert frame.nan is not None and frame.nan.tolist() == [0, -1, -1]
    message = decode_frame_message(encode_message(frame_to_message(frame)))
    assert message.nan is None
    assert message_to_merged(message, 3).gradient.has_nan().tolist() == [True, False, False]
