"""Per-layer gradient summaries: the statistics every rank sends for every optimiser step.

For each layer the summary holds ``numel``, ``sum_abs`` = sum |g|, ``sum_sq`` = sum g^2,
``max_abs`` = max |g| and ``nonfinite`` = number of NaN/+-Inf elements. NaN and Inf are
counted and left out of the three float statistics, which accumulate in float64 whatever
the input dtype. They merge exactly across ranks (sums add, max takes the max, counts add),
which is what lets the consumer rebuild a full-tensor frame from per-rank shards
(DESIGN.md, "Wire contract"; derived frame fields follow seed 001 ``record_step``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

_FLOAT_KINDS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}
_MAX_DOUBLE = float(np.finfo(np.float64).max)


@dataclass(frozen=True, slots=True)
class LayerSummaries:
    """Columnar summaries of L layers, aligned with ``names``.

    Attributes:
        names: layer names, length L, in the order of the input mapping.
        numel: int64[L], elements per layer (finite or not).
        sum_abs: float64[L], sum of |g| over finite elements.
        sum_sq: float64[L], sum of g^2 over finite elements (saturates at the largest
            finite double instead of overflowing to inf).
        max_abs: float64[L], max |g| over finite elements (0.0 when there are none).
        nonfinite: int64[L], count of NaN/+-Inf elements.
    """

    names: tuple[str, ...]
    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray
    nonfinite: np.ndarray

    def __len__(self) -> int:
        return len(self.names)


def _as_float_array(name: str, value: object) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype not in _FLOAT_KINDS:
        raise TypeError(
            f"gradient {name!r} has dtype {arr.dtype}; expected float16, float32 or float64"
        )
    if arr.size == 0:
        raise ValueError(f"gradient {name!r} is empty (0 elements)")
    return arr.reshape(-1)


def _summarize_one(flat: np.ndarray) -> tuple[float, float, float, int]:
    """(sum_abs, sum_sq, max_abs, nonfinite) of one flat float array, float64 accumulation."""
    x = flat.astype(np.float64, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        sum_sq = float(np.dot(x, x))
    if np.isfinite(sum_sq):
        # A NaN or Inf element would have made the sum of squares non-finite, and
        # float16/32 squares cannot overflow a double: every element is finite.
        absx = np.abs(x)
        return float(np.add.reduce(absx)), sum_sq, float(absx.max()), 0
    finite = np.isfinite(x)
    nonfinite = int(x.size - np.count_nonzero(finite))
    good = np.abs(x[finite])
    if good.size == 0:
        return 0.0, 0.0, 0.0, nonfinite
    with np.errstate(over="ignore"):
        sum_sq = float(np.dot(good, good))
    return (
        float(np.add.reduce(good)),
        min(sum_sq, _MAX_DOUBLE),
        float(good.max()),
        nonfinite,
    )


def summarize(gradients: Mapping[str, np.ndarray]) -> LayerSummaries:
    """Summarise a mapping of layer name -> gradient array.

    Args:
        gradients: name -> NumPy array of any shape, dtype float16, float32 or float64.

    Returns:
        LayerSummaries with one entry per layer, in the mapping's order.

    Raises:
        TypeError: an array is not of a float dtype (names the layer).
        ValueError: the mapping is empty or an array has no elements (names the layer).
    """
    if not gradients:
        raise ValueError("no gradients to summarise (empty mapping)")
    names = tuple(gradients)
    count = len(names)
    numel = np.empty(count, dtype=np.int64)
    sum_abs = np.empty(count, dtype=np.float64)
    sum_sq = np.empty(count, dtype=np.float64)
    max_abs = np.empty(count, dtype=np.float64)
    nonfinite = np.empty(count, dtype=np.int64)
    for i, name in enumerate(names):
        flat = _as_float_array(name, gradients[name])
        numel[i] = flat.size
        sum_abs[i], sum_sq[i], max_abs[i], nonfinite[i] = _summarize_one(flat)
    return LayerSummaries(names, numel, sum_abs, sum_sq, max_abs, nonfinite)
