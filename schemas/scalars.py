"""Training scalars beside the gradients: loss, learning rate, loss scale, tokens, step time.

A step's scalars come in two kinds:

- **Step scalars**, one value per (run, step): the learning rate of each parameter group
  (``lr``, ``lr/1``, ...), the AMP loss scale (``loss_scale``), and any name a user gives.
  Every rank knows the same value; the consumer keeps the one of the lowest rank that
  sent it.
- **Rank scalars**, one value per (run, step, rank), in :data:`RANK_SCALARS`: the rank's
  own loss, tokens and samples of its micro-batches, and its step and compute times,
  measured by the SDK. The step's value of each is an aggregate over the ranks
  (:data:`RANK_AGGREGATES`: the mean loss, the summed tokens, the slowest rank's times)
  and joins the step scalars, so that a loss curve reads one number per step whatever the
  parallelism, while the per-rank rows name the rank where a NaN loss or a slow step
  happened.

Values are float64 and may be NaN or +-Inf (a non-finite loss is a finding, not an
error). Names are short identifiers (:data:`SCALAR_NAME_PATTERN`).

:class:`RankScalars` holds a step's per-rank values in long form (rank, name, value),
the same rows the store writes to ``rank_scalars``; merging the reports of disjoint
ranks is concatenation (``+=``).

>>> a = RankScalars.of_rank(0, {"loss": 2.0, "compute_time_s": 0.5})
>>> a += RankScalars.of_rank(1, {"loss": float("nan"), "compute_time_s": 0.9})
>>> a.values_of("loss")
(array([0, 1]), array([ 2., nan]))
>>> step_scalars({"lr": 0.1}, a)["compute_time_s"]
0.9
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
from pydantic import StringConstraints

SCALAR_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_./:-]{0,63}$"
"""A scalar's name: a letter or underscore, then at most 63 letters, digits or ``_./:-``
(``lr/1``, ``loss_scale``, ``eval:ppl``): safe as a column name, a Prometheus label value
and a URL path segment."""

ScalarName = Annotated[str, StringConstraints(pattern=SCALAR_NAME_PATTERN)]

LOSS = "loss"
LEARNING_RATE = "lr"
LOSS_SCALE = "loss_scale"
TOKENS = "tokens"
SAMPLES = "samples"
STEP_TIME = "step_time_s"
COMPUTE_TIME = "compute_time_s"

STEP_TIME_DOC = (
    "wall seconds between this rank's previous optimiser step and this one (a data-"
    "parallel collective makes it about the same on every rank)")
COMPUTE_TIME_DOC = (
    "seconds from this rank's previous optimiser step to the moment its own backward pass "
    "produced the last of its local gradients, before the final wait for the other ranks "
    "(measured by the SDK: a straggler shows here, while every rank's step time is evened "
    "out by the gradient all-reduce)")


@dataclass(frozen=True, slots=True)
class Aggregate:
    """How the step's value of a per-rank scalar is made from the ranks' values, written
    once for NumPy (the worker's frames) and once for SQL (the store, which recomputes it
    over every rank it holds when a late rank arrives).

    Attributes:
        name: ``mean``, ``sum`` or ``max``.
        sql: the DuckDB aggregate function over the ranks' values. DuckDB's ``avg`` and
            ``sum`` give NaN when a value is NaN, and its ``max`` orders NaN above every
            number: the same answers as ``reduce``.
        reduce: float64[k] -> float (k >= 1).
    """

    name: str
    sql: str
    reduce: Callable[[np.ndarray], float]


def _max(values: np.ndarray) -> float:
    # NaN wins, as in SQL's ordering of NaN: a rank whose time is unknown makes it unknown
    return float(np.nan) if np.isnan(values).any() else float(values.max())


MEAN = Aggregate("mean", "avg", lambda v: float(v.mean()))
SUM = Aggregate("sum", "sum", lambda v: float(v.sum()))
MAX = Aggregate("max", "max", _max)

RANK_AGGREGATES: dict[str, Aggregate] = {
    LOSS: MEAN,  # the data-parallel loss: the mean of the ranks' losses (a NaN stays NaN)
    TOKENS: SUM,
    SAMPLES: SUM,
    STEP_TIME: MAX,  # the step takes as long as its slowest rank
    COMPUTE_TIME: MAX,
}
"""Per-rank scalar name -> how the step's value is made from the values of the ranks
that sent one (a per-rank name outside it, from a producer sending more, takes the
mean)."""

RANK_SCALARS = frozenset(RANK_AGGREGATES)
"""The names whose values are per rank (:class:`RankScalars`); every other name is a step
scalar."""

_NAME = re.compile(SCALAR_NAME_PATTERN)


def check_scalar_names(names: Iterable[str]) -> None:
    """Raise ValueError naming the first name that is not a valid scalar name
    (:data:`SCALAR_NAME_PATTERN`)."""
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"scalar name {name!r} must match {SCALAR_NAME_PATTERN}")


def as_scalar(name: str, value: object) -> float:
    """``value`` as a Python float (a 0-d tensor or array, a NumPy or Python number).

    Raises:
        TypeError: not a real number (a string, a tensor of more than one element).
    """
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "ndim", 0) == 0:
        value = item()
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"scalar {name!r} must be a real number, got {type(value).__name__}")
    return float(value)


def split_scalars(scalars: Mapping[str, object]) -> tuple[dict[str, float], dict[str, float]]:
    """Split a rank's scalars into (step scalars, rank scalars) by name
    (:data:`RANK_SCALARS`), each value a float.

    Raises:
        ValueError: an invalid name. TypeError: a value that is not a real number.
    """
    check_scalar_names(scalars)
    step: dict[str, float] = {}
    rank: dict[str, float] = {}
    for name, value in scalars.items():
        (rank if name in RANK_SCALARS else step)[name] = as_scalar(name, value)
    return step, rank


@dataclass(slots=True)
class RankScalars:
    """Per-rank scalars of one step in long form.

    Attributes:
        names: the scalar names ``name_index`` refers to.
        rank: int64[m], the rank of each row.
        name_index: int64[m], index into ``names``.
        value: float64[m] (NaN/Inf allowed).

    A (rank, name) pair appears at most once (:meth:`check`).
    """

    names: tuple[str, ...] = ()
    rank: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    name_index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    value: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))

    @classmethod
    def of_rank(cls, rank: int, values: Mapping[str, float]) -> RankScalars:
        """One rank's values (name -> value)."""
        names = tuple(values)
        return cls(names, np.full(len(names), rank, np.int64), np.arange(len(names)),
                   np.fromiter(values.values(), np.float64, count=len(names)))

    @classmethod
    def from_rows(cls, names: Iterable[str], rank: Iterable[int], name_index: Iterable[int],
                  value: Iterable[float]) -> RankScalars:
        """From aligned columns (wire arrays), checked (:meth:`check`)."""
        out = cls(tuple(names), np.asarray(rank, np.int64), np.asarray(name_index, np.int64),
                  np.asarray(value, np.float64))
        out.check()
        return out

    def __len__(self) -> int:
        return len(self.rank)

    def check(self) -> None:
        """Raise ValueError when the columns are not aligned, an index is outside
        ``names``, a name is invalid or repeated, or a (rank, name) pair repeats."""
        check_scalar_names(self.names)
        if len(set(self.names)) != len(self.names):
            raise ValueError("rank scalar names must be unique")
        m = len(self.rank)
        if len(self.name_index) != m or len(self.value) != m:
            raise ValueError("rank scalar ranks, name indices and values must be aligned")
        if m and (int(self.name_index.min()) < 0 or int(self.name_index.max()) >= len(self.names)
                  or int(self.rank.min()) < 0):
            raise ValueError("rank scalar rows need ranks >= 0 and name indices into the names")
        key = self.rank * max(len(self.names), 1) + self.name_index
        if len(np.unique(key)) != m:
            raise ValueError("a rank reports each scalar at most once a step")

    def __iadd__(self, other: RankScalars) -> RankScalars:
        """Append the rows of ``other`` (other ranks), mapping its names onto these."""
        if not len(other):
            return self
        names = list(self.names)
        index = {n: i for i, n in enumerate(names)}
        for n in other.names:
            if n not in index:
                index[n] = len(names)
                names.append(n)
        remap = np.array([index[n] for n in other.names], np.int64)
        self.names = tuple(names)
        self.rank = np.concatenate([self.rank, other.rank])
        self.name_index = np.concatenate([self.name_index, remap[other.name_index]])
        self.value = np.concatenate([self.value, other.value])
        return self

    @classmethod
    def concat(cls, parts: list[RankScalars]) -> RankScalars:
        """The rows of ``parts`` (disjoint ranks) in one table: one concatenation per
        column when every part has the same names (the usual case), else ``+=`` part by
        part.

        Raises:
            ValueError: ``parts`` is empty.
        """
        if not parts:
            raise ValueError("concat needs at least one RankScalars")
        names = parts[0].names
        if all(p.names == names for p in parts):
            return cls(names, np.concatenate([p.rank for p in parts]),
                       np.concatenate([p.name_index for p in parts]),
                       np.concatenate([p.value for p in parts]))
        out = parts[0].copy()
        for more in parts[1:]:
            out += more
        return out

    def copy(self) -> RankScalars:
        """An independent copy."""
        return RankScalars(self.names, self.rank.copy(), self.name_index.copy(),
                           self.value.copy())

    def without_ranks(self, ranks: Iterable[int]) -> RankScalars:
        """The rows of every rank but ``ranks``."""
        keep = ~np.isin(self.rank, np.fromiter(ranks, np.int64))
        return RankScalars(self.names, self.rank[keep], self.name_index[keep], self.value[keep])

    @classmethod
    def from_dense(cls, names: Iterable[str], ranks: np.ndarray,
                   values: np.ndarray) -> RankScalars:
        """From the dense form (:meth:`dense`): float64[len(ranks) * K] row-major, rank by
        rank, the K ``names`` of each.

        Raises:
            ValueError: ``values`` is not ``len(ranks) * K`` long.
        """
        names = tuple(names)
        k = len(names)
        if len(values) != len(ranks) * k:
            raise ValueError(f"dense rank scalars need {len(ranks)} x {k} values, "
                             f"got {len(values)}")
        return cls(names, np.repeat(np.asarray(ranks, np.int64), k),
                   np.tile(np.arange(k, dtype=np.int64), len(ranks)),
                   np.asarray(values, np.float64))

    def dense(self, ranks: np.ndarray) -> np.ndarray | None:
        """The values as float64[len(ranks) * K] row-major (rank by rank, the K names of
        each) when the rows are exactly every (rank of ``ranks``, name) pair, else None.
        A checked (:meth:`check`) table of R x K rows costs 24 bytes a row in long form
        (rank, index, value) and 8 a cell dense: a summary reduced over 4,096 ranks with
        three per-rank scalars is 98 kB instead of 295 kB.

        Args:
            ranks: int64[R], ascending.
        """
        k, n = len(self.names), len(ranks)
        if k == 0 or len(self) != n * k:
            return None
        position = np.searchsorted(ranks, self.rank)
        inside = position < n
        if not inside.all() or (ranks[position] != self.rank).any():
            return None
        out = np.empty(n * k, np.float64)
        out[position * k + self.name_index] = self.value  # unique pairs: every cell once
        return out

    def values_of(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ranks int64[k], values float64[k])`` of scalar ``name``, ascending by rank
        (empty when no rank sent it)."""
        if name not in self.names:
            return np.empty(0, np.int64), np.empty(0, np.float64)
        rows = np.flatnonzero(self.name_index == self.names.index(name))
        order = rows[np.argsort(self.rank[rows], kind="stable")]
        return self.rank[order], self.value[order]


def step_scalars(step: Mapping[str, float], ranks: RankScalars | None) -> dict[str, float]:
    """The step's scalars: ``step`` (step scalars, name -> value) plus, for each per-rank
    name some rank sent, its aggregate over those ranks (:data:`RANK_AGGREGATES`; a name
    outside it takes the mean). A step scalar and a per-rank scalar of the same name: the
    per-rank aggregate wins."""
    out = dict(step)
    if ranks is not None and len(ranks):
        for i, name in enumerate(ranks.names):
            values = ranks.value[ranks.name_index == i]
            if values.size:
                out[name] = RANK_AGGREGATES.get(name, MEAN).reduce(values)
    return out


def is_finite(value: float) -> bool:
    """Whether a scalar value is finite (neither NaN nor +-Inf)."""
    return math.isfinite(value)
