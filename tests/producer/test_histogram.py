"""Exponent histogram: bin placement, zeros, subnormals, merge across ranks, underflow.

Every test runs on both backends: the numba kernels (numba is a dependency: a missing numba
fails, never skips) and the pure-NumPy fallback.
"""

import math
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from producer.backend import set_backend
from producer.histogram import FLOAT_FORMATS, exp_hist_edges, underflow_fraction
from producer.summary import summarize
from schemas.stats import exp_hist_column
from schemas.wire import EXP_HIST_BINS, EXP_HIST_MAX, EXP_HIST_MIN

B = EXP_HIST_BINS
FLOATS = [np.float16, np.float32, np.float64]


@pytest.fixture(autouse=True, params=["numba", "numpy"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the given backend, then go back to the default."""
    assert set_backend(request.param) == request.param
    yield request.param
    set_backend(None)


def hist(g: np.ndarray) -> np.ndarray:
    """Exponent histogram (int64[B]) of one array, through summarize()."""
    s = summarize({"g": g}, histogram=True)
    assert s.exp_hist is not None and s.exp_hist.shape == (1, B)
    assert s.exp_hist.dtype == np.int64
    return s.exp_hist[0]


def reference_hist(g: np.ndarray) -> np.ndarray:
    """Pure-Python reference: column of each finite element from math.frexp."""
    counts = np.zeros(B, np.int64)
    for v in np.asarray(g, dtype=np.float64).ravel().tolist():
        if not math.isfinite(v):
            continue
        if v == 0:
            counts[0] += 1
        else:
            k = math.frexp(abs(v))[1] - 1  # |v| in [2^k, 2^(k+1))
            counts[min(max(k - EXP_HIST_MIN + 2, 1), B - 1)] += 1
    return counts


def only(col: int) -> np.ndarray:
    expected = np.zeros(B, np.int64)
    expected[col] = 1
    return expected


def test_layout_constants_and_columns():
    assert (EXP_HIST_MIN, EXP_HIST_MAX, B) == (-134, 24, 161)
    assert exp_hist_column(EXP_HIST_MIN) == 2
    assert exp_hist_column(EXP_HIST_MIN - 1) == 1
    assert exp_hist_column(-1074) == 1
    assert exp_hist_column(EXP_HIST_MAX - 1) == B - 2
    assert exp_hist_column(EXP_HIST_MAX) == B - 1
    assert exp_hist_column(1023) == B - 1
    assert exp_hist_column(0) == 136  # [1, 2)
    np.testing.assert_array_equal(exp_hist_column(np.array([-200, 0, 200])), [1, 136, B - 1])


def test_edges_describe_the_columns():
    lower, upper = exp_hist_edges()
    assert lower.shape == upper.shape == (B,)
    assert (lower[0], upper[0]) == (0.0, 0.0)
    assert (lower[1], upper[1]) == (0.0, 2.0**EXP_HIST_MIN)
    assert (lower[2], upper[2]) == (2.0**EXP_HIST_MIN, 2.0 ** (EXP_HIST_MIN + 1))
    assert (lower[-1], upper[-1]) == (2.0**EXP_HIST_MAX, math.inf)
    assert np.all(upper[1:-1] == lower[2:])  # contiguous, no gaps
    rng = np.random.default_rng(5)
    values = np.exp2(rng.uniform(-150, 40, 2000))
    cols = exp_hist_column(np.frexp(values)[1] - 1)
    assert np.all((lower[cols] <= values) & (values < upper[cols]))


@pytest.mark.parametrize(
    ("dtype", "kmin", "kmax"),
    [
        (np.float64, EXP_HIST_MIN - 4, EXP_HIST_MAX + 4),
        (np.float32, -149, 127),  # down to the smallest float32 subnormal
        (np.float16, -24, 15),  # smallest fp16 subnormal .. largest binade
    ],
)
def test_exact_powers_of_two_and_their_neighbours(dtype, kmin, kmax):
    for k in range(kmin, kmax + 1):
        p = np.array([2.0**k], dtype=dtype)
        assert p[0] == 2.0**k
        np.testing.assert_array_equal(hist(p), only(exp_hist_column(k)), err_msg=f"2^{k}")
        np.testing.assert_array_equal(hist(-p), only(exp_hist_column(k)), err_msg=f"-2^{k}")
        below = np.nextafter(p, dtype(0))  # largest value below 2^k
        if below[0] != 0:
            np.testing.assert_array_equal(
                hist(below), only(exp_hist_column(k - 1)), err_msg=f"just below 2^{k}"
            )


def test_zeros_counted_in_column_zero():
    for dtype in FLOATS:
        g = np.array([0.0, -0.0, 0.0, 1.0], dtype=dtype)
        expected = only(exp_hist_column(0))
        expected[0] = 3
        np.testing.assert_array_equal(hist(g), expected)


def test_subnormals_are_binned_by_their_true_exponent():
    f32 = np.array([1e-45, 2.0**-140, 1.5 * 2.0**-130, 2.0**-127, -(2.0**-133)], np.float32)
    expected = np.zeros(B, np.int64)
    for k in (-149, -140, -130, -127, -133):
        expected[exp_hist_column(k)] += 1
    np.testing.assert_array_equal(hist(f32), expected)
    assert expected[1] == 2  # 2^-149 and 2^-140 land in the underflow column
    f16 = np.array([2.0**-24, 3 * 2.0**-24, 2.0**-15, 1023 * 2.0**-24], np.float16)
    expected = np.zeros(B, np.int64)
    for k in (-24, -23, -15, -15):
        expected[exp_hist_column(k)] += 1
    np.testing.assert_array_equal(hist(f16), expected)
    f64 = np.array([5e-324, 2.0**-1030, 2.0**-135], np.float64)
    np.testing.assert_array_equal(hist(f64), 3 * only(1))


def test_zeros_and_subnormals_mixed_inside_large_blocks():
    rng = np.random.default_rng(2)
    g = rng.standard_normal(20_000).astype(np.float32)
    g[rng.random(20_000) < 0.3] = 0.0
    g[::997] = np.float32(2.0**-140)
    g[5::1999] = -np.float32(3e-39)
    np.testing.assert_array_equal(hist(g), reference_hist(g))


def test_nonfinite_and_overflow():
    g = np.array([np.nan, np.inf, -np.inf, 2.0**24, 3e38, 2.0**23, 1.0], np.float32)
    s = summarize({"g": g}, histogram=True)
    row = s.exp_hist[0]
    assert row.sum() == s.numel[0] - s.nonfinite[0] == 4
    assert row[B - 1] == 2 and row[exp_hist_column(23)] == 1 and row[exp_hist_column(0)] == 1
    big = np.array([1e300, -1e308, np.finfo(np.float64).max])
    np.testing.assert_array_equal(hist(big), 3 * only(B - 1))


def test_histogram_of_many_layers_and_dtypes():
    rng = np.random.default_rng(9)
    grads = {}
    for i in range(300):
        n = int(rng.integers(1, 50))
        g = rng.standard_normal(n) * np.exp2(rng.uniform(-150, 40, n))
        with np.errstate(over="ignore"):  # float16 overflows to inf: not counted
            grads[f"l{i}"] = g.astype(FLOATS[i % 3])
    s = summarize(grads, histogram=True)
    for i, g in enumerate(grads.values()):
        np.testing.assert_array_equal(s.exp_hist[i], reference_hist(g))
        assert s.exp_hist[i].sum() == s.numel[i] - s.nonfinite[i]


def test_no_count_carries_over_to_the_next_layer():
    """The kernels fold only the exponent range a layer spans (and zero the NaN/Inf key):
    a wide layer with NaN/Inf, zeros and subnormals followed by narrow layers of either
    sign and dtype must leave nothing behind in the scratch tables."""
    rng = np.random.default_rng(21)
    grads = {}
    for i in range(120):
        dtype = FLOATS[i % 3]
        if i % 4 == 0:
            g = rng.standard_normal(700) * np.exp2(rng.uniform(-160, 130, 700))
            g[::50] = 0.0
            g[1::97] = [np.nan, np.inf, -np.inf, 2.0**-140, -(2.0**-149), 1e-320, -0.0, 5.0][
                (i // 4) % 8]
        else:
            g = (rng.standard_normal(int(rng.integers(1, 600))) * 2.0 ** float(i % 7 - 3))
            g = -np.abs(g) if i % 2 else np.abs(g)
        with np.errstate(over="ignore", under="ignore"):
            grads[f"l{i}"] = g.astype(dtype)
    s = summarize(grads, histogram=True)
    for i, g in enumerate(grads.values()):
        np.testing.assert_array_equal(s.exp_hist[i], reference_hist(g), err_msg=f"layer {i}")


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_counts_merge_exactly_across_ranks(ranks):
    rng = np.random.default_rng(ranks)
    full = (rng.standard_normal(50_001) * np.exp2(rng.uniform(-145, 30, 50_001))).astype(
        np.float32
    )
    full[rng.random(full.size) < 0.05] = 0.0
    full[::1000] = np.nan
    shards = np.array_split(full, ranks)
    per_rank = [summarize({"w": shard}, histogram=True) for shard in shards]
    whole = summarize({"w": full}, histogram=True)
    np.testing.assert_array_equal(sum(s.exp_hist for s in per_rank), whole.exp_hist)
    assert sum(int(s.numel[0]) for s in per_rank) == whole.numel[0]
    assert sum(int(s.nonfinite[0]) for s in per_rank) == whole.nonfinite[0]
    assert max(float(s.max_abs[0]) for s in per_rank) == whole.max_abs[0]
    assert sum(float(s.sum_sq[0]) for s in per_rank) == pytest.approx(whole.sum_sq[0], rel=1e-12)
    # Fractions computed from merged counts equal those of the whole tensor.
    merged = sum(s.exp_hist for s in per_rank)
    for fmt in ("fp16", "bf16"):
        np.testing.assert_array_equal(
            np.array(underflow_fraction(merged, fmt)),
            np.array(underflow_fraction(whole.exp_hist, fmt)),
        )


def _bf16_round(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32, by bit manipulation."""
    u = x32.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return (rounded.astype(np.uint32) << 16).view(np.float32)


def test_underflow_fraction_fp16_matches_an_actual_cast():
    rng = np.random.default_rng(4)
    x = rng.choice([-1.0, 1.0], 200_000) * np.exp2(rng.uniform(-30, -8, 200_000))
    # Leave out the documented exception: values that round up to the smallest normal.
    x = x[~((np.abs(x) >= 2.0**-14 - 2.0**-25) & (np.abs(x) < 2.0**-14))]
    cast = x.astype(np.float16)
    expected_zero = np.mean(cast == 0)
    expected_sub = np.mean((cast != 0) & (np.abs(cast) < 2.0**-14))
    fractions = underflow_fraction(hist(x), "fp16")
    assert fractions.to_zero == pytest.approx(expected_zero, abs=1e-15)
    assert fractions.subnormal == pytest.approx(expected_sub, abs=1e-15)
    assert 0.05 < fractions.to_zero < 0.5 and 0.05 < fractions.subnormal < 0.9


def test_underflow_fraction_bf16_matches_an_actual_cast():
    rng = np.random.default_rng(6)
    x = (rng.choice([-1.0, 1.0], 200_000) * np.exp2(rng.uniform(-140, -118, 200_000))).astype(
        np.float32
    )
    x = x[(np.abs(x) != 2.0**-134) & (x != 0)]  # the tie rounds to zero (documented)
    x = x[~((np.abs(x) >= 2.0**-126 - 2.0**-134) & (np.abs(x) < 2.0**-126))]
    cast = _bf16_round(x)
    expected_zero = np.mean(cast == 0)
    expected_sub = np.mean((cast != 0) & (np.abs(cast) < 2.0**-126))
    fractions = underflow_fraction(hist(x), "bf16")
    assert fractions.to_zero == pytest.approx(expected_zero, abs=1e-15)
    assert fractions.subnormal == pytest.approx(expected_sub, abs=1e-15)
    assert 0.1 < fractions.to_zero < 0.5 and 0.1 < fractions.subnormal < 0.6


def test_underflow_fraction_shapes_and_errors():
    counts = np.zeros((3, B), np.int64)
    counts[0, 0] = 4  # only zeros: nothing underflows
    counts[1, exp_hist_column(-30)] = 1  # fp16: to zero
    counts[1, exp_hist_column(-20)] = 3  # fp16: subnormal
    fz, fs = underflow_fraction(counts, "fp16")
    np.testing.assert_array_equal(fz, [0.0, 0.25, 0.0])  # row 2 empty -> 0
    np.testing.assert_array_equal(fs, [0.0, 0.75, 0.0])
    single = underflow_fraction(counts[1], "fp16")
    assert isinstance(single.to_zero, float) and single == (0.25, 0.75)
    assert underflow_fraction(counts[1], "bf16") == (0.0, 0.0)
    assert set(FLOAT_FORMATS) >= {"fp16", "bf16"}
    for fmt, spec in FLOAT_FORMATS.items():  # thresholds must lie inside the binned range
        assert EXP_HIST_MIN <= spec.emin - spec.fraction_bits - 1 < spec.emin < EXP_HIST_MAX, fmt
    with pytest.raises(ValueError, match="unknown format"):
        underflow_fraction(counts, "fp4")
    with pytest.raises(ValueError, match="shape"):
        underflow_fraction(np.zeros((2, 7)), "fp16")


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # the backend fixture is meant to persist
        HealthCheck.filter_too_much,  # large arrays are rejected now and then
        HealthCheck.too_slow,
    ],
)
@given(
    st.sampled_from(FLOATS).flatmap(
        lambda dtype: arrays(
            dtype=dtype,
            shape=st.integers(1, 5000),
            elements=st.floats(
                allow_nan=True,
                allow_infinity=True,
                allow_subnormal=True,
                width=int(np.dtype(dtype).itemsize * 8),
            ),
        )
    )
)
def test_histogram_matches_reference(g):
    row = hist(g)
    np.testing.assert_array_equal(row, reference_hist(g))
    assert row.sum() == np.isfinite(g).sum()
