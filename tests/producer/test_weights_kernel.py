"""The fused weight-statistics pass (producer.kernels.weights_f32/f64 via
producer.weights.summarize_weights) against the NumPy reference of schemas.stats.

Sums: rtol 1e-12, with an absolute slack of 1e-12 * sum |w|^k for the signed sums S1 and
S3 (two summation orders of n terms differ by at most 2 gamma_(n-1) sum |x_i|, Higham
2002, section 4.2, so a sum that cancels to ~0 cannot be compared relatively). Counts,
extremes and the histogram: exactly.
"""

import numba  # noqa: F401 - a dependency of gradstream: missing fails here, never skips
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from producer.backend import set_backend
from producer.weights import summarize_weights
from schemas.stats import ExponentHistogram, PowerSums

FLOATS = [np.float16, np.float32, np.float64]
SETTINGS = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True, params=["numba", "numpy"])
def backend(request: pytest.FixtureRequest):
    assert set_backend(request.param) == request.param
    yield request.param
    set_backend(None)


def _layer(dtype: type) -> st.SearchStrategy[np.ndarray]:
    if dtype is np.float64:  # |w| < 1e60 keeps S4 finite (overflow: test below)
        values = st.floats(min_value=-1e60, max_value=1e60, width=64)
    else:
        values = st.floats(width=np.dtype(dtype).itemsize * 8)
    elements = st.one_of(values, st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf]))
    return arrays(dtype=dtype, shape=st.integers(1, 9000), elements=elements)


def _check(layers: list[np.ndarray], previous: list[np.ndarray] | None = None) -> None:
    names = [f"w{i}" for i in range(len(layers))]
    prev = None if previous is None else dict(zip(names, previous, strict=True))
    got = summarize_weights(dict(zip(names, layers, strict=True)), prev)
    ref = PowerSums.from_layers(layers).saturate()
    hist = ExponentHistogram.from_layers(layers)
    np.testing.assert_array_equal(got.moments.power.count, ref.count)
    np.testing.assert_array_equal(got.nonfinite, ref.nonfinite)
    np.testing.assert_array_equal(got.moments.power.minimum, ref.minimum)
    np.testing.assert_array_equal(got.moments.power.maximum, ref.maximum)
    np.testing.assert_array_equal(got.exp_hist, hist.counts)
    np.testing.assert_array_equal(got.moments.zeros(), hist.zeros())
    for k, name in enumerate(("s1", "s2", "s3", "s4"), start=1):
        slack = np.array([
            1e-12 * float(np.sum(np.abs(x[np.isfinite(x)].astype(np.float64)) ** k))
            for x in layers
        ])
        np.testing.assert_allclose(getattr(got.moments.power, name), getattr(ref, name),
                                   rtol=1e-12, atol=0.0 if k % 2 == 0 else float(slack.max()),
                                   err_msg=name)
    if previous is not None:
        assert got.update_sum_sq is not None
        for i, (w, p) in enumerate(zip(layers, previous, strict=True)):
            with np.errstate(over="ignore", invalid="ignore"):
                d = w.astype(np.float32).astype(np.float64) - p.astype(np.float64)
            d = d[np.isfinite(d)]
            assert got.update_sum_sq[i] == pytest.approx(float(np.dot(d, d)), rel=1e-12,
                                                         abs=1e-300)


@SETTINGS
@given(st.lists(st.sampled_from(FLOATS).flatmap(_layer), min_size=1, max_size=4))
def test_fused_pass_matches_numpy_reference(layers):
    _check(layers)


@SETTINGS
@given(st.sampled_from(FLOATS).flatmap(_layer), st.integers(0, 2**32 - 1))
def test_update_norm_matches_reference(w, seed):
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", invalid="ignore"):
        p = w.astype(np.float32) + rng.standard_normal(w.shape).astype(np.float32)
    _check([w], [p])


