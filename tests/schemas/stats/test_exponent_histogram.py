"""Exponent histogram (schemas.stats.exponent_histogram): binning by exact exponent and
the sparse merge."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import schemas.stats
from schemas.stats import (
    ExponentHistogram,
    exp_hist_column,
)
from tests.schemas.stats.samples import assert_same, samples


@settings(max_examples=60, deadline=None)
@given(sample=samples())
def test_sparse_histogram_merge_equals_the_dense_one(sample) -> None:
    num_layers, x, layer, _ = sample
    part = ExponentHistogram.empty(num_layers).update(x, layer)
    at = np.arange(num_layers)[::-1] * 2
    dense = ExponentHistogram.empty(2 * num_layers).merge_at(at, part)
    sparse = ExponentHistogram.empty(2 * num_layers)
    assert sparse.merge_columns(at, **part.to_columns()) is sparse
    assert_same(sparse, dense)
    with pytest.raises(ValueError, match="one row per layer"):
        sparse.merge_columns(at[:-1], **part.to_columns())


def test_histogram_bins_by_exact_exponent_in_every_dtype() -> None:
    x = np.array([0.0, -0.0, 1.0, -1.5, 2.0**-140, 2.0**-134, 2.0**30, np.nan, -np.inf])
    for dtype in (np.float16, np.float32, np.float64):
        with np.errstate(over="ignore", under="ignore"):
            v = x.astype(dtype)
        h = ExponentHistogram.empty(1).update(v)
        expected = np.zeros(schemas.stats.EXP_HIST_BINS, np.int64)
        for value in v.astype(np.float64):
            if np.isfinite(value):
                col = 0 if value == 0 else exp_hist_column(np.frexp(abs(value))[1] - 1)
                expected[col] += 1
        np.testing.assert_array_equal(h.counts[0], expected, err_msg=str(dtype))
        assert h.nonfinite[0] == int((~np.isfinite(v)).sum())
