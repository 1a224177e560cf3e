"""GradientFrame computation: one step of one run, all layers, vectorised over layers.

Formulas (README.md, "How it works"; semantics follow trustformers-debug's
``gradient_flow`` module), for layer l after merging every rank's shard:

- ``mean_abs_grad = sum_abs / numel``
- ``max_abs_grad = max_abs``
- ``grad_norm = sqrt(sum_sq)``
- ``is_vanishing = mean_abs_grad < vanishing_threshold`` and no non-finite element (a
  layer holding NaN/Inf is reported as non-finite, not as vanishing: its finite part says
  nothing about how much gradient flows)
- ``is_exploding = max_abs_grad > exploding_threshold``
- ``flow_intensity = clamp(grad_norm / max_l grad_norm, 0, 1)``, 0 when that max is 0
  (when a norm overflowed to +inf, as float64 sums of squares above ~1.8e308 do, that
  layer's intensity is inf / inf = NaN and the others' 0, as in the reference)

Norms mode: when some shard of a layer came without ``sum_abs``/``max_abs``,
those two and ``mean_abs_grad`` are unknown (NaN, stored as NULL), and the flags use the
RMS ``rms = sqrt(sum_sq / numel)`` as a bound. Over the same n elements (non-finite ones
counting 0), Cauchy-Schwarz gives ``mean |g| <= rms`` and the maximum is at least the
quadratic mean, ``max |g| >= rms``; hence

- ``is_vanishing = rms < vanishing_threshold`` (implies mean |g| < threshold),
- ``is_exploding = rms > exploding_threshold`` (implies max |g| > threshold):

every flag raised is one the full statistics would raise; a layer with a few elements
above the exploding threshold but a smaller RMS is not flagged.

Non-finite elements are left out of the sums by the producer and counted in
``nonfinite`` (the NaN among them in ``nan``, so that the reference's values can be
rebuilt: ``analysis.nonfinite``); ``numel`` counts every
element, finite or not.

The merged sums are the statistic objects of :mod:`schemas.stats` (one per statistic,
vectorised over layers), held together by :class:`MergedShards`; :func:`compute_frame` only
reads them (their ``get`` accessors) and applies the thresholds above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas.scalars import RankScalars
from schemas.stats import (
    ExponentHistogram,
    GradientSums,
    LayerStatistic,
    SummaryMessage,
    SumOfSquares,
    WeightMoments,
)
from schemas.wire import StepSummary


@dataclass(slots=True, eq=False)
class MergedShards:
    """The exactly mergeable statistics of one (run, step) over a run's L layers (model
    order), one :mod:`schemas.stats` object per statistic the shards carried.

    Layers no rank has reported yet have ``numel == 0``. An optional statistic of a layer
    is complete (and reported in the frame) when it covers as many elements as the
    gradient sums: a shard that did not send it leaves it short (``schemas.stats``,
    "Coverage").

    Attributes:
        gradient: numel, sum |g|, sum g^2, max |g|, non-finite count (``sum |g|`` and
            ``max |g|`` known only where every shard carried them: full mode).
        histogram: exponent histogram of the gradient, or None while no shard carried one.
        weight_norm, update_norm: sums of squares ``weight_sum_sq`` / ``update_sum_sq``,
            or None while no shard carried them.
        weight_moments: weight distribution, or None while no shard carried it.

    Messages' gradient sums are merged in batches: :meth:`merge_message` queues them and
    the first read of :attr:`gradient` (or of anything derived from it) merges the queue,
    all at once when the queued messages cover distinct layers (each layer then takes one
    addition, as it would one message at a time), else one after the other in arrival
    order. The sums are bit for bit those of merging each message as it came; a frame of
    many small messages (one per pipeline stage) costs eight NumPy operations instead of
    eight per message.
    """

    _gradient: GradientSums
    histogram: ExponentHistogram | None = None
    weight_norm: SumOfSquares | None = None
    update_norm: SumOfSquares | None = None
    weight_moments: WeightMoments | None = None
    _queued: list[tuple[np.ndarray, SummaryMessage]] = field(default_factory=list,
                                                             repr=False)

    @property
    def gradient(self) -> GradientSums:
        """The gradient sums (class doc), every queued message merged."""
        if self._queued:
            self._merge_queued()
        return self._gradient

    def _merge_queued(self) -> None:
        """Merge the queued messages' gradient sums (class doc)."""
        queued, self._queued = self._queued, []
        sums = self._gradient
        if len(queued) > 1 and all(_full_without_nan(m) for _, m in queued):
            layers = np.concatenate([at for at, _ in queued])
            hit = np.zeros(sums.num_layers, bool)
            hit[layers] = True
            if np.count_nonzero(hit) == len(layers):  # distinct: one addition per layer
                sums.merge_message_at(layers, _Columns(*(
                    np.concatenate([np.asarray(getattr(m, name)) for _, m in queued])
                    for name in _Columns.__slots__)))
                return
        for at, message in queued:
            sums.merge_message_at(at, message)

    @classmethod
    def empty(cls, num_layers: int) -> MergedShards:
        """No shard yet, ``num_layers`` layers."""
        return cls(GradientSums.empty(num_layers))

    @classmethod
    def from_message(
        cls, message: SummaryMessage, num_layers: int | None = None,
    ) -> MergedShards:
        """Every statistic a StepSummary or MergedFrame carries.

        Args:
            message: the shard (its indices checked against the run).
            num_layers: None: the result has the message's k layers, aligned with its
                ``layer_indices``; L: the result spans the run's L layers (the message
                merged into an empty frame, :meth:`merge_message`).
        """
        if num_layers is not None:
            return cls.empty(num_layers).merge_message(message)
        return cls(
            GradientSums.from_message(message),
            ExponentHistogram.from_message(message),
            SumOfSquares.from_message(message, "weight_sum_sq"),
            SumOfSquares.from_message(message, "update_sum_sq"),
            WeightMoments.from_message(message),
        )

    def merge_message(self, message: SummaryMessage) -> MergedShards:
        """Merge every statistic a StepSummary or MergedFrame carries into its layers, in
        place: the same result as ``self.merge_at(layers, MergedShards.from_message(message))``
        with the two histograms merged from their sparse form (a dense k x B copy of a
        message's histogram costs more than merging it). Returns ``self``.
        """
        layers = np.asarray(message.layer_indices, np.int64)
        self._queued.append((layers, message))  # merged when first read (class doc)
        for name, field_name in (("weight_norm", "weight_sum_sq"),
                                 ("update_norm", "update_sum_sq")):
            norm = SumOfSquares.from_message(message, field_name)
            if norm is not None:
                self._ensure(name).merge_at(layers, norm)
        columns = ExponentHistogram.message_columns(message)
        if columns is not None:
            self._ensure("histogram").merge_columns(layers, **columns)
        if message.weight_sum is not None:
            moments = self.weight_moments
            if moments is None:
                moments = WeightMoments.empty(self.num_layers)
            if moments.merge_message(layers, message):
                self.weight_moments = moments
        return self

    def _ensure(self, name: str) -> Any:
        """The optional statistic ``name``, created empty if absent."""
        stat = getattr(self, name)
        if stat is None:
            stat = dict(_OPTIONAL_PARTS)[name].empty(self.num_layers)
            setattr(self, name, stat)
        return stat

    @property
    def num_layers(self) -> int:
        """L."""
        return self.gradient.num_layers

    @property
    def numel(self) -> np.ndarray:
        """int64[L] gradient elements merged per layer."""
        return self.gradient.numel

    def merge_at(self, layers: np.ndarray, part: MergedShards) -> MergedShards:
        """Merge ``part`` (k layers) into layers ``layers`` (int[k], distinct) in place:
        sums and counts add, extremes take the min / max. Returns ``self``."""
        self.gradient.merge_at(layers, part.gradient)
        for name, _ in _OPTIONAL_PARTS:
            theirs = getattr(part, name)
            if theirs is not None:
                self._ensure(name).merge_at(layers, theirs)
        return self

    def __iadd__(self, other: MergedShards) -> MergedShards:
        """Merge ``other`` (same L) into ``self``.

        Raises:
            ValueError: another number of layers.
        """
        if other.num_layers != self.num_layers:
            raise ValueError(f"cannot merge {other.num_layers} layers into {self.num_layers}")
        return self.merge_at(np.arange(self.num_layers), other)

    def take(self, layers: np.ndarray) -> MergedShards:
        """The statistics of the selected layers (int[k] indices or bool[L] mask; a copy)."""
        return MergedShards(
            self.gradient.take(layers),
            *(None if (s := getattr(self, name)) is None else s.take(layers)
              for name, _ in _OPTIONAL_PARTS),
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
        """Merge one shard's gradient sums in place: sums and counts add, maxima take the
        maximum.

        Args:
            layer_indices: int[k], unique indices into the run's layers.
            numel, nonfinite: int[k]; sum_sq: float[k]; sum_abs, max_abs: float[k], or
                both None for a norms-mode shard (aligned).
        """
        self.gradient.merge_at(
            np.asarray(layer_indices, np.int64),
            GradientSums.from_columns(numel, sum_abs, sum_sq, max_abs, nonfinite),
        )


def _full_without_nan(message: SummaryMessage) -> bool:
    """Whether ``message``'s gradient sums can join a batch (:class:`_Columns`): full mode
    (``sum_abs`` and ``max_abs``), no NaN counts."""
    return (message.sum_abs is not None and message.max_abs is not None
            and getattr(message, "nan", None) is None)


class _Columns:
    """The gradient columns of several messages laid end to end, read by
    :meth:`GradientSums.merge_message_at` as one message (full mode, no NaN counts)."""

    __slots__ = ("max_abs", "nonfinite", "numel", "sum_abs", "sum_sq")
    nan = None

    def __init__(self, max_abs: np.ndarray, nonfinite: np.ndarray, numel: np.ndarray,
                 sum_abs: np.ndarray, sum_sq: np.ndarray) -> None:
        self.max_abs, self.nonfinite, self.numel = max_abs, nonfinite, numel
        self.sum_abs, self.sum_sq = sum_abs, sum_sq


_OPTIONAL_PARTS: tuple[tuple[str, type[LayerStatistic]], ...] = (
    ("histogram", ExponentHistogram), ("weight_norm", SumOfSquares),
    ("update_norm", SumOfSquares), ("weight_moments", WeightMoments),
)


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


_LOCAL_FIELDS = ("rank", "layer_index", "numel", "sum_abs", "sum_sq", "max_abs", "nonfinite")


@dataclass(slots=True)
class GradientFrame:
    """One frame: the derived fields of every reported layer at one (run, step), in
    columnar form.

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
        layout_violations: int64[v, 5] rows (layer_index, kind, rank, got, expected) of
            pieces that do not fit their parameter's size or shard layout
            (``consumer.merge.check_layout``; kinds in ``consumer.merge``); a frame with any
            is stored as partial and raises the ``shard_layout`` alert.
        refused_ranks: rank -> why its data for this frame was refused (its RunStarted was
            refused, or its summary of this step was dead-lettered): a missing rank listed
            here sent data, one not listed sent nothing.
        nan: int64[n], how many of the ``nonfinite`` elements are NaN (the others +-Inf),
            -1 where some shard of the layer did not send the count;
            None for a frame built without it.
        nonfinite_pieces: int64[p, 2] rows (rank, layer_index): the ranks whose own
            summaries of this step held NaN/Inf in that layer (per-rank sending; a summary
            reduced in-band names none), for the ``nonfinite`` alert.
        scalars: the step's training scalars (``schemas.scalars``): step scalars (learning
            rates, loss scale, user names) and the aggregate over the ranks of each per-rank
            one (the mean loss, the slowest rank's times); empty when no rank sent any.
        rank_scalars: the per-rank values (loss, times, tokens) of the ranks merged into
            this version of the frame, or None when none sent any.
        rewrite: this version of the frame may replace one already stored (a late rank's
            frame, a frame the store receives again): the output deletes what it replaces.

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
    layout_violations: np.ndarray = field(
        default_factory=lambda: np.empty((0, 5), np.int64)
    )
    refused_ranks: dict[int, str] = field(default_factory=dict)
    nan: np.ndarray | None = None
    nonfinite_pieces: np.ndarray = field(
        default_factory=lambda: np.empty((0, 2), np.int64)
    )
    scalars: dict[str, float] = field(default_factory=dict)
    rank_scalars: RankScalars | None = None
    rewrite: bool = False

    @property
    def all_ranks_seen(self) -> bool:
        """True when every rank of ``world_size`` reported."""
        return len(self.ranks_seen) == self.world_size

    @property
    def complete(self) -> bool:
        """True when every rank of ``world_size`` reported and every piece fits its
        parameter (no ``layout_violations``): only then are the frame's values the
        statistics of the whole gradient."""
        return self.all_ranks_seen and not len(self.layout_violations)

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
    """Derive the frame fields from merged shard sums (formulas in the module doc).

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
    part = merged if present.size == merged.num_layers else merged.take(present)  # read only
    grad = part.gradient.get()
    numel, nonfinite = grad["numel"], grad["nonfinite"]
    has_abs = part.gradient.has_abs()
    rms, norm = grad["rms"], grad["norm"]
    vanishing = np.where(has_abs, grad["mean_abs"] < vanishing_threshold,
                         rms < vanishing_threshold)
    exploding = np.where(has_abs, grad["max_abs"] > exploding_threshold,
                         rms > exploding_threshold)
    top = float(norm.max()) if norm.size else 0.0
    if top > 0.0:  # an overflowed (+inf) norm: inf / inf = NaN, the others 0 (reference)
        with np.errstate(invalid="ignore"):
            intensity = np.clip(norm / top, 0.0, 1.0)
    else:
        intensity = np.zeros_like(norm)
    weight = _complete_sum_sq(part.weight_norm, numel)
    update = _complete_sum_sq(part.update_norm, numel)
    ratio = None
    if weight is not None and update is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.sqrt(update / weight)
        ratio[~np.isfinite(ratio)] = np.nan
    hist = None
    if part.histogram is not None:
        covered = part.histogram.numel() == numel
        hist = np.where(covered[:, None], part.histogram.counts, -1)
    return GradientFrame(
        run_id=run_id,
        step=step,
        layer_index=present.astype(np.int32),
        numel=numel,
        sum_abs=grad["sum_abs"],
        sum_sq=grad["sum_sq"],
        max_abs_grad=grad["max_abs"],
        nonfinite=nonfinite,
        mean_abs_grad=grad["mean_abs"],
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
        nan=grad["nan"],
        **_weight_fields(part.weight_moments, numel),
    )


def _complete_sum_sq(stat: SumOfSquares | None, numel: np.ndarray) -> np.ndarray | None:
    """float64[n] sums of squares, NaN where they do not cover the whole layer; None when
    no shard sent them."""
    if stat is None:
        return None
    return np.where(stat.numel == numel, stat.sum_sq, np.nan)


def _weight_fields(moments: WeightMoments | None, numel: np.ndarray) -> dict[str, np.ndarray]:
    """GradientFrame weight_* fields (power sums S1, S3, S4, extremes, non-finite count,
    histogram) of the present layers; NaN / -1 where not every shard sent them."""
    if moments is None:
        return {}
    complete = moments.numel() == numel
    cols = moments.power.to_columns()

    def pick(name: str) -> np.ndarray:
        return np.where(complete, cols[name], np.nan)

    hist = np.where(complete[:, None], moments.exp_hist.counts, -1)
    return {
        "weight_sum": pick("s1"), "weight_sum_cube": pick("s3"),
        "weight_sum_quad": pick("s4"), "weight_min": pick("minimum"),
        "weight_max": pick("maximum"),
        "weight_nonfinite": np.where(complete, cols["nonfinite"], -1),
        "weight_exp_hist": hist,
    }
