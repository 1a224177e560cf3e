"""Message encoding: a recorded step as a ``StepSummary``, and a message as record values
that each fit the cluster's size limit."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from producer.flight_recorder import LocalEntry
from producer.summary import LayerSummaries
from producer.weights import WeightSummaries
from schemas.scalars import RankScalars
from schemas.stats import csr_from_dense
from schemas.wire import (
    LocalSummary,
    LocalTrigger,
    RunFinished,
    RunStarted,
    StepSummary,
    encode_message,
    ranges_to_ranks,
    rank_scalar_fields,
    split_step_summary,
)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One recorded step, as the training thread leaves it for the sender thread.

    Attributes:
        step: optimiser step, >= 0.
        wall_time: seconds since the epoch when it was recorded.
        layer_indices: int64[k], each summarised layer's ``layer_index`` (its position in
            the run's layer list).
        summaries: the k layers' gradient statistics (with layout and local view, if any).
        weights: the k layers' weight statistics, or None.
        scalars: the step's step scalars (name -> value), or None.
        rank_scalars: per-rank scalars of the ranks the summary reports for, or None.
    """

    step: int
    wall_time: float
    layer_indices: np.ndarray
    summaries: LayerSummaries
    weights: WeightSummaries | None
    scalars: dict[str, float] | None = None
    rank_scalars: RankScalars | None = None


def step_summary(
    record: StepRecord, *, run_id: str, rank: int, world_size: int,
    layer_index: Mapping[str, int],
) -> StepSummary:
    """The ``StepSummary`` message of one recorded step.

    Args:
        record: the step.
        run_id, rank, world_size: the sending rank.
        layer_index: layer name -> ``layer_index`` of the run's watched layers; the local
            view keeps only these layers.

    Returns:
        The message (optional fields set only when the record has them; ``nan`` only when
        some layer has a non-finite element).
    """
    summaries = record.summaries
    optional: dict[str, Any] = {}
    if summaries.exp_hist is not None:
        optional.update(_sparse_histogram("exp_hist", summaries.exp_hist))
    extra = record.weights
    if extra is not None:
        optional.update(
            weight_sum_sq=extra.sum_sq.tolist(), weight_sum=extra.sum.tolist(),
            weight_sum_cube=extra.sum_cube.tolist(), weight_sum_quad=extra.sum_quad.tolist(),
            weight_min=extra.min.tolist(), weight_max=extra.max.tolist(),
            weight_nonfinite=extra.nonfinite.tolist(),
            **_sparse_histogram("weight_exp_hist", extra.exp_hist),
        )
        if extra.update_sum_sq is not None:
            optional["update_sum_sq"] = extra.update_sum_sq.tolist()
    if summaries.nan is not None and summaries.nonfinite.any():
        # Without the field a layer with nonfinite = 0 has no NaN either.
        optional["nan"] = summaries.nan.tolist()
    if summaries.shard_index is not None and summaries.shard_count is not None:
        optional.update(shard_index=summaries.shard_index.tolist(),
                        shard_count=summaries.shard_count.tolist())
    if summaries.reduced_ranks is not None:
        optional["reduced_ranks"] = summaries.reduced_ranks.tolist()
        divergence = summaries.replica_divergence
        if divergence is not None and len(divergence):
            optional["replica_divergence"] = np.asarray(divergence, np.int64).ravel().tolist()
    if record.scalars:
        optional["scalars"] = record.scalars
    if record.rank_scalars is not None and len(record.rank_scalars):
        reporting = (np.array([rank], np.int64) if summaries.reduced_ranks is None
                     else ranges_to_ranks(summaries.reduced_ranks))
        optional.update(rank_scalar_fields(record.rank_scalars, reporting))
    local = summaries.local
    if local is not None:
        keep = [i for i, n in enumerate(local.names) if n in layer_index]
        if keep:
            sel = np.asarray(keep, np.int64)
            assert local.sum_abs is not None and local.max_abs is not None
            optional.update(
                local_layer_indices=[layer_index[local.names[i]] for i in keep],
                local_numel=local.numel[sel].tolist(),
                local_sum_abs=local.sum_abs[sel].tolist(),
                local_sum_sq=local.sum_sq[sel].tolist(),
                local_max_abs=local.max_abs[sel].tolist(),
                local_nonfinite=local.nonfinite[sel].tolist(),
            )
    return StepSummary(
        run_id=run_id,
        step=record.step,
        rank=rank,
        world_size=world_size,
        wall_time=record.wall_time,
        layer_indices=record.layer_indices.tolist(),
        numel=summaries.numel.tolist(),
        sum_abs=None if summaries.sum_abs is None else summaries.sum_abs.tolist(),
        sum_sq=summaries.sum_sq.tolist(),
        max_abs=None if summaries.max_abs is None else summaries.max_abs.tolist(),
        nonfinite=summaries.nonfinite.tolist(),
        **optional,
    )


@dataclass(frozen=True, slots=True)
class LocalRecord:
    """One local-view entry to send as a ``LocalSummary`` (built on the sender thread).

    Attributes:
        entry: the rank's local view of one step (:class:`producer.flight_recorder.LocalEntry`).
        trigger: why it is sent (``schemas.wire.LocalTrigger``, or ``"every_step"``).
        trigger_step: the step at which the trigger fired (>= ``entry.step``).
    """

    entry: LocalEntry
    trigger: LocalTrigger
    trigger_step: int


