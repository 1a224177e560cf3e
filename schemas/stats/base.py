"""Exactly mergeable per-layer statistics of gradients and weights, vectorised over layers.

The one home of the sums that travel from a training rank to the store: a rank computes
them (``producer.summary``, ``producer.weights``) and sends them in a StepSummary, a worker
merges the ranks of a step (``consumer.merge``, ``consumer.frames``), the store keeps them
in ``layer_stats`` and reloads them to merge a late rank (``consumer.sink``), and the frame
fields and the weight analysis are derived from them.

Protocol. Every class follows River's statistics protocol (``river.stats.Var`` and its
siblings): ``update`` folds raw values in and returns the statistic itself, ``a += b``
merges ``b`` into ``a``, ``a + b`` returns a new merged statistic and ``get`` returns the
derived value(s). Unlike River's scalar statistics, one object holds one entry per layer:
arrays of length ``L`` (the run's layers in model order, or the ``k`` layers of one
message), and every operation is vectorised over the layers.

=====================  ======================================================================
class                  state per layer
=====================  ======================================================================
GradientSums           numel, abs_numel, sum |g|, sum g^2, max |g|, non-finite count
ExponentHistogram      counts per base-2 exponent bin (``EXP_HIST_BINS`` columns), non-finite
SumOfSquares           numel, sum x^2 (weight norm, update norm)
PowerSums              finite count, S1..S4 = sum x^k, min, max, non-finite count
WeightMoments          PowerSums + ExponentHistogram of the same weights
=====================  ======================================================================

Merge rules: counts and sums add, extremes take the min / max (the wire contract,
``schemas.wire``). Counts, extremes and histograms merge exactly; a float sum merged from
parts equals the sum of the whole up to rounding: recursive summation of n terms has an
absolute error of at most ``gamma_(n-1) * sum |x_i|`` with ``gamma_n = n u / (1 - n u)``,
``u = 2^-53`` (Higham [3], section 4.2), whatever the order, so two orders differ by at most
twice that (below ``1e-12 * sum |x_i|`` up to about 4500 terms per sum; the property test
``tests/schemas/test_stats.py`` checks this bound).

The derived values follow trustformers-debug (frame fields: its ``gradient_flow`` module;
weight moments, with skewness and kurtosis 0 for a constant set: its ``weight_analysis``
module).

Moments are carried as power sums S_k rather than as central moments updated pairwise
(Chan, Golub and LeVeque [1]; Pebay [2] for higher orders) because power sums merge by plain
addition, which is what the wire and the store carry; the central moments follow from the
binomial expansion (:meth:`PowerSums.get`), accurate while ``std / |mean|`` is not tiny.

Coverage. Every statistic counts the elements it covers (``numel``, or finite plus
non-finite counts), so optional statistics need no shard bookkeeping: a merged optional
statistic of a layer is complete when it covers as many elements as the layer's
:class:`GradientSums` (a rank that did not send it leaves it short), and ``sum |g|`` /
``max |g|`` are known when ``abs_numel == numel`` (norms-mode shards send neither).

Construction: ``Cls.empty(L)``; ``Cls.from_columns(...)`` from aligned arrays as stored in
``layer_stats`` (NaN for a NULL float; ``to_columns`` is its inverse);
``Cls.from_message(message)`` from the ``k`` layers of a StepSummary or MergedFrame, aligned
with its ``layer_indices`` (None when the message does not carry the statistic; the sums of
squares take the field name, the histogram ``weights=True`` for the weights'); from raw
values, ``update(values, layer)`` or ``Cls.from_layers(arrays)`` (one array per layer).

Merging and reading: ``a.merge_at(layers, b)`` merges a ``k``-layer statistic into layers
``layers`` of an ``L``-layer one (``ExponentHistogram.merge_columns`` and
``WeightMoments.merge_message`` do the same from the sparse wire form); ``take`` selects
layers, ``pooled`` merges all layers into one, ``per_copy`` reads one of R identical
copies merged into a layer (a replicated tensor), ``state`` / ``exact_fields`` expose the
arrays for comparisons.

References:
    [1] T. F. Chan, G. H. Golub, R. J. LeVeque, "Algorithms for computing the sample
        variance: analysis and recommendations", The American Statistician 37(3),
        242-247, 1983.
    [2] P. Pebay, "Formulas for robust, one-pass parallel computation of covariances and
        arbitrary-order statistical moments", Sandia report SAND2008-6212, 2008.
    [3] N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM,
        2002: section 3.1 (gamma_n), section 4.2 (recursive summation).
    [4] IEEE Std 754-2019, section 3.4 (binary interchange format encodings).
    [5] C. E. Shannon, "A mathematical theory of communication", Bell System Technical
        Journal 27, 1948 (entropy in bits).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import numpy as np

__all__ = [
    "EXP_HIST_BINS",
    "EXP_HIST_MAX",
    "EXP_HIST_MIN",
    "STATISTICS",
    "ExponentHistogram",
    "GradientSums",
    "LayerStatistic",
    "PowerSums",
    "SumOfSquares",
    "SummaryMessage",
    "WeightMoments",
    "csr_from_lists",
    "exp_hist_column",
    "exponent_lut",
]

# The histogram layout is part of the wire contract (``schemas.wire`` re-exports these
# three names); this module imports NumPy only.
EXP_HIST_MIN = -134
"""Smallest binned base-2 exponent: |x| in [2^k, 2^(k+1)) goes to column k - MIN + 2.
-134 reaches below bf16's smallest subnormal (2^-133; IEEE 754 binary32 range)."""
EXP_HIST_MAX = 24
"""One past the largest binned exponent: |x| >= 2^MAX share the last column."""
EXP_HIST_BINS = EXP_HIST_MAX - EXP_HIST_MIN + 3
"""Columns: 0 exact zeros, 1 underflow (< 2^MIN), 2..B-2 one per exponent, B-1 overflow."""

_MAX_DOUBLE = float(np.finfo(np.float64).max)
_CHUNK = 1 << 16  # elements per float64 scratch chunk: 512 KiB, cache-resident


# -- exponent columns ---------------------------------------------------------------------


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


