"""Weight moments: the weight distribution of each layer, as power sums plus the exponent
histogram of the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.stats.base import PART, LayerStatistic, SummaryMessage, as_ints
from schemas.stats.exponent_histogram import ExponentHistogram
from schemas.stats.power_sums import PowerSums


@dataclass(slots=True, eq=False)
class WeightMoments(LayerStatistic):
    """The weight distribution of each layer, as exactly mergeable statistics of the
    finite weights: power sums and extremes (:class:`PowerSums`) and the exponent histogram
    of |w| (:class:`ExponentHistogram`, whose column 0 counts the exact zeros).

    Parameters:
        power: PowerSums[L]. exp_hist: ExponentHistogram[L] of the same weights.

    Raises:
        ValueError: (construction) the two parts disagree on the number of layers or on the
            finite / non-finite counts.

    Examples:
        >>> w = WeightMoments.empty(1).update(np.array([0.0, 0.5, -1.0, 2.0, np.nan]))
        >>> out = w.get()
        >>> out["mean"].tolist(), out["zero_fraction"].tolist(), out["nonfinite"].tolist()
        ([0.375], [0.25], [1])
        >>> round(float(out["entropy"][0]), 6)  # four weights in four binades
        2.0
        >>> cols = w.to_columns()
        >>> WeightMoments.from_columns(**cols).state()["power.s4"].tolist()
        [17.0625]

    References:
        trustformers-debug, ``weight_analysis`` module (the fields of a weight
        distribution); :mod:`schemas.stats.power_sums` and
        :mod:`schemas.stats.exponent_histogram` (their references).
    """

    power: PowerSums = field(metadata=PART)
    exp_hist: ExponentHistogram = field(metadata=PART)

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
    def from_columns(
        cls,
        numel: Sequence[int] | np.ndarray,
        nonfinite: Sequence[int] | np.ndarray,
        hist_offsets: Sequence[int] | np.ndarray,
        hist_columns: Sequence[int] | np.ndarray,
        hist_counts: Sequence[int] | np.ndarray,
        **power_sums: Sequence[float] | np.ndarray,
    ) -> WeightMoments:
        """From the stored ``layer_stats`` columns (k rows): ``numel``,
        ``weight_nonfinite``, the CSR form of ``weight_exp_hist_columns`` /
        ``weight_exp_hist_counts`` (:func:`csr_from_lists`) and the power sums' float
        columns by :meth:`PowerSums.from_columns`' names: ``s1``..``s4`` (``weight_sum``,
        ``weight_sum_sq``, ``weight_sum_cube``, ``weight_sum_quad``), ``minimum``,
        ``maximum`` (``weight_min``, ``weight_max``). A row whose ``s1`` is NaN (NULL) has
        no weight statistics and covers nothing (its histogram row must be empty).

        Raises:
            ValueError: malformed CSR, or histogram rows that do not sum to
                ``numel - nonfinite``.
            TypeError: a power-sum column missing or of another name.
        """
        power = PowerSums.from_columns(count=as_ints(numel) - as_ints(nonfinite),
                                       nonfinite=nonfinite, **power_sums)
        hist = ExponentHistogram.from_columns(hist_offsets, hist_columns, hist_counts,
                                              power.nonfinite)
        return cls(power, hist)

    def to_columns(self) -> dict[str, np.ndarray]:
        """The stored form, inverse of :meth:`from_columns` (keys are its parameter names;
        ``s1``..``s4`` NaN and ``numel`` 0 where a layer covers nothing): the power sums'
        columns (:meth:`PowerSums.to_columns`) with ``count`` read as ``numel`` (finite and
        non-finite), and the histogram's CSR columns prefixed ``hist_``."""
        columns = self.power.to_columns()
        columns["numel"] = columns.pop("count") + columns["nonfinite"]
        sparse = self.exp_hist.to_columns()
        for name in ("offsets", "columns", "counts"):
            columns[f"hist_{name}"] = sparse[name]
        return columns

    @classmethod
    def from_message(cls, message: SummaryMessage) -> WeightMoments | None:
        """The weight distribution of a StepSummary / MergedFrame (k layers), or None when
        the message carries none (the ``weight_*`` fields)."""
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

