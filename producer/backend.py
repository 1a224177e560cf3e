"""Which implementation computes the producer's statistics: the numba kernels
(:mod:`producer.kernels`) or pure NumPy. Chosen once per process, used by
:mod:`producer.summary` and :mod:`producer.weights` alike.

* ``"numba"`` (default when numba imports): one fused read pass per layer, float64
  accumulation, GIL released. numba is imported and the kernels are compiled (or loaded
  from numba's on-disk cache) on the first summary, not at ``import producer``
  (``producer.summary.warmup`` pays that cost at start-up).
* ``"numpy"``: the mergeable statistics of :mod:`schemas.stats`, several passes over
  float64 chunks; used when numba is missing or fails to import or compile (a warning is
  logged), or when forced.

Choose with :func:`set_backend` or the environment variable ``GRADSTREAM_SUMMARY_BACKEND``
= ``auto`` (default) | ``numba`` | ``numpy``.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType
from typing import Literal

import numpy as np

from schemas.stats import exponent_lut

log = logging.getLogger("gradstream.producer")

__all__ = [
    "BACKENDS",
    "BINARY32_EXPONENT_LUT",
    "KernelError",
    "active_backend",
    "histogram_tables",
    "kernel_failed",
    "kernels",
    "set_backend",
]

BACKENDS = ("auto", "numba", "numpy")
"""The names :func:`set_backend` and ``GRADSTREAM_SUMMARY_BACKEND`` accept."""

BINARY32_EXPONENT_LUT = exponent_lut(8, 127)
"""IEEE 754 binary32 exponent-field -> histogram column table (8-bit field, bias 127)
through which the histogram kernels fold their counts, for float32 and float64 input."""

_lock = threading.Lock()
_requested: str | None = None  # set_backend(); None -> environment variable
_mode = "auto"  # the resolved request: auto | numba | numpy
_resolved = False
_kernels_module: ModuleType | None = None


class KernelError(RuntimeError):
    """A compiled kernel failed to compile or run (not an input error)."""


def set_backend(name: Literal["auto", "numba", "numpy"] | None) -> str:
    """Select the implementation of the statistics (process-wide).

    Args:
        name: ``"auto"`` (numba if it imports, else NumPy), ``"numba"`` (required: import
            errors are raised) or ``"numpy"`` (pure NumPy, no compilation); None goes
            back to the default, the ``GRADSTREAM_SUMMARY_BACKEND`` environment variable
            (``auto`` when unset).

    Returns:
        The active backend after the call, ``"numba"`` or ``"numpy"``.

    Raises:
        ValueError: unknown name.
        ImportError: ``"numba"`` requested and numba (or the kernels) cannot be imported.
    """
    global _requested, _resolved, _kernels_module
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown summary backend {name!r}; expected one of {BACKENDS}")
    with _lock:
        _requested = name
        _resolved = False
        _kernels_module = None
    return active_backend()


def active_backend() -> str:
    """Name of the backend in use now: ``"numba"`` or ``"numpy"``.

    Resolving ``auto`` imports numba (once per process) if it is not imported yet.

    Raises:
        ImportError: backend ``"numba"`` was forced and cannot be imported.
        ValueError: ``GRADSTREAM_SUMMARY_BACKEND`` holds an unknown name.
    """
    return "numba" if kernels() is not None else "numpy"


def kernels() -> ModuleType | None:
    """The numba kernel module (:mod:`producer.kernels`), or None for the NumPy backend
    (resolved once, lazily).

    Raises:
        ImportError: backend ``"numba"`` was forced and cannot be imported.
        ValueError: ``GRADSTREAM_SUMMARY_BACKEND`` holds an unknown name.
    """
    global _mode, _resolved, _kernels_module
    if _resolved:
        return _kernels_module
    with _lock:
        if _resolved:
            return _kernels_module
        mode = _requested or os.environ.get("GRADSTREAM_SUMMARY_BACKEND", "auto").strip().lower()
        _mode = mode
        if mode not in BACKENDS:
            raise ValueError(
                f"GRADSTREAM_SUMMARY_BACKEND={mode!r}; expected one of {BACKENDS}"
            )
        module: ModuleType | None = None
        if mode != "numpy":
            try:
                from producer import kernels as module
            except Exception as exc:
                if mode == "numba":
                    raise ImportError(f"numba summary backend unavailable: {exc}") from exc
                log.warning("numba unavailable (%s); gradient summaries use pure NumPy", exc)
                module = None
        _kernels_module = module
        _resolved = True
        return module


def kernel_failed(exc: KernelError) -> None:
    """Switch to the NumPy backend after a kernel failure, unless numba was forced.

    Raises:
        KernelError: ``exc`` itself, when the backend ``"numba"`` was forced.
    """
    global _kernels_module
    if _mode == "numba":
        raise exc
    log.warning("numba summary kernel failed (%s); switching to pure NumPy", exc.__cause__)
    with _lock:
        _kernels_module = None


def histogram_tables(module: ModuleType) -> np.ndarray:
    """Zeroed int32 scratch count tables for one histogram kernel call (the kernels leave
    them zero again)."""
    return np.zeros(module.TABLES * module.STRIDE, np.int32)
