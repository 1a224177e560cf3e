"""The bit-pattern helpers of producer.kernels: their plain-Python bodies and the compiled
overloads the kernels use give the same keys, and the keys order / bin as documented."""

import numpy as np
import pytest
from numba import njit

from producer import kernels

VALUES = [1.5, -1.5, 2.0**-130, -(2.0**-149), 0.0, -0.0, 3e38, -3e38, np.inf, -np.inf, np.nan]


@njit
def _compiled(u32, i32, u64, i64):  # pragma: no cover - compiled
    return (kernels._hist_key(u32), kernels._order_key(i32), kernels._magnitude(i32),
            kernels._hist_key(u64), kernels._order_key(i64), kernels._magnitude(i64))


def _python(u32, i32, u64, i64):
    return (kernels._hist_key(u32), kernels._order_key(i32), kernels._magnitude(i32),
            kernels._hist_key(u64), kernels._order_key(i64), kernels._magnitude(i64))


@pytest.mark.parametrize("value", VALUES)
def test_python_and_compiled_helpers_agree(value: float) -> None:
    f32, f64 = np.float32(value), np.float64(value) * (1e250 if abs(value) == 3e38 else 1)
    args = (f32.view(np.uint32), f32.view(np.int32), f64.view(np.uint64), f64.view(np.int64))
    assert [int(a) for a in _python(*args)] == [int(b) for b in _compiled(*args)]


def test_order_keys_sort_like_the_values_and_keys_hold_the_exponent() -> None:
    finite = np.array([v for v in VALUES if np.isfinite(v) and (v != 0 or v.hex()[0] != "-")],
                      np.float32)  # -0.0 left out: it equals +0.0 but its key is just below
    keys = [int(kernels._order_key(v)) for v in finite.view(np.int32)]
    assert np.argsort(keys).tolist() == np.argsort(finite).tolist()
    zero, minus_zero = (int(kernels._order_key(np.float32(z).view(np.int32))) for z in (0.0, -0.0))
    assert minus_zero == zero - 1
    assert kernels._hist_key(np.float32(1.5).view(np.uint32)) == 127  # exponent field of 1
    assert kernels._hist_key(np.float32(-1.5).view(np.uint32)) == 256 + 127
    # binary64 keys move to the binary32 bias, clamped: tiny -> 0, huge -> 254, NaN -> 255
    assert kernels._hist_key(np.float64(1.5).view(np.uint64)) == 127
    assert kernels._hist_key(np.float64(1e-300).view(np.uint64)) == 0
    assert kernels._hist_key(np.float64(1e300).view(np.uint64)) == 254
    assert kernels._hist_key(np.float64(np.nan).view(np.uint64)) == 255
