"""Distribution statistics of sets of weights from their mergeable sums: the moments from
the power sums, and the entropy of the base-2 exponent histogram.

This module is self-contained (NumPy only) so that the weight analysis can later take its
moments from mergeable statistic objects instead, without touching the rest.

From the power sums ``S_k = sum w^k`` of ``n`` weights (central moments by the binomial
expansion): ``mean = S1 / n``, ``var = S2 / n - mean^2``, ``m3 = S3 / n - 3 mean S2 / n +
2 mean^3``, ``m4 = S4 / n - 4 mean S3 / n + 6 mean^2 S2 / n - 3 mean^4``; ``skewness = m3 /
std^3``, excess ``kurtosis = m4 / std^4 - 3`` (0 when std = 0, as in trustformers-debug's
``WeightAnalyzer``). In float64 these are accurate while ``std / |mean|`` is not tiny
(cancellation grows like ``(mean / std)^k``), which holds for trained weight tensors.
"""

from __future__ import annotations

import numpy as np

__all__ = ["histogram_entropy_bits", "moments_from_power_sums"]


def moments_from_power_sums(
    n: np.ndarray, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray, s4: np.ndarray
) -> dict[str, np.ndarray]:
    """Population mean, standard deviation, skewness and excess kurtosis of ``K`` sets of
    values, each given by its count and power sums (formulas: module docstring).

    Args:
        n: float64 ``[K]`` values per set (finite weights); s1..s4: float64 ``[K]``,
            ``sum w^k`` over each set.

    Returns:
        ``{"mean", "std", "skewness", "kurtosis"}``, float64 ``[K]`` each; all NaN where
        ``n = 0``; skewness 0 where ``n < 3`` or std = 0, kurtosis 0 where ``n < 4`` or
        std = 0.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s1 / n
        e2, e3, e4 = s2 / n, s3 / n, s4 / n
        var = np.maximum(e2 - mean * mean, 0.0)
        m3 = e3 - 3.0 * mean * e2 + 2.0 * mean**3
        m4 = e4 - 4.0 * mean * e3 + 6.0 * mean**2 * e2 - 3.0 * mean**4
        std = np.sqrt(var)
        ok = std > 0
        skew = np.where(ok & (n >= 3), m3 / np.where(ok, std**3, 1.0), 0.0)
        kurt = np.where(ok & (n >= 4), m4 / np.where(ok, var * var, 1.0) - 3.0, 0.0)
    empty = ~(n > 0)
    return {
        "mean": np.where(empty, np.nan, mean),
        "std": np.where(empty, np.nan, std),
        "skewness": np.where(empty, np.nan, skew),
        "kurtosis": np.where(empty, np.nan, kurt),
    }


def histogram_entropy_bits(counts: np.ndarray) -> float:
    """Shannon entropy ``-sum_k p_k log2 p_k`` in bits of a histogram, ``p_k = c_k / sum c``.

    Args:
        counts: float64 ``[B]`` non-negative bin counts with a positive sum.

    Returns:
        The entropy, >= 0 (0.0 when one bin holds everything).
    """
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum()) + 0.0
