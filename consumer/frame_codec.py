"""Frames on the wire (scale-out mode): GradientFrame -> MergedFrame -> MergedShards.

A worker publishes each finished frame as its merged sums (:class:`schemas.wire.MergedFrame`)
rather than its derived fields, so that the store can recompute the frame fields with
:func:`consumer.frames.compute_frame` (identical to what a single-process worker stores) and
can merge a late rank's frame into a stored partial one exactly. On the topic a frame
travels in the columnar binary form (:func:`encode_frame`, ``schemas.wire.encode_binary``);
:func:`schemas.wire.decode_frame_message` reads it and JSON alike.
"""

from __future__ import annotations

import numpy as np

from consumer.frames import GradientFrame, MergedShards
from consumer.merge import VIOLATION_NUMEL
from schemas.wire import MergedFrame, WireFormat, encode_message


def _csr(hist: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """(offsets, columns, counts) of an int64[n, B] histogram."""
    rows, cols = np.nonzero(hist)
    offsets = np.zeros(hist.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=hist.shape[0]), out=offsets[1:])
    return offsets.tolist(), cols.tolist(), hist[rows, cols].tolist()


def _all_known(values: np.ndarray | None) -> bool:
    return values is not None and not np.isnan(values).any()


def frame_to_message(frame: GradientFrame) -> MergedFrame:
    """The merged sums of ``frame`` as a MergedFrame.

    An optional statistic (sum_abs/max_abs, the NaN count, histogram, weight norms, weight
    distribution) is included only when it is known for every layer of the frame; otherwise
    it is left out for the whole frame (a layer-mixed frame only arises when ranks of one
    run use different producer settings). The frame's per-rank local view rows travel
    along (``local_ranks``). So do (schema 1.8) the frame's layout violations that its sums
    cannot show (the worker's ledger rows: replicas of another numel, other shard counts;
    the ``numel`` kind the store checks again from the sums) and its refused ranks.

    Raises:
        pydantic.ValidationError: the frame violates the wire contract (a bug upstream).
    """
    optional: dict[str, object] = {}
    if _all_known(frame.sum_abs) and _all_known(frame.max_abs_grad):
        optional.update(sum_abs=frame.sum_abs.tolist(), max_abs=frame.max_abs_grad.tolist())
    if frame.nan is not None and frame.nonfinite.any() and (frame.nan >= 0).all():
        optional["nan"] = frame.nan.tolist()  # schema 1.7, known everywhere
    if frame.exp_hist is not None and (frame.exp_hist[:, 0] >= 0).all():
        off, cols, counts = _csr(frame.exp_hist)
        optional.update(exp_hist_offsets=off, exp_hist_columns=cols, exp_hist_counts=counts)
    if _all_known(frame.weight_sum_sq):
        optional["weight_sum_sq"] = frame.weight_sum_sq.tolist()  # type: ignore[union-attr]
        if _all_known(frame.update_sum_sq):
            optional["update_sum_sq"] = frame.update_sum_sq.tolist()  # type: ignore[union-attr]
        if _all_known(frame.weight_sum) and frame.weight_exp_hist is not None:
            off, cols, counts = _csr(frame.weight_exp_hist)
            optional.update(
                weight_sum=frame.weight_sum.tolist(),  # type: ignore[union-attr]
                weight_sum_cube=frame.weight_sum_cube.tolist(),  # type: ignore[union-attr]
                weight_sum_quad=frame.weight_sum_quad.tolist(),  # type: ignore[union-attr]
                weight_min=frame.weight_min.tolist(),  # type: ignore[union-attr]
                weight_max=frame.weight_max.tolist(),  # type: ignore[union-attr]
                weight_nonfinite=frame.weight_nonfinite.tolist(),  # type: ignore[union-attr]
                weight_exp_hist_offsets=off, weight_exp_hist_columns=cols,
                weight_exp_hist_counts=counts,
            )
    local = frame.local
    if local is not None and len(local):
        optional.update(
            local_ranks=local.rank.tolist(), local_layer_indices=local.layer_index.tolist(),
            local_numel=local.numel.tolist(), local_sum_abs=local.sum_abs.tolist(),
            local_sum_sq=local.sum_sq.tolist(), local_max_abs=local.max_abs.tolist(),
            local_nonfinite=local.nonfinite.tolist(),
        )
    ledger = frame.layout_violations[frame.layout_violations[:, 1] != VIOLATION_NUMEL]
    if len(ledger):
        optional["layout_violations"] = ledger.ravel().tolist()
    if frame.refused_ranks:
        optional["refused_ranks"] = sorted(frame.refused_ranks)
    ranks = sorted(frame.ranks_seen)
    return MergedFrame(
        run_id=frame.run_id, step=frame.step, rank=ranks[0], world_size=frame.world_size,
        wall_time=frame.wall_time, ranks_seen=ranks,
        layer_indices=frame.layer_index.tolist(), numel=frame.numel.tolist(),
        sum_sq=frame.sum_sq.tolist(), nonfinite=frame.nonfinite.tolist(), **optional,
    )


def encode_frame(frame: GradientFrame, wire_format: WireFormat = "binary") -> bytes:
    """The record value of ``frame`` on the frames topic: its MergedFrame
    (:func:`frame_to_message`) in the columnar binary form (default) or as JSON.

    Raises:
        schemas.wire.WireError: the encoded frame exceeds ``MAX_MESSAGE_BYTES``.
        pydantic.ValidationError: as :func:`frame_to_message`.
    """
    return encode_message(frame_to_message(frame), wire_format)


def message_to_merged(message: MergedFrame, num_layers: int) -> MergedShards:
    """The MergedShards of a MergedFrame over a run's ``num_layers`` layers: every
    statistic it carries (:meth:`consumer.frames.MergedShards.from_message`), zero in the
    layers it does not report."""
    return MergedShards.from_message(message, num_layers)


def message_violations(message: MergedFrame) -> np.ndarray:
    """int64[v, 5] layout-violation rows (layer_index, kind, rank, got, expected) a
    MergedFrame carries (schema 1.8; none for an older worker's frame)."""
    if message.layout_violations is None:
        return np.empty((0, 5), np.int64)
    return np.asarray(message.layout_violations, np.int64).reshape(-1, 5)
