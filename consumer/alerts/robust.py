"""Robust z-scores of each layer's newest value against its rolling history, vectorised.

The modified z-score of Iglewicz & Hoaglin (1993, "How to Detect and Handle Outliers",
ASQC Basic References in Quality Control 16), for a value ``x`` against a sample with
median ``med``:

- ``M = (x - med) / (MAD / q)`` with ``MAD = median |sample - med|`` and
  ``q = Phi^-1(0.75) = 0.67449`` (for normal data ``MAD / q`` estimates the standard
  deviation);
- when ``MAD == 0`` (more than half the sample is identical), the mean absolute deviation
  is used instead: ``M = (x - med) / (MeanAD * sqrt(pi / 2))``, because for normal data
  ``E|X - mu| = sigma * sqrt(2 / pi)``;
- when both are 0 (a constant history), ``M`` is +inf above the median, -inf below it and
  0 at it.

Each layer keeps a ring buffer of its last ``window`` values; missing values (layer not in
the frame, or not testable) are NaN and do not count. Layout ``(layers, window)`` keeps a
layer's history contiguous, so the medians are one in-place selection along axis 1 over
all the layers (:func:`window_stats`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

Q3_NORMAL = NormalDist().inv_cdf(0.75)
"""Phi^-1(0.75) = 0.6744897...: the MAD of a standard normal variable."""
MEANAD_NORMAL = math.sqrt(2.0 / math.pi)
"""E|Z| = sqrt(2/pi) = 0.7978845...: the mean absolute deviation of a standard normal."""


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Per-row statistics of a sample matrix: ``median``, ``mad`` (median absolute
    deviation), ``mean_ad`` (mean absolute deviation from the median), all float64[k],
    and ``samples`` int64[k] (non-missing values)."""

    median: np.ndarray
    mad: np.ndarray
    mean_ad: np.ndarray
    samples: np.ndarray


