"""DuckDBSink.load_sums: the stored rows of a frame give back its mergeable statistics, so
that a late rank merged into them gives the frame of all ranks merged at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.merge import merge_shard
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from consumer.runs import RunInfo
from producer.summary import summarize
from producer.weights import summarize_weights
from schemas.wire import StepSummary

RUN = RunInfo("r", 3, ("a", "b", "c"), np.array([60, 80, 10]), 1e-7, 1e3)
FIELDS = (
    "layer_index", "numel", "sum_abs", "sum_sq", "max_abs_grad", "nonfinite", "mean_abs_grad",
    "grad_norm", "flow_intensity", "is_vanishing", "is_exploding", "weight_sum_sq",
    "update_sum_sq", "update_to_weight", "exp_hist", "weight_sum", "weight_sum_cube",
    "weight_sum_quad", "weight_min", "weight_max", "weight_nonfinite", "weight_exp_hist",
)


def _csr(hist: np.ndarray) -> dict[str, list[int]]:
    rows, cols = np.nonzero(hist)
    off = np.concatenate(([0], np.cumsum(np.bincount(rows, minlength=len(hist)))))
    return {"offsets": off.tolist(), "columns": cols.tolist(),
            "counts": hist[rows, cols].tolist()}


def shard(rank: int, *, weights: bool = True, norms_only: bool = False) -> StepSummary:
    """Rank ``rank``'s third of every layer (layer "c" only from rank 0), NaN in one."""
    rng = np.random.default_rng(rank)
    layers = [0, 1] if rank else [0, 1, 2]
    g = {RUN.layer_names[i]: rng.standard_normal(int(RUN.numel[i]) // 3 if i < 2 else 10)
         .astype(np.float32) * 10.0 ** (i - 2) for i in layers}
    g["a"][rank] = np.nan
    s = summarize(g, histogram=True, norms_only=norms_only)
    extra: dict[str, object] = {}
    if weights:
        w = {n: (x * 100).astype(np.float32) for n, x in g.items()}
        ws = summarize_weights(w, previous={n: x * 0.5 for n, x in w.items()})
        wh = _csr(ws.exp_hist)
        extra = dict(
            weight_sum_sq=ws.sum_sq.tolist(), update_sum_sq=ws.update_sum_sq.tolist(),
            weight_sum=ws.sum.tolist(), weight_sum_cube=ws.sum_cube.tolist(),
            weight_sum_quad=ws.sum_quad.tolist(), weight_min=ws.min.tolist(),
            weight_max=ws.max.tolist(), weight_nonfinite=ws.nonfinite.tolist(),
            weight_exp_hist_offsets=wh["offsets"], weight_exp_hist_columns=wh["columns"],
            weight_exp_hist_counts=wh["counts"],
        )
    h = _csr(s.exp_hist)
    return StepSummary(
        run_id="r", step=7, rank=rank, world_size=3, wall_time=1.0, layer_indices=layers,
        numel=s.numel.tolist(), sum_sq=s.sum_sq.tolist(), nonfinite=s.nonfinite.tolist(),
        sum_abs=None if s.sum_abs is None else s.sum_abs.tolist(),
        max_abs=None if s.max_abs is None else s.max_abs.tolist(),
        exp_hist_offsets=h["offsets"], exp_hist_columns=h["columns"],
        exp_hist_counts=h["counts"], **extra,
    )


def frame(merged: MergedShards, ranks: tuple[int, ...]) -> GradientFrame:
    return compute_frame("r", 7, merged, vanishing_threshold=1e-7, exploding_threshold=1e3,
                         ranks_seen=ranks, world_size=3, wall_time=1.0)


def assert_frames_equal(got: GradientFrame, want: GradientFrame) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-13, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("late", [
    {"weights": True, "norms_only": False},
    {"weights": False, "norms_only": False},  # a late rank without weight statistics
    {"weights": True, "norms_only": True},  # a late rank in norms mode
])
def test_stored_partial_frame_plus_late_rank_equals_all_ranks(tmp_path: Path, late) -> None:
    early = [shard(0), shard(2)]
    merged = MergedShards.empty(RUN.num_layers)
    for s in early:
        merge_shard(merged, s)
    partial = frame(merged, (0, 2))
    sink = DuckDBSink(tmp_path / "s.duckdb", write_behind=False)
    try:
        sink.write(Batch(frames={("r", 7): (partial, "Healthy")}), "g")
        stored = sink.load_sums(RUN, 7)
        assert stored is not None and sink.load_sums(RUN, 8) is None
        assert_frames_equal(frame(stored, (0, 2)), partial)

        last = shard(1, **late)
        merge_shard(stored, last)
        merge_shard(merged, last)
        whole = frame(merged, (0, 1, 2))
        assert_frames_equal(frame(stored, (0, 1, 2)), whole)
    finally:
        sink.close()
    if not late["weights"]:  # layers a, b lack the late rank's weights: unknown
        assert np.isnan(whole.weight_sum[:2]).all() and not np.isnan(whole.weight_sum[2])
        assert whole.weight_nonfinite[:2].tolist() == [-1, -1]
    if late["norms_only"]:
        assert np.isnan(whole.sum_abs[:2]).all() and whole.sum_abs[2] > 0
