"""Weight summaries (producer.weights): power sums, extremes and histogram of the weights."""

import numpy as np
import pytest

from producer.weights import summarize_weights
from schemas.stats import exp_hist_column


def test_moments_extremes_and_histogram_against_numpy():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 7)).astype(np.float32)
    w[0, :3] = 0.0
    b = np.array([np.nan, 2.0, -0.5, np.inf], np.float32)
    s = summarize_weights({"w": w, "b": b})
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
    s = summarize_weights(w1, previous={"w": w0["w"].copy()})
    assert s.update_sum_sq.tolist() == [5 * 0.25]
    assert summarize_weights(w1, previous={"w": np.ones(4, np.float32)}).update_sum_sq is None


def test_all_nonfinite_layer_has_zero_extremes():
    s = summarize_weights({"w": np.array([np.nan, np.inf])})
    assert (s.min[0], s.max[0], s.sum[0], s.nonfinite[0]) == (0.0, 0.0, 0.0, 2)


def test_parts_agree_with_the_mergeable_statistics():
    """The fused histogram pass and the NumPy power sums describe the same weights:
    WeightMoments.update over the raw weights gives the same state."""
    from schemas.stats import WeightMoments

    rng = np.random.default_rng(5)
    w = {"a": rng.standard_normal(1000).astype(np.float32),
         "b": np.array([0.0, np.nan, 3.0, -np.inf, 1e-30], np.float32)}
    s = summarize_weights(w)
    ref = WeightMoments.empty(2)
    for i, x in enumerate(w.values()):
        ref.update(x, i)
    got, want = s.moments.state(), ref.state()
    for key in s.moments.exact_fields():
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    for key in set(got) - s.moments.exact_fields():
        np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)
