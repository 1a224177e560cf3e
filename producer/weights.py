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

import numpy as np

from producer.summary import summarize
from schemas.stats import ExponentHistogram, PowerSums, SumOfSquares, WeightMoments

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

    The exponent histogram and the non-finite counts come from the fused gradient pass
    (:func:`producer.summary.summarize`, numba when available); the power sums and extremes
    from :meth:`schemas.stats.PowerSums.from_layers` (NumPy, float64 chunks); the two are checked
    to agree on the finite / non-finite counts when they are put together in a
    :class:`schemas.stats.WeightMoments`. Sums that overflow saturate at +-max double.

    Args:
        weights: layer name -> weight array (float16/32/64, any shape).
        previous: the same layers' weights at the previous recorded step (float32 copies),
            or None; ``update_sum_sq`` is None unless every layer is present with the same
            shape.

    Returns:
        WeightSummaries aligned with ``weights``.

    Raises:
        TypeError / ValueError: as :func:`producer.summary.summarize` (non-float dtype,
            empty array).
    """
    base = summarize(weights, histogram=True)
    assert base.exp_hist is not None
    power = PowerSums.from_layers([np.asarray(w) for w in weights.values()]).saturate()
    moments = WeightMoments(power, ExponentHistogram(base.exp_hist, base.nonfinite))
    update = None
    if previous is not None and previous.keys() == weights.keys() and all(
        np.shape(previous[n]) == np.shape(w) for n, w in weights.items()
    ):
        change = summarize({
            n: np.asarray(w, dtype=np.float32) - previous[n] for n, w in weights.items()
        })
        update = SumOfSquares.from_columns(change.numel, change.sum_sq)
    return WeightSummaries(moments, update)

