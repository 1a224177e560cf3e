"""Random samples of values and the comparison of two statistics, for the property tests
of the mergeable statistics."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from schemas.stats import LayerStatistic

TINY = 5e-324  # smallest subnormal: the absolute rounding step of sums of subnormals
VALUES = st.one_of(
    st.floats(min_value=-1e60, max_value=1e60, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, np.nan, np.inf, -np.inf, 5e-324, -2.2e-308, 1e-300, -1e60,
                     65504.0, 3.4e38]),
)


@st.composite
def samples(draw: st.DrawFn) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(L, values[n] of a random float dtype, layer int64[n] in [0, L), split bool[n])."""
    num_layers = draw(st.integers(1, 4))
    n = draw(st.integers(0, 300))
    values = draw(arrays(np.float64, n, elements=VALUES))
    dtype = draw(st.sampled_from([np.float16, np.float32, np.float64]))
    with np.errstate(over="ignore"):  # too large for float16/32: becomes inf, counted
        values = values.astype(dtype)
    layer = draw(arrays(np.int64, n, elements=st.integers(0, num_layers - 1)))
    split = draw(arrays(np.bool_, n))
    return num_layers, values, layer, split


def assert_same(
    got: LayerStatistic, want: LayerStatistic, bound: LayerStatistic | None = None,
    n: int = 0,
) -> None:
    """Exact equality of the exact fields; float sums within 1e-12 * the same sums over |x|
    (exact too when ``bound`` is None)."""
    a, b = got.state(), want.state()
    assert a.keys() == b.keys()
    exact = want.exact_fields()
    limits = None if bound is None else bound.state()
    for key in b:
        assert a[key].shape == b[key].shape, key
        if key in exact or limits is None:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            tol = 1e-12 * np.abs(limits[key]) + n * TINY
            assert np.all(np.abs(a[key] - b[key]) <= tol), (key, a[key], b[key], tol)