def local_summary(record: LocalRecord, *, run_id: str, rank: int,
                  world_size: int) -> LocalSummary:
    """The ``LocalSummary`` message of one local-view entry.

    Raises:
        pydantic.ValidationError: the entry breaks the wire's rules (a bug upstream).
    """
    e = record.entry
    return LocalSummary(
        run_id=run_id, step=e.step, rank=rank, world_size=world_size, wall_time=e.wall_time,
        trigger=record.trigger, trigger_step=record.trigger_step,
        local_layer_indices=e.layer_indices.tolist(), local_numel=e.numel.tolist(),
        local_sum_abs=e.sum_abs.tolist(), local_sum_sq=e.sum_sq.tolist(),
        local_max_abs=e.max_abs.tolist(), local_nonfinite=e.nonfinite.tolist(),
    )


_LOCAL_ARRAYS = ("local_layer_indices", "local_numel", "local_sum_abs", "local_sum_sq",
                 "local_max_abs", "local_nonfinite")


class EncodedMessage(NamedTuple):
    """The record values of one message.

    Attributes:
        values: the encoded records, each at most the limit (a StepSummary too large
            for one record becomes several, each holding a disjoint layer range).
        oversized_layers: ``layer_index`` of each layer left out because its statistics
            alone exceed the limit.
    """

    values: list[bytes]
    oversized_layers: list[int]


def encode_within(
    message: StepSummary | RunStarted | RunFinished | LocalSummary,
    wire_format: Literal["binary", "json"],
    limit: int | None,
) -> EncodedMessage:
    """Encode ``message`` (:func:`schemas.wire.encode_message`) into record values of at
    most ``limit`` bytes.

    A StepSummary over the limit is cut into ``ceil(size / (0.9 limit))`` layer ranges
    (:func:`schemas.wire.split_step_summary`); a range whose part is still too large is
    halved until every part fits; a single layer that alone does not fit is left out. A
    LocalSummary over the limit is cut the same way, by halving its layer ranges. Other
    messages, and any message when ``limit`` is None, are one value.

    Args:
        message: the message.
        wire_format: ``"binary"`` or ``"json"`` (StepSummary only; the others are JSON).
        limit: the largest record value in bytes, or None (not known yet).

    Returns:
        The :class:`EncodedMessage`.
    """
    value = encode_message(message, wire_format)
    if limit is None or len(value) <= limit:
        return EncodedMessage([value], [])
    if isinstance(message, LocalSummary):
        return _local_within(message, limit)
    if not isinstance(message, StepSummary):
        return EncodedMessage([value], [])
    n = len(message.layer_indices)
    k = min(n, -(-len(value) // max(int(limit * 0.9), 1)))
    edges = np.linspace(0, n, k + 1).astype(int).tolist()
    values, dropped = _halve_to_fit(
        [(a, b) for a, b in itertools.pairwise(edges) if b > a],
        lambda bounds: [encode_message(part, wire_format)
                        for part in split_step_summary(message, bounds)], limit)
    return EncodedMessage(values, [message.layer_indices[a] for a in dropped])


def _local_within(message: LocalSummary, limit: int) -> EncodedMessage:
    """A LocalSummary over ``limit`` bytes as several, each holding a disjoint range of its
    layers (every one a valid LocalSummary of the same step; the store keys local rows by
    layer), halving a range until it fits; a single layer that alone does not fit is left
    out (``oversized_layers``)."""
    arrays = {name: getattr(message, name) for name in _LOCAL_ARRAYS}
    values, dropped = _halve_to_fit(
        [(0, len(message.local_layer_indices))],
        lambda bounds: [encode_message(message.model_copy(
            update={k: v[a:b] for k, v in arrays.items()})) for a, b in bounds], limit)
    return EncodedMessage(values, [int(message.local_layer_indices[a]) for a in dropped])


def _halve_to_fit(
    bounds: list[tuple[int, int]],
    encode: Callable[[list[tuple[int, int]]], list[bytes]], limit: int,
) -> tuple[list[bytes], list[int]]:
    """Encode the layer ranges ``bounds`` (``encode(bounds)``: one value per range, in
    order), halving every range whose value is over ``limit`` bytes until all fit.

    Returns:
        (the values, the start of each single-layer range that alone does not fit and is
        left out).
    """
    dropped: list[int] = []
    while True:
        values = encode(bounds) if bounds else []
        over = {i for i, v in enumerate(values) if len(v) > limit}
        if not over:
            return values, dropped
        refined: list[tuple[int, int]] = []
        for i, (a, b) in enumerate(bounds):
            if i not in over:
                refined.append((a, b))
            elif b - a > 1:
                mid = (a + b) // 2
                refined.extend([(a, mid), (mid, b)])
            else:
                dropped.append(a)
        bounds = refined


def _sparse_histogram(prefix: str, hist: np.ndarray) -> dict[str, list[int]]:
    """CSR wire form (``<prefix>_offsets/_columns/_counts``) of an int64[k, B] histogram
    (:func:`schemas.stats.csr_from_dense`)."""
    offsets, columns, counts = csr_from_dense(hist)
    return {
        f"{prefix}_offsets": offsets.tolist(), f"{prefix}_columns": columns.tolist(),
        f"{prefix}_counts": counts.tolist(),
    }
