"""The common machinery of the mergeable statistics: the protocol, the merge rules, the
message shape they read.

Every statistic is a dataclass whose fields are arrays with the layer on axis 0 (or nested
statistics), each declared with its merge rule (:data:`COUNT`, :data:`SUM`, :data:`MAXIMUM`,
:data:`MINIMUM`, :data:`PART`); :class:`LayerStatistic` derives merging, copying, selection,
pooling and comparison from those declarations. The statistics read a StepSummary or
MergedFrame through :class:`SummaryMessage`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, Self, get_type_hints

import numpy as np

MAX_DOUBLE = float(np.finfo(np.float64).max)
"""The largest finite float64, the bound a saturated sum is clipped to."""

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



COUNT = {"merge": "add", "exact": True, "neutral": 0, "dtype": np.int64}
"""Field metadata: merged by addition from 0, compared exactly (an int64 count)."""
SUM = {"merge": "add", "exact": False, "neutral": 0.0, "dtype": np.float64}
"""Field metadata: merged by addition from 0.0, equal up to rounding (a float64 sum)."""
MAXIMUM = {"merge": "max", "exact": True, "neutral": -np.inf, "dtype": np.float64}
"""Field metadata: merged by taking the maximum from -inf, compared exactly."""
MAGNITUDE_MAXIMUM = {**MAXIMUM, "neutral": 0.0}
"""Field metadata: the maximum of magnitudes (values >= 0), whose neutral element is 0.0
(a layer without elements reads 0)."""
MINIMUM = {"merge": "min", "exact": True, "neutral": np.inf, "dtype": np.float64}
"""Field metadata: merged by taking the minimum from +inf, compared exactly."""
PART = {"merge": "nested", "exact": False}
"""Field metadata: another statistic (the field's annotated class), merged by its own
rules."""


def per_column(rule: dict[str, Any], columns: int) -> dict[str, Any]:
    """Field metadata ``rule`` for an array of ``columns`` entries per layer
    (shape [L, columns]), e.g. a histogram's counts."""
    return {**rule, "columns": columns}


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


def as_slice(layers: np.ndarray | slice) -> np.ndarray | slice:
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
    # Strictly ascending from the first to the last index, spanning as many indices as it
    # holds: consecutive (one comparison pass; count_nonzero is the cheapest reduction of
    # a small boolean array, a fraction of ``.all()``'s call overhead).
    if int(idx[-1]) - start + 1 == idx.size and (
            idx.size == 1 or not np.count_nonzero(idx[1:] <= idx[:-1])):
        return slice(start, start + idx.size)
    return idx


_RULES: dict[type, tuple[tuple[str, str], ...]] = {}
"""Per statistic class, its (field name, merge rule) pairs (cached ``dataclasses.fields``)."""


def or_empty(values: Sequence[Any] | np.ndarray | None) -> Sequence[Any] | np.ndarray:
    """A message's array field, or an empty tuple when absent (a list or a NumPy array:
    never tested for truth)."""
    return () if values is None else values


def as_floats(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """``values`` as a new float64 array."""
    return np.array(values, dtype=np.float64)


def as_ints(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """``values`` as a new int64 array."""
    return np.array(values, dtype=np.int64)



_PARTS: dict[type, dict[str, type[LayerStatistic]]] = {}
"""Per statistic class, the classes of its nested statistics by field name."""


def _part_classes(cls: type) -> dict[str, type[LayerStatistic]]:
    """The annotated classes of ``cls``'s :data:`PART` fields (resolved once)."""
    parts = _PARTS.get(cls)
    if parts is None:
        hints = get_type_hints(cls)
        parts = _PARTS[cls] = {
            f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.metadata["merge"] == "nested"
        }
    return parts


class LayerStatistic:
    """Base of the mergeable statistics: one entry per layer, River-style protocol.

    Subclasses are dataclasses whose fields are arrays with the layer on axis 0 (or nested
    statistics), each declared with its merge rule (add / max / min), whose metadata also
    carries the rule's neutral element and the array's dtype. This base implements, from
    those declarations: :meth:`empty`, :meth:`merge_at`, ``+=``, ``+``, :meth:`copy`,
    :meth:`take`, :meth:`per_copy`, :meth:`pooled`, :meth:`saturate`, :meth:`state` and
    :meth:`exact_fields`, and
    :meth:`update`'s layer dispatch (validate ``layer``, then one layer or one layer per
    element); subclasses implement ``_update_layer`` and ``_update_elements``
    (what raw values add), ``from_columns``, ``to_columns``, ``from_message`` and
    ``get``.

    Examples:
        A statistic of its own (counts add, the peak takes the maximum):

        >>> from dataclasses import dataclass, field
        >>> @dataclass(slots=True, eq=False)
        ... class Peak(LayerStatistic):
        ...     numel: np.ndarray = field(metadata=COUNT)
        ...     peak: np.ndarray = field(metadata=MAXIMUM)
        ...     def _update_layer(self, flat, layer):
        ...         self.numel[layer] += flat.size
        ...         self.peak[layer] = max(self.peak[layer], flat.max(initial=-np.inf))
        >>> a = Peak.empty(2).update(np.array([1.0, 5.0]), 0)
        >>> b = Peak.empty(2).update(np.array([7.0]), 0).update(np.array([2.0]), 1)
        >>> merged = a + b
        >>> merged.numel.tolist(), merged.peak.tolist(), merged.pooled().peak.tolist()
        ([3, 1], [7.0, 2.0], [7.0])
        >>> sorted(merged.exact_fields())
        ['numel', 'peak']
        >>> Peak.empty(1).peak.tolist()  # each field's neutral element
        [-inf]
    """

    __slots__ = ()

    @classmethod
    def empty(cls, num_layers: int) -> Self:
        """The neutral element over ``num_layers`` layers (``empty + a == a``): every
        array field filled with its rule's ``neutral`` value in its ``dtype`` (shape [L],
        or [L, columns]); every nested statistic its own class's ``empty``."""
        parts: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            meta = f.metadata
            if meta["merge"] == "nested":
                parts[f.name] = _part_classes(cls)[f.name].empty(num_layers)
            else:
                shape = (num_layers, meta["columns"]) if "columns" in meta else num_layers
                parts[f.name] = np.full(shape, meta["neutral"], meta["dtype"])
        return cls(**parts)

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
        layers = as_slice(layers)
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

    def saturate(self) -> Self:
        """Clip every float sum (the fields merged by addition and compared up to rounding;
        those of nested statistics too) to [-MAX_DOUBLE, MAX_DOUBLE], in place: an
        overflowing sum is reported as that bound, NaN stays NaN. For a caller that needs
        finite numbers. Returns ``self``."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.metadata["merge"] == "nested":
                value.saturate()
            elif f.metadata["merge"] == "add" and not f.metadata["exact"]:
                np.clip(value, -MAX_DOUBLE, MAX_DOUBLE, out=value)
        return self

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

