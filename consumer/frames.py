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

from schemas.wire import EXP_HIST_BINS


@dataclass(slots=True)
class MergedShards:
    """Exactly-mergeable sums of one (run, step), over a run's L layers (model order).

    Layers no rank has reported yet have ``numel == 0``.

    Attributes:
        numel: int64[L]; sum_abs, sum_sq, max_abs: float64[L]; nonfinite: int64[L].
        shards: int64[L], shards merged per layer.
        exp_hist: int64[L, EXP_HIST_BINS] summed exponent histograms, or None while no
            shard carried one; hist_shards: int64[L] shards that carried one.
        weight_sum_sq, update_sum_sq: float64[L] or None; weight_shards, update_shards:
            int64[L] shards that carried them. A richer statistic of a layer is complete
            (and stored) only when every shard of that layer carried it.
    """

    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray
    nonfinite: np.ndarray
    shards: np.ndarray | None = None
    exp_hist: np.ndarray | None = None
    hist_shards: np.ndarray | None = None
    weight_sum_sq: np.ndarray | None = None
    weight_shards: np.ndarray | None = None
    update_sum_sq: np.ndarray | None = None
    update_shards: np.ndarray | None = None

    @classmethod
    def empty(cls, num_layers: int) -> MergedShards:
        """All-zero sums for ``num_layers`` layers."""
        return cls(
            np.zeros(num_layers, np.int64),
            np.zeros(num_layers, np.float64),
            np.zeros(num_layers, np.float64),
            np.zeros(num_layers, np.float64),
            np.zeros(num_layers, np.int64),
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
        if self.shards is None:
            self.shards = np.zeros(len(self.numel), np.int64)
        self.shards[idx] += 1

    def add_histogram(
        self, layer_indices: np.ndarray, offsets: np.ndarray, columns: np.ndarray,
        counts: np.ndarray,
    ) -> None:
        """Merge one shard's sparse exponent histograms (CSR form of the wire) by addition.

        Args:
            layer_indices: int[k]. offsets: int[k+1]. columns, counts: int[nnz].
        """
        num_layers = len(self.numel)
        if self.exp_hist is None:
            self.exp_hist = np.zeros((num_layers, EXP_HIST_BINS), np.int64)
            self.hist_shards = np.zeros(num_layers, np.int64)
        rows = np.repeat(layer_indices, np.diff(offsets))
        np.add.at(self.exp_hist, (rows, columns), counts)
        assert self.hist_shards is not None
        self.hist_shards[layer_indices] += 1

    def add_weights(
        self, layer_indices: np.ndarray, weight_sum_sq: np.ndarray | None,
        update_sum_sq: np.ndarray | None,
    ) -> None:
        """Merge one shard's weight / update squared norms (float64[k] or None) by addition."""
        num_layers = len(self.numel)
        if weight_sum_sq is not None:
            if self.weight_sum_sq is None:
                self.weight_sum_sq = np.zeros(num_layers)
                self.weight_shards = np.zeros(num_layers, np.int64)
            self.weight_sum_sq[layer_indices] += weight_sum_sq
            assert self.weight_shards is not None
            self.weight_shards[layer_indices] += 1
        if update_sum_sq is not None:
            if self.update_sum_sq is None:
                self.update_sum_sq = np.zeros(num_layers)
                self.update_shards = np.zeros(num_layers, np.int64)
            self.update_sum_sq[layer_indices] += update_sum_sq
            assert self.update_shards is not None
            self.update_shards[layer_indices] += 1


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
        weight_sum_sq, update_sum_sq, update_to_weight: float64[n] with NaN where not every
            shard of the layer sent weights (None when no shard did);
            ``update_to_weight = sqrt(update_sum_sq / weight_sum_sq)``.
        exp_hist: int64[n, EXP_HIST_BINS] (rows of layers without a complete histogram are
            all -1), or None when no shard sent one.
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
    weight_sum_sq: np.ndarray | None = None
    update_sum_sq: np.ndarray | None = None
    update_to_weight: np.ndarray | None = None
    exp_hist: np.ndarray | None = None

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
    shards = merged.shards[present] if merged.shards is not None else None

    def complete_only(values: np.ndarray | None, carried: np.ndarray | None) -> np.ndarray | None:
        if values is None or carried is None:
            return None
        return np.where(carried[present] == shards, values[present], np.nan)

    weight = complete_only(merged.weight_sum_sq, merged.weight_shards)
    update = complete_only(merged.update_sum_sq, merged.update_shards)
    ratio = None
    if weight is not None and update is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.sqrt(update / weight)
        ratio[~np.isfinite(ratio)] = np.nan
    hist = None
    if merged.exp_hist is not None and merged.hist_shards is not None:
        hist = merged.exp_hist[present]
        hist[merged.hist_shards[present] != shards] = -1
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
        weight_sum_sq=weight,
        update_sum_sq=update,
        update_to_weight=ratio,
        exp_hist=hist,
    )
