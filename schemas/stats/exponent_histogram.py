"""Exponent histogram: counts of finite elements per power-of-two magnitude band, per layer.

The histogram layout (:data:`EXP_HIST_MIN`, :data:`EXP_HIST_MAX`, :data:`EXP_HIST_BINS`) is
part of the wire contract (``schemas.wire`` re-exports the three names). A column is read
from the IEEE 754 exponent field through a lookup table (:func:`exponent_lut`, shared with
the numba kernels of ``producer.kernels``); zeros and subnormals are re-binned exactly.

References:
    [1] IEEE Std 754-2019, section 3.4 (binary interchange format encodings).
    [2] C. E. Shannon, "A mathematical theory of communication", Bell System Technical
        Journal 27, 1948 (entropy in bits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.stats.base import (
    COUNT,
    LayerStatistic,
    SummaryMessage,
    as_ints,
    as_slice,
    or_empty,
    per_column,
)
from schemas.stats.chunks import CHUNK
from schemas.stats.csr import checked_csr, csr_from_dense, dense_from_csr

EXP_HIST_MIN = -134
"""Smallest binned base-2 exponent: |x| in [2^k, 2^(k+1)) goes to column k - MIN + 2.
-134 reaches below bf16's smallest subnormal (2^-133; IEEE 754 binary32 range)."""
EXP_HIST_MAX = 24
"""One past the largest binned exponent: |x| >= 2^MAX share the last column."""
EXP_HIST_BINS = EXP_HIST_MAX - EXP_HIST_MIN + 3
"""Columns: 0 exact zeros, 1 underflow (< 2^MIN), 2..B-2 one per exponent, B-1 overflow."""


def exp_hist_column(k: int | np.ndarray) -> int | np.ndarray:
    """Histogram column of finite non-zero magnitudes with base-2 exponent ``k``.

    ``k = floor(log2 |x|)`` (the IEEE 754 unbiased exponent for normal numbers; equal to
    ``np.frexp(x)[1] - 1`` for every finite non-zero x, subnormals included).

    Args:
        k: exponent(s), int or integer ndarray.

    Returns:
        ``clip(k - EXP_HIST_MIN + 2, 1, EXP_HIST_BINS - 1)`` (int, or int64 ndarray): column 1
        is the underflow column (k < EXP_HIST_MIN), column ``EXP_HIST_BINS - 1`` the
        overflow column (k >= EXP_HIST_MAX); column 0 (exact zeros) is never returned.

    >>> exp_hist_column(0), exp_hist_column(-1074), exp_hist_column(1023)
    (136, 1, 160)
    """
    col = np.clip(np.asarray(k) - EXP_HIST_MIN + 2, 1, EXP_HIST_BINS - 1)
    return int(col) if np.ndim(col) == 0 else col


def exponent_lut(exp_bits: int, bias: int) -> np.ndarray:
    """Histogram column of every (sign, biased exponent field) of an IEEE 754 binary format.

    Indexed by the bit pattern shifted right by the significand width, i.e. by
    ``sign * 2^exp_bits + biased exponent`` (IEEE 754-2019 section 3.4): the table repeats
    for the sign bit. Field 0 (zero or subnormal) maps to the scratch column ``B + 1``, to be
    re-binned exactly; the all-ones field (NaN/Inf) to the scratch column ``B``
    (``B = EXP_HIST_BINS``). The numba kernels of ``producer.kernels`` use the same tables.

    Args:
        exp_bits: width of the exponent field (8 for binary32, 11 for binary64).
        bias: exponent bias (127, 1023).

    Returns:
        uint16[2^(exp_bits + 1)].

    >>> lut = exponent_lut(8, 127)
    >>> int(lut[127]), int(lut[0]), int(lut[255]), int(lut[256 + 127])
    (136, 162, 161, 136)
    """
    biased = np.arange(1 << exp_bits, dtype=np.int64)
    cols = np.clip(biased - bias - EXP_HIST_MIN + 2, 1, EXP_HIST_BINS - 1)
    cols[0] = EXP_HIST_BINS + 1
    cols[-1] = EXP_HIST_BINS
    return np.tile(cols, 2).astype(np.uint16)


_LUT32 = exponent_lut(8, 127)  # IEEE 754 binary32: 8-bit exponent field, bias 127
_LUT64 = exponent_lut(11, 1023)  # IEEE 754 binary64: 11-bit exponent field, bias 1023
_F16, _F32, _F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


