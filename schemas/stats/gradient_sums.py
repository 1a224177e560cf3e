"""Gradient sums: the per-layer gradient statistics every rank sends.

One home of the NumPy computation of those sums (:func:`gradient_sums_of_array`, one layer;
:func:`gradient_sums_of_layers`, many): :class:`GradientSums` and the producer's NumPy
backend (``producer.summary``) both call it.

References:
    [1] N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM,
        2002: section 4.2 (recursive summation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.stats.base import (
    COUNT,
    MAGNITUDE_MAXIMUM,
    SUM,
    LayerStatistic,
    SummaryMessage,
    as_floats,
    as_ints,
    as_slice,
)
from schemas.stats.chunks import CHUNK

SMALL_LAYER = 4096
"""Layers of at most this many elements are batched into one chunk (one NumPy call per
statistic for many layers); recursive summation of n <= 4096 non-negative terms has a
relative error below (n - 1) u < 4.6e-13 (Higham [1], section 4.2), whatever order
``reduceat`` uses."""


def gradient_sums_of_array(
    flat: np.ndarray, buf: np.ndarray | None = None,
) -> tuple[float, float, float, int, int]:
    """(sum |x|, sum x^2, max |x|, non-finite count, NaN count) of a 1-D array over its
    finite elements.

    Each chunk of ``CHUNK`` elements is widened to float64 and made absolute in one ufunc
    call into a scratch buffer, then read by three reductions (``dot`` for the sum of
    squares); a chunk whose sum of squares is non-finite (a NaN/Inf element, or a float64
    square that overflows) is redone with masking. Sums are not saturated (+inf on
    overflow).

    Args:
        flat: 1-D array of a float or integer dtype.
        buf: float64[>= min(flat.size, CHUNK)] scratch buffer to reuse, or None.

    >>> gradient_sums_of_array(np.array([3.0, -4.0, np.nan], np.float32))
    (7.0, 25.0, 4.0, 1, 1)
    """
    if flat.dtype.kind != "f":  # |x| of an integer must not wrap (abs(int8(-128)))
        flat = flat.astype(np.float64)
    if buf is None:
        buf = np.empty(min(flat.size, CHUNK))
    sum_abs = sum_sq = max_abs = 0.0
    bad = nans = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, flat.size, CHUNK):
            part = flat[lo:lo + CHUNK]
            x = buf[:part.size]
            np.abs(part, out=x)  # widen to float64 and take |g| in one pass
            q = float(np.dot(x, x))
            if not math.isfinite(q):  # NaN/Inf element (or an overflowing square): mask
                nans += int(np.count_nonzero(np.isnan(x)))
                x = x[np.isfinite(x)]
                bad += part.size - x.size
                if x.size == 0:
                    continue
                q = float(np.dot(x, x))
            sum_abs += float(np.add.reduce(x))
            sum_sq += q
            max_abs = max(max_abs, float(np.maximum.reduce(x)))
    return sum_abs, sum_sq, max_abs, bad, nans


def gradient_sums_of_layers(
    flats: Sequence[np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`gradient_sums_of_array` of k layers, with runs of small layers (at most
    :data:`SMALL_LAYER` elements each) sharing one chunk, reduced per layer with
    ``reduceat``; a layer whose sum of squares comes out non-finite is redone with
    :func:`gradient_sums_of_array`. Sums are not saturated (+inf on overflow).

    Args:
        flats: k 1-D arrays of a float or integer dtype.

    Returns:
        (sums float64[3, k]: sum |x|, sum x^2, max |x| over the finite elements;
        nonfinite int64[k]; nan int64[k], the NaN among them).

    >>> sums, bad, nan = gradient_sums_of_layers([np.array([3.0, -4.0]), np.array([np.inf])])
    >>> sums.tolist(), bad.tolist(), nan.tolist()
    ([[7.0, 0.0], [25.0, 0.0], [4.0, 0.0]], [0, 1], [0, 0])
    """
    flats = [f if f.dtype.kind == "f" else f.astype(np.float64) for f in flats]
    count = len(flats)
    sums = np.zeros((3, count))  # sum |g|, sum g^2, max |g|
    nonfinite = np.zeros(count, np.int64)
    nan = np.zeros(count, np.int64)
    buf = np.empty(CHUNK)
    squares = np.empty(CHUNK)

    with np.errstate(over="ignore", invalid="ignore"):
        i = 0
        while i < count:
            if flats[i].size > SMALL_LAYER or flats[i].size == 0:
                a, q, m, nonfinite[i], nan[i] = gradient_sums_of_array(flats[i], buf)
                sums[:, i] = a, q, m
                i += 1
                continue
            j, total = i, 0
            while (j < count and 0 < flats[j].size <= SMALL_LAYER
                   and total + flats[j].size <= CHUNK):
                total += flats[j].size
                j += 1
            x = buf[:total]
            np.concatenate(flats[i:j], out=x, casting="same_kind")
            np.abs(x, out=x)
            starts = np.cumsum([0] + [f.size for f in flats[i:j - 1]])
            q = np.add.reduceat(np.multiply(x, x, out=squares[:total]), starts)
            sums[0, i:j] = np.add.reduceat(x, starts)
            sums[1, i:j] = q
            sums[2, i:j] = np.maximum.reduceat(x, starts)
            for k in np.flatnonzero(~np.isfinite(q)):
                a, q_k, m, nonfinite[i + k], nan[i + k] = gradient_sums_of_array(flats[i + k], buf)
                sums[:, i + k] = a, q_k, m
            i = j
    return sums, nonfinite, nan


