"""summarize() against a float64 reference, NaN/Inf handling, dtypes and errors.

Every test runs on both backends: the numba kernels (numba is a dependency: a missing numba
fails, never skips) and the pure-NumPy fallback.
"""

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from producer import summary
from producer.backend import active_backend, set_backend
from producer.summary import LayerSummaries, summarize

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["numba", "numpy"]
FLOATS = [np.float16, np.float32, np.float64]
HYPOTHESIS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # the backend fixture is meant to persist
        HealthCheck.filter_too_much,  # large arrays are rejected now and then
        HealthCheck.too_slow,
    ],
)


@pytest.fixture(autouse=True, params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the given backend, then go back to the default."""
    assert set_backend(request.param) == request.param
    yield request.param
    set_backend(None)


def _reference(g: np.ndarray) -> tuple[int, float, float, float, int, int]:
    """(numel, sum |g|, sum g^2, max |g| over the finite elements, non-finite count, NaN
    count), element by element in Python."""
    x = np.asarray(g, dtype=np.float64).ravel()
    finite = x[np.isfinite(x)]
    return (
        x.size,
        float(sum(abs(v) for v in finite.tolist())),
        float(sum(v * v for v in finite.tolist())),
        float(max((abs(v) for v in finite.tolist()), default=0.0)),
        int(x.size - finite.size),
        sum(1 for v in x.tolist() if v != v),
    )


def _exact_reference(g: np.ndarray) -> tuple[int, float, float, float, int, int]:
    """Like _reference, with correctly rounded sums (math.fsum); inf when a sum exceeds the
    double range, like summarize."""
    x = np.asarray(g, dtype=np.float64).ravel()
    finite = np.abs(x[np.isfinite(x)])
    with np.errstate(over="ignore"):
        squares = finite * finite
    return (
        x.size,
        _fsum(finite),
        _fsum(squares),
        float(finite.max()) if finite.size else 0.0,
        int(x.size - finite.size),
        int(np.isnan(x).sum()),
    )


def _fsum(values: np.ndarray) -> float:
    """Correctly rounded sum of non-negative values; inf when it exceeds the double range."""
    if not np.isfinite(values).all():
        return math.inf
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


def _check_row(s: LayerSummaries, i: int,
               expected: tuple[int, float, float, float, int, int]) -> None:
    n, sabs, ssq, mabs, bad, nan = expected
    assert s.numel[i] == n and s.nonfinite[i] == bad
    assert s.nan is not None and s.nan[i] == nan
    assert s.sum_abs[i] == pytest.approx(sabs, rel=1e-12, abs=1e-300)
    assert s.sum_sq[i] == pytest.approx(ssq, rel=1e-12, abs=1e-300)
    assert s.max_abs[i] == mabs


def _check(g: np.ndarray) -> None:
    s = summarize({"layer": g})
    _check_row(s, 0, _reference(g))


def test_nan_and_inf_counted_and_left_out():
    g = np.array([[1.0, -2.0], [np.nan, np.inf], [-np.inf, 0.5]], dtype=np.float32)
    s = summarize({"w": g})
    assert s.numel[0] == 6 and s.nonfinite[0] == 3 and s.nan is not None and s.nan[0] == 1
    assert s.sum_abs[0] == 3.5 and s.sum_sq[0] == 5.25 and s.max_abs[0] == 2.0


def test_all_nonfinite_layer():
    s = summarize({"w": np.full(5, np.nan, np.float16)})
    assert (s.sum_abs[0], s.sum_sq[0], s.max_abs[0], s.nonfinite[0]) == (0, 0, 0, 5)
    assert s.nan is not None and s.nan[0] == 5


def test_float16_accumulates_in_float64():
    g = np.full(70_000, 60_000.0, dtype=np.float16)  # float16 sums would overflow
    s = summarize({"w": g})
    value = float(np.float16(60_000.0))
    assert s.sum_abs[0] == pytest.approx(70_000 * value, rel=1e-12)
    assert s.sum_sq[0] == pytest.approx(70_000 * value * value, rel=1e-12)
    assert s.nonfinite[0] == 0


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_float64_square_overflow_is_inf_not_capped(backend: str) -> None:
    """As in the reference implementation's f64 sums: a square above the double range is
    inf (2e154^2 = 4e308), never the largest double; the element is finite, not counted
    as NaN/Inf."""
    previous = active_backend()
    set_backend(backend)
    try:
        s = summarize({"w": np.array([2e154, 1.0]), "near": np.array([1.3e154, 1.0])})
    finally:
        set_backend(previous)
    assert s.sum_sq[0] == np.inf and s.nonfinite[0] == 0 and s.max_abs[0] == 2e154
    assert s.sum_abs[0] == 2e154
    assert np.isfinite(s.sum_sq[1]) and s.sum_sq[1] == pytest.approx(1.69e308, rel=1e-12)


def test_float64_sum_overflow_is_inf_in_both_sums():
    big = float(np.finfo(np.float64).max)
    s = summarize({"w": np.array([big, big, -big, np.nan])})
    assert s.sum_abs[0] == np.inf and s.sum_sq[0] == np.inf
    assert s.max_abs[0] == big and s.nonfinite[0] == 1


def test_order_and_shapes_preserved():
    grads = {"z": np.ones((2, 3, 4), np.float32), "a": np.ones(7, np.float64)}
    s = summarize(grads)
    assert s.names == ("z", "a") and s.numel.tolist() == [24, 7]


def test_result_dtypes_and_no_histogram_by_default():
    s = summarize({"a": np.ones(3, np.float32), "b": np.ones(2, np.float16)})
    assert s.numel.dtype == np.int64 and s.nonfinite.dtype == np.int64
    for field in (s.sum_abs, s.sum_sq, s.max_abs):
        assert field.dtype == np.float64 and field.shape == (2,)
    assert s.exp_hist is None and len(s) == 2


def test_errors_name_the_layer():
    with pytest.raises(TypeError, match="'ints'"):
        summarize({"ints": np.arange(3)})
    with pytest.raises(TypeError, match="'big_endian'"):
        summarize({"ok": np.ones(2, np.float32), "big_endian": np.ones(2, ">f4")})
    with pytest.raises(ValueError, match="'empty'"):
        summarize({"empty": np.zeros(0, np.float32)})
    with pytest.raises(ValueError, match="'empty16'"):
        summarize({"empty16": np.zeros((3, 0), np.float16)})
    with pytest.raises(ValueError, match="empty mapping"):
        summarize({})


def test_layouts_views_and_array_likes():
    base = np.arange(-600, 600, dtype=np.float32).reshape(30, 40) / 7
    readonly = base.copy()
    readonly.flags.writeable = False
    layers = {
        "transposed": base.T,
        "strided": base[::3, ::2],
        "fortran": np.asfortranarray(base),
        "readonly": readonly,
        "scalar": np.array(-2.5),
        "list": [1.0, -3.0, float("nan")],
        "f16_strided": base.astype(np.float16)[:, ::5],
    }
    s = summarize(layers)
    for i, g in enumerate(layers.values()):
        _check_row(s, i, _exact_reference(np.asarray(g)))


def test_huge_layers_stay_exact():
    rng = np.random.default_rng(7)
    big32 = (rng.standard_normal(3_000_001, dtype=np.float32) * 1e-3).astype(np.float32)
    big32[1_234_567] = np.nan
    big32[2_999_999] = -np.inf
    big64 = rng.standard_normal(2_000_003) * np.exp(rng.uniform(-30, 30, 2_000_003))
    same_sign = np.abs(rng.standard_normal(2_500_000, dtype=np.float32)) + 1  # worst case
    s = summarize({"big32": big32, "big64": big64, "same_sign": same_sign})
    for i, g in enumerate((big32, big64, same_sign)):
        _check_row(s, i, _exact_reference(g))


def test_many_small_layers_in_one_call():
    rng = np.random.default_rng(3)
    grads = {}
    for i in range(1000):
        dtype = FLOATS[i % 3]
        g = rng.standard_normal(int(rng.integers(1, 60))).astype(dtype)
        if i % 17 == 0:
            g[0] = [np.nan, np.inf, -np.inf][i % 3]
        grads[f"block.{i}.weight"] = g
    s = summarize(grads)
    assert s.names == tuple(grads)
    for i, g in enumerate(grads.values()):
        _check_row(s, i, _exact_reference(g))


def test_block_boundaries():
    # Layers around multiples of the kernels' block size, NaN/Inf in the last block.
    for n in (4095, 4096, 4097, 8191, 8192, 8193, 12_289):
        g = np.linspace(-3, 5, n).astype(np.float32)
        g[-1] = np.inf
        _check_row(summarize({"w": g}), 0, _exact_reference(g))


def test_subnormal_and_extreme_values():
    tiny32 = np.array([1e-45, -1e-40, 1.17e-38, 3.4e38, -3.4e38], np.float32)
    tiny16 = np.array([6e-8, -6.1e-5, 65504.0, -65504.0], np.float16)
    tiny64 = np.array([5e-324, -2.2e-308, 1e-300], np.float64)
    s = summarize({"f32": tiny32, "f16": tiny16, "f64": tiny64})
    for i, g in enumerate((tiny32, tiny16, tiny64)):
        _check_row(s, i, _exact_reference(g))


def test_backends_agree():
    rng = np.random.default_rng(11)
    grads = {
        f"l{i}": (rng.standard_normal(5000) * 10.0 ** rng.uniform(-30, 3)).astype(FLOATS[i % 3])
        for i in range(12)
    }
    grads["l3"][::7] = np.nan
    grads["l3"][1] = -np.inf
    results = {}
    for name in BACKENDS:
        if name == "numba" and not _numba_installed():
            continue
        set_backend(name)
        results[name] = summarize(grads, histogram=True)
    if len(results) < 2:
        pytest.fail("numba (a declared dependency) is not installed")
    a, b = results["numba"], results["numpy"]
    np.testing.assert_array_equal(a.numel, b.numel)
    np.testing.assert_array_equal(a.nonfinite, b.nonfinite)
    np.testing.assert_array_equal(a.nan, b.nan)
    assert a.nan is not None and a.nan[3] == a.nonfinite[3] - 1  # the one Inf of l3
    np.testing.assert_array_equal(a.max_abs, b.max_abs)
    np.testing.assert_array_equal(a.exp_hist, b.exp_hist)
    np.testing.assert_allclose(a.sum_abs, b.sum_abs, rtol=1e-13)
    np.testing.assert_allclose(a.sum_sq, b.sum_sq, rtol=1e-13)


def test_layer_summaries_positional_construction_still_works():
    one = np.ones(1)
    s = LayerSummaries(("a",), one.astype(np.int64), one, one, one, one.astype(np.int64) * 0)
    assert s.exp_hist is None and len(s) == 1


@HYPOTHESIS
@given(
    arrays(
        dtype=st.sampled_from(FLOATS),
        shape=st.integers(1, 300),
        elements=st.floats(allow_nan=True, allow_infinity=True, width=16),
    )
)
def test_matches_reference(g):
    _check(g)


@HYPOTHESIS
@given(
    st.lists(
        st.sampled_from(FLOATS).flatmap(
            lambda dtype: arrays(
                dtype=dtype,
                shape=st.integers(1, 5000),
                elements=st.floats(
                    allow_nan=True,
                    allow_infinity=True,
                    width=int(np.dtype(dtype).itemsize * 8),
                    allow_subnormal=True,
                ),
            )
        ),
        min_size=1,
        max_size=6,
    )
)
def test_many_layers_match_exact_reference(layers):
    grads = {f"layer {i}": g for i, g in enumerate(layers)}
    s = summarize(grads)
    for i, g in enumerate(layers):
        _check_row(s, i, _exact_reference(g))


# -- backend selection ------------------------------------------------------------------


def _numba_installed() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def test_import_producer_does_not_import_numba():
    code = (
        "import sys, producer, producer.summary; "
        "assert 'numba' not in sys.modules, 'numba imported eagerly'; "
        "assert 'producer.kernels' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_warmup_returns_backend(backend: str):
    assert summary.warmup() == backend


def test_summaries_convert_to_the_mergeable_statistics():
    """Either backend's output wraps into schemas.stats objects equal to updating them
    with the raw gradients, and back (LayerSummaries.from_statistics)."""
    from schemas.stats import ExponentHistogram, GradientSums

    grads = {"a": np.array([3.0, -4.0, np.nan], np.float32), "b": np.arange(-5.0, 6.0)}
    s = summarize(grads, histogram=True)
    sums, hist = s.gradient_sums(), s.exponent_histogram()
    ref = GradientSums.from_layers(list(grads.values()))
    for key, value in ref.state().items():
        np.testing.assert_allclose(sums.state()[key], value, rtol=1e-15, err_msg=key)
    np.testing.assert_array_equal(hist.counts, ExponentHistogram.from_layers(
        list(grads.values())).counts)
    back = LayerSummaries.from_statistics(s.names, sums, hist)
    np.testing.assert_array_equal(back.exp_hist, s.exp_hist)
    assert not s.norms_only().gradient_sums().has_abs().any()
    with pytest.raises(ValueError, match="norms_only"):
        LayerSummaries.from_statistics(s.names, s.norms_only().gradient_sums())
    with pytest.raises(ValueError, match="2 layers"):
        LayerSummaries.from_statistics(("a", "b"), GradientSums.empty(3))


def test_nonfinite_at_block_edges_with_histogram():
    """A NaN/Inf on either side of every block edge of the kernels (producer.kernels.BLOCK)
    and in the tail: only the blocks holding one are redone masked, the others keep their
    fast sums; counts, sums, max and histogram stay those of the finite elements."""
    from producer.kernels import BLOCK
    from schemas.stats import ExponentHistogram

    n = 3 * BLOCK + 7
    for dtype in (np.float32, np.float64, np.float16):
        for pos in (0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, n - 1):
            g = np.linspace(-2, 3, n).astype(dtype)
            g[pos] = np.nan
            g[(pos + BLOCK) % n] = -np.inf
            s = summarize({"w": g}, histogram=True)
            _check_row(s, 0, _exact_reference(g))
            np.testing.assert_array_equal(s.exp_hist, ExponentHistogram.from_layers([g]).counts)
            assert s.nonfinite[0] == 2 and s.nan is not None and s.nan[0] == 1
