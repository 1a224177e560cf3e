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
  :func:`producer.summary.exp_hist_edges`; column 0 counts exact zeros).

Mean, variance, skewness and kurtosis follow from the power sums
(:meth:`schemas.stats.PowerSums.get`). All sums accumulate in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from producer import summary as summary_mod
from producer.summary import EXP_HIST_BINS, EXP_HIST_MIN, summarize
from schemas.stats import ExponentHistogram, PowerSums, SumOfSquares, WeightMoments

_MAX_DOUBLE = float(np.finfo(np.float64).max)

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
) -> WeightSummaries:
    """Compute the :class:`WeightSummaries` of the layers of ``weights`` (in mapping order).

    With the numba backend (:func:`producer.summary.active_backend`) each layer is read
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

    Args:
        weights: layer name -> weight array (float16/32/64, any shape).
        previous: the same layers' weights at the previous recorded step (float32 copies;
            other dtypes are converted to float32), or None; ``update_sum_sq`` is None
            unless every layer is present with the same shape.

    Returns:
        WeightSummaries aligned with ``weights``.

    Raises:
        TypeError / ValueError: as :func:`producer.summary.summarize` (non-float dtype,
            empty array, empty mapping).
    """
    if not weights:
        raise ValueError("no weights to summarise (empty mapping)")
    with_update = previous is not None and previous.keys() == weights.keys() and all(
        np.shape(previous[n]) == np.shape(w) for n, w in weights.items()
    )
    kernels = summary_mod._kernels()
    if kernels is not None:
        try:
            return _summarize_numba(kernels, weights, previous if with_update else None)
        except summary_mod._KernelError as exc:
            summary_mod._kernel_failed(exc)  # re-raises when numba was forced
    return _summarize_numpy(weights, previous if with_update else None)


def _summarize_numba(
    kernels: ModuleType, weights: Mapping[str, np.ndarray],
    previous: Mapping[str, np.ndarray] | None,
) -> WeightSummaries:
    count = len(weights)
    out = np.empty((7, count), np.float64)  # S1..S4, update, min, max (see kernels)
    nonfinite = np.empty(count, np.int64)
    counts = np.empty((count, EXP_HIST_BINS), np.int64)
    numel = np.empty(count, np.int64)
    no_prev = np.zeros(0, np.float32)
    for i, (name, value) in enumerate(weights.items()):
        arr = summary_mod._as_float_array(name, value)
        if arr.dtype == np.float64:
            kernel, flat, lut = kernels.weights_f64, arr.ravel(), summary_mod._LUT64
        else:  # float16 -> float32 is exact (NaN/Inf kept); numba has no float16
            flat = arr.ravel() if arr.dtype == np.float32 else arr.astype(np.float32).ravel()
            kernel, lut = kernels.weights_f32, summary_mod._LUT32
        prev = no_prev
        if previous is not None:
            prev = np.ascontiguousarray(previous[name], dtype=np.float32).reshape(-1)
        numel[i] = flat.size
        try:
            kernel(flat, prev, previous is not None, out, nonfinite, i, counts, lut,
                   EXP_HIST_MIN)
        except Exception as exc:  # compilation/typing failure: never break training
            raise summary_mod._KernelError(f"{type(exc).__name__}: {exc}") from exc
    power = PowerSums(numel - nonfinite, out[0], out[1], out[2], out[3], out[5], out[6],
                      nonfinite).saturate()
    moments = WeightMoments(power, ExponentHistogram(counts, nonfinite.copy()))
    update = None
    if previous is not None:
        update = SumOfSquares(numel.copy(), np.minimum(out[4], _MAX_DOUBLE))
    return WeightSummaries(moments, update)


def _summarize_numpy(
    weights: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray] | None,
) -> WeightSummaries:
    """The NumPy backend: the mergeable statistics' own ``from_layers`` (float64 chunks)."""
    flats = [summary_mod._as_float_array(n, w).reshape(-1) for n, w in weights.items()]
    power = PowerSums.from_layers(flats).saturate()
    moments = WeightMoments(power, ExponentHistogram.from_layers(flats))
    update = None
    if previous is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            change = summarize({
                n: flat.astype(np.float32).astype(np.float64)
                - np.asarray(previous[n], np.float32).reshape(-1).astype(np.float64)
                for n, flat in zip(weights, flats, strict=True)
            })
        update = SumOfSquares.from_columns(change.numel, change.sum_sq)
    return WeightSummaries(moments, update)
