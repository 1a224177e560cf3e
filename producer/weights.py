"""Weight summaries of the watched layers (producer setting ``weight_stats``, off by default).

Per layer, over this rank's shard of the weights, everything exactly mergeable across ranks
(power sums add, extremes take min / max, counts add; ``schemas.stats``):

- ``sum_sq`` = sum w^2 (the weight norm squared) and ``update_sum_sq`` =
  sum (w_t - w_prev)^2, the squared norm of the change since the previous recorded step
  (needs one float32 copy of the watched weights, kept by the producer);
- the weight distribution (semantics follow trustformers-debug's ``weight_analysis``
  module) as a :class:`schemas.stats.WeightMoments`: power sums over the finite weights
  (``sum`` = sum w, ``sum_cube`` = sum w^3, ``sum_quad`` = sum w^4), ``min`` / ``max``
  (0.0 on the wire when a layer has no finite weight), ``nonfinite`` = count of NaN/Inf
  weights, plus the base-2 exponent histogram of |w| (same layout as the gradient histogram,
  :func:`producer.histogram.exp_hist_edges`; column 0 counts exact zeros).

Mean, variance, skewness and kurtosis follow from the power sums
(:meth:`schemas.stats.PowerSums.get`). All sums accumulate in float64.

Error bounds: the numba kernels sum each block of ``producer.kernels.BLOCK`` elements in a
reassociated (vectorised) order and add the block sums with Neumaier compensation, so the
float64 sums differ from a correctly rounded sum by at most about (BLOCK / 4 + 2) u
sum |w|^k (u = 2^-53; recursive summation bound of Higham 2002, section 4.2, per lane),
below 1e-13 relative for S2 and S4 and 1e-13 sum |w|^k absolute for the signed S1 and S3;
counts, extremes and the histogram are exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from producer import backend
from producer.summary import as_float_array, summarize
from schemas.stats import (
    MAX_DOUBLE,
    ExponentHistogram,
    PowerSums,
    SumOfSquares,
    WeightMoments,
)
from schemas.wire import EXP_HIST_BINS, EXP_HIST_MIN

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)

__all__ = ["WeightSummaries", "summarize_weights"]


@dataclass(frozen=True, slots=True)
class WeightSummaries:
    """Weight summaries of k layers, aligned with the gradient summaries of the step.

    Attributes:
        moments: the weight distribution (power sums S1..S4, extremes, non-finite count and
            exponent histogram of |w|) of the k layers.
        update: sum (w_t - w_prev)^2 of the k layers, or None (first step, or a layer's
            shape changed).

    The remaining attributes are the wire's per-layer arrays (``schemas.wire.StepSummary``
    ``weight_*`` fields), read from ``moments`` / ``update``: ``sum_sq``: float64[k] sum w^2;
    ``update_sum_sq``: float64[k] or None; ``sum``, ``sum_cube``, ``sum_quad``: float64[k];
    ``min``, ``max``: float64[k] (0.0 where a layer has no finite weight); ``nonfinite``:
    int64[k]; ``exp_hist``: int64[k, EXP_HIST_BINS].
    """

    moments: WeightMoments
    update: SumOfSquares | None

    @property
    def sum_sq(self) -> np.ndarray:
        """float64[k] sum w^2 (S2)."""
        return self.moments.power.s2

    @property
    def update_sum_sq(self) -> np.ndarray | None:
        """float64[k] sum (w_t - w_prev)^2, or None."""
        return None if self.update is None else self.update.sum_sq

    @property
    def sum(self) -> np.ndarray:
        """float64[k] sum w (S1)."""
        return self.moments.power.s1

    @property
    def sum_cube(self) -> np.ndarray:
        """float64[k] sum w^3 (S3)."""
        return self.moments.power.s3

    @property
    def sum_quad(self) -> np.ndarray:
        """float64[k] sum w^4 (S4)."""
        return self.moments.power.s4

    @property
    def min(self) -> np.ndarray:
        """float64[k] smallest finite weight (0.0 where none)."""
        return self.moments.power.to_columns()["minimum"]

    @property
    def max(self) -> np.ndarray:
        """float64[k] largest finite weight (0.0 where none)."""
        return self.moments.power.to_columns()["maximum"]

    @property
    def nonfinite(self) -> np.ndarray:
        """int64[k] NaN/Inf weights."""
        return self.moments.power.nonfinite

    @property
    def exp_hist(self) -> np.ndarray:
        """int64[k, EXP_HIST_BINS] exponent histogram of |w|."""
        return self.moments.exp_hist.counts


def summarize_weights(
    weights: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray] | None = None,
    *, refresh: bool = False,
) -> WeightSummaries:
    """Compute the :class:`WeightSummaries` of the layers of ``weights`` (in mapping order).

    With the numba backend (:func:`producer.backend.active_backend`) each layer is read
    once: :func:`producer.kernels.weights_f32` / ``weights_f64`` compute the power sums,
    extremes, non-finite count, exponent histogram and (with ``previous``) the update's
    sum of squares in one fused pass over blocks of ``producer.kernels.BLOCK`` elements,
    float64 accumulation with Neumaier-compensated block sums. The NumPy backend uses
    :meth:`schemas.stats.PowerSums.from_layers` and
    :meth:`schemas.stats.ExponentHistogram.from_layers` (several passes over float64
    chunks). Both equal the NumPy reference up to rounding in the sums (exactly in the
    counts, extremes and histogram). Sums that overflow saturate at +-max double.

    The update norm: ``sum (float32(w) - prev)^2`` over the elements whose difference is
    finite, the difference taken in float64 (exact for float32 operands); ``w`` is rounded
    to float32 first, as the kept copy is, so unchanged float64 weights give 0.

    With ``refresh`` (and an update computed) the kept copy is brought forward in the same
    pass: each ``previous[name]`` is overwritten in place with ``float32(weights[name])``
    (round to nearest), so the caller keeps one set of float32 buffers for the whole run
    and the step reads each weight once, reads the copy once and writes it once. Without
    an update (``update`` None: first step, a layer added, removed or reshaped) nothing is
    written and the caller makes a new copy.

    Args:
        weights: layer name -> weight array (float16/32/64, any shape).
        previous: the same layers' weights at the previous recorded step (float32 copies;
            other dtypes are converted to float32), or None; ``update_sum_sq`` is None
            unless every layer is present with the same shape.
        refresh: overwrite ``previous`` with this step's weights (see above).

    Returns:
        WeightSummaries aligned with ``weights``.

    Raises:
        TypeError / ValueError: as :func:`producer.summary.summarize` (non-float dtype,
            empty array, empty mapping).
        ValueError: ``refresh`` with an update and a ``previous`` array that is not a
            writeable, C-contiguous float32 ``numpy.ndarray`` (checked before anything is
            written).
    """
    if not weights:
        raise ValueError("no weights to summarise (empty mapping)")
    kept = _kept_copies(weights, previous, refresh)
    refresh = refresh and kept is not None
    module = backend.kernels()
    if module is not None:
        try:
            return _summarize_numba(module, weights, kept, refresh)
        except backend.KernelError as exc:
            backend.kernel_failed(exc)  # re-raises when numba was forced
    return _summarize_numpy(weights, kept, refresh)


def _kept_copies(
    weights: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray] | None,
    refresh: bool,
) -> list[np.ndarray] | None:
    """The kept copies as flat C-contiguous float32 arrays aligned with ``weights`` (views
    of ``previous`` where possible, always with ``refresh``), or None when there is no
    update (no ``previous``, other layers, or a shape changed).

    Raises:
        ValueError: ``refresh`` and a copy that is not a writeable C-contiguous float32
            ``numpy.ndarray`` (before anything is written).
        TypeError / ValueError: with ``refresh``, a weight array that
            :func:`producer.summary.summarize` would reject (before anything is written).
    """
    if previous is None or previous.keys() != weights.keys():
        return None
    flats = []
    bad = []
    for name, w in weights.items():
        if refresh:  # input errors must surface before any copy is written
            as_float_array(name, w)
        p = previous[name]
        if type(p) is np.ndarray and type(w) is np.ndarray:
            if p.shape != w.shape:
                return None
            flags = p.flags
            dtype = p.dtype
            if (dtype is _F32 or dtype == _F32) and flags.c_contiguous and (
                    flags.writeable or not refresh):
                flats.append(p.ravel())  # C-contiguous: a view, what refresh writes through
                continue
        elif np.shape(p) != np.shape(w):
            return None
        bad.append(name)
        flats.append(np.ascontiguousarray(p, dtype=_F32).reshape(-1))
    if refresh and bad:
        raise ValueError(f"refresh needs writeable C-contiguous float32 arrays in previous; "
                         f"not so for {bad[:5]!r}")
    return flats


def _summarize_numba(
    kernels: ModuleType, weights: Mapping[str, np.ndarray], kept: list[np.ndarray] | None,
    refresh: bool,
) -> WeightSummaries:
    count = len(weights)
    out = np.empty((8, count), np.float64)  # S1..S4, update, min, max, nonfinite
    counts = np.zeros((count, EXP_HIST_BINS), np.int64)  # the kernels add to it
    tables = backend.histogram_tables(kernels)
    no_prev = np.zeros(0, np.float32)
    f32, f64 = kernels.weights_f32, kernels.weights_f64
    # One compiled call per layer and a few attribute reads, nothing else per layer.
    for i, (name, value) in enumerate(weights.items()):
        arr = as_float_array(name, value)
        dtype = arr.dtype
        if dtype is _F32 or dtype == _F32:
            kernel, flat = f32, arr.ravel()
        elif dtype == _F64:
            kernel, flat = f64, arr.ravel()
        else:  # float16 -> float32 is exact (NaN/Inf kept); numba has no float16
            kernel, flat = f32, arr.astype(_F32).ravel()
        try:
            kernel(flat, no_prev if kept is None else kept[i], kept is not None, refresh, out,
                   i, counts, tables, backend.BINARY32_EXPONENT_LUT, EXP_HIST_MIN)
        except Exception as exc:  # compilation/typing failure: never break training
            raise backend.KernelError(f"{type(exc).__name__}: {exc}") from exc
    nonfinite = out[7].astype(np.int64)
    finite = counts.sum(axis=1)  # each histogram row counts the layer's finite weights
    numel = finite + nonfinite
    power = PowerSums(finite, out[0], out[1], out[2], out[3], out[5], out[6],
                      nonfinite).saturate()
    moments = WeightMoments(power, ExponentHistogram(counts, nonfinite.copy()))
    update = None
    if kept is not None:
        update = SumOfSquares(numel.copy(), np.minimum(out[4], MAX_DOUBLE))
    return WeightSummaries(moments, update)


def _summarize_numpy(
    weights: Mapping[str, np.ndarray], kept: list[np.ndarray] | None, refresh: bool,
) -> WeightSummaries:
    """The NumPy backend: the mergeable statistics' own ``from_layers`` (float64 chunks);
    with ``refresh``, the kept copies are overwritten afterwards (one ``copyto`` per
    layer)."""
    flats = [as_float_array(n, w).reshape(-1) for n, w in weights.items()]
    power = PowerSums.from_layers(flats).saturate()
    moments = WeightMoments(power, ExponentHistogram.from_layers(flats))
    update = None
    if kept is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            change = summarize({
                n: flat.astype(np.float32).astype(np.float64) - prev.astype(np.float64)
                for n, flat, prev in zip(weights, flats, kept, strict=True)
            })
        update = SumOfSquares.from_columns(change.numel, change.sum_sq)
        if refresh:
            for flat, prev in zip(flats, kept, strict=True):
                np.copyto(prev, flat, casting="same_kind")
    return WeightSummaries(moments, update)
