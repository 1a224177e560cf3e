"""Power sums: ``S_k = sum x^k`` (k = 1..4) and extremes of the finite elements, per layer,
and the central moments derived from them.

Moments are carried as power sums rather than as central moments updated pairwise (Chan,
Golub and LeVeque [1]; Pebay [2] for higher orders) because power sums merge by plain
addition, which is what the wire and the store carry; the central moments follow from the
binomial expansion (:func:`central_moments`), accurate while ``std / |mean|`` is not tiny.

References:
    [1] T. F. Chan, G. H. Golub, R. J. LeVeque, "Algorithms for computing the sample
        variance: analysis and recommendations", The American Statistician 37(3),
        242-247, 1983.
    [2] P. Pebay, "Formulas for robust, one-pass parallel computation of covariances and
        arbitrary-order statistical moments", Sandia report SAND2008-6212, 2008.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.stats.base import (
    COUNT,
    MAXIMUM,
    MINIMUM,
    SUM,
    LayerStatistic,
    SummaryMessage,
    as_floats,
    as_ints,
    or_empty,
)
from schemas.stats.chunks import float64_chunks

WEIGHT_POWER_SUMS = {
    "s1": "weight_sum", "s2": "weight_sum_sq", "s3": "weight_sum_cube",
    "s4": "weight_sum_quad", "minimum": "weight_min", "maximum": "weight_max",
}
"""The message field and ``layer_stats`` column of each float column of
:meth:`PowerSums.from_columns` for the weights (the same names on the wire and in the
store)."""


def power_sums_of_array(flat: np.ndarray) -> tuple[int, float, float, float, float, float, float]:
    """(finite count, S1, S2, S3, S4, min, max) of the finite elements of a 1-D array,
    float64 chunk by chunk (min > max when there is no finite element).

    >>> power_sums_of_array(np.array([1.0, 2.0, np.nan]))
    (2, 3.0, 5.0, 9.0, 17.0, 1.0, 2.0)
    """
    count = 0
    s1 = s2 = s3 = s4 = 0.0
    lo, hi = math.inf, -math.inf
    with np.errstate(over="ignore", invalid="ignore"):
        for x in float64_chunks(flat):
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


def central_moments(
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

    Parameters (all [L]):
        count: int64 finite elements. nonfinite: int64 NaN/Inf elements (left out).
        s1, s2, s3, s4: float64 sum x, sum x^2, sum x^3, sum x^4.
        minimum, maximum: float64 extremes (+inf / -inf while count = 0).

    Derived values (:meth:`get`): mean, population std, skewness and excess kurtosis
    (:func:`central_moments`), min and max.

    Examples:
        >>> p = PowerSums.empty(1).update(np.array([1.0, 2.0, 3.0, 4.0]))
        >>> q = PowerSums.empty(1).update(np.array([np.nan, 10.0]))
        >>> out = (p + q).get()
        >>> out["mean"].tolist(), out["min"].tolist(), out["max"].tolist()
        ([4.0], [1.0], [10.0])
        >>> out["count"].tolist()
        [5]
        >>> round(float(p.get()["std_dev"][0]) ** 2, 12), float(p.get()["skewness"][0])
        (1.25, 0.0)

    References:
        Chan, Golub and LeVeque [1]; Pebay [2] (the moments from power sums);
        trustformers-debug, ``weight_analysis`` module (skewness and kurtosis 0 for a
        constant set).
    """

    count: np.ndarray = field(metadata=COUNT)
    s1: np.ndarray = field(metadata=SUM)
    s2: np.ndarray = field(metadata=SUM)
    s3: np.ndarray = field(metadata=SUM)
    s4: np.ndarray = field(metadata=SUM)
    minimum: np.ndarray = field(metadata=MINIMUM)
    maximum: np.ndarray = field(metadata=MAXIMUM)
    nonfinite: np.ndarray = field(metadata=COUNT)

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
        a = as_floats(s1)
        known = ~np.isnan(a)
        n = np.where(known, as_ints(count), 0)
        has = n > 0

        def sums(values: Sequence[float] | np.ndarray) -> np.ndarray:
            return np.where(known, as_floats(values), 0.0)

        return cls(
            n, sums(a), sums(s2), sums(s3), sums(s4),
            np.where(has, as_floats(minimum), np.inf), np.where(has, as_floats(maximum), -np.inf),
            np.where(known, as_ints(nonfinite), 0),
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
        """The weight power sums of a StepSummary / MergedFrame (k layers; the fields of
        :data:`WEIGHT_POWER_SUMS` and ``weight_nonfinite``), or None without a weight
        distribution."""
        if message.weight_sum is None or message.weight_nonfinite is None:
            return None
        nonfinite = as_ints(message.weight_nonfinite)
        return cls.from_columns(
            count=as_ints(message.numel) - nonfinite, nonfinite=nonfinite,
            **{name: or_empty(getattr(message, wire_name))
               for name, wire_name in WEIGHT_POWER_SUMS.items()},
        )

    def _update_layer(self, flat: np.ndarray, layer: int) -> None:
        """:meth:`LayerStatistic.update` of raw values: NaN/Inf count in ``nonfinite``
        only; the finite ones add their powers (float64) and move the extremes."""
        n, a, b, c, d, lo, hi = power_sums_of_array(flat)
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
            n, *rest = power_sums_of_array(flat)
            counts[i] = n, flat.size - n
            sums[i] = rest
        return cls(counts[:, 0].copy(), *(sums[:, j].copy() for j in range(6)),
                   counts[:, 1].copy())

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
        (:func:`central_moments`), ``min``, ``max`` (NaN where count = 0), and the counts
        ``count``, ``nonfinite``."""
        out = central_moments(self.count, self.s1, self.s2, self.s3, self.s4)
        has = self.count > 0
        out["min"] = np.where(has, self.minimum, np.nan)
        out["max"] = np.where(has, self.maximum, np.nan)
        out["count"] = self.count.copy()
        out["nonfinite"] = self.nonfinite.copy()
        return out

