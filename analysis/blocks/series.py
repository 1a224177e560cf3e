"""Per-layer time-series statistics, vectorised over layers.

Every function takes ``x``: float64 ``[L, W]``, one row per layer, NaN where the layer has
no sample (the right-aligned :class:`analysis.blocks.gradient_arrays.Packed` layout, or any layout
where a row's samples are in step order), and returns one value per row. Each is a constant
number of passes over the array: O(L x W) time, O(L x W) temporary memory.

"Consecutive" pairs are adjacent columns that are both present; with the packed layout
those are exactly a layer's consecutive samples.

The per-layer flow statistics follow trustformers-debug's ``gradient_visualization`` and
``enhanced_analysis`` modules (the reference, trustformers-debug); each docstring names the
reference function and says where gradstream departs from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from analysis.blocks.significance import DEFAULT_ALPHA, t_critical, z_critical

RowsT = TypeVar("RowsT")


def concat_rows(parts: Sequence[RowsT]) -> RowsT:
    """Join the per-chunk results of a row-wise statistic computed a chunk of layers at a
    time (:func:`analysis.blocks.gradient_arrays.layer_chunks`) into the result over every
    layer, in chunk order.

    Args:
        parts: one result per chunk, all of one kind: a NumPy array (joined along axis 0),
            a tuple of them, or a dataclass whose array fields are per row (as
            :class:`Moments`, :class:`Trend`, :class:`TurningPoints`).

    Returns:
        The same kind of result over the rows of every part.

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("concat_rows needs at least one chunk")
    first = parts[0]
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)  # type: ignore[return-value]
    if isinstance(first, tuple):
        return tuple(concat_rows(list(column)) for column in zip(*parts, strict=True))  # type: ignore[return-value]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{  # type: ignore[type-var]
            f.name: concat_rows([getattr(part, f.name) for part in parts])
            for f in dataclasses.fields(first)
        })
    raise TypeError(f"concat_rows cannot join {type(first).__name__}")


@dataclass(frozen=True)
class Moments:
    """Population moments per row (the reference ``compute_detailed_gradient_stats``).

    Attributes (float64 ``[L]`` unless noted):
        n: int64 samples.
        mean: ``sum x / n``.
        variance: ``sum (x - mean)^2 / n`` (population, as in the reference).
        std: ``sqrt(variance)``.
        skewness: ``sum ((x - mean) / std)^3 / n``; 0 when ``std == 0`` (as in the reference).
        kurtosis: excess kurtosis ``sum ((x - mean) / std)^4 / n - 3``; 0 when ``std == 0``.
    """

    n: np.ndarray
    mean: np.ndarray
    variance: np.ndarray
    std: np.ndarray
    skewness: np.ndarray
    kurtosis: np.ndarray


def moments(x: np.ndarray) -> Moments:
    """Mean, variance, skewness and excess kurtosis of every row (two passes, centred sums).

    Args:
        x: float64 ``[L, W]``, NaN = absent.

    Returns:
        :class:`Moments`; rows without samples get NaN.
    """
    mask = ~np.isnan(x)
    dense = bool(mask.all())
    n = np.full(x.shape[0], x.shape[1]) if dense else mask.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = (x if dense else np.where(mask, x, 0.0)).sum(axis=1) / n
        d = x - mean[:, None]
        if not dense:
            d[~mask] = 0.0
        d2 = np.square(d)
        m2 = d2.sum(axis=1) / n
        np.multiply(d, d2, out=d)
        m3 = d.sum(axis=1) / n
        np.square(d2, out=d2)
        m4 = d2.sum(axis=1) / n
        std = np.sqrt(m2)
        positive = std > 0
        skew = np.where(positive, m3 / np.where(positive, std**3, 1.0), 0.0)
        kurt = np.where(positive, m4 / np.where(positive, m2 * m2, 1.0) - 3.0, 0.0)
    return Moments(n.astype(np.int64), mean, m2, std, skew, kurt)


