"""Power sums (schemas.stats.power_sums): the moments against SciPy."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.stats import (
    PowerSums,
)


def test_moments_match_scipy() -> None:
    from scipy import stats as sps

    rng = np.random.default_rng(2)
    x = rng.gamma(2.0, 0.1, 5000) - 0.1
    got = PowerSums.empty(1).update(x).get()
    assert got["mean"][0] == pytest.approx(x.mean(), rel=1e-12)
    assert got["std_dev"][0] == pytest.approx(x.std(), rel=1e-9)
    assert got["skewness"][0] == pytest.approx(sps.skew(x), rel=1e-8)
    assert got["kurtosis"][0] == pytest.approx(sps.kurtosis(x), rel=1e-8)
    edge = PowerSums.empty(3).update(np.array([1.0, 2.0, 7.0, 7.0]), np.array([0, 0, 1, 1]))
    out = edge.get()
    assert out["skewness"].tolist()[:2] == [0.0, 0.0]  # n < 3, std = 0
    assert np.isnan(out["mean"][2]) and np.isnan(out["min"][2])