def _row_medians(work: np.ndarray) -> np.ndarray:
    """Median of each row of ``work`` (float64[k, w], w >= 1, no NaN), partitioning
    ``work`` in place: one partition at ``w // 2``, plus the largest value left of it for
    an even ``w``. The same values as ``np.median(work, axis=1)`` (the mean of the two
    middle values, computed as ``(a + b) / 2``), with one selection instead of two."""
    w = work.shape[1]
    work.partition(w // 2, axis=1)
    upper = work[:, w // 2]
    if w % 2:
        return upper.copy()
    return (work[:, : w // 2].max(axis=1) + upper) / 2


def _complete_stats(history: np.ndarray, work: np.ndarray | None) -> WindowStats:
    """:func:`window_stats` of rows without a missing value (float64[k, w], w >= 1)."""
    k, w = history.shape
    if work is None or work.size < k * w:
        work = np.empty(k * w)
    buf = work.reshape(-1)[: k * w].reshape(k, w)
    np.copyto(buf, history)
    med = _row_medians(buf)
    np.subtract(history, med[:, None], out=buf)
    np.abs(buf, out=buf)
    mean_ad = buf.mean(axis=1)
    mad = _row_medians(buf)
    return WindowStats(med, mad, mean_ad, np.full(k, w, np.int64))


def _gappy_stats(history: np.ndarray, missing: np.ndarray) -> WindowStats:
    """:func:`window_stats` of rows with missing values (NaN-aware NumPy reductions)."""
    samples = (~missing).sum(axis=1)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows give NaN
        med = np.nanmedian(history, axis=1)
        dev = np.abs(history - med[:, None])
        mad = np.nanmedian(dev, axis=1)
        mean_ad = np.nanmean(dev, axis=1)
    return WindowStats(med, mad, mean_ad, samples.astype(np.int64))


def window_stats(history: np.ndarray, work: np.ndarray | None = None) -> WindowStats:
    """Statistics of each row of ``history`` (float64[k, w], NaN = missing); rows with no
    value give NaN statistics and 0 samples.

    Rows without a missing value (the usual case) take the fast path: two in-place
    selections per row (:func:`_row_medians`); only rows with gaps use ``np.nanmedian``.
    Each row's results are those of ``np.median`` / ``np.nanmedian`` and ``mean`` /
    ``nanmean`` over that row.

    Args:
        history: the samples.
        work: optional scratch buffer, float64 with at least ``k * w`` elements (contiguous;
            overwritten). Reusing one avoids allocating (and page-faulting) two ``k x w``
            temporaries per call, which costs as much as the selections themselves.
    """
    k, w = history.shape
    if w == 0:
        return WindowStats(np.full(k, np.nan), np.full(k, np.nan), np.full(k, np.nan),
                           np.zeros(k, np.int64))
    missing = np.isnan(history)
    if not missing.any():
        return _complete_stats(history, work)
    gappy = missing.any(axis=1)
    if gappy.all():
        return _gappy_stats(history, missing)
    whole = _complete_stats(history[~gappy], work)
    part = _gappy_stats(history[gappy], missing[gappy])
    out = []
    for name in ("median", "mad", "mean_ad", "samples"):
        column = np.empty(k, np.int64 if name == "samples" else np.float64)
        column[~gappy] = getattr(whole, name)
        column[gappy] = getattr(part, name)
        out.append(column)
    return WindowStats(*out)


def z_scores(x: np.ndarray, stats: WindowStats) -> np.ndarray:
    """Modified z-scores of ``x`` (float64[k]) against ``stats`` (module doc formulas)."""
    diff = x - stats.median
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # tiny MAD: +-inf
        z = np.where(
            stats.mad > 0,
            diff * Q3_NORMAL / stats.mad,
            np.where(stats.mean_ad > 0, diff * MEANAD_NORMAL / stats.mean_ad,
                     np.sign(diff) * np.inf),
        )
    return np.where(diff == 0, 0.0, z)


def modified_z(
    x: np.ndarray, history: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Modified z-scores (formulas in the module doc) of ``x[i]`` against ``history[i]``.

    Args:
        x: float64[k], the values to score.
        history: float64[k, w], the samples (NaN = missing; each row needs at least one
            finite value or its results are NaN).

    Returns:
        (z float64[k], median float64[k], samples int64[k]): the scores, the medians and
        the number of non-missing samples per row.
    """
    stats = window_stats(history)
    return z_scores(x, stats), stats.median, stats.samples


class RollingRobustZ:
    """Per-layer rolling history with modified z-scores of new values.

    The window statistics (median, MAD, MeanAD) are recomputed for all layers at once
    every ``refresh_every`` pushed frames (every frame until the window is full) and reused
    in between: new values are scored against a window at most ``refresh_every - 1``
    frames old. With ``refresh_every = 1`` every score uses the exact current window.
    While fewer than ``min_samples`` frames were pushed no layer can be tested, and no
    statistics are computed: the scores and medians are NaN, the sample counts exact.
    A refresh selects in place in a scratch buffer kept with the history (two partial
    sorts of ``L x W`` values, no temporaries; costs in ``bench/README.md``).

    Args:
        num_layers: L. window: values kept per layer (W >= 1).
        refresh_every: frames between recomputations of the statistics (>= 1).
        min_samples: frames of history below which nothing is scored (>= 1; the rules
            ignore layers with fewer samples than their own minimum anyway).

    Attributes:
        history: float64[L, W] ring buffer (NaN = missing). samples: int64[L], the
            non-missing values per layer in it.

    Memory: ``16 * L * W`` bytes (history and scratch; 1000 layers x 100 frames = 1.6 MB).
    """

    def __init__(self, num_layers: int, window: int, refresh_every: int = 1,
                 min_samples: int = 1) -> None:
        self.window = window
        self.refresh_every = max(1, refresh_every)
        self.min_samples = max(1, min_samples)
        self.history = np.full((num_layers, window), np.nan)
        self.samples = np.zeros(num_layers, np.int64)
        self._work = np.empty(num_layers * window)
        self._pos = 0
        self._filled = 0
        self._stats: WindowStats | None = None
        self._since_refresh = 0

    def score(self, layers: np.ndarray, values: np.ndarray) -> tuple[
        np.ndarray, np.ndarray, np.ndarray
    ]:
        """Score ``values`` against each layer's history (the values are not added).

        Args:
            layers: int[k] layer indices. values: float64[k].

        Returns:
            (z, median, samples) as in :func:`modified_z`; ``samples`` is 0 (and z, median
            NaN) for layers without history; z and median are NaN for every layer while
            fewer than ``min_samples`` frames were pushed.
        """
        k = len(layers)
        if self._filled < self.min_samples or k == 0:
            return np.full(k, np.nan), np.full(k, np.nan), self.samples[layers]
        warming = self._filled < self.window  # the first frames: always exact
        if self._stats is None or warming or self._since_refresh >= self.refresh_every:
            self._stats = window_stats(self.history[:, : self._filled], self._work)
            self._since_refresh = 0
        s = self._stats
        sub = WindowStats(s.median[layers], s.mad[layers], s.mean_ad[layers],
                          s.samples[layers])
        return z_scores(values, sub), sub.median, sub.samples

    def push(self, layers: np.ndarray, values: np.ndarray) -> None:
        """Append one frame: ``values`` (float64[k], NaN = not testable) for ``layers``;
        every other layer gets a missing value for this frame."""
        column = np.full(self.history.shape[0], np.nan)
        column[layers] = values
        if self._filled == self.window:
            self.samples -= ~np.isnan(self.history[:, self._pos])
        self.samples += ~np.isnan(column)
        self.history[:, self._pos] = column
        self._pos = (self._pos + 1) % self.window
        self._filled = min(self._filled + 1, self.window)
        self._since_refresh += 1
