"""schemas.wire_batch: decoding a poll's records together gives, record by record, what
decoding each alone gives: the same message, or the same refusal with the same reason."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.wire import (
    RunStarted,
    StepSummary,
    WireError,
    encode_binary,
    encode_message,
)
from schemas.wire_batch import decode_messages, decode_one

LAYERS = 4

BREAKS = (
    None, "negative_sum_sq", "nan_sum_abs", "inf_max_abs", "zero_numel", "descending_layers",
    "repeated_layers", "nonfinite_over_numel", "nan_over_nonfinite", "shard_index_over_count",
    "shard_count_over_world", "rank_over_world", "dup_scalar_names", "part_index_only",
    "negative_layer",
)
"""How one message of a batch is broken (None: left valid)."""


def _fields(step: int, rank: int, brk: str | None, scalars: bool, nan: bool) -> dict:
    layers = [0, 1, 2, 3]
    numel = [10, 20, 30, 40]
    fields: dict = dict(
        run_id="run", step=step, rank=rank, world_size=4, wall_time=1.0 + step,
        layer_indices=layers, numel=numel, sum_abs=[1.0, 2.0, 3.0, 4.0],
        sum_sq=[0.5, 1.5, 2.5, 3.5], max_abs=[0.1, 0.2, 0.3, 0.4], nonfinite=[0, 1, 0, 0],
        shard_index=[0, 0, 0, 0], shard_count=[1, 1, 1, 1],
    )
    if nan:
        fields["nan"] = [0, 1, 0, 0]
    if scalars:
        fields.update(scalars={"lr": 1e-3}, rank_scalar_names=["loss", "step_time_s"],
                      rank_scalar_values=[2.5 + step, math.nan])
    edits = {
        "negative_sum_sq": {"sum_sq": [0.5, -1.0, 2.5, 3.5]},
        "nan_sum_abs": {"sum_abs": [1.0, math.nan, 3.0, 4.0]},
        "inf_max_abs": {"max_abs": [0.1, 0.2, math.inf, 0.4]},
        "zero_numel": {"numel": [10, 0, 30, 40]},
        "descending_layers": {"layer_indices": [3, 2, 1, 0]},
        "repeated_layers": {"layer_indices": [0, 1, 1, 3]},
        "nonfinite_over_numel": {"nonfinite": [0, 21, 0, 0]},
        "nan_over_nonfinite": {"nan": [1, 1, 0, 0]} if nan else {"nonfinite": [0, 0, 0, 99]},
        "shard_index_over_count": {"shard_index": [0, 1, 0, 0]},
        "shard_count_over_world": {"shard_count": [1, 1, 5, 1], "shard_index": [0, 0, 4, 0]},
        "rank_over_world": {"rank": 4},
        "dup_scalar_names": ({"rank_scalar_names": ["loss", "loss"]} if scalars
                             else {"part_index": 2, "part_count": 2}),
        "part_index_only": {"part_index": 0},
        "negative_layer": {"layer_indices": [-1, 1, 2, 3]},
    }
    fields.update(edits.get(brk, {}))  # type: ignore[arg-type]
    return fields


def _same(batch: object, alone: object) -> bool:
    if isinstance(alone, WireError):
        return isinstance(batch, WireError) and batch.reason == alone.reason
    # the same values field by field (NaN included): the same bytes when encoded again
    return (type(batch) is type(alone)
            and encode_message(batch, "binary") == encode_message(alone, "binary"))  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(breaks=st.lists(st.sampled_from(BREAKS), min_size=1, max_size=12),
       scalars=st.booleans(), nan=st.booleans(), extra=st.booleans())
def test_a_batch_decodes_record_by_record_as_each_record_alone(
        breaks: list[str | None], scalars: bool, nan: bool, extra: bool) -> None:
    """Random batches of same-shaped binary summaries, some broken in one rule each, with
    a JSON summary, a RunStarted and an undecodable record among them when ``extra``."""
    raws: list[bytes] = [
        encode_binary(StepSummary.model_construct(**_fields(i, i % 4, brk, scalars, nan)))
        for i, brk in enumerate(breaks)]
    if extra:
        raws.insert(0, encode_message(RunStarted(
            run_id="run", rank=0, world_size=4, layer_names=["a", "b", "c", "d"],
            numel=[10, 20, 30, 40], host="h", start_time=0.0), "json"))
        raws.append(encode_message(StepSummary(**_fields(50, 1, None, scalars, nan)), "json"))
        raws.append(b"\x00not a message")
    batch = decode_messages(raws)
    alone = [decode_one(raw) for raw in raws]
    assert len(batch) == len(raws)
    for got, want in zip(batch, alone, strict=True):
        assert _same(got, want), (got, want)


def test_valid_summaries_of_one_shape_come_back_with_read_only_arrays() -> None:
    """Every message of a valid batch decodes, its arrays are read-only and hold its own
    values; a refused one in the middle does not disturb its neighbours."""
    raws = [encode_binary(StepSummary(**_fields(i, i % 4, None, True, True))) for i in range(5)]
    raws[2] = encode_binary(StepSummary.model_construct(
        **_fields(2, 2, "nonfinite_over_numel", True, True)))
    out = decode_messages(raws)
    assert isinstance(out[2], WireError) and "nonfinite[1]=21 exceeds numel[1]=20" in out[2].reason
    for i in (0, 1, 3, 4):
        message = out[i]
        assert isinstance(message, StepSummary)
        assert message.step == i and message.rank == i % 4
        assert isinstance(message.sum_sq, np.ndarray) and not message.sum_sq.flags.writeable
        assert np.asarray(message.rank_scalar_values)[0] == 2.5 + i
        assert _same(message, StepSummary(**_fields(i, i % 4, None, True, True)))
