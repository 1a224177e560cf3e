"""GradientFrame computation: one step of one run, all layers, vectorised over layers.

Formulas (seed 001 ``GradientFlowAnimator::record_step``, DESIGN.md "Frame and health
semantics"), for layer l after merging every rank's shard:

- ``mean_abs_grad = sum_abs / numel``
- ``max_abs_grad = max_abs``
- ``grad_norm = sqrt(sum_sq)``
- ``is_vanishing = mean_abs_grad < vanishing_threshold`` and no non-finite element (a
  layer holding NaN/Inf is reported as non-finite, not as vanishing: its finite part says
  nothing about how much gradient flows; seed 001 never sees NaN because it sums them in)
- ``is_exploding = max_abs_grad > exploding_threshold``
- ``flow_intensity = clamp(grad_norm / max_l grad_norm, 0, 1)``, 0 when that max is 0.

Non-finite elements are left out of the sums by the producer and counted in
``nonfinite``; ``numel`` counts every element, as in the seed's ``values.len()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class MergedShards:
    """Exactly-mergeable sums of one (run, step), over a run's L layers (model order).

    Layers no rank has reported yet have ``numel == 0``.

    Attributes:
        numel: int64[L]; sum_abs, sum_sq, max_abs: float64[L]; nonfinite: int64[L].
    """

    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray
    nonfinite: np.ndarray

    @classmethod
    def empty(cls, num_layers: int) -> MergedShards:
        """All-zero sums for ``num_layers`` layers."""
        return cls(
            np.zeros(num_layers, np.int64),
            np.zeros(num_layers, np.float64),
            np.zeros(num_layers, np.float64),
            np.zeros(num_layers, np.float64),
            np.zeros(num_layers, np.int64),
        )

    def add(
        self,
        layer_indices: np.ndarray,
        numel: np.ndarray,
        sum_abs: np.ndarray,
        sum_sq: np.ndarray,
        max_abs: np.ndarray,
        nonfinite: np.ndarray,
    ) -> None:
        """Merge one shard in place: sums and counts add, maxima take the maximum.

        Args:
            layer_indices: int[k], unique indices into the run's layers.
            numel, nonfinite: int[k]; sum_abs, sum_sq, max_abs: float[k] (aligned).
        """
        idx = layer_indices
        self.numel[idx] += numel
        self.sum_abs[idx] += sum_abs
        self.sum_sq[idx] += sum_sq
        self.max_abs[idx] = np.maximum(self.max_abs[idx], max_abs)
        self.nonfinite[idx] += nonfinite


@dataclass(slots=True)
class GradientFrame:
    """One frame (seed 001 ``GradientFrame``) in columnar form.

    Arrays have one entry per *reported* layer (``numel > 0``), ordered by
    ``layer_index`` (model order).

    Attributes:
        run_id: the run. step: optimiser step.
        layer_index: int32[n]. numel, nonfinite: int64[n].
        sum_abs, sum_sq, max_abs_grad, mean_abs_grad, grad_norm, flow_intensity: float64[n].
        is_vanishing, is_exploding: bool[n].
        ranks_seen: sorted ranks whose shard is merged in. world_size: expected ranks.
        wall_time: latest producer wall time among the shards (unix s).
    """

    run_id: str
    step: int
    layer_index: np.ndarray
    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs_grad: np.ndarray
    nonfinite: np.ndarray
    mean_abs_grad: np.ndarray
    grad_norm: np.ndarray
    flow_intensity: np.ndarray
    is_vanishing: np.ndarray
    is_exploding: np.ndarray
    ranks_seen: tuple[int, ...]
    world_size: int
    wall_time: float

    @property
    def complete(self) -> bool:
        """True when every rank of ``world_size`` reported."""
        return len(self.ranks_seen) == self.world_size

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        """Ranks that did not report, ascending."""
        seen = set(self.ranks_seen)
        return tuple(r for r in range(self.world_size) if r not in seen)

    @property
    def has_nonfinite(self) -> bool:
        """True when any layer holds a NaN/Inf gradient element."""
        return bool(self.nonfinite.any())


def compute_frame(
    run_id: str,
    step: int,
    merged: MergedShards,
    *,
    vanishing_threshold: float,
    exploding_threshold: float,
    ranks_seen: tuple[int, ...],
    world_size: int,
    wall_time: float,
) -> GradientFrame:
    """Derive the seed-001 frame fields from merged shard sums (formulas in the module doc).

    Args:
        run_id, step: identify the frame.
        merged: the merged sums over the run's L layers.
        vanishing_threshold: mean |g| threshold (strictly below = vanishing).
        exploding_threshold: max |g| threshold (strictly above = exploding).
        ranks_seen: ranks merged in. world_size: ranks expected.
        wall_time: producer wall time to record (unix s).

    Returns:
        The GradientFrame over the layers with ``numel > 0``.
    """
    present = np.flatnonzero(merged.numel > 0)
    numel = merged.numel[present]
    sum_abs = merged.sum_abs[present]
    sum_sq = merged.sum_sq[present]
    max_abs = merged.max_abs[present]
    mean_abs = sum_abs / numel
    norm = np.sqrt(sum_sq)
    top = float(norm.max()) if norm.size else 0.0
    if top > 0.0 and np.isfinite(top):
        intensity = np.clip(norm / top, 0.0, 1.0)
    else:
        intensity = np.zeros_like(norm)
    return GradientFrame(
        run_id=run_id,
        step=step,
        layer_index=present.astype(np.int32),
        numel=numel,
        sum_abs=sum_abs,
        sum_sq=sum_sq,
        max_abs_grad=max_abs,
        nonfinite=merged.nonfinite[present],
        mean_abs_grad=mean_abs,
        grad_norm=norm,
        flow_intensity=intensity,
        is_vanishing=(mean_abs < vanishing_threshold) & (merged.nonfinite[present] == 0),
        is_exploding=max_abs > exploding_threshold,
        ranks_seen=tuple(sorted(ranks_seen)),
        world_size=world_size,
        wall_time=wall_time,
    )
