"""Significance thresholds and robust fences shared by the analyses.

The reference (trustformers-debug) classifies with fixed cut-offs
(``avg < 1e-5``, ``ratio <= 1.2``...). gradstream replaces those with standard statistical
tests at a significance level ``alpha`` (:data:`DEFAULT_ALPHA`, the user can change it) so
that a class means "this is unlikely to be noise" whatever the units, the layer size or the
run length.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_ALPHA = 0.01
"""Two-sided significance level of every test in the analyses (the conventional 1 %)."""


def family_alpha(alpha: float, tests: int) -> float:
    """Per-test level that keeps the family-wise error rate of ``tests`` tests at ``alpha``
    (Bonferroni): ``alpha / max(tests, 1)``.

    One test per layer of a 1000-layer model at 1 % would flag about ten layers of pure
    noise; with this correction the chance of any false flag in the whole model is
    ``alpha``.

    Args:
        alpha: family-wise level in (0, 1).
        tests: number of tests in the family (layers, layer pairs...).

    Returns:
        The per-test level.

    Raises:
        ValueError: ``alpha`` outside (0, 1).
    """
    _check_alpha(alpha)
    return alpha / max(tests, 1)


def z_critical(alpha: float = DEFAULT_ALPHA) -> float:
    """Two-sided critical value of the standard normal: ``Phi^-1(1 - alpha / 2)``.

    Args:
        alpha: significance level in (0, 1).

    Returns:
        The quantile, e.g. 2.5758 for ``alpha = 0.01``.

    Raises:
        ValueError: ``alpha`` outside (0, 1).
    """
    _check_alpha(alpha)
    from scipy.special import ndtri

    return float(ndtri(1.0 - alpha / 2.0))


def t_critical(dof: np.ndarray | float, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """Two-sided critical values of Student's t with ``dof`` degrees of freedom.

    Args:
        dof: degrees of freedom (array or scalar, float64); entries < 1 give NaN.
        alpha: significance level in (0, 1).

    Returns:
        float64 array shaped like ``dof``: ``t^-1_dof(1 - alpha / 2)``.

    Raises:
        ValueError: ``alpha`` outside (0, 1).
    """
    _check_alpha(alpha)
    from scipy.special import stdtrit

    d = np.asarray(dof, dtype=np.float64)
    out = np.full(d.shape, np.nan)
    ok = d >= 1
    out[ok] = stdtrit(d[ok], 1.0 - alpha / 2.0)
    return out


def max_normal_z(n: np.ndarray | float, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """Largest |z| that the extreme of ``n`` normal samples exceeds with probability ``alpha``.

    For ``n`` independent samples of a normal distribution, ``P(max_i |z_i| <= z) =
    (2 Phi(z) - 1)^n``; solving ``(2 Phi(z) - 1)^n = 1 - alpha`` gives
    ``z = Phi^-1((1 + (1 - alpha)^(1/n)) / 2)`` (the extreme-value test behind Grubbs'
    outlier test, with known moments). Computed with ``log1p``/``expm1`` so that it stays
    accurate for ``n`` in the billions.

    Args:
        n: sample counts (>= 1), array or scalar.
        alpha: significance level in (0, 1).

    Returns:
        float64 array shaped like ``n``; NaN where ``n < 1``.
    """
    _check_alpha(alpha)
    from scipy.special import ndtri

    count = np.asarray(n, dtype=np.float64)
    out = np.full(count.shape, np.nan)
    ok = count >= 1
    # 1 - (1 - alpha)^(1/n), accurate for large n.
    tail = -np.expm1(np.log1p(-alpha) / count[ok])
    out[ok] = ndtri(1.0 - tail / 2.0)
    return out


def tukey_fences(values: np.ndarray) -> tuple[float, float]:
    """Tukey's fences ``(Q1 - 1.5 IQR, Q3 + 1.5 IQR)`` of the finite entries (Tukey 1977,
    *Exploratory Data Analysis*): values outside are outliers of the batch.

    Quartiles are NumPy's default (linear interpolation, type 7).

    Args:
        values: float64 array of any shape; non-finite entries are ignored.

    Returns:
        ``(low, high)``; ``(-inf, inf)`` when fewer than 4 finite values (too few to call
        anything an outlier).
    """
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    if finite.size < 4:
        return -math.inf, math.inf
    q1, q3 = np.percentile(finite, [25.0, 75.0])
    iqr = q3 - q1
    return float(q1 - 1.5 * iqr), float(q3 + 1.5 * iqr)


def pearson_significant(r: np.ndarray, n: np.ndarray, alpha: float = DEFAULT_ALPHA) -> np.ndarray:
    """Whether Pearson correlations differ from zero at level ``alpha`` (two-sided).

    Fisher's transformation: ``atanh(r) * sqrt(n - 3)`` is approximately standard normal
    under no correlation (Fisher 1921); significant when it exceeds :func:`z_critical`.
    ``|r| = 1`` is significant for ``n >= 4``.

    Args:
        r: correlations in [-1, 1] (NaN allowed: not significant).
        n: number of paired samples behind each correlation.
        alpha: significance level.

    Returns:
        bool array shaped like ``r``.
    """
    rr = np.clip(np.asarray(r, dtype=np.float64), -1.0, 1.0)
    nn = np.asarray(n, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        stat = np.abs(np.arctanh(rr)) * np.sqrt(np.maximum(nn - 3.0, 0.0))
    return np.nan_to_num(stat, nan=0.0) > z_critical(alpha)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