def nearest_rank_percentiles(
    x: np.ndarray, n: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Median, 5th and 95th percentiles of every row, as the reference defines
    them.

    With ``s`` the row's sorted samples (``n`` of them): ``median`` is the middle sample
    (mean of the two middle ones for even ``n``), ``p5 = s[floor(0.05 n)]``,
    ``p95 = s[min(floor(0.95 n), n - 1)]`` (nearest-rank style, no interpolation).

    Args:
        x: float64 ``[L, W]``, NaN = absent.
        n: int64 ``[L]`` samples per row (>= 1 where a result is wanted).

    Returns:
        ``(median, p5, p95)``, float64 ``[L]`` each; NaN for rows with ``n == 0``.
        The four ranks are selected with :func:`order_statistics` (NaN last), O(L W).
    """
    safe = np.maximum(n, 1)
    hi = safe // 2
    lo = np.where(safe % 2 == 0, hi - 1, hi)
    ranks = np.stack([lo, hi, np.floor(safe * 0.05).astype(np.int64),
                      np.minimum(np.floor(safe * 0.95).astype(np.int64), safe - 1)], axis=1)
    s = order_statistics(x, ranks)
    median = (s[:, 0] + s[:, 1]) / 2.0
    p5, p95 = s[:, 2], s[:, 3]
    empty = n == 0
    for arr in (median, p5, p95):
        arr[empty] = np.nan
    return median, p5, p95


def order_statistics(x: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """``np.sort(x, axis=1)[i, ranks[i, j]]``: the entries of each row's ascending order
    (NaN last, as :func:`numpy.sort` places it) at the given ranks, without sorting.

    The rows sharing one set of ranks are selected together by :func:`numpy.partition`
    (introselect, O(W) per rank and row instead of the sort's O(W log W); both order NaN
    after every number, NumPy documentation of ``numpy.sort`` and ``numpy.partition``).
    An entry of a row's order is one of the row's values, so it is the same number
    whichever algorithm finds it, except between ``-0.0`` and ``0.0``, which compare equal
    but print differently: a block holding a ``-0.0`` is sorted as before.

    Args:
        x: float64 ``[L, W]``.
        ranks: int64 ``[L, K]`` positions in ``[0, W)`` (a negative one counts from the
            end, as a NumPy index).

    Returns:
        float64 ``[L, K]``; all NaN when ``W == 0`` (no sample, so no order: a row
        without samples holds only absences, which NaN stands for).

    Raises:
        IndexError: a rank ``>= W`` where ``W >= 1``.

    >>> order_statistics(np.array([[3.0, np.nan, 1.0]]), np.array([[0, 2]]))
    array([[ 1., nan]])
    >>> order_statistics(np.empty((2, 0)), np.zeros((2, 1), dtype=np.int64))
    array([[nan],
           [nan]])
    """
    if x.shape[1] == 0:
        return np.full(ranks.shape, np.nan)
    rows = np.arange(x.shape[0])
    negative = np.signbit(x)
    if (x.size == 0 or int(ranks.min(initial=0)) < 0 or int(ranks.max(initial=0)) >= x.shape[1]
            or (negative.any() and bool((negative & (x == 0)).any()))):
        return np.sort(x, axis=1)[rows[:, None], ranks]
    del negative
    out = np.empty(ranks.shape)
    groups, which = np.unique(ranks, axis=0, return_inverse=True)
    if groups.shape[0] == 1:  # every row alike (every layer with every sample)
        out[:] = np.partition(x, np.unique(groups[0]), axis=1)[:, groups[0]]
        return out
    which = which.reshape(-1)
    for g, kth in enumerate(groups):
        members = np.flatnonzero(which == g)
        out[members] = np.partition(x[members], np.unique(kth), axis=1)[:, kth]
    return out


def flow_consistency(x: np.ndarray) -> np.ndarray:
    """Flow consistency (``compute_flow_consistency``): ``1 / (1 + mean_t r_t)`` with the relative
    change ``r_t = |x_t - x_{t-1}| / x_{t-1}``.

    The reference adds 1e-8 to the denominator; here a zero previous sample gives ``r_t = 0`` if
    the next is zero too (no change) and ``r_t = inf`` otherwise (flow appearing from
    nothing), making the consistency 0, which is the reference's limit.

    Returns:
        float64 ``[L]`` in [0, 1]; 1.0 with fewer than two samples (as in the reference).
    """
    prev = x[:, :-1]
    change = np.abs(np.diff(x, axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(prev > 0, change / prev, np.where(change == 0, 0.0, np.inf))
    valid = ~np.isnan(change)
    pairs = valid.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_rel = np.where(valid, rel, 0.0).sum(axis=1) / pairs
        out = 1.0 / (1.0 + mean_rel)
    return np.where(pairs > 0, out, 1.0)


def step_consistency(x: np.ndarray) -> np.ndarray:
    """Per-sample ``consistency_score`` of the flow network:
    ``1 - |x_t - x_{t-1}| / (x_t + x_{t-1})``, 1.0 for a row's first sample (as in the
    reference) and for two zero samples (0/0: no change; the reference's 1e-8 gives the same).

    Returns:
        float64 ``[L, W]`` in [0, 1]; NaN where ``x`` is absent.
    """
    out = np.full(x.shape, np.nan)
    if x.shape[1] == 0:
        return out
    prev, cur = x[:, :-1], x[:, 1:]
    total = prev + cur
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(total > 0, 1.0 - np.abs(cur - prev) / total, 1.0)
    out[:, 1:] = np.where(np.isnan(total), np.nan, score)
    first = np.isnan(np.concatenate([np.full((x.shape[0], 1), np.nan), prev], axis=1))
    out[first & ~np.isnan(x)] = 1.0
    return out


def bottleneck_score(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Bottleneck score (``compute_bottleneck_score``): ``1 - min(min_t x / mean_t x, 1)``; 1.0 when
    the mean is 0 (as in the reference).

    Args:
        x: float64 ``[L, W]``; mean: float64 ``[L]`` its row means.

    Returns:
        float64 ``[L]`` in [0, 1]: how far the weakest step falls below the typical one.
    """
    low = np.nanmin(np.where(np.isnan(x), np.inf, x), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 1.0 - np.minimum(low / mean, 1.0)
    return np.where(mean > 0, out, 1.0)


def information_flow_rate(x: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Information flow rate (``compute_information_flow_rate``): ``sum_t |x_t - x_{t-1}| / n``, the
    total variation of the norm per sample (norm units per step).

    Returns:
        float64 ``[L]``; 0.0 with fewer than two samples (as in the reference).
    """
    change = np.abs(np.diff(x, axis=1))
    total = np.where(np.isnan(change), 0.0, change).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = total / n
    return np.where(n >= 2, out, 0.0)


def smoothness(x: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Smoothness index: ``1 / (1 + mean_t |x_t - 2 x_{t-1} + x_{t-2}| / mean_t x)``.

    The reference ``compute_smoothness_index`` uses the mean absolute second difference in norm
    units, so a layer with norms around 1e-6 is always "smooth" and one around 1e3 never;
    dividing by the layer's mean norm makes it scale-free (a curvature relative to the
    level). A row whose mean is 0 (all zero) is perfectly smooth (1.0).

    Returns:
        float64 ``[L]`` in (0, 1]; 1.0 with fewer than three samples (as in the reference).
    """
    d2 = np.abs(x[:, 2:] - 2.0 * x[:, 1:-1] + x[:, :-2])
    valid = ~np.isnan(d2)
    count = valid.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_d2 = np.where(valid, d2, 0.0).sum(axis=1) / count
        out = 1.0 / (1.0 + mean_d2 / mean)
    out = np.where(mean > 0, out, 1.0)
    return np.where(count > 0, out, 1.0)


def stability(std: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """Stability measure (``compute_stability_measure``): ``1 / (1 + std / mean)`` (one over
    one plus the coefficient of variation).

    The reference returns 0 for a zero mean; a row that is zero at every step does not vary at
    all, so it gets 1.0 here (constant = perfectly stable). Empty rows get NaN.

    Returns:
        float64 ``[L]`` in (0, 1].
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        out = 1.0 / (1.0 + std / mean)
    return np.where(mean > 0, out, np.where(np.isnan(mean), np.nan, 1.0))


@dataclass(frozen=True)
class Trend:
    """Ordinary least squares ``y = a + b * step`` per row.

    Attributes (float64 ``[L]``):
        n: samples used.
        slope: ``b`` (y units per optimiser step); NaN with < 2 distinct steps.
        intercept_last: fitted ``y`` at the row's last step.
        r2: coefficient of determination ``Sxy^2 / (Sxx Syy)``; 0 when ``y`` is constant.
        t: ``b / se(b)``, ``se(b)^2 = (Syy - b Sxy) / ((n - 2) Sxx)``; +-inf for a perfect
            non-flat fit, 0 for a flat one; NaN with n < 3.
        significant: bool ``[L]``, ``|t| > t_{n-2, 1 - alpha/2}`` (two-sided t-test of
            the slope).
        span: last step - first step of the row's samples.
    """

    n: np.ndarray
    slope: np.ndarray
    intercept_last: np.ndarray
    r2: np.ndarray
    t: np.ndarray
    significant: np.ndarray
    span: np.ndarray


def trend(y: np.ndarray, steps: np.ndarray, alpha: float = DEFAULT_ALPHA) -> Trend:
    """Least-squares line of every row against its optimiser steps, with a t-test.

    Args:
        y: float64 ``[L, W]``, NaN (or +-inf) = not used.
        steps: float64 ``[L, W]`` (or broadcastable) step of each sample.
        alpha: significance level of the slope test.

    Returns:
        :class:`Trend`.
    """
    steps = np.broadcast_to(steps, y.shape)
    mask = np.isfinite(y) & ~np.isnan(steps)
    if y.size and steps.strides[0] == 0 and mask.all():
        return _dense_trend(y, steps[0], alpha)
    n = mask.sum(axis=1).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        x = np.where(mask, steps, 0.0)
        yy = np.where(mask, y, 0.0)
        mx = x.sum(axis=1) / n
        my = yy.sum(axis=1) / n
        dx = np.where(mask, x - mx[:, None], 0.0)
        dy = np.where(mask, yy - my[:, None], 0.0)
        sxx = np.einsum("ij,ij->i", dx, dx)
        sxy = np.einsum("ij,ij->i", dx, dy)
        syy = np.einsum("ij,ij->i", dy, dy)
        last = np.max(np.where(mask, steps, -np.inf), axis=1)
        first = np.min(np.where(mask, steps, np.inf), axis=1)
    return _finish_trend(n, sxx, sxy, syy, my, mx, first, last, alpha)


def _finish_trend(
    n: np.ndarray, sxx: np.ndarray, sxy: np.ndarray, syy: np.ndarray, my: np.ndarray,
    mx: np.ndarray, first: np.ndarray, last: np.ndarray, alpha: float,
) -> Trend:
    """Slope, R^2, t-test from the centred sums (shared by both layouts)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(sxx > 0, sxy / sxx, np.nan)
        r2 = np.where(syy > 0, sxy * sxy / (sxx * syy), 0.0)
        r2 = np.where(sxx > 0, np.clip(r2, 0.0, 1.0), np.nan)
        resid = np.maximum(syy - slope * sxy, 0.0)
        se = np.sqrt(resid / ((n - 2.0) * sxx))
        t = np.where(se > 0, slope / se, np.where(slope == 0, 0.0, np.sign(slope) * np.inf))
        t = np.where(n >= 3, t, np.nan)
        intercept_last = my + slope * (last - mx)
    crit = t_critical(n - 2.0, alpha)
    significant = np.nan_to_num(np.abs(t), nan=0.0) > np.nan_to_num(crit, nan=np.inf)
    return Trend(n, slope, intercept_last, r2, t, significant, last - first)


def _dense_trend(y: np.ndarray, x: np.ndarray, alpha: float) -> Trend:
    """:func:`trend` when every row has every sample on the same steps ``x``: the centred
    step vector is computed once and shared by the rows.

    Every sum is taken per row with the kernel the general layout uses (``einsum`` over a
    row, not a BLAS matrix-vector product, whose summation order depends on how many rows
    it is given), so a row's line has the same bits whichever layout and whatever block
    of rows computes it (the analyses run a block of layers at a time)."""
    rows, width = y.shape
    n = np.full(rows, float(width))
    dx = x - x.mean()
    my = y.mean(axis=1)
    dy = y - my[:, None]
    sxy = np.einsum("ij,ij->i", dy, np.broadcast_to(dx, dy.shape))
    syy = np.einsum("ij,ij->i", dy, dy)
    sxx = np.full(rows, float(np.einsum("ij,ij->i", dx[None, :], dx[None, :])[0]))
    mx = np.full(rows, float(x.mean()))
    return _finish_trend(n, sxx, sxy, syy, my, mx, np.full(rows, float(x.min())),
                         np.full(rows, float(x.max())), alpha)


@dataclass(frozen=True)
class TurningPoints:
    """Direction reversals of every row (the reference ``compute_oscillation_frequency`` and the
    turning-point test of Wallis & Moore 1941 / Kendall).

    Attributes:
        count: int64 ``[L]`` samples ``t`` with ``(x_t - x_{t-1}) (x_{t+1} - x_t) < 0``.
        frequency: ``count / n`` (reference: sign changes / history length).
        z: ``(count - 2 (n - 2) / 3) / sqrt((16 n - 29) / 90)``: for an i.i.d. series the
            count has that mean and variance, so ``z >> 0`` means more reversals than noise
            (a systematic oscillation), ``z << 0`` fewer (a trend). NaN for n < 3.
        oscillating: bool ``[L]``, ``z > z_{1 - alpha/2}``.
    """

    count: np.ndarray
    frequency: np.ndarray
    z: np.ndarray
    oscillating: np.ndarray


def turning_points(x: np.ndarray, n: np.ndarray, alpha: float = DEFAULT_ALPHA) -> TurningPoints:
    """Count direction reversals and test them against an i.i.d. series.

    Args:
        x: float64 ``[L, W]``, NaN = absent; n: int64 ``[L]`` samples per row.
        alpha: significance level.

    Returns:
        :class:`TurningPoints`; rows with fewer than four samples get frequency 0 (as in the
        reference).
    """
    d = np.diff(x, axis=1)
    count = (d[:, 1:] * d[:, :-1] < 0).sum(axis=1).astype(np.int64)
    nf = n.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        frequency = np.where(n >= 4, count / nf, 0.0)
        z = (count - 2.0 * (nf - 2.0) / 3.0) / np.sqrt((16.0 * nf - 29.0) / 90.0)
    z = np.where(n >= 3, z, np.nan)
    oscillating = np.nan_to_num(z, nan=-np.inf) > z_critical(alpha)
    return TurningPoints(count, frequency, z, oscillating)


def log_changes(x: np.ndarray) -> np.ndarray:
    """``ln x_t - ln x_{t-1}`` between consecutive samples; NaN where either is absent or 0.

    Returns:
        float64 ``[L, W - 1]``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.diff(np.log(x), axis=1)
    d[~np.isfinite(d)] = np.nan
    return d


def row_pearson(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pearson correlation of row ``i`` of ``a`` with row ``i`` of ``b`` over the columns
    where both are finite.

    Args:
        a, b: float64 ``[K, W]`` aligned in time.

    Returns:
        ``(r, n)``: float64 ``[K]`` correlations (NaN when fewer than 3 pairs or a
        constant side) and int64 ``[K]`` pair counts.
    """
    mask = np.isfinite(a) & np.isfinite(b)
    dense = bool(mask.all())
    n = np.full(a.shape[0], a.shape[1]) if dense else mask.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ma = (a if dense else np.where(mask, a, 0.0)).sum(axis=1) / n
        mb = (b if dense else np.where(mask, b, 0.0)).sum(axis=1) / n
        da = a - ma[:, None]
        db = b - mb[:, None]
        if not dense:
            da[~mask] = 0.0
            db[~mask] = 0.0
        sab = np.einsum("ij,ij->i", da, db)
        saa = np.einsum("ij,ij->i", da, da)
        sbb = np.einsum("ij,ij->i", db, db)
        r = sab / np.sqrt(saa * sbb)
    r = np.where((n >= 3) & (saa > 0) & (sbb > 0), np.clip(r, -1.0, 1.0), np.nan)
    return r, n.astype(np.int64)


def lag1_autocorrelation(x: np.ndarray) -> np.ndarray:
    """Lag-1 autocorrelation of every row: Pearson correlation of ``x_t`` with ``x_{t-1}``
    over consecutive present pairs.

    Returns:
        float64 ``[L]`` in [-1, 1]; NaN with fewer than three pairs or a constant row.
    """
    r, _ = row_pearson(x[:, 1:], x[:, :-1])
    return r
