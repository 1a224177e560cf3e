"""Weight statistics (producer.weights): power sums, extremes and histogram of the weights."""

import numpy as np
import pytest

from producer.summary import exp_hist_column
from producer.weights import weight_statistics


def test_moments_extremes_and_histogram_against_numpy():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 7)).astype(np.float32)
    w[0, :3] = 0.0
    b = np.array([np.nan, 2.0, -0.5, np.inf], np.float32)
    s = weight_statistics({"w": w, "b": b})
    x = w.astype(np.float64).ravel()
    assert s.sum[0] == pytest.approx(x.sum(), rel=1e-12)
    assert s.sum_cube[0] == pytest.approx((x ** 3).sum(), rel=1e-12)
    assert s.sum_quad[0] == pytest.approx((x ** 4).sum(), rel=1e-12)
    assert s.sum_sq[0] == pytest.approx((x ** 2).sum(), rel=1e-12)
    assert (s.min[0], s.max[0]) == (x.min(), x.max())
    assert s.exp_hist[0, 0] == 3 and s.exp_hist[0].sum() == x.size
    # NaN/Inf weights are counted and left out of every other statistic.
    assert s.nonfinite.tolist() == [0, 2]
    assert (s.sum[1], s.sum_cube[1], s.sum_quad[1]) == (1.5, 8.0 - 0.125, 16.0 + 0.0625)
    assert (s.min[1], s.max[1]) == (-0.5, 2.0)
    assert s.exp_hist[1, exp_hist_column(1)] == 1 and s.exp_hist[1].sum() == 2
    assert s.update_sum_sq is None


def test_update_norm_against_previous_copy():
    w0 = {"w": np.ones(5, np.float32)}
    w1 = {"w": np.full(5, 1.5, np.float32)}
    s = weight_statistics(w1, previous={"w": w0["w"].copy()})
    assert s.update_sum_sq.tolist() == [5 * 0.25]
    assert weight_statistics(w1, previous={"w": np.ones(4, np.float32)}).update_sum_sq is None


def test_all_nonfinite_layer_has_zero_extremes():
    s = weight_statistics({"w": np.array([np.nan, np.inf])})
    assert (s.min[0], s.max[0], s.sum[0], s.nonfinite[0]) == (0.0, 0.0, 0.0, 2)
