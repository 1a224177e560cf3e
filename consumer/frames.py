"""GradientFrame computation: one step of one run, all layers, vectorised over layers.

Formulas (seed 001 ``GradientFlowAnimator::record_step``; README.md, "How it works"),
for layer l after merging every rank's shard:

- ``mean_abs_grad = sum_abs / numel``
- ``max_abs_grad = max_abs``
- ``grad_norm = sqrt(sum_sq)``
- ``is_vanishing = mean_abs_grad < vanishing_threshold`` and no non-finite element (a
  layer holding NaN/Inf is reported as non-finite, not as vanishing: its finite part says
  nothing about how much gradient flows; seed 001 never sees NaN because it sums them in)
- ``is_exploding = max_abs_grad > exploding_threshold``
- ``flow_intensity = clamp(grad_norm / max_l grad_norm, 0, 1)``, 0 when that max is 0.

Norms mode (schema 1.2): when some shard of a layer came without ``sum_abs``/``max_abs``,
those two and ``mean_abs_grad`` are unknown (NaN, stored as NULL), and the flags use the
RMS ``rms = sqrt(sum_sq / numel)`` as a bound. Over the same n elements (non-finite ones
counting 0), Cauchy-Schwarz gives ``mean |g| <= rms`` and the maximum is at least the
quadratic mean, ``max |g| >= rms``; hence

- ``is_vanishing = rms < vanishing_threshold`` (implies mean |g| < threshold),
- ``is_exploding = rms > exploding_threshold`` (implies max |g| > threshold):

every flag raised is one the full statistics would raise; a layer with a few elements
above the exploding threshold but a smaller RMS is not flagged.

Non-finite elements are left out of the sums by the producer and counted in
``nonfinite``; ``numel`` counts every element, as in the seed's ``values.len()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from schemas.wire import EXP_HIST_BINS, StepSummary


@dataclass(slots=True)
class MergedShards:
    """Exactly-mergeable sums of one (run, step), over a run's L layers (model order).

    Layers no rank has reported yet have ``numel == 0``.

    Attributes:
        numel: int64[L]; sum_abs, sum_sq, max_abs: float64[L]; nonfinite: int64[L].
        shards: int64[L], shards merged per layer.
        exp_hist: int64[L, EXP_HIST_BINS] summed exponent histograms, or None while no
            shard carried one; hist_shards: int64[L] shards that carried one.
        abs_shards: int64[L] shards that carried ``sum_abs``/``max_abs`` (full mode); a
            layer's sum_abs/max_abs are known only when every shard carried them.
        weight_dist: merged weight-distribution statistics (schema 1.2) or None.
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
    abs_shards: np.ndarray | None = None
    weight_dist: WeightDistribution | None = None

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
        sum_abs: np.ndarray | None,
        sum_sq: np.ndarray,
        max_abs: np.ndarray | None,
        nonfinite: np.ndarray,
    ) -> None:
        """Merge one shard in place: sums and counts add, maxima take the maximum.

        Args:
            layer_indices: int[k], unique indices into the run's layers.
            numel, nonfinite: int[k]; sum_sq: float[k]; sum_abs, max_abs: float[k], or
                both None for a norms-mode shard (aligned).
        """
        idx = layer_indices
        if self.shards is None:
            self.shards = np.zeros(len(self.numel), np.int64)
        if self.abs_shards is None:
            self.abs_shards = self.shards.copy()
        self.numel[idx] += numel
        self.sum_sq[idx] += sum_sq
        self.nonfinite[idx] += nonfinite
        self.shards[idx] += 1
        if sum_abs is not None and max_abs is not None:
            self.sum_abs[idx] += sum_abs
            self.max_abs[idx] = np.maximum(self.max_abs[idx], max_abs)
            self.abs_shards[idx] += 1

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
class WeightDistribution:
    """Merged weight-distribution statistics over a run's L layers (schema 1.2).

    Attributes:
        sum, sum_cube, sum_quad: float64[L] power sums sum w, sum w^3, sum w^4 (add).
        min, max: float64[L] extremes (+inf / -inf until a shard arrives).
        nonfinite: int64[L] NaN/Inf weights (add).
        exp_hist: int64[L, EXP_HIST_BINS] exponent histogram of |w| (add).
        shards: int64[L] shards merged in.
    """

    sum: np.ndarray
    sum_cube: np.ndarray
    sum_quad: np.ndarray
    min: np.ndarray
    max: np.ndarray
    nonfinite: np.ndarray
    exp_hist: np.ndarray
    shards: np.ndarray

    @classmethod
    def empty(cls, num_layers: int) -> WeightDistribution:
        """Neutral elements for ``num_layers`` layers."""
        zeros = np.zeros(num_layers)
        return cls(zeros.copy(), zeros.copy(), zeros.copy(), np.full(num_layers, np.inf),
                   np.full(num_layers, -np.inf), np.zeros(num_layers, np.int64),
                   np.zeros((num_layers, EXP_HIST_BINS), np.int64),
                   np.zeros(num_layers, np.int64))

    def add(
        self, idx: np.ndarray, power_sums: np.ndarray, lo: np.ndarray, hi: np.ndarray,
        nonfinite: np.ndarray, offsets: np.ndarray, columns: np.ndarray, counts: np.ndarray,
    ) -> None:
        """Merge one shard: power sums (float64[3, k]: sum, cube, quad), nonfinite and the
        CSR histogram add; ``lo``/``hi`` (float64[k]) take min / max."""
        self.sum[idx] += power_sums[0]
        self.sum_cube[idx] += power_sums[1]
        self.sum_quad[idx] += power_sums[2]
        self.min[idx] = np.minimum(self.min[idx], lo)
        self.max[idx] = np.maximum(self.max[idx], hi)
        self.nonfinite[idx] += nonfinite
        rows = np.repeat(idx, np.diff(offsets))
        np.add.at(self.exp_hist, (rows, columns), counts)
        self.shards[idx] += 1