def _exponent_lookup(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x as a contiguous float32/float64 array, column of each element from the exponent
    lookup table: ``[1, B)``, ``B`` for NaN/Inf, ``B + 1`` for a zero exponent field).
    float16 is widened to float32 (exact), other non-float32 dtypes to float64."""
    if x.dtype == _F16:
        x = x.astype(_F32)
    elif x.dtype != _F32 and x.dtype != _F64:
        x = x.astype(_F64)
    x = np.ascontiguousarray(x)
    if x.dtype == _F32:  # index: sign and biased exponent, the bits above the significand
        return x, _LUT32[x.view(np.uint32) >> 23]
    return x, _LUT64[x.view(np.uint64) >> 52]


def _zero_field_columns(values: np.ndarray) -> np.ndarray:
    """int64 columns of elements with a zero exponent field: 0 for exact zeros, the
    ``np.frexp`` exponent's column for subnormals (subnormal = m * 2^e with 0.5 <= m < 1,
    so floor(log2 |x|) = e - 1)."""
    cols = np.zeros(values.size, np.int64)
    nonzero = values != 0
    if nonzero.any():
        _, exp = np.frexp(np.abs(values[nonzero]).astype(np.float64))
        cols[nonzero] = exp_hist_column(exp.astype(np.int64) - 1)
    return cols


def _exponent_columns(x: np.ndarray) -> np.ndarray:
    """Column of every element of a 1-D array: ``[0, B)`` for finite values, ``B`` for
    NaN/Inf (int64, same length)."""
    x, lut = _exponent_lookup(x)
    cols = lut.astype(np.int64)
    field0 = cols == EXP_HIST_BINS + 1
    if field0.any():
        cols[field0] = _zero_field_columns(x[field0])
    return cols


def _exponent_counts(x: np.ndarray) -> np.ndarray:
    """int64[B + 1] counts per column of a 1-D array, NaN/Inf in the last slot (one
    bincount of the lookup; zeros and subnormals re-binned only when present)."""
    x, lut = _exponent_lookup(x)
    counts = np.bincount(lut, minlength=EXP_HIST_BINS + 2)
    if counts[EXP_HIST_BINS + 1]:
        counts[:EXP_HIST_BINS] += np.bincount(
            _zero_field_columns(x[lut == EXP_HIST_BINS + 1]), minlength=EXP_HIST_BINS)
    return counts[:EXP_HIST_BINS + 1]



@dataclass(slots=True, eq=False)
class ExponentHistogram(LayerStatistic):
    """Counts of finite elements per power-of-two magnitude band, per layer.

    Columns (``B = EXP_HIST_BINS``): 0 exact zeros, 1 underflow (0 < |x| < 2^EXP_HIST_MIN),
    ``c`` in 2..B-2 holds 2^(MIN+c-2) <= |x| < 2^(MIN+c-1), B-1 overflow (|x| >=
    2^EXP_HIST_MAX); NaN/Inf are counted apart in ``nonfinite``. Counts merge by addition,
    exactly.

    Parameters:
        counts: int64[L, B].
        nonfinite: int64[L] NaN/Inf elements (not binned); ``counts.sum(1) + nonfinite``
            is the number of elements covered.

    Examples:
        >>> h = ExponentHistogram.empty(1).update(np.array([0.0, 1.0, 1.5, 3.0, np.inf]))
        >>> int(h.counts[0, 0]), int(h.counts[0, exp_hist_column(0)]), int(h.nonfinite[0])
        (1, 2, 1)
        >>> round(float(h.entropy()[0]), 6)  # p = (1/4, 1/2, 1/4)
        1.5

    References:
        IEEE Std 754-2019 [1], section 3.4 (the exponent field the columns come from);
        Shannon [2] (the entropy in bits).
    """

    counts: np.ndarray = field(metadata=per_column(COUNT, EXP_HIST_BINS))
    nonfinite: np.ndarray = field(metadata=COUNT)

    @classmethod
    def from_columns(
        cls,
        offsets: Sequence[int] | np.ndarray,
        columns: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray,
        nonfinite: Sequence[int] | np.ndarray,
    ) -> ExponentHistogram:
        """From the sparse (CSR) form of the wire and of the stored list columns: layer i
        holds ``counts[offsets[i]:offsets[i+1]]`` in columns ``columns[...]``.

        Args:
            offsets: int[k + 1]. columns, counts: int[nnz]. nonfinite: int[k] elements
                not binned (0 for a layer without a histogram, which then covers nothing).

        Raises:
            ValueError: malformed CSR (offsets not from 0 to nnz, a column out of range).
        """
        return cls(dense_from_csr(offsets, columns, counts, EXP_HIST_BINS), as_ints(nonfinite))

    def to_columns(self) -> dict[str, np.ndarray]:
        """The sparse form, inverse of :meth:`from_columns`: ``offsets``, ``columns``,
        ``counts`` (non-zero entries, columns ascending per layer), ``nonfinite``."""
        offsets, columns, counts = csr_from_dense(self.counts)
        return {"offsets": offsets, "columns": columns, "counts": counts,
                "nonfinite": self.nonfinite.copy()}

    @staticmethod
    def message_columns(
        message: SummaryMessage, weights: bool = False,
    ) -> dict[str, Sequence[int]] | None:
        """The sparse form (the arguments of :meth:`from_columns`) of a StepSummary /
        MergedFrame's exponent histogram, or None when the message carries none.

        Args:
            message: k layers. weights: the histogram of |w| (``weight_exp_hist_*``, with
                ``weight_nonfinite``) rather than the gradient's (``exp_hist_*``, with
                ``nonfinite``).
        """
        if weights:
            offsets, columns = message.weight_exp_hist_offsets, message.weight_exp_hist_columns
            counts, nonfinite = message.weight_exp_hist_counts, message.weight_nonfinite
        else:
            offsets, columns = message.exp_hist_offsets, message.exp_hist_columns
            counts, nonfinite = message.exp_hist_counts, message.nonfinite
        if offsets is None or nonfinite is None:
            return None
        return {"offsets": offsets, "columns": or_empty(columns),
                "counts": or_empty(counts), "nonfinite": nonfinite}

    @classmethod
    def from_message(
        cls, message: SummaryMessage, weights: bool = False,
    ) -> ExponentHistogram | None:
        """The gradient's (or, with ``weights``, the weights') exponent histogram of a
        StepSummary / MergedFrame (k layers), or None when the message carries none."""
        columns = cls.message_columns(message, weights)
        return None if columns is None else cls.from_columns(**columns)

    def merge_columns(
        self,
        layers: np.ndarray,
        offsets: Sequence[int] | np.ndarray,
        columns: Sequence[int] | np.ndarray,
        counts: Sequence[int] | np.ndarray,
        nonfinite: Sequence[int] | np.ndarray,
    ) -> ExponentHistogram:
        """Merge a k-layer histogram given in its sparse form into layers ``layers``
        (int[k], distinct), in place: the same as ``self.merge_at(layers,
        ExponentHistogram.from_columns(offsets, columns, counts, nonfinite))`` without
        building the dense k x B array (most of a message's histogram is zeros). Returns
        ``self``.

        Raises:
            ValueError: malformed CSR, a column out of range, or offsets for another number
                of layers.
        """
        idx = np.asarray(layers, np.int64)
        off, cols, vals = checked_csr(offsets, columns, counts, EXP_HIST_BINS, idx.size)
        np.add.at(self.counts, (np.repeat(idx, np.diff(off)), cols), vals)
        self.nonfinite[as_slice(idx)] += as_ints(nonfinite)
        return self

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw values: bin them by base-2 exponent
        (exactly, subnormals included: the column is read from the IEEE 754 exponent
        field, zeros and subnormals re-binned with ``np.frexp``); NaN/Inf go to
        ``nonfinite``. float16/32/64 are binned from their own bits (float16 widened to
        float32 exactly), other dtypes as float64."""
        total = np.zeros(EXP_HIST_BINS + 1, np.int64)
        for lo in range(0, flat.size, CHUNK):
            total += _exponent_counts(flat[lo:lo + CHUNK])
        self.counts[layer] += total[:EXP_HIST_BINS]
        self.nonfinite[layer] += total[EXP_HIST_BINS]

    def _update_elements(self, flat: np.ndarray, where: np.ndarray) -> None:
        """As :meth:`_update_layer`, element i into layer ``where[i]``."""
        cols = _exponent_columns(flat)
        bad = cols == EXP_HIST_BINS
        size = self.num_layers
        self.nonfinite += np.bincount(where[bad], minlength=size)
        keys = where[~bad] * EXP_HIST_BINS + cols[~bad]
        self.counts += np.bincount(keys, minlength=size * EXP_HIST_BINS).reshape(
            size, EXP_HIST_BINS)

    @classmethod
    def from_layers(cls, layers: Sequence[np.ndarray]) -> ExponentHistogram:
        """The histograms of k layers given as one array each (see
        :meth:`LayerStatistic.from_layers`)."""
        total = np.zeros((len(layers), EXP_HIST_BINS + 1), np.int64)
        for i, values in enumerate(layers):
            flat = np.asarray(values).reshape(-1)
            for lo in range(0, flat.size, CHUNK):
                total[i] += _exponent_counts(flat[lo:lo + CHUNK])
        return cls(total[:, :EXP_HIST_BINS].copy(), total[:, EXP_HIST_BINS].copy())

    def finite(self) -> np.ndarray:
        """int64[L] binned (finite) elements."""
        return self.counts.sum(axis=1)

    def numel(self) -> np.ndarray:
        """int64[L] elements covered: finite plus non-finite."""
        return self.finite() + self.nonfinite

    def zeros(self) -> np.ndarray:
        """int64[L] exact zeros (column 0)."""
        return self.counts[:, 0].copy()

    def entropy(self) -> np.ndarray:
        """float64[L] Shannon entropy in bits, ``-sum_c p_c log2 p_c`` with ``p_c`` the
        fraction of the finite elements in column c (Shannon 1948); 0 when every element
        lies in one column, NaN for a layer with no finite element."""
        total = self.finite().astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = self.counts / total[:, None]
            terms = np.where(p > 0, p * np.log2(np.where(p > 0, p, 1.0)), 0.0)
        return np.where(total > 0, -terms.sum(axis=1) + 0.0, np.nan)

    def get(self) -> np.ndarray:
        """int64[L, B] the counts (a copy)."""
        return self.counts.copy()