@dataclass(slots=True, eq=False)
class GradientSums(LayerStatistic):
    """The per-layer gradient statistics every rank sends (``schemas.wire.StepSummary``).

    Parameters:
        numel: int64[L] elements (finite or not).
        abs_numel: int64[L] elements whose |g| is in ``sum_abs`` / ``max_abs``: equal to
            ``numel`` in full mode; a norms-mode shard adds its elements to ``numel`` only,
            leaving ``sum_abs``/``max_abs`` unknown for that layer.
        sum_abs: float64[L] sum |g| over the finite elements.
        sum_sq: float64[L] sum g^2 over the finite elements.
        max_abs: float64[L] max |g| over the finite elements (0 when none).
        nonfinite: int64[L] NaN/+-Inf elements (left out of the float statistics).
        nan: int64[L] NaN elements among ``nonfinite`` (the others are +-Inf), where known.
        nan_numel: int64[L] elements whose NaN/Inf split is known: equal to ``numel`` when
            every shard sent its ``nan`` count or had no non-finite element (then it has no
            NaN either); a shard with non-finite elements and no count adds its elements to
            ``numel`` only, leaving the split unknown.

    The producer does not :meth:`~LayerStatistic.saturate` these sums: an overflowing
    gradient sum travels as +inf, as the reference's f64 sums overflow.

    Frame fields (:meth:`get`; ``consumer.frames``):
    ``mean_abs = sum_abs / numel``, ``norm = sqrt(sum_sq)``, ``rms = sqrt(sum_sq / numel)``.
    The NaN and Inf counts are what the reference's values need besides the finite sums
    (its mean and norm are NaN with a NaN element, else inf with an Inf one; its max
    ignores NaN and is inf with an Inf element; ``analysis.nonfinite``).

    Examples:
        >>> g = GradientSums.empty(2)
        >>> g.update(np.array([3.0, -4.0]), 0) is g
        True
        >>> g += GradientSums.empty(2).update(np.array([1.0, np.nan]), 1)
        >>> out = g.get()
        >>> out["norm"].tolist(), out["mean_abs"].tolist(), out["nonfinite"].tolist()
        ([5.0, 1.0], [3.5, 0.5], [0, 1])
        >>> out["nan"].tolist()
        [0, 1]
        >>> norms = GradientSums.from_columns([2], None, [25.0], None, [0])  # norms mode
        >>> (g.take(np.array([0])) + norms).get()["sum_abs"].tolist()
        [nan]

    References:
        trustformers-debug, ``gradient_flow`` module (the frame fields and the NaN / Inf
        behaviour of its values). Higham [1] (the rounding of merged sums).
    """

    numel: np.ndarray = field(metadata=COUNT)
    abs_numel: np.ndarray = field(metadata=COUNT)
    sum_abs: np.ndarray = field(metadata=SUM)
    sum_sq: np.ndarray = field(metadata=SUM)
    max_abs: np.ndarray = field(metadata=MAGNITUDE_MAXIMUM)
    nonfinite: np.ndarray = field(metadata=COUNT)
    nan: np.ndarray = field(metadata=COUNT)
    nan_numel: np.ndarray = field(metadata=COUNT)

    @classmethod
    def from_columns(
        cls,
        numel: Sequence[int] | np.ndarray,
        sum_abs: Sequence[float] | np.ndarray | None,
        sum_sq: Sequence[float] | np.ndarray,
        max_abs: Sequence[float] | np.ndarray | None,
        nonfinite: Sequence[int] | np.ndarray,
        nan: Sequence[float] | np.ndarray | None = None,
    ) -> GradientSums:
        """From aligned per-layer arrays: a message's lists, ``LayerSummaries`` fields or
        stored ``layer_stats`` columns (``max_abs`` is the stored ``max_abs_grad``).

        Args:
            numel, nonfinite: int[k]. sum_sq: float[k].
            sum_abs, max_abs: float[k] (NaN where unknown, a stored NULL), or both None
                for a norms-mode shard.
            nan: int[k] NaN counts (a negative value, or NaN in a float array, where
                unknown: a stored NULL), or None when not given (a message without it).
                Where ``nonfinite`` is 0 the count is 0 and known whatever is given.

        Raises:
            ValueError: only one of ``sum_abs`` / ``max_abs`` given.
        """
        if (sum_abs is None) != (max_abs is None):
            raise ValueError("sum_abs and max_abs go together (or neither, in norms mode)")
        n = as_ints(numel)
        bad = as_ints(nonfinite)
        if nan is None:
            nan_count, nan_numel = np.zeros(len(n), np.int64), np.where(bad == 0, n, 0)
        else:
            given = np.asarray(nan, np.float64)
            split = (given >= 0) | (bad == 0)  # NaN (a NULL) and negatives: unknown
            nan_count = np.where(given >= 0, given, 0).astype(np.int64)
            nan_numel = np.where(split, n, 0)
        if sum_abs is None or max_abs is None:
            zeros = np.zeros(len(n))
            return cls(n, np.zeros(len(n), np.int64), zeros, as_floats(sum_sq), zeros.copy(),
                       as_ints(nonfinite), nan_count, nan_numel)
        a, m = as_floats(sum_abs), as_floats(max_abs)
        known = ~(np.isnan(a) | np.isnan(m))
        return cls(n, np.where(known, n, 0), np.where(known, a, 0.0), as_floats(sum_sq),
                   np.where(known, m, 0.0), as_ints(nonfinite), nan_count, nan_numel)

    def to_columns(self) -> dict[str, np.ndarray]:
        """The stored form, inverse of :meth:`from_columns`: ``numel``, ``sum_abs``,
        ``sum_sq``, ``max_abs``, ``nonfinite``, ``nan``, with NaN in
        ``sum_abs``/``max_abs`` where they are unknown and -1 in ``nan`` where the NaN/Inf
        split is unknown."""
        known = self.has_abs()
        return {
            "numel": self.numel.copy(), "sum_abs": np.where(known, self.sum_abs, np.nan),
            "sum_sq": self.sum_sq.copy(), "max_abs": np.where(known, self.max_abs, np.nan),
            "nonfinite": self.nonfinite.copy(),
            "nan": np.where(self.has_nan(), self.nan, -1),
        }

    @classmethod
    def from_message(cls, message: SummaryMessage) -> GradientSums:
        """The gradient sums of a StepSummary / MergedFrame (k layers, aligned with its
        ``layer_indices``)."""
        return cls.from_columns(message.numel, message.sum_abs, message.sum_sq,
                                message.max_abs, message.nonfinite,
                                getattr(message, "nan", None))

    def merge_message_at(self, layers: np.ndarray, message: SummaryMessage) -> GradientSums:
        """Merge the gradient sums of ``message`` into the layers ``layers`` in place: the
        same result as ``self.merge_at(layers, GradientSums.from_message(message))``.

        A full-mode message without NaN counts and without NaN in ``sum_abs`` /
        ``max_abs`` (every validated StepSummary of a finite run) is added column by
        column into ``self``, without building the k-layer statistic first: the fixed
        cost of a small message is the NumPy calls, so this makes eight in-place
        operations of about twenty. Any other message takes the general path.

        Args:
            layers: int[k] distinct layer indices of ``self``, aligned with the message's
                ``layer_indices``.
            message: a StepSummary / MergedFrame of k layers.

        Returns:
            ``self``.
        """
        sum_abs, max_abs = message.sum_abs, message.max_abs
        if sum_abs is None or max_abs is None or getattr(message, "nan", None) is not None:
            return self.merge_at(layers, GradientSums.from_message(message))
        a = np.asarray(sum_abs, np.float64)
        m = np.asarray(max_abs, np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            if np.count_nonzero(np.isnan(a + m)):  # unknown (NaN) entries: general path
                return self.merge_at(layers, GradientSums.from_message(message))
            at = as_slice(layers)
            n = np.asarray(message.numel, np.int64)
            bad = np.asarray(message.nonfinite, np.int64)
            self.numel[at] += n
            self.abs_numel[at] += n
            self.sum_abs[at] += a
            self.sum_sq[at] += np.asarray(message.sum_sq, np.float64)
            self.max_abs[at] = np.maximum(self.max_abs[at], m)
            self.nonfinite[at] += bad
            # Without a NaN count, a layer's split is known where it has no non-finite
            # element (``from_columns``); its NaN count adds 0.
            self.nan_numel[at] += np.where(bad == 0, n, 0) if np.count_nonzero(bad) else n
        return self

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw gradient values: every element counts in
        ``numel``; NaN/Inf in ``nonfinite`` only; the finite ones in the sums and the
        maximum (float64 accumulation, whatever the input dtype); the NaN among them in
        ``nan``."""
        sums, nonfinite, nan = gradient_sums_of_layers([flat])
        a, q, m = sums[:, 0]
        self.numel[layer] += flat.size
        self.abs_numel[layer] += flat.size
        self.nan[layer] += nan[0]
        self.nan_numel[layer] += flat.size
        with np.errstate(over="ignore"):
            self.sum_abs[layer] += a
            self.sum_sq[layer] += q
        self.max_abs[layer] = max(self.max_abs[layer], m)
        self.nonfinite[layer] += nonfinite[0]

    def _update_elements(self, flat: np.ndarray, where: np.ndarray) -> None:
        """As :meth:`_update_layer`, element i into layer ``where[i]``."""
        v = flat.astype(np.float64)
        finite = np.isfinite(v)
        size = self.num_layers
        counts = np.bincount(where, minlength=size)
        self.numel += counts
        self.abs_numel += counts
        self.nonfinite += np.bincount(where[~finite], minlength=size)
        self.nan += np.bincount(where[np.isnan(v)], minlength=size)
        self.nan_numel += counts
        good, at = np.abs(v[finite]), where[finite]
        with np.errstate(over="ignore"):
            self.sum_abs += np.bincount(at, weights=good, minlength=size)
            self.sum_sq += np.bincount(at, weights=good * good, minlength=size)
        np.maximum.at(self.max_abs, at, good)

    @classmethod
    def from_layers(cls, layers: Sequence[np.ndarray]) -> GradientSums:
        """The gradient sums of k layers given as one array each (see
        :meth:`LayerStatistic.from_layers`; what the producer's NumPy backend sends)."""
        flats = [np.asarray(values).reshape(-1) for values in layers]
        sums, nonfinite, nan = gradient_sums_of_layers(flats)
        numel = np.array([f.size for f in flats], np.int64)
        return cls(numel, numel.copy(), sums[0].copy(), sums[1].copy(), sums[2].copy(),
                   nonfinite, nan, numel.copy())

    def has_abs(self) -> np.ndarray:
        """bool[L]: ``sum_abs`` and ``max_abs`` cover every element of the layer."""
        return self.abs_numel == self.numel

    def has_nan(self) -> np.ndarray:
        """bool[L]: ``nan`` covers every element of the layer (the NaN/Inf split is known:
        ``nonfinite - nan`` elements are +-Inf)."""
        return self.nan_numel == self.numel

    def mean_abs(self) -> np.ndarray:
        """float64[L] mean |g| = sum |g| / numel (non-finite elements counting 0); NaN
        where unknown (norms mode) or numel = 0."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.has_abs(), self.sum_abs, np.nan) / self.numel

    def norm(self) -> np.ndarray:
        """float64[L] L2 norm sqrt(sum g^2) of the finite elements."""
        return np.sqrt(self.sum_sq)

    def rms(self) -> np.ndarray:
        """float64[L] root mean square sqrt(sum g^2 / numel); NaN where numel = 0. Bounds
        mean |g| <= rms <= max |g| (Cauchy-Schwarz), which norms mode relies on."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.sqrt(self.sum_sq / self.numel)

    def get(self) -> dict[str, np.ndarray]:
        """The frame's gradient fields, float64/int64[L] each: ``numel``, ``sum_abs``,
        ``sum_sq``, ``max_abs``, ``nonfinite``, ``nan`` (the stored form of
        :meth:`to_columns`, NaN / -1 where unknown) and ``mean_abs``, ``norm``, ``rms``."""
        out = self.to_columns()
        out.update(mean_abs=self.mean_abs(), norm=self.norm(), rms=self.rms())
        return out

