"""Training scalars on the wire (schema 1.12): step scalars and per-rank scalars, in the
dense form when every reported rank has every name and the long form otherwise; NaN and
+-Inf travel; what does not fit the message's ranks is refused; a split summary carries
them once."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from pydantic import ValidationError

from schemas.scalars import RankScalars
from schemas.wire import (
    StepSummary,
    decode_message,
    encode_message,
    ranges_to_ranks,
    rank_scalar_fields,
    split_step_summary,
)

W = 8


def summary(**fields: object) -> StepSummary:
    return StepSummary(run_id="r", step=3, rank=0, world_size=W, wall_time=time.time(),
                       layer_indices=[0, 1], numel=[4, 4], sum_sq=[1.0, 2.0],
                       nonfinite=[0, 0], **fields)


def rows(ranks: list[int], names: tuple[str, ...], values: list[float]) -> RankScalars:
    k = len(names)
    return RankScalars(names, np.repeat(ranks, k), np.tile(np.arange(k), len(ranks)),
                       np.asarray(values, np.float64))


@pytest.mark.parametrize("wire_format", ["binary", "json"])
def test_dense_form_when_every_reported_rank_has_every_name(wire_format: str) -> None:
    every = rows(list(range(W)), ("loss", "compute_time_s"),
                 [v for r in range(W) for v in (math.nan if r == 5 else 1.0 + r, 0.1 * r)])
    fields = rank_scalar_fields(every, np.arange(W))
    assert "rank_scalar_ranks" not in fields  # dense: 8 bytes a value
    message = summary(reduced_ranks=[0, W], scalars={"lr": 0.1, "loss_scale": math.inf},
                      **fields)
    back = decode_message(encode_message(message, wire_format))
    assert back.scalars == {"lr": 0.1, "loss_scale": math.inf}
    got = back.rank_scalar_rows()
    assert got.names == ("loss", "compute_time_s")
    ranks, losses = got.values_of("loss")
    assert ranks.tolist() == list(range(W)) and math.isnan(losses[5])
    assert losses[[0, 7]].tolist() == [1.0, 8.0]


@pytest.mark.parametrize("wire_format", ["binary", "json"])
def test_long_form_when_some_rank_lacks_a_name(wire_format: str) -> None:
    some = RankScalars(("loss", "compute_time_s"), np.array([7, 0, 7]), np.array([0, 1, 1]),
                       np.array([-math.inf, 0.2, 0.3]))  # the loss only on the last stage
    fields = rank_scalar_fields(some, np.arange(W))
    assert fields["rank_scalar_ranks"] == [7, 0, 7]
    back = decode_message(encode_message(summary(reduced_ranks=[0, W], **fields), wire_format))
    assert back.rank_scalar_rows().values_of("loss")[1].tolist() == [-math.inf]
    assert back.rank_scalar_rows().values_of("compute_time_s")[0].tolist() == [0, 7]


def test_a_rank_reports_only_its_own_scalars() -> None:
    own = rows([0], ("loss",), [2.5])
    assert summary(**rank_scalar_fields(own, np.array([0]))).rank_scalar_rows() is not None
    with pytest.raises(ValidationError, match="ranks this message reports for"):
        summary(rank_scalar_names=["loss"], rank_scalar_ranks=[3], rank_scalar_index=[0],
                rank_scalar_values=[1.0])
    with pytest.raises(ValueError, match="does not report for"):
        rank_scalar_fields(rows([3], ("loss",), [1.0]), np.array([0]))


@pytest.mark.parametrize("fields,error", [
    ({"rank_scalar_names": ["loss"]}, "go together"),
    ({"rank_scalar_names": ["loss"], "rank_scalar_values": [1.0], "rank_scalar_ranks": [0]},
     "go together"),
    ({"rank_scalar_names": ["loss"], "rank_scalar_values": [1.0, 2.0]}, "1 x 1 values"),
    ({"rank_scalar_names": ["loss", "loss"], "rank_scalar_values": [1.0, 2.0]}, "unique"),
    ({"rank_scalar_names": ["bad name"], "rank_scalar_values": [1.0]}, "should match pattern"),
    ({"rank_scalar_names": ["loss"], "rank_scalar_ranks": [0, 0],
      "rank_scalar_index": [0, 0], "rank_scalar_values": [1.0, 2.0]}, "at most once"),
    ({"scalars": {"not ok": 1.0}}, "scalars"),
])
def test_what_does_not_fit_is_refused(fields: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        summary(**fields)


def test_split_summary_carries_the_scalars_in_its_first_part_only() -> None:
    message = summary(scalars={"lr": 0.1}, **rank_scalar_fields(rows([0], ("loss",), [2.0]),
                                                               np.array([0])))
    first, second = split_step_summary(message, [(0, 1), (1, 2)])
    assert first.scalars == {"lr": 0.1} and first.rank_scalar_rows() is not None
    assert second.scalars is None and second.rank_scalar_rows() is None


def test_ranges_to_ranks() -> None:
    assert ranges_to_ranks(np.array([0, 3, 6, 8])).tolist() == [0, 1, 2, 6, 7]
