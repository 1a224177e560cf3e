"""Gradient sums (schemas.stats.gradient_sums): frame fields, norms mode, NaN / Inf counts."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.stats import (
    GradientSums,
)


def test_gradient_sums_frame_fields_and_norms_mode() -> None:
    full = GradientSums.empty(1).update(np.array([3.0, -4.0, np.nan]))
    norms = GradientSums.from_columns([2], None, [2.0], None, [0])
    got = full.get()
    assert (got["numel"][0], got["nonfinite"][0], got["max_abs"][0]) == (3, 1, 4.0)
    assert (got["mean_abs"][0], got["norm"][0]) == (7.0 / 3.0, 5.0)
    mixed = (full + norms).get()
    assert np.isnan(mixed["sum_abs"][0]) and np.isnan(mixed["max_abs"][0])
    assert np.isnan(mixed["mean_abs"][0]) and mixed["rms"][0] == pytest.approx(np.sqrt(27 / 5))


def test_nan_and_inf_are_counted_apart() -> None:
    """``nan`` counts the NaN elements among ``nonfinite`` (the sign of an Inf does not
    matter), by both update paths; the split is known only where every piece gave it."""
    x = np.array([np.nan, np.inf, -np.inf, 1.0, -np.nan, 2.0])
    one = GradientSums.empty(1).update(x, 0)
    assert (one.nonfinite.tolist(), one.nan.tolist()) == ([4], [2])
    per_element = GradientSums.empty(2).update(x, np.array([0, 0, 1, 1, 1, 0]))
    assert per_element.nonfinite.tolist() == [2, 2]
    assert per_element.nan.tolist() == [1, 1] and per_element.has_nan().all()
    assert GradientSums.from_layers([x, x[:2]]).nan.tolist() == [2, 1]
    unknown = GradientSums.from_columns([3], [1.0], [1.0], [1.0], [1], [np.nan])
    assert not unknown.has_nan()[0]
    assert not (one + GradientSums.from_columns([6], [1.0], [1.0], [1.0], [1])).has_nan()[0]


def _merged_both_ways(prior: GradientSums, layers: np.ndarray, message: object
                      ) -> tuple[GradientSums, GradientSums]:
    """``prior`` with ``message`` merged by ``merge_message_at`` and by the general path
    (``merge_at`` of ``from_message``), each into its own copy."""
    fused = GradientSums.empty(prior.num_layers).merge_at(np.arange(prior.num_layers), prior)
    general = GradientSums.empty(prior.num_layers).merge_at(np.arange(prior.num_layers), prior)
    fused.merge_message_at(layers, message)
    general.merge_at(layers, GradientSums.from_message(message))
    return fused, general


@pytest.mark.parametrize("layers", [[4, 5, 6, 7], [7, 2, 0, 5], [0, 1, 2, 3]])
@pytest.mark.parametrize("case", ["finite", "nonfinite", "nan_count", "norms", "unknown", "inf"])
def test_merge_message_at_equals_the_general_merge(layers: list[int], case: str) -> None:
    """The fused merge of a message (a consecutive range: slices; any other order: a
    gather) gives bit for bit what ``merge_at(from_message(...))`` gives, for the common
    finite full-mode message and every case it hands to the general path (NaN counts,
    norms mode, unknown (NaN) sums), and with an overflowed (+inf) sum."""
    from schemas.wire import StepSummary

    rng = np.random.default_rng(len(layers) + len(case))
    prior = GradientSums.from_columns(
        rng.integers(1, 100, 8), rng.random(8), rng.random(8), rng.random(8),
        rng.integers(0, 2, 8), rng.integers(0, 2, 8))
    k = len(layers)
    fields = dict(run_id="r", step=0, rank=0, world_size=1, wall_time=0.0,
                  layer_indices=np.array(layers), numel=rng.integers(5, 50, k),
                  sum_abs=rng.random(k) * 10, sum_sq=rng.random(k), max_abs=rng.random(k),
                  nonfinite=np.zeros(k, np.int64))
    if case in ("nonfinite", "nan_count"):
        fields["nonfinite"] = np.array([0, 2, 0, 1][:k])
    if case == "nan_count":
        fields["nan"] = np.array([0, 1, 0, 1][:k])
    if case == "norms":
        fields["sum_abs"] = fields["max_abs"] = None
    if case == "unknown":  # not a valid wire message: as a stored frame's NULLs
        fields["sum_abs"] = np.array([1.0, np.nan, 2.0, 3.0])
    if case == "inf":
        fields["sum_sq"] = np.array([np.inf, 1.0, 2.0, 3.0])
        prior.sum_abs[layers[0]] = np.finfo(np.float64).max
        fields["sum_abs"] = np.array([np.finfo(np.float64).max, 1.0, 1.0, 1.0])
    message = StepSummary.model_construct(**fields)
    fused, general = _merged_both_ways(prior, np.array(layers), message)
    for name, _, mine in fused._fields():
        theirs = getattr(general, name)
        assert mine.dtype == theirs.dtype and np.array_equal(mine, theirs, equal_nan=True), name