def test_block_boundaries_and_nonfinite_blocks():
    for n in (4095, 4096, 4097, 8193, 12_289):
        w = np.linspace(-3, 5, n).astype(np.float32)
        w[::997] = 0.0
        w[-1] = np.nan
        w[n // 2] = -np.inf
        _check([w, w.astype(np.float64), w.astype(np.float16)])


def test_all_nonfinite_and_signed_zero_layers():
    got = summarize_weights({"a": np.array([np.nan, -np.inf], np.float32),
                             "z": np.array([-0.0, 0.0, -0.0])})
    assert got.nonfinite.tolist() == [2, 0]
    assert (got.min[0], got.max[0]) == (0.0, 0.0)
    assert (got.min[1], got.max[1]) == (0.0, 0.0) and got.exp_hist[1, 0] == 3


def test_float64_overflow_saturates():
    big = float(np.finfo(np.float64).max)
    got = summarize_weights({"w": np.array([1e200, 1e200, 3.0])})
    assert got.sum_sq[0] == big and got.sum_quad[0] == big and got.max[0] == 1e200
    assert got.sum[0] == pytest.approx(2e200, rel=1e-15)


def test_nonfinite_at_block_edges():
    """NaN/Inf weights and NaN/Inf kept copies on either side of every block edge
    (producer.kernels.BLOCK): only those blocks take the masked path."""
    from producer.kernels import BLOCK

    n = 3 * BLOCK + 7
    for pos in (0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, n - 1):
        w = np.linspace(-3, 5, n).astype(np.float32)
        w[pos] = np.nan
        w[(pos + BLOCK) % n] = np.inf
        p = w + np.float32(0.25)
        p[(pos + 1) % n] = -np.inf  # a non-finite difference next to the NaN weight
        _check([w, w.astype(np.float64), w.astype(np.float16)], [p, p, p])


def test_many_small_layers_in_one_call():
    rng = np.random.default_rng(11)
    layers, previous = [], []
    for i in range(400):
        w = rng.standard_normal(int(rng.integers(1, 70))).astype(FLOATS[i % 3])
        if i % 13 == 0:
            w[-1] = [np.nan, np.inf, -np.inf][i % 3]
        if i % 29 == 0:
            w[0] = 0.0
        layers.append(w)
        previous.append(rng.standard_normal(w.shape).astype(np.float32))
    _check(layers, previous)


def test_refresh_overwrites_the_kept_copy_in_the_same_call():
    rng = np.random.default_rng(2)
    weights = {"a": rng.standard_normal((40, 30)).astype(np.float32),
               "b": rng.standard_normal(1500),  # float64: the copy holds float32(w)
               "c": rng.standard_normal(700).astype(np.float16)}
    weights["a"][3, 4] = np.nan
    kept = {n: rng.standard_normal(w.shape).astype(np.float32) for n, w in weights.items()}
    kept["b"][10] = np.inf
    before = {n: p.copy() for n, p in kept.items()}
    want = summarize_weights(weights, before)
    got = summarize_weights(weights, kept, refresh=True)
    np.testing.assert_array_equal(got.update_sum_sq, want.update_sum_sq)
    np.testing.assert_array_equal(got.sum_sq, want.sum_sq)
    np.testing.assert_array_equal(got.exp_hist, want.exp_hist)
    for name, w in weights.items():
        np.testing.assert_array_equal(kept[name], w.astype(np.float32))  # NaN == NaN here
    again = summarize_weights(weights, kept, refresh=True)  # unchanged weights: no update
    assert again.update_sum_sq.tolist() == [0.0, 0.0, 0.0]


def test_refresh_writes_nothing_without_an_update_or_with_an_unusable_copy():
    w = {"a": np.ones(5, np.float32), "b": np.full(3, 2.0, np.float32)}
    reshaped = {"a": np.zeros(5, np.float32), "b": np.zeros(4, np.float32)}
    s = summarize_weights(w, reshaped, refresh=True)
    assert s.update_sum_sq is None
    assert reshaped["a"].tolist() == [0.0] * 5 and reshaped["b"].tolist() == [0.0] * 4
    for bad in (np.zeros(3, np.float64), np.zeros(6, np.float32)[::2]):
        kept = {"a": np.zeros(5, np.float32), "b": bad}
        with pytest.raises(ValueError, match="'b'"):
            summarize_weights(w, kept, refresh=True)
        assert kept["a"].tolist() == [0.0] * 5  # checked before anything is written


def test_empty_layer_and_empty_mapping_are_rejected():
    with pytest.raises(ValueError, match="'b'"):
        summarize_weights({"a": np.ones(3, np.float32), "b": np.zeros(0, np.float32)})
    with pytest.raises(ValueError, match="empty mapping"):
        summarize_weights({})


def test_refresh_rejects_bad_weights_before_writing():
    kept = {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)}
    with pytest.raises(TypeError, match="'b'"):
        summarize_weights({"a": np.ones(3, np.float32), "b": np.ones(2, np.int32)}, kept,
                          refresh=True)
    assert kept["a"].tolist() == [0.0, 0.0, 0.0]