@dataclass(frozen=True, slots=True)
class LocalRows:
    """Per-rank local view rows (statistics of a rank's own gradient before the cross-rank
    reduction), never merged into frames; stored in ``local_layer_stats``.

    Attributes (aligned, m rows): rank, layer_index: int32[m]; numel, nonfinite: int64[m];
    sum_abs, sum_sq, max_abs: float64[m] (over the finite elements, like the frame's).
    """

    rank: np.ndarray
    layer_index: np.ndarray
    numel: np.ndarray
    sum_abs: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray
    nonfinite: np.ndarray

    @classmethod
    def from_shard(cls, shard: StepSummary) -> LocalRows:
        """The local view of a StepSummary (one rank) or a MergedFrame (``local_ranks``).

        Raises:
            ValueError: the message carries no local view.
        """
        if shard.local_layer_indices is None:
            raise ValueError("the message carries no local view")
        m = len(shard.local_layer_indices)
        ranks = getattr(shard, "local_ranks", None)
        return cls(
            np.full(m, shard.rank, np.int32) if ranks is None else np.asarray(ranks, np.int32),
            np.asarray(shard.local_layer_indices, np.int32),
            np.asarray(shard.local_numel, np.int64),
            np.asarray(shard.local_sum_abs, np.float64),
            np.asarray(shard.local_sum_sq, np.float64),
            np.asarray(shard.local_max_abs, np.float64),
            np.asarray(shard.local_nonfinite, np.int64),
        )

    @classmethod
    def concat(cls, parts: list[LocalRows]) -> LocalRows:
        """All rows of ``parts`` (at least one) in one table."""
        if len(parts) == 1:
            return parts[0]
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in _LOCAL_FIELDS))

    def __len__(self) -> int:
        return len(self.rank)

    def ranks_where(self, mask: np.ndarray) -> list[int]:
        """Sorted distinct ranks of the rows where ``mask`` (bool[m]) is True."""
        return sorted(set(self.rank[mask].tolist()))


_LOCAL_FIELDS = ("rank", "layer_index", "numel", "sum_abs", "sum_sq", "max_abs", "nonfinite")


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
        weight_sum, weight_sum_cube, weight_sum_quad, weight_min, weight_max: float64[n]
            and weight_nonfinite: int64[n] (-1 where unknown) with NaN where not every
            shard sent the weight distribution; weight_exp_hist: int64[n, EXP_HIST_BINS]
            (rows -1 where incomplete); all None when no shard sent it.
        replica_divergence: int32[d, 3] rows (layer_index, rank, reference_rank): replicas of
            a counted piece whose statistics disagreed with it (``consumer.merge``).
        local: the per-rank local view rows of the ranks merged into this version of the
            frame, or None.

    In norms mode ``sum_abs``, ``max_abs_grad`` and ``mean_abs_grad`` are NaN for the
    layers where some shard lacked them (module docstring).
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
    weight_sum: np.ndarray | None = None
    weight_sum_cube: np.ndarray | None = None
    weight_sum_quad: np.ndarray | None = None
    weight_min: np.ndarray | None = None
    weight_max: np.ndarray | None = None
    weight_nonfinite: np.ndarray | None = None
    weight_exp_hist: np.ndarray | None = None
    replica_divergence: np.ndarray = field(
        default_factory=lambda: np.empty((0, 3), np.int32)
    )
    local: LocalRows | None = None

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
    sum_sq = merged.sum_sq[present]
    nonfinite = merged.nonfinite[present]
    has_abs = (merged.abs_shards[present] == shards) if merged.abs_shards is not None \
        else np.ones(len(present), bool)
    sum_abs = np.where(has_abs, merged.sum_abs[present], np.nan)
    max_abs = np.where(has_abs, merged.max_abs[present], np.nan)
    mean_abs = sum_abs / numel
    rms = np.sqrt(sum_sq / numel)
    norm = np.sqrt(sum_sq)
    vanishing = np.where(has_abs, mean_abs < vanishing_threshold, rms < vanishing_threshold)
    exploding = np.where(has_abs, max_abs > exploding_threshold, rms > exploding_threshold)
    dist = _weight_distribution(merged.weight_dist, present, shards)
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
        nonfinite=nonfinite,
        mean_abs_grad=mean_abs,
        grad_norm=norm,
        flow_intensity=intensity,
        is_vanishing=vanishing & (nonfinite == 0),
        is_exploding=exploding,
        ranks_seen=tuple(sorted(ranks_seen)),
        world_size=world_size,
        wall_time=wall_time,
        weight_sum_sq=weight,
        update_sum_sq=update,
        update_to_weight=ratio,
        exp_hist=hist,
        **dist,
    )


def _weight_distribution(
    dist: WeightDistribution | None, present: np.ndarray, shards: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """GradientFrame weight_* fields of the present layers; unknown where incomplete."""
    if dist is None:
        return {}
    complete = dist.shards[present] == shards

    def pick(values: np.ndarray) -> np.ndarray:
        return np.where(complete, values[present], np.nan)

    hist = dist.exp_hist[present]
    hist[~complete] = -1
    return {
        "weight_sum": pick(dist.sum), "weight_sum_cube": pick(dist.sum_cube),
        "weight_sum_quad": pick(dist.sum_quad), "weight_min": pick(dist.min),
        "weight_max": pick(dist.max),
        "weight_nonfinite": np.where(complete, dist.nonfinite[present], -1),
        "weight_exp_hist": hist,
    }
