"""Sum of squares: the squared weight norm and the squared update norm of each layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.stats.base import (
    COUNT,
    SUM,
    LayerStatistic,
    SummaryMessage,
    as_floats,
    as_ints,
)
from schemas.stats.gradient_sums import gradient_sums_of_array


@dataclass(slots=True, eq=False)
class SumOfSquares(LayerStatistic):
    """Sum of squares of a tensor's finite elements per layer: the squared weight norm
    ``weight_sum_sq`` and the squared update norm ``update_sum_sq`` of the wire.

    Parameters:
        numel: int64[L] elements covered (0: the layer has no such statistic).
        sum_sq: float64[L] sum x^2 over the finite elements.

    Examples:
        >>> s = SumOfSquares.empty(1).update(np.array([3.0, 4.0]))
        >>> null = SumOfSquares.from_columns([1], [np.nan])  # a NULL covers nothing
        >>> (s + null).norm().tolist()
        [5.0]

    References:
        Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM, 2002,
        section 4.2 (the rounding of merged sums).
    """

    numel: np.ndarray = field(metadata=COUNT)
    sum_sq: np.ndarray = field(metadata=SUM)

    @classmethod
    def from_columns(
        cls, numel: Sequence[int] | np.ndarray, sum_sq: Sequence[float] | np.ndarray,
    ) -> SumOfSquares:
        """From aligned arrays: ``numel`` int[k] elements of each layer and ``sum_sq``
        float[k]; a NaN ``sum_sq`` (a stored NULL) covers no element."""
        q = as_floats(sum_sq)
        known = ~np.isnan(q)
        return cls(np.where(known, as_ints(numel), 0), np.where(known, q, 0.0))

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
        _, q, _, _, _ = gradient_sums_of_array(flat)
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

    def norm(self) -> np.ndarray:
        """float64[L] sqrt(sum x^2)."""
        return np.sqrt(self.sum_sq)

    def get(self) -> np.ndarray:
        """float64[L] sum x^2 (a copy)."""
        return self.sum_sq.copy()

