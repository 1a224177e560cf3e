"""summarize() against a float64 reference, NaN/Inf handling, dtypes and errors."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from producer.summary import summarize


def _reference(g: np.ndarray) -> tuple[int, float, float, float, int]:
    x = np.asarray(g, dtype=np.float64).ravel()
    finite = x[np.isfinite(x)]
    return (
        x.size,
        float(sum(abs(v) for v in finite.tolist())),
        float(sum(v * v for v in finite.tolist())),
        float(max((abs(v) for v in finite.tolist()), default=0.0)),
        int(x.size - finite.size),
    )


def _check(g: np.ndarray) -> None:
    s = summarize({"layer": g})
    n, sabs, ssq, mabs, bad = _reference(g)
    assert s.numel[0] == n and s.nonfinite[0] == bad
    assert s.sum_abs[0] == pytest.approx(sabs, rel=1e-12, abs=1e-300)
    assert s.sum_sq[0] == pytest.approx(ssq, rel=1e-12, abs=1e-300)
    assert s.max_abs[0] == mabs


def test_nan_and_inf_counted_and_left_out():
    g = np.array([[1.0, -2.0], [np.nan, np.inf], [-np.inf, 0.5]], dtype=np.float32)
    s = summarize({"w": g})
    assert s.numel[0] == 6 and s.nonfinite[0] == 3
    assert s.sum_abs[0] == 3.5 and s.sum_sq[0] == 5.25 and s.max_abs[0] == 2.0


def test_all_nonfinite_layer():
    s = summarize({"w": np.full(5, np.nan, np.float16)})
    assert (s.sum_abs[0], s.sum_sq[0], s.max_abs[0], s.nonfinite[0]) == (0, 0, 0, 5)


def test_float16_accumulates_in_float64():
    g = np.full(70_000, 60_000.0, dtype=np.float16)  # float16 sums would overflow
    s = summarize({"w": g})
    value = float(np.float16(60_000.0))
    assert s.sum_abs[0] == pytest.approx(70_000 * value, rel=1e-12)
    assert s.sum_sq[0] == pytest.approx(70_000 * value * value, rel=1e-12)
    assert s.nonfinite[0] == 0


def test_float64_square_overflow_saturates_instead_of_inf():
    s = summarize({"w": np.array([1e200, 1e200])})
    assert np.isfinite(s.sum_sq[0]) and s.nonfinite[0] == 0 and s.max_abs[0] == 1e200


def test_order_and_shapes_preserved():
    grads = {"z": np.ones((2, 3, 4), np.float32), "a": np.ones(7, np.float64)}
    s = summarize(grads)
    assert s.names == ("z", "a") and s.numel.tolist() == [24, 7]


def test_errors_name_the_layer():
    with pytest.raises(TypeError, match="'ints'"):
        summarize({"ints": np.arange(3)})
    with pytest.raises(ValueError, match="'empty'"):
        summarize({"empty": np.zeros(0, np.float32)})
    with pytest.raises(ValueError, match="empty mapping"):
        summarize({})


@settings(max_examples=150, deadline=None)
@given(
    arrays(
        dtype=st.sampled_from([np.float16, np.float32, np.float64]),
        shape=st.integers(1, 300),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=16),
    )
)
def test_matches_reference(g):
    _check(g)
