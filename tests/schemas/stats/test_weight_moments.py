"""Weight moments (schemas.stats.weight_moments): per-copy and pooled readings, and
consistency of the parts."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.stats import (
    ExponentHistogram,
    PowerSums,
    WeightMoments,
)


def test_weight_moments_per_copy_and_pooled_for_the_analysis() -> None:
    """A replicated layer (R identical copies merged) reads as one copy; pooling the
    layers gives the statistics of all the weights together."""
    rng = np.random.default_rng(8)
    w0, w1 = rng.standard_normal(100), np.concatenate([np.zeros(5), rng.standard_normal(50)])
    one = WeightMoments.empty(2).update(w0, 0).update(w1, 1)
    three = WeightMoments.empty(2)
    for _ in range(3):
        three.update(w0, 0)
    three.update(w1, 1)
    copies = np.array([3.0, 1.0])
    got, want = three.per_copy(copies).get(), one.get()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)
    pooled = one.pooled().get()
    everything = WeightMoments.empty(1).update(np.concatenate([w0, w1])).get()
    for key in everything:
        np.testing.assert_allclose(pooled[key], everything[key], rtol=1e-12, err_msg=key)
    assert pooled["zero_fraction"][0] == pytest.approx(5 / 155)


def test_weight_moments_reject_parts_that_disagree() -> None:
    hist = ExponentHistogram.empty(1).update(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="disagree"):
        WeightMoments(PowerSums.empty(1).update(np.array([1.0])), hist)
    with pytest.raises(ValueError, match="same layers"):
        WeightMoments(PowerSums.empty(2), hist)
