"""Weight statistics of the watched layers (producer setting ``weight_stats``, off by default).

Per layer, over this rank's shard of the weights, everything exactly mergeable across ranks
(power sums add, extremes take min / max, counts add; ``schemas.wire``):

- ``sum_sq`` = sum w^2 (the weight norm squared) and ``update_sum_sq`` =
  sum (w_t - w_prev)^2, the squared norm of the change since the previous recorded step
  (needs one float32 copy of the watched weights, kept by the producer);
- the distribution of seed 004 (``WeightDistributionAnalyzer``) as power sums over the
  finite weights: ``sum`` = sum w, ``sum_cube`` = sum w^3, ``sum_quad`` = sum w^4, and
  ``min`` / ``max`` (0.0 when a layer has no finite weight), ``nonfinite`` = count of NaN/Inf
  weights, plus the base-2 exponent histogram of |w| (same layout as the gradient
  histogram, :func:`producer.summary.exp_hist_edges`; column 0 counts exact zeros).

The consumer derives mean, variance, skewness and kurtosis from the power sums
(``analysis.weights``). All sums accumulate in float64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from producer.summary import summarize

_CHUNK = 1 << 18  # elements per float64 scratch chunk (2 MiB)


@dataclass(frozen=True, slots=True)
class WeightStatistics:
    """Weight statistics of k layers, aligned with the gradient summaries of the step.

    Attributes:
        sum_sq: float64[k] sum w^2. update_sum_sq: float64[k] or None (first step).
        sum, sum_cube, sum_quad: float64[k] sum w, sum w^3, sum w^4 (finite weights).
        min, max: float64[k] extremes of the finite weights (0.0 when none).
        nonfinite: int64[k] NaN/Inf weights.
        exp_hist: int64[k, EXP_HIST_BINS] exponent histogram of |w| (finite weights).
    """

    sum_sq: np.ndarray
    update_sum_sq: np.ndarray | None
    sum: np.ndarray
    sum_cube: np.ndarray
    sum_quad: np.ndarray
    min: np.ndarray
    max: np.ndarray
    nonfinite: np.ndarray
    exp_hist: np.ndarray


def _moments(flat: np.ndarray, buf: np.ndarray) -> tuple[float, float, float, float, float]:
    """(sum w, sum w^3, sum w^4, min, max) over the finite elements of a 1-D float array,
    accumulated in float64 chunk by chunk (``buf``: float64 scratch of ``_CHUNK``)."""
    s1 = s3 = s4 = 0.0
    lo, hi = np.inf, -np.inf
    sq = np.empty_like(buf)
    for start in range(0, flat.size, _CHUNK):
        part = flat[start:start + _CHUNK]
        x = buf[:part.size]
        np.copyto(x, part, casting="unsafe")
        finite = np.isfinite(x)
        if not finite.all():
            x = x[finite]
            if x.size == 0:
                continue
        w2 = np.multiply(x, x, out=sq[:x.size])
        s1 += float(np.add.reduce(x))
        s3 += float(np.dot(w2, x))
        s4 += float(np.dot(w2, w2))
        lo = min(lo, float(x.min()))
        hi = max(hi, float(x.max()))
    if lo > hi:  # no finite weight
        lo = hi = 0.0
    return s1, s3, s4, lo, hi


def weight_statistics(
    weights: Mapping[str, np.ndarray], previous: Mapping[str, np.ndarray] | None = None,
) -> WeightStatistics:
    """Compute :class:`WeightStatistics` of the layers of ``weights`` (in mapping order).

    Args:
        weights: layer name -> weight array (float16/32/64, any shape).
        previous: the same layers' weights at the previous recorded step (float32 copies),
            or None; ``update_sum_sq`` is None unless every layer is present with the same
            shape.

    Returns:
        WeightStatistics aligned with ``weights``.

    Raises:
        TypeError / ValueError: as :func:`producer.summary.summarize` (non-float dtype,
            empty array).
    """
    base = summarize(weights, histogram=True)
    k = len(base)
    sums = np.empty((5, k), np.float64)
    buf = np.empty(_CHUNK, np.float64)
    for i, w in enumerate(weights.values()):
        sums[:, i] = _moments(np.asarray(w).reshape(-1), buf)
    update = None
    if previous is not None and previous.keys() == weights.keys() and all(
        np.shape(previous[n]) == np.shape(w) for n, w in weights.items()
    ):
        update = summarize({
            n: np.asarray(w, dtype=np.float32) - previous[n] for n, w in weights.items()
        }).sum_sq
    big = np.finfo(np.float64).max
    with np.errstate(invalid="ignore"):
        clipped = np.clip(sums[:3], -big, big)  # overflow saturates like the gradient sums
    assert base.exp_hist is not None
    return WeightStatistics(
        sum_sq=base.sum_sq, update_sum_sq=update, sum=clipped[0], sum_cube=clipped[1],
        sum_quad=clipped[2], min=sums[3], max=sums[4], nonfinite=base.nonfinite,
        exp_hist=base.exp_hist,
    )