def _csr_arrays(
    offsets: Sequence[int] | np.ndarray, columns: Sequence[int] | np.ndarray,
    counts: Sequence[int] | np.ndarray, rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, columns, counts) of a sparse histogram as int64 arrays, checked: offsets
    run from 0 to the number of entries (``rows + 1`` of them when given), columns lie in
    ``[0, EXP_HIST_BINS)``.

    Raises:
        ValueError: a check failed.
    """
    off, cols, vals = _ints(offsets), _ints(columns), _ints(counts)
    if len(off) < 1 or off[0] != 0 or off[-1] != len(cols) or len(vals) != len(cols) or (
        rows is not None and len(off) != rows + 1
    ):
        raise ValueError("histogram offsets must run from 0 to the number of entries, "
                         "one row per layer")
    if cols.size and (cols.min() < 0 or cols.max() >= EXP_HIST_BINS):
        raise ValueError(f"histogram columns must be in [0, {EXP_HIST_BINS})")
    return off, cols, vals


def csr_from_lists(
    rows: Sequence[Sequence[int] | None],
) -> tuple[np.ndarray, np.ndarray]:
    """CSR form of per-layer lists (e.g. stored histogram list columns fetched as Python
    lists); a None row counts as empty.

    Args:
        rows: k lists of ints, or None.

    Returns:
        (offsets int64[k + 1], values int64[nnz]).

    >>> off, vals = csr_from_lists([[1, 2], None, [5]])
    >>> off.tolist(), vals.tolist()
    ([0, 2, 2, 3], [1, 2, 5])
    """
    lengths = np.fromiter((0 if r is None else len(r) for r in rows), np.int64, len(rows))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = [v for r in rows if r is not None for v in r]
    return offsets, np.asarray(flat, np.int64)


# -- messages -------------------------------------------------------------------------------


class SummaryMessage(Protocol):
    """What :meth:`LayerStatistic.from_message` reads of a ``schemas.wire.StepSummary`` or
    ``MergedFrame`` (``k`` layers, every array aligned with ``layer_indices``: a list, or
    a read-only NumPy array in a binary-decoded message; optional statistics are None
    when not sent)."""

    @property
    def layer_indices(self) -> Sequence[int]: ...
    @property
    def numel(self) -> Sequence[int]: ...
    @property
    def sum_abs(self) -> Sequence[float] | None: ...
    @property
    def sum_sq(self) -> Sequence[float]: ...
    @property
    def max_abs(self) -> Sequence[float] | None: ...
    @property
    def nonfinite(self) -> Sequence[int]: ...
    @property
    def nan(self) -> Sequence[int] | None: ...
    @property
    def exp_hist_offsets(self) -> Sequence[int] | None: ...
    @property
    def exp_hist_columns(self) -> Sequence[int] | None: ...
    @property
    def exp_hist_counts(self) -> Sequence[int] | None: ...
    @property
    def weight_sum_sq(self) -> Sequence[float] | None: ...
    @property
    def update_sum_sq(self) -> Sequence[float] | None: ...
    @property
    def weight_sum(self) -> Sequence[float] | None: ...
    @property
    def weight_sum_cube(self) -> Sequence[float] | None: ...
    @property
    def weight_sum_quad(self) -> Sequence[float] | None: ...
    @property
    def weight_min(self) -> Sequence[float] | None: ...
    @property
    def weight_max(self) -> Sequence[float] | None: ...
    @property
    def weight_nonfinite(self) -> Sequence[int] | None: ...
    @property
    def weight_exp_hist_offsets(self) -> Sequence[int] | None: ...
    @property
    def weight_exp_hist_columns(self) -> Sequence[int] | None: ...
    @property
    def weight_exp_hist_counts(self) -> Sequence[int] | None: ...


# -- the common machinery -------------------------------------------------------------------


_COUNT = {"merge": "add", "exact": True}
"""Field metadata: merged by addition, compared exactly (an integer count)."""
_SUM = {"merge": "add", "exact": False}
"""Field metadata: merged by addition, equal up to rounding (a float sum)."""
_MAXIMUM = {"merge": "max", "exact": True}
_MINIMUM = {"merge": "min", "exact": True}
_PART = {"merge": "nested", "exact": False}
"""Field metadata: another statistic, merged by its own rules."""


def _float64_chunks(flat: np.ndarray) -> Iterator[np.ndarray] | tuple[np.ndarray, ...]:
    """Consecutive pieces of a 1-D array widened to float64 in one reusable scratch buffer
    (the consumer of a piece may overwrite it); one float64 copy for a small array."""
    if flat.size <= _CHUNK:
        return (flat.astype(np.float64),) if flat.size else ()
    return _float64_pieces(flat)


def _float64_pieces(flat: np.ndarray) -> Iterator[np.ndarray]:
    buf = np.empty(_CHUNK, np.float64)
    for lo in range(0, flat.size, _CHUNK):
        part = flat[lo:lo + _CHUNK]
        x = buf[:part.size]
        np.copyto(x, part, casting="unsafe")
        yield x


def _layer_of(layer: int | np.ndarray, values: np.ndarray, num_layers: int) -> np.ndarray | int:
    """Validate ``update``'s ``layer``: an int, or an int array of ``values``' shape,
    returned flattened (intp)."""
    if np.ndim(layer) == 0:
        i = int(layer)  # type: ignore[arg-type]
        if not 0 <= i < num_layers:
            raise ValueError(f"layer {i} out of range for {num_layers} layers")
        return i
    idx = np.asarray(layer)
    if idx.shape != values.shape or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(
            f"layer must be an int or an integer array of the values' shape {values.shape}, "
            f"got {idx.dtype}{list(idx.shape)}"
        )
    idx = idx.reshape(-1).astype(np.intp)
    if idx.size and (idx.min() < 0 or idx.max() >= num_layers):
        raise ValueError(f"layer indices must be in [0, {num_layers})")
    return idx


def _as_slice(layers: np.ndarray | slice) -> np.ndarray | slice:
    """``layers`` as a slice when it is an ascending run of consecutive indices (a whole
    message of consecutive layers): in-place arithmetic on a slice is one pass, on a fancy
    index a gather, an operation and a scatter."""
    if isinstance(layers, slice):
        return layers
    idx = np.asarray(layers)
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        return idx
    if idx.size == 0:
        return slice(0, 0)
    start = int(idx[0])
    if int(idx[-1]) - start + 1 == idx.size and (idx.size == 1 or bool(np.all(np.diff(idx) == 1))):
        return slice(start, start + idx.size)
    return idx


_RULES: dict[type, tuple[tuple[str, str], ...]] = {}
"""Per statistic class, its (field name, merge rule) pairs (cached ``dataclasses.fields``)."""


def _or_empty(values: Sequence[Any] | np.ndarray | None) -> Sequence[Any] | np.ndarray:
    """A message's array field, or an empty tuple when absent (a list or a NumPy array:
    never tested for truth)."""
    return () if values is None else values


def _floats(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def _ints(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class LayerStatistic:
    """Base of the mergeable statistics: one entry per layer, River-style protocol.

    Subclasses are dataclasses whose fields are arrays with the layer on axis 0 (or nested
    statistics), each declared with its merge rule (add / max / min). This base implements,
    from those rules: :meth:`merge_at`, ``+=``, ``+``, :meth:`copy`, :meth:`take`,
    :meth:`per_copy`, :meth:`pooled`, :meth:`state` and :meth:`exact_fields`, and
    :meth:`update`'s layer dispatch (validate ``layer``, then one layer or one layer per
    element); subclasses implement ``empty``, ``_update_layer`` and ``_update_elements``
    (what raw values add), ``from_columns``, ``to_columns``, ``from_message`` and
    ``get``.
    """

    __slots__ = ()

    @classmethod
    def empty(cls, num_layers: int) -> Self:
        """The neutral element over ``num_layers`` layers (``empty + a == a``)."""
        raise NotImplementedError

    def update(self, values: np.ndarray, layer: int | np.ndarray = 0) -> Self:
        """Fold raw values in and return ``self``: what each element adds is the
        subclass's (:meth:`_update_layer`, :meth:`_update_elements`); the layer dispatch is
        this one.

        Args:
            values: array of any shape (float or integer dtype; each subclass says how it
                widens).
            layer: the layer of every element (int), or int[values.shape], one layer per
                element.

        Returns:
            ``self``.

        Raises:
            ValueError: a layer index out of range, or a ``layer`` array of another shape
                or a non-integer dtype.
        """
        x = np.asarray(values)
        where = _layer_of(layer, x, self.num_layers)
        if isinstance(where, int):
            self._update_layer(x.reshape(-1), where)
        else:
            self._update_elements(x.reshape(-1), where)
        return self

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """Fold the 1-D array ``flat`` into layer ``layer`` (checked in range)."""
        raise NotImplementedError

    def _update_elements(self, flat: np.ndarray, where: np.ndarray) -> None:
        """Fold the 1-D array ``flat`` in, element i into layer ``where[i]`` (intp[n],
        checked in range)."""
        raise NotImplementedError

    @classmethod
    def from_layers(cls, layers: Sequence[np.ndarray]) -> Self:
        """The statistic of k layers given as one array each (any shapes): the same as
        ``empty(k)`` followed by ``update(layers[i], i)`` for every i (the classes the
        producer uses compute each layer's numbers and write them into the arrays once).

        Raises:
            as ``update``.
        """
        stat = cls.empty(len(layers))
        for i, values in enumerate(layers):
            stat.update(values, i)
        return stat

    def get(self) -> Any:
        """The derived value(s) (see each subclass)."""
        raise NotImplementedError

    # -- generic, from the fields' merge rules ------------------------------------------

    def _fields(self) -> Iterator[tuple[str, str, Any]]:
        rules = _RULES.get(type(self))
        if rules is None:
            rules = _RULES[type(self)] = tuple(
                (f.name, f.metadata["merge"]) for f in dataclasses.fields(self)  # type: ignore[arg-type]
            )
        for name, rule in rules:
            yield name, rule, getattr(self, name)

    @property
    def num_layers(self) -> int:
        """L, the number of layers (length of axis 0)."""
        _, rule, value = next(self._fields())
        return value.num_layers if rule == "nested" else len(value)

    def merge_at(self, layers: np.ndarray | slice, other: Self) -> Self:
        """Merge ``other`` into the layers ``layers`` of ``self``, in place.

        Args:
            layers: int[k] distinct layer indices of ``self`` (or a slice selecting k
                layers), aligned with ``other``'s k layers.
            other: a statistic of the same class over k layers.

        Returns:
            ``self``.

        Raises:
            TypeError: ``other`` is of another class.
        """
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        layers = _as_slice(layers)
        with np.errstate(over="ignore", invalid="ignore"):
            for (_, rule, mine), (_, _, theirs) in zip(self._fields(), other._fields(),
                                                       strict=True):
                if rule == "nested":
                    mine.merge_at(layers, theirs)
                elif rule == "add":
                    mine[layers] += theirs
                elif rule == "max":
                    mine[layers] = np.maximum(mine[layers], theirs)
                else:
                    mine[layers] = np.minimum(mine[layers], theirs)
        return self

    def __iadd__(self, other: Self) -> Self:
        """Merge ``other`` (same class, same number of layers) into ``self``.

        Raises:
            TypeError: another class. ValueError: another number of layers.
        """
        if isinstance(other, LayerStatistic) and other.num_layers != self.num_layers:
            raise ValueError(
                f"cannot merge {other.num_layers} layers into {self.num_layers} layers"
            )
        return self.merge_at(slice(None), other)

    def __add__(self, other: Self) -> Self:
        """A new statistic: ``self`` merged with ``other`` (neither is changed)."""
        result = self.copy()
        result += other
        return result

    def _rebuild(self, convert: Any) -> Self:
        """A new statistic whose arrays are ``convert(array, merge rule)`` of this one's
        (built without re-running construction checks: it derives from a valid one)."""
        new = object.__new__(type(self))
        for name, rule, value in self._fields():
            object.__setattr__(
                new, name, value._rebuild(convert) if rule == "nested" else convert(value, rule)
            )
        return new

    def copy(self) -> Self:
        """A deep copy."""
        return self._rebuild(lambda value, rule: value.copy())

    def take(self, layers: np.ndarray) -> Self:
        """The statistic of the selected layers (a copy).

        Args:
            layers: int[k] layer indices or bool[L] mask.
        """
        index = np.asarray(layers)
        return self._rebuild(lambda value, rule: value[index])

    def per_copy(self, copies: np.ndarray | float) -> Self:
        """The statistic of one of ``copies`` identical copies merged into each layer
        (a data-parallel replica summed once per rank): counts and sums are divided by
        ``copies``, extremes are unchanged. Counts become float64, so the result is for
        reading (``get``), not for merging into integer counts.

        Args:
            copies: float64[L] (or a scalar), > 0.
        """
        div = np.asarray(copies, np.float64)

        def convert(value: np.ndarray, rule: str) -> np.ndarray:
            if rule != "add":
                return value.copy()
            scale = div.reshape(div.shape + (1,) * (value.ndim - div.ndim)) if div.ndim else div
            return value / scale

        return self._rebuild(convert)

    def pooled(self) -> Self:
        """All layers merged into one (a statistic over 1 layer)."""
        def convert(value: np.ndarray, rule: str) -> np.ndarray:
            if rule == "add":
                return value.sum(axis=0, keepdims=True)
            if rule == "max":
                return value.max(axis=0, keepdims=True, initial=-np.inf)
            return value.min(axis=0, keepdims=True, initial=np.inf)

        return self._rebuild(convert)

    def state(self) -> dict[str, np.ndarray]:
        """The arrays that make up the statistic, by field name (nested statistics as
        ``"part.field"``); for comparisons and tests."""
        out: dict[str, np.ndarray] = {}
        for name, rule, value in self._fields():
            if rule == "nested":
                out.update({f"{name}.{k}": v for k, v in value.state().items()})
            else:
                out[name] = value
        return out

    def exact_fields(self) -> frozenset[str]:
        """Keys of :meth:`state` that merge exactly (counts, extremes, histograms); the
        others are float sums, exact up to rounding (module docstring)."""
        out: set[str] = set()
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.metadata["merge"] == "nested":
                out |= {f"{f.name}.{k}" for k in getattr(self, f.name).exact_fields()}
            elif f.metadata["exact"]:
                out.add(f.name)
        return frozenset(out)


# -- gradient sums --------------------------------------------------------------------------


def _gradient_sums(flat: np.ndarray) -> tuple[float, float, float, int, int]:
    """(sum |x|, sum x^2, max |x|, non-finite count, NaN count) of a 1-D array over its
    finite elements, float64 accumulation chunk by chunk; sums are not saturated (inf on
    overflow)."""
    sum_abs = sum_sq = max_abs = 0.0
    nonfinite = nan = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for x in _float64_chunks(flat):
            q = float(np.dot(x, x))
            if math.isfinite(q):
                # A NaN or Inf element would have made the sum of squares non-finite (an
                # overflowing square too, which takes the masked path below).
                np.abs(x, out=x)
                sum_abs += float(np.add.reduce(x))
                sum_sq += q
                max_abs = max(max_abs, float(x.max()))
                continue
            good = np.abs(x[np.isfinite(x)])
            nonfinite += x.size - good.size
            nan += int(np.count_nonzero(np.isnan(x)))
            if good.size:
                sum_abs += float(np.add.reduce(good))
                sum_sq += float(np.dot(good, good))
                max_abs = max(max_abs, float(good.max()))
    return sum_abs, sum_sq, max_abs, nonfinite, nan


@dataclass(slots=True, eq=False)
class GradientSums(LayerStatistic):
    """The per-layer gradient statistics every rank sends (``schemas.wire.StepSummary``).

    Attributes (all [L]):
        numel: int64 elements (finite or not).
        abs_numel: int64 elements whose |g| is in ``sum_abs`` / ``max_abs``: equal to
            ``numel`` in full mode; a norms-mode shard (schema 1.2) adds its elements to
            ``numel`` only, leaving ``sum_abs``/``max_abs`` unknown for that layer.
        sum_abs: float64 sum |g| over the finite elements.
        sum_sq: float64 sum g^2 over the finite elements.
        max_abs: float64 max |g| over the finite elements (0 when none).
        nonfinite: int64 NaN/+-Inf elements (left out of the float statistics).
        nan: int64 NaN elements among ``nonfinite`` (the others are +-Inf), where known.
        nan_numel: int64 elements whose NaN/Inf split is known (wire schema 1.7): equal to
            ``numel`` when every shard sent its ``nan`` count or had no non-finite element
            (then it has no NaN either); a shard with non-finite elements and no count (an
            older producer) adds its elements to ``numel`` only, leaving the split
            unknown.

    Frame fields (:meth:`get`; ``consumer.frames``):
    ``mean_abs = sum_abs / numel``, ``norm = sqrt(sum_sq)``, ``rms = sqrt(sum_sq / numel)``.
    The NaN and Inf counts are what the reference implementation's values need besides the
    finite sums (its mean and norm are NaN with a NaN element, else inf with an Inf one;
    its max ignores NaN and is inf with an Inf element; ``analysis.nonfinite``).

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
    """

    numel: np.ndarray = field(metadata=_COUNT)
    abs_numel: np.ndarray = field(metadata=_COUNT)
    sum_abs: np.ndarray = field(metadata=_SUM)
    sum_sq: np.ndarray = field(metadata=_SUM)
    max_abs: np.ndarray = field(metadata=_MAXIMUM)
    nonfinite: np.ndarray = field(metadata=_COUNT)
    nan: np.ndarray = field(metadata=_COUNT)
    nan_numel: np.ndarray = field(metadata=_COUNT)

    @classmethod
    def empty(cls, num_layers: int) -> GradientSums:
        """Zero sums for ``num_layers`` layers."""
        counts, sums = np.zeros(num_layers, np.int64), np.zeros(num_layers)
        return cls(counts, counts.copy(), sums, sums.copy(), sums.copy(), counts.copy(),
                   counts.copy(), counts.copy())

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
        n = _ints(numel)
        bad = _ints(nonfinite)
        if nan is None:
            nan_count, nan_numel = np.zeros(len(n), np.int64), np.where(bad == 0, n, 0)
        else:
            given = np.asarray(nan, np.float64)
            split = (given >= 0) | (bad == 0)  # NaN (a NULL) and negatives: unknown
            nan_count = np.where(given >= 0, given, 0).astype(np.int64)
            nan_numel = np.where(split, n, 0)
        if sum_abs is None or max_abs is None:
            zeros = np.zeros(len(n))
            return cls(n, np.zeros(len(n), np.int64), zeros, _floats(sum_sq), zeros.copy(),
                       _ints(nonfinite), nan_count, nan_numel)
        a, m = _floats(sum_abs), _floats(max_abs)
        known = ~(np.isnan(a) | np.isnan(m))
        return cls(n, np.where(known, n, 0), np.where(known, a, 0.0), _floats(sum_sq),
                   np.where(known, m, 0.0), _ints(nonfinite), nan_count, nan_numel)

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

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw gradient values: every element counts in
        ``numel``; NaN/Inf in ``nonfinite`` only; the finite ones in the sums and the
        maximum (float64 accumulation, whatever the input dtype); the NaN among them in
        ``nan``."""
        a, q, m, bad, nan = _gradient_sums(flat)
        self.numel[layer] += flat.size
        self.abs_numel[layer] += flat.size
        self.nan[layer] += nan
        self.nan_numel[layer] += flat.size
        with np.errstate(over="ignore"):
            self.sum_abs[layer] += a
            self.sum_sq[layer] += q
        self.max_abs[layer] = max(self.max_abs[layer], m)
        self.nonfinite[layer] += bad

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
        k = len(layers)
        counts, sums = np.empty((k, 3), np.int64), np.empty((k, 3))
        for i, values in enumerate(layers):
            flat = np.asarray(values).reshape(-1)
            sum_abs, sum_sq, max_abs, bad, nan = _gradient_sums(flat)
            counts[i] = flat.size, bad, nan
            sums[i] = sum_abs, sum_sq, max_abs
        numel = counts[:, 0].copy()
        return cls(numel, numel.copy(), sums[:, 0].copy(), sums[:, 1].copy(),
                   sums[:, 2].copy(), counts[:, 1].copy(), counts[:, 2].copy(), numel.copy())

    def saturate(self) -> GradientSums:
        """Clip ``sum_abs`` and ``sum_sq`` at the largest finite double, in place, for a
        caller that needs finite numbers. Returns ``self``. The producer does not: an
        overflowing gradient sum travels as +inf (wire schema 1.6), as the reference
        implementation's f64 sums overflow."""
        np.minimum(self.sum_abs, _MAX_DOUBLE, out=self.sum_abs)
        np.minimum(self.sum_sq, _MAX_DOUBLE, out=self.sum_sq)
        return self

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


# -- exponent histogram ---------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class ExponentHistogram(LayerStatistic):
    """Counts of finite elements per power-of-two magnitude band, per layer.

    Columns (``B = EXP_HIST_BINS``): 0 exact zeros, 1 underflow (0 < |x| < 2^EXP_HIST_MIN),
    ``c`` in 2..B-2 holds 2^(MIN+c-2) <= |x| < 2^(MIN+c-1), B-1 overflow (|x| >=
    2^EXP_HIST_MAX); NaN/Inf are counted apart in ``nonfinite``. Counts merge by addition,
    exactly.

    Attributes:
        counts: int64[L, B].
        nonfinite: int64[L] NaN/Inf elements (not binned); ``counts.sum(1) + nonfinite``
            is the number of elements covered.

    >>> h = ExponentHistogram.empty(1).update(np.array([0.0, 1.0, 1.5, 3.0, np.inf]))
    >>> int(h.counts[0, 0]), int(h.counts[0, exp_hist_column(0)]), int(h.nonfinite[0])
    (1, 2, 1)
    >>> round(float(h.entropy()[0]), 6)  # p = (1/4, 1/2, 1/4)
    1.5
    """

    counts: np.ndarray = field(metadata=_COUNT)
    nonfinite: np.ndarray = field(metadata=_COUNT)

    @classmethod
    def empty(cls, num_layers: int) -> ExponentHistogram:
        """Zero counts for ``num_layers`` layers."""
        return cls(np.zeros((num_layers, EXP_HIST_BINS), np.int64),
                   np.zeros(num_layers, np.int64))

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
        off, cols, vals = _csr_arrays(offsets, columns, counts)
        k = len(off) - 1
        dense = np.zeros((k, EXP_HIST_BINS), np.int64)
        keys = np.repeat(np.arange(k) * EXP_HIST_BINS, np.diff(off)) + cols
        flat = dense.reshape(-1)
        if keys.size < 2 or bool(np.all(keys[1:] > keys[:-1])):
            flat[keys] = vals  # distinct entries (the wire's ascending columns): one scatter
        else:
            np.add.at(flat, keys, vals)
        return cls(dense, _ints(nonfinite))

    def to_columns(self) -> dict[str, np.ndarray]:
        """The sparse form, inverse of :meth:`from_columns`: ``offsets``, ``columns``,
        ``counts`` (non-zero entries, columns ascending per layer), ``nonfinite``."""
        rows, cols = np.nonzero(self.counts)
        offsets = np.zeros(self.num_layers + 1, np.int64)
        np.cumsum(np.bincount(rows, minlength=self.num_layers), out=offsets[1:])
        return {"offsets": offsets, "columns": cols.astype(np.int64),
                "counts": self.counts[rows, cols], "nonfinite": self.nonfinite.copy()}

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
        return {"offsets": offsets, "columns": _or_empty(columns),
                "counts": _or_empty(counts), "nonfinite": nonfinite}

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
        off, cols, vals = _csr_arrays(offsets, columns, counts, idx.size)
        np.add.at(self.counts, (np.repeat(idx, np.diff(off)), cols), vals)
        self.nonfinite[_as_slice(idx)] += _ints(nonfinite)
        return self

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw values: bin them by base-2 exponent
        (exactly, subnormals included: the column is read from the IEEE 754 exponent
        field, zeros and subnormals re-binned with ``np.frexp``); NaN/Inf go to
        ``nonfinite``. float16/32/64 are binned from their own bits (float16 widened to
        float32 exactly), other dtypes as float64."""
        total = np.zeros(EXP_HIST_BINS + 1, np.int64)
        for lo in range(0, flat.size, _CHUNK):
            total += _exponent_counts(flat[lo:lo + _CHUNK])
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
            for lo in range(0, flat.size, _CHUNK):
                total[i] += _exponent_counts(flat[lo:lo + _CHUNK])
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


# -- sums of squares ------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class SumOfSquares(LayerStatistic):
    """Sum of squares of a tensor's finite elements per layer: the squared weight norm
    ``weight_sum_sq`` and the squared update norm ``update_sum_sq`` of the wire.

    Attributes:
        numel: int64[L] elements covered (0: the layer has no such statistic).
        sum_sq: float64[L] sum x^2 over the finite elements.

    >>> s = SumOfSquares.empty(1).update(np.array([3.0, 4.0]))
    >>> (s + SumOfSquares.from_columns([1], [np.nan])).norm().tolist()  # NULL covers nothing
    [5.0]
    """

    numel: np.ndarray = field(metadata=_COUNT)
    sum_sq: np.ndarray = field(metadata=_SUM)

    @classmethod
    def empty(cls, num_layers: int) -> SumOfSquares:
        """Zero sums for ``num_layers`` layers."""
        return cls(np.zeros(num_layers, np.int64), np.zeros(num_layers))

    @classmethod
    def from_columns(
        cls, numel: Sequence[int] | np.ndarray, sum_sq: Sequence[float] | np.ndarray,
    ) -> SumOfSquares:
        """From aligned arrays: ``numel`` int[k] elements of each layer and ``sum_sq``
        float[k]; a NaN ``sum_sq`` (a stored NULL) covers no element."""
        q = _floats(sum_sq)
        known = ~np.isnan(q)
        return cls(np.where(known, _ints(numel), 0), np.where(known, q, 0.0))

    def to_columns(self) -> dict[str, np.ndarray]:
        """``numel`` and ``sum_sq`` (NaN where no element is covered), inverse of
        :meth:`from_columns`."""
        return {"numel": self.numel.copy(),
                "sum_sq": np.where(self.numel > 0, self.sum_sq, np.nan)}

    @classmethod
    def from_message(cls, message: SummaryMessage, name: str) -> SumOfSquares | None:
        """The sums of squares ``name`` (``"weight_sum_sq"`` or ``"update_sum_sq"``) of a
        StepSummary / MergedFrame (k layers; the tensors have the gradient's shape), or None
        when the message does not carry them.

        Raises:
            ValueError: another ``name``.
        """
        if name not in ("weight_sum_sq", "update_sum_sq"):
            raise ValueError(f"no sum of squares named {name!r}")
        values = getattr(message, name)
        return None if values is None else cls.from_columns(message.numel, values)

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw values: every element counts in
        ``numel``, the finite ones add their square (float64)."""
        _, q, _, _, _ = _gradient_sums(flat)
        self.numel[layer] += flat.size
        with np.errstate(over="ignore"):
            self.sum_sq[layer] += q

    def _update_elements(self, flat: np.ndarray, where: np.ndarray) -> None:
        """As :meth:`_update_layer`, element i into layer ``where[i]``."""
        v = flat.astype(np.float64)
        finite = np.isfinite(v)
        self.numel += np.bincount(where, minlength=self.num_layers)
        with np.errstate(over="ignore"):
            self.sum_sq += np.bincount(where[finite], weights=v[finite] ** 2,
                                       minlength=self.num_layers)

    def saturate(self) -> SumOfSquares:
        """Clip ``sum_sq`` at the largest finite double, in place; returns ``self``."""
        np.minimum(self.sum_sq, _MAX_DOUBLE, out=self.sum_sq)
        return self

    def norm(self) -> np.ndarray:
        """float64[L] sqrt(sum x^2)."""
        return np.sqrt(self.sum_sq)

    def get(self) -> np.ndarray:
        """float64[L] sum x^2 (a copy)."""
        return self.sum_sq.copy()


# -- power sums and weight moments ----------------------------------------------------------


def _power_sums(flat: np.ndarray) -> tuple[int, float, float, float, float, float, float]:
    """(finite count, S1, S2, S3, S4, min, max) of the finite elements of a 1-D array,
    float64 chunk by chunk (min > max when there is no finite element)."""
    count = 0
    s1 = s2 = s3 = s4 = 0.0
    lo, hi = math.inf, -math.inf
    with np.errstate(over="ignore", invalid="ignore"):
        for x in _float64_chunks(flat):
            finite = np.isfinite(x)
            if not finite.all():
                x = x[finite]
                if x.size == 0:
                    continue
            count += x.size
            x2 = x * x
            s1 += float(np.add.reduce(x))
            s2 += float(np.add.reduce(x2))
            s3 += float(np.dot(x2, x))
            s4 += float(np.dot(x2, x2))
            lo = min(lo, float(x.min()))
            hi = max(hi, float(x.max()))
    return count, s1, s2, s3, s4, lo, hi


def _central_moments(
    n: np.ndarray, s1: np.ndarray, s2: np.ndarray, s3: np.ndarray, s4: np.ndarray,
) -> dict[str, np.ndarray]:
    """Mean, population std, skewness and excess kurtosis from power sums (binomial
    expansion of the central moments; Pebay 2008 eq. 1.1 with the mean expanded):
    ``m2 = S2/n - mean^2``, ``m3 = S3/n - 3 mean S2/n + 2 mean^3``,
    ``m4 = S4/n - 4 mean S3/n + 6 mean^2 S2/n - 3 mean^4``; skewness ``m3 / m2^1.5``
    (0 when n < 3 or std = 0), excess kurtosis ``m4 / m2^2 - 3`` (0 when n < 4 or
    std = 0); all NaN where n = 0."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
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
        "mean": np.where(empty, np.nan, mean), "std_dev": np.where(empty, np.nan, std),
        "skewness": np.where(empty, np.nan, skew), "kurtosis": np.where(empty, np.nan, kurt),
    }


@dataclass(slots=True, eq=False)
class PowerSums(LayerStatistic):
    """Power sums ``S_k = sum x^k`` (k = 1..4) and extremes of the finite elements, per layer.

    Attributes (all [L]):
        count: int64 finite elements. nonfinite: int64 NaN/Inf elements (left out).
        s1, s2, s3, s4: float64 sum x, sum x^2, sum x^3, sum x^4.
        minimum, maximum: float64 extremes (+inf / -inf while count = 0).

    Derived values (:meth:`get`): mean, population std, skewness and excess kurtosis
    (:func:`_central_moments`), min and max.

    >>> p = PowerSums.empty(1).update(np.array([1.0, 2.0, 3.0, 4.0]))
    >>> q = PowerSums.empty(1).update(np.array([np.nan, 10.0]))
    >>> out = (p + q).get()
    >>> out["mean"].tolist(), out["min"].tolist(), out["max"].tolist(), out["count"].tolist()
    ([4.0], [1.0], [10.0], [5])
    >>> round(float(p.get()["std_dev"][0]) ** 2, 12), float(p.get()["skewness"][0])
    (1.25, 0.0)
    """

    count: np.ndarray = field(metadata=_COUNT)
    s1: np.ndarray = field(metadata=_SUM)
    s2: np.ndarray = field(metadata=_SUM)
    s3: np.ndarray = field(metadata=_SUM)
    s4: np.ndarray = field(metadata=_SUM)
    minimum: np.ndarray = field(metadata=_MINIMUM)
    maximum: np.ndarray = field(metadata=_MAXIMUM)
    nonfinite: np.ndarray = field(metadata=_COUNT)

    @classmethod
    def empty(cls, num_layers: int) -> PowerSums:
        """Zero sums and infinite extremes (the neutral element) for ``num_layers`` layers."""
        counts, sums = np.zeros(num_layers, np.int64), np.zeros(num_layers)
        return cls(counts, sums, sums.copy(), sums.copy(), sums.copy(),
                   np.full(num_layers, np.inf), np.full(num_layers, -np.inf), counts.copy())

    @classmethod
    def from_columns(
        cls,
        count: Sequence[int] | np.ndarray,
        s1: Sequence[float] | np.ndarray,
        s2: Sequence[float] | np.ndarray,
        s3: Sequence[float] | np.ndarray,
        s4: Sequence[float] | np.ndarray,
        minimum: Sequence[float] | np.ndarray,
        maximum: Sequence[float] | np.ndarray,
        nonfinite: Sequence[int] | np.ndarray,
    ) -> PowerSums:
        """From aligned arrays (the wire's and the store's form).

        Args:
            count, nonfinite: int[k] finite and non-finite elements.
            s1..s4: float[k]; a NaN ``s1`` (a stored NULL) marks a layer without these
                statistics, which then covers nothing.
            minimum, maximum: float[k] extremes; ignored where ``count`` is 0 (the wire
                sends 0.0 there).
        """
        a = _floats(s1)
        known = ~np.isnan(a)
        n = np.where(known, _ints(count), 0)
        has = n > 0

        def sums(values: Sequence[float] | np.ndarray) -> np.ndarray:
            return np.where(known, _floats(values), 0.0)

        return cls(
            n, sums(a), sums(s2), sums(s3), sums(s4),
            np.where(has, _floats(minimum), np.inf), np.where(has, _floats(maximum), -np.inf),
            np.where(known, _ints(nonfinite), 0),
        )

    def to_columns(self) -> dict[str, np.ndarray]:
        """The wire/stored form, inverse of :meth:`from_columns`: ``count``, ``s1``..``s4``
        (NaN where the layer covers no element), ``minimum``/``maximum`` (0.0 where there is
        no finite element, as the wire sends them) and ``nonfinite``."""
        covered = (self.count + self.nonfinite) > 0
        has = self.count > 0
        out = {"count": self.count.copy()}
        for name in ("s1", "s2", "s3", "s4"):
            out[name] = np.where(covered, getattr(self, name), np.nan)
        out["minimum"] = np.where(has, self.minimum, 0.0)
        out["maximum"] = np.where(has, self.maximum, 0.0)
        out["nonfinite"] = self.nonfinite.copy()
        return out

    @classmethod
    def from_message(cls, message: SummaryMessage) -> PowerSums | None:
        """The weight power sums of a StepSummary / MergedFrame (k layers; ``weight_sum``,
        ``weight_sum_sq``, ``weight_sum_cube``, ``weight_sum_quad``, ``weight_min``,
        ``weight_max``, ``weight_nonfinite``), or None without a weight distribution."""
        if message.weight_sum is None or message.weight_nonfinite is None:
            return None
        nonfinite = _ints(message.weight_nonfinite)
        return cls.from_columns(
            _ints(message.numel) - nonfinite, message.weight_sum,
            *(_or_empty(getattr(message, name)) for name in (
                "weight_sum_sq", "weight_sum_cube", "weight_sum_quad", "weight_min",
                "weight_max")),
            nonfinite,
        )

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw values: NaN/Inf count in ``nonfinite``
        only; the finite ones add their powers (float64) and move the extremes."""
        n, a, b, c, d, lo, hi = _power_sums(flat)
        self.count[layer] += n
        self.nonfinite[layer] += flat.size - n
        with np.errstate(over="ignore", invalid="ignore"):
            self.s1[layer] += a
            self.s2[layer] += b
            self.s3[layer] += c
            self.s4[layer] += d
        self.minimum[layer] = min(self.minimum[layer], lo)
        self.maximum[layer] = max(self.maximum[layer], hi)

    def _update_elements(self, flat: np.ndarray, where: np.ndarray) -> None:
        """As :meth:`_update_layer`, element i into layer ``where[i]``."""
        v = flat.astype(np.float64)
        finite = np.isfinite(v)
        size = self.num_layers
        good, at = v[finite], where[finite]
        self.count += np.bincount(at, minlength=size)
        self.nonfinite += np.bincount(where[~finite], minlength=size)
        with np.errstate(over="ignore", invalid="ignore"):
            x2 = good * good
            for name, weights in (("s1", good), ("s2", x2), ("s3", x2 * good),
                                  ("s4", x2 * x2)):
                getattr(self, name)[:] += np.bincount(at, weights=weights, minlength=size)
        np.minimum.at(self.minimum, at, good)
        np.maximum.at(self.maximum, at, good)

    @classmethod
    def from_layers(cls, layers: Sequence[np.ndarray]) -> PowerSums:
        """The power sums of k layers given as one array each (see
        :meth:`LayerStatistic.from_layers`; what the producer sends for the weights)."""
        k = len(layers)
        counts, sums = np.empty((k, 2), np.int64), np.empty((k, 6))
        for i, values in enumerate(layers):
            flat = np.asarray(values).reshape(-1)
            n, *rest = _power_sums(flat)
            counts[i] = n, flat.size - n
            sums[i] = rest
        return cls(counts[:, 0].copy(), *(sums[:, j].copy() for j in range(6)),
                   counts[:, 1].copy())

    def saturate(self) -> PowerSums:
        """Clip ``s1``..``s4`` to [-max double, max double], in place (an overflowing power
        sum is reported as that bound; NaN stays NaN). Returns ``self``."""
        for name in ("s1", "s2", "s3", "s4"):
            values = getattr(self, name)
            np.clip(values, -_MAX_DOUBLE, _MAX_DOUBLE, out=values)
        return self

    def mean(self) -> np.ndarray:
        """float64[L] mean of the finite elements (NaN where count = 0)."""
        return self.get()["mean"]

    def std(self) -> np.ndarray:
        """float64[L] population standard deviation (NaN where count = 0)."""
        return self.get()["std_dev"]

    def skewness(self) -> np.ndarray:
        """float64[L] skewness m3 / m2^1.5 (0 when count < 3 or std = 0)."""
        return self.get()["skewness"]

    def kurtosis(self) -> np.ndarray:
        """float64[L] excess kurtosis m4 / m2^2 - 3 (0 when count < 4 or std = 0)."""
        return self.get()["kurtosis"]

    def get(self) -> dict[str, np.ndarray]:
        """float64[L] each: ``mean``, ``std_dev``, ``skewness``, ``kurtosis``
        (:func:`_central_moments`), ``min``, ``max`` (NaN where count = 0), and the counts
        ``count``, ``nonfinite``."""
        out = _central_moments(self.count, self.s1, self.s2, self.s3, self.s4)
        has = self.count > 0
        out["min"] = np.where(has, self.minimum, np.nan)
        out["max"] = np.where(has, self.maximum, np.nan)
        out["count"] = self.count.copy()
        out["nonfinite"] = self.nonfinite.copy()
        return out


@dataclass(slots=True, eq=False)
class WeightMoments(LayerStatistic):
    """The weight distribution of each layer, as exactly mergeable statistics of the
    finite weights: power sums and extremes (:class:`PowerSums`) and the exponent histogram
    of |w| (:class:`ExponentHistogram`, whose column 0 counts the exact zeros).

    Attributes:
        power: PowerSums[L]. exp_hist: ExponentHistogram[L] of the same weights.

    Raises:
        ValueError: (construction) the two parts disagree on the number of layers or on the
            finite / non-finite counts.

    >>> w = WeightMoments.empty(1).update(np.array([0.0, 0.5, -1.0, 2.0, np.nan]))
    >>> out = w.get()
    >>> out["mean"].tolist(), out["zero_fraction"].tolist(), out["nonfinite"].tolist()
    ([0.375], [0.25], [1])
    >>> round(float(out["entropy"][0]), 6)  # four weights in four binades
    2.0
    >>> cols = w.to_columns()
    >>> WeightMoments.from_columns(**cols).state()["power.s4"].tolist()
    [17.0625]
    """

    power: PowerSums = field(metadata=_PART)
    exp_hist: ExponentHistogram = field(metadata=_PART)

    def __post_init__(self) -> None:
        if self.power.num_layers != self.exp_hist.num_layers:
            raise ValueError("power sums and histogram must cover the same layers")
        agree = np.array_equal if self.power.count.dtype.kind == "i" else np.allclose
        if not (agree(self.power.count, self.exp_hist.finite())
                and agree(self.power.nonfinite, self.exp_hist.nonfinite)):
            raise ValueError(
                "power sums and exponent histogram disagree on the finite / non-finite counts"
            )

    @classmethod
    def empty(cls, num_layers: int) -> WeightMoments:
        """The neutral element for ``num_layers`` layers."""
        return cls(PowerSums.empty(num_layers), ExponentHistogram.empty(num_layers))

    @classmethod
    def from_columns(
        cls,
        numel: Sequence[int] | np.ndarray,
        nonfinite: Sequence[int] | np.ndarray,
        s1: Sequence[float] | np.ndarray,
        s2: Sequence[float] | np.ndarray,
        s3: Sequence[float] | np.ndarray,
        s4: Sequence[float] | np.ndarray,
        minimum: Sequence[float] | np.ndarray,
        maximum: Sequence[float] | np.ndarray,
        hist_offsets: Sequence[int] | np.ndarray,
        hist_columns: Sequence[int] | np.ndarray,
        hist_counts: Sequence[int] | np.ndarray,
    ) -> WeightMoments:
        """From the stored ``layer_stats`` columns (k rows): ``numel``,
        ``weight_nonfinite``, ``weight_sum``, ``weight_sum_sq``, ``weight_sum_cube``,
        ``weight_sum_quad``, ``weight_min``, ``weight_max`` and the CSR form of
        ``weight_exp_hist_columns`` / ``weight_exp_hist_counts``
        (:func:`csr_from_lists`). A row whose ``s1`` is NaN (NULL) has no weight
        statistics and covers nothing (its histogram row must be empty).

        Raises:
            ValueError: malformed CSR, or histogram rows that do not sum to
                ``numel - nonfinite``.
        """
        power = PowerSums.from_columns(_ints(numel) - _ints(nonfinite), s1, s2, s3, s4,
                                       minimum, maximum, nonfinite)
        hist = ExponentHistogram.from_columns(hist_offsets, hist_columns, hist_counts,
                                              power.nonfinite)
        return cls(power, hist)

    def to_columns(self) -> dict[str, np.ndarray]:
        """The stored form, inverse of :meth:`from_columns` (keys are its parameter names;
        ``s1``..``s4`` NaN and ``numel`` 0 where a layer covers nothing)."""
        p, h = self.power.to_columns(), self.exp_hist.to_columns()
        return {
            "numel": p["count"] + p["nonfinite"], "nonfinite": p["nonfinite"], "s1": p["s1"],
            "s2": p["s2"], "s3": p["s3"], "s4": p["s4"], "minimum": p["minimum"],
            "maximum": p["maximum"], "hist_offsets": h["offsets"],
            "hist_columns": h["columns"], "hist_counts": h["counts"],
        }

    @classmethod
    def from_message(cls, message: SummaryMessage) -> WeightMoments | None:
        """The weight distribution of a StepSummary / MergedFrame (k layers), or None when
        the message carries none (schema 1.2 fields ``weight_*``)."""
        power = PowerSums.from_message(message)
        hist = ExponentHistogram.from_message(message, weights=True)
        return None if power is None or hist is None else cls(power, hist)

    def merge_message(self, layers: np.ndarray, message: SummaryMessage) -> bool:
        """Merge the weight distribution of a StepSummary / MergedFrame (k layers) into
        layers ``layers`` (int[k]), in place: the same as ``self.merge_at(layers,
        WeightMoments.from_message(message))``, the histogram merged from its sparse form
        (:meth:`ExponentHistogram.merge_columns`).

        Returns:
            False (and nothing merged) when the message carries no weight distribution.
        """
        power = PowerSums.from_message(message)
        columns = ExponentHistogram.message_columns(message, weights=True)
        if power is None or columns is None:
            return False
        self.exp_hist.merge_columns(layers, **columns)  # checks its input before merging
        self.power.merge_at(layers, power)
        return True

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw weights: both parts (see
        :meth:`PowerSums._update_layer` and :meth:`ExponentHistogram._update_layer`)."""
        self.power._update_layer(flat, layer)
        self.exp_hist._update_layer(flat, layer)

    def _update_elements(self, flat: np.ndarray, where: np.ndarray) -> None:
        """As :meth:`_update_layer`, element i into layer ``where[i]``."""
        self.power._update_elements(flat, where)
        self.exp_hist._update_elements(flat, where)

    def saturate(self) -> WeightMoments:
        """:meth:`PowerSums.saturate` in place; returns ``self``."""
        self.power.saturate()
        return self

    def numel(self) -> np.ndarray:
        """int64[L] weights covered (finite and not)."""
        return self.power.count + self.power.nonfinite

    def zeros(self) -> np.ndarray:
        """int64[L] exact-zero weights (column 0 of the histogram)."""
        return self.exp_hist.zeros()

    def zero_fraction(self) -> np.ndarray:
        """float64[L] exact zeros / finite weights (NaN where there is no finite weight)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.power.count > 0, self.zeros() / self.power.count, np.nan)

    def entropy(self) -> np.ndarray:
        """float64[L] entropy in bits of |w| over the exponent bins
        (:meth:`ExponentHistogram.entropy`; NaN where there is no finite weight)."""
        return self.exp_hist.entropy()

    def get(self) -> dict[str, np.ndarray]:
        """[L] each, the fields of a weight distribution: ``mean``, ``std_dev``,
        ``skewness``, ``kurtosis``, ``min``, ``max`` (:meth:`PowerSums.get`), ``entropy``,
        ``zero_fraction``, ``count`` (finite weights) and ``nonfinite``."""
        out = self.power.get()
        out["entropy"] = self.entropy()
        out["zero_fraction"] = self.zero_fraction()
        return out


STATISTICS: tuple[type[LayerStatistic], ...] = (
    GradientSums, ExponentHistogram, SumOfSquares, PowerSums, WeightMoments,
)
"""Every mergeable statistic class (the property test runs over this registry)."""
