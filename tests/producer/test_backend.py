"""The backend choice (producer.backend): environment variable, fallbacks to NumPy.

Every test runs with each backend selected first (the fixture of ``test_summary``).
"""

import logging
import sys

import numpy as np
import pytest

from producer.backend import active_backend, set_backend
from producer.summary import summarize
from tests.producer.test_summary import _check, backend  # noqa: F401 - autouse fixture


def test_environment_variable_selects_backend(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GRADSTREAM_SUMMARY_BACKEND", "numpy")
    set_backend(None)
    assert active_backend() == "numpy"
    monkeypatch.setenv("GRADSTREAM_SUMMARY_BACKEND", "fortran")
    with pytest.raises(ValueError, match="GRADSTREAM_SUMMARY_BACKEND"):
        set_backend(None)
    with pytest.raises(ValueError, match="GRADSTREAM_SUMMARY_BACKEND"):
        summarize({"w": np.ones(2)})
    with pytest.raises(ValueError, match="unknown summary backend"):
        set_backend("cuda")  # type: ignore[arg-type]


def test_falls_back_to_numpy_when_numba_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    import producer

    monkeypatch.delattr(producer, "kernels", raising=False)
    monkeypatch.setitem(sys.modules, "producer.kernels", None)  # import -> ImportError
    with caplog.at_level(logging.WARNING, logger="gradstream.producer"):
        assert set_backend("auto") == "numpy"
    assert "pure NumPy" in caplog.text
    _check(np.array([1.0, np.nan, -4.0], np.float32))
    with pytest.raises(ImportError, match="numba summary backend unavailable"):
        set_backend("numba")


def test_falls_back_to_numpy_when_a_kernel_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    from producer import kernels

    def broken(*args: object) -> None:
        raise RuntimeError("LLVM ran out of luck")

    monkeypatch.setattr(kernels, "summarize_f32", broken)
    set_backend("numba")
    with pytest.raises(RuntimeError, match="LLVM ran out of luck"):
        summarize({"w": np.ones(3, np.float32)})
    set_backend("auto")
    with caplog.at_level(logging.WARNING, logger="gradstream.producer"):
        s = summarize({"a": np.ones(2, np.float64), "w": np.full(3, -2.0, np.float32)})
    assert s.sum_abs.tolist() == [2.0, 6.0] and s.max_abs.tolist() == [1.0, 2.0]
    assert "switching to pure NumPy" in caplog.text
    assert active_backend() == "numpy"
    # Input errors are still input errors, not kernel failures.
    set_backend("auto")
    with pytest.raises(TypeError, match="'i'"):
        summarize({"i": np.ones(2, np.int32)})
