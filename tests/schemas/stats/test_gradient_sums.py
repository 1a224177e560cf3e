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
