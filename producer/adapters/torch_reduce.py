"""In-band reduction: a step's gradient statistics reduced across the ranks inside training,
so that one message per optimiser step carries the statistics of the whole parameters.

Without it every rank sends its own summary and the consumer merges them: a DDP job of W
ranks sends W identical copies of every parameter's statistics (each rank having read the
whole gradient), and an FSDP job W pieces of every parameter. With it, per summarised step:

1. **Ownership.** The ranks that hold the same piece of a parameter are its replicas: under
   DDP every rank of the default group holds the whole all-reduced gradient; for a
   ``DTensor`` (FSDP2, HSDP, tensor parallel) the ranks along its ``Replicate`` mesh
   dimensions hold the same piece, the ranks along its ``Shard`` dimensions disjoint pieces
   (:func:`replica_layout`). Each layer is owned by one replica *slot*, assigned once by the
   LPT rule (largest parameter first, to the least-loaded slot; R. L. Graham, "Bounds on
   multiprocessing timing anomalies", SIAM J. Appl. Math. 17 (1969); :func:`assign_owners`),
   so each slot reads about ``1/R`` of the gradient's elements. A rank summarises only the
   pieces of the layers its slot owns.
2. **Cross-check.** A replica that diverges (a rank whose copy of the gradient is not the
   all-reduced one) must still be found, at a small bounded cost. With ``t`` the step and
   ``C`` = ``check_slices``, a layer's *check slice* is its position among its owner's layers
   modulo C; at step t the slot ``(owner - k) mod R``, ``k = 1 + t mod (R - 1)``, also
   summarises the layers of slice ``(t // (R - 1)) mod C``: every piece of those layers is
   summarised by its owner and by exactly one other replica, which rotates over all R - 1
   others. Extra reading per rank: about ``1 / (C R)`` of the gradient. **Bound**: a
   replica whose copy of a layer diverges is compared within ``C (R - 1)`` consecutive
   summarised steps (within C steps when its slot owns the layer).
3. **Collectives.** The counted rows go into a float64 [L, 10] buffer reduced with SUM
   (numel, nonfinite, NaN count, sum |g|, sum g^2, NaN-count-unknown, and the checked copy's
   numel, nonfinite, sum |g|, sum g^2), the maxima into a float64 [L, 2] buffer reduced with
   MAX; a rank's zeros where it counts nothing keep the sums exact (``x + 0 = x``; counts are
   exact in float64 below 2^53). Both are ``all_reduce(..., async_op=True)`` on a dedicated
   gloo group (CPU tensors, never in the way of the training's own collectives) and are
   waited for at the next summarised step (or :meth:`InBandReducer.collect` at a flush), so
   training never stalls on them.
4. **One sender.** Rank ``sender`` (0) hands the reduced statistics to the producer as one
   summary of the whole parameters (piece 0 of 1) marked as reduced over ranks ``[0, W)``
   (``StepSummary.reduced_ranks``), with the disagreeing replicas as
   ``replica_divergence`` rows (layer, checking rank, owning rank) for every layer whose
   two copies differ beyond ``schemas.replicas.REPLICA_RTOL``: the ranks are carried
   through the MAX buffer (rank + 1 beside each counted and each checked row), exact for
   DDP, where a layer is one piece; for a layer cut into several pieces the highest
   checking and counting ranks are named (the layer and the step are exact). The consumer
   counts the message as the report of every rank.

The replica sets and the layer list come from
:func:`producer.adapters.torch_run_layers.gather_run_layers`: under pipeline parallelism a
plain tensor is replicated on the ranks of its stage only, and the buffers span the union
of every stage's layers, so one message per step still carries the whole model.

Importing this module does not import torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.adapters.optional import import_torch
from producer.adapters.torch_run_layers import RunLayers
from producer.summary import LayerSummaries
from schemas.replicas import replicas_disagree
from schemas.scalars import RANK_SCALARS, RankScalars, split_scalars

SUM_COLUMNS = 10
"""Columns of the SUM buffer: counted numel, nonfinite, nan, sum_abs, sum_sq, nan-unknown;
checked numel, nonfinite, sum_abs, sum_sq."""
MAX_COLUMNS = 4
"""Columns of the MAX buffer: counted max |g|, checked max |g|, the counting rank + 1 and
the checking rank + 1 (0 where none: the largest such rank is named)."""


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """Where one parameter's pieces and their replicas live.

    Attributes:
        ranks: int64[P, R] global rank holding piece p in replica slot s (P pieces that
            cut the parameter, R replicas of each).
        slot: this rank's replica slot in ``[0, R)``, or -1 when this rank holds no piece.
    """

    ranks: np.ndarray
    slot: int

    @property
    def replicas(self) -> int:
        """R, the number of replicas of each piece."""
        return int(self.ranks.shape[1])


def replica_layout(param: Any, rank: int, world_size: int,
                   holders: Sequence[int] | None = None) -> ReplicaLayout:
    """The replica layout of ``param`` as seen from ``rank``.

    A plain tensor is one piece replicated on the ranks ``holders`` that declare it (every
    rank of the default group under DDP; a pipeline stage's data-parallel ranks). A
    ``DTensor`` is cut by its ``Shard`` mesh dimensions (the piece index is the coordinate
    flattened row-major over them, as in
    :func:`producer.adapters.torch_layout.gradient_piece`) and replicated along the others
    (``Replicate``; a ``Partial`` parameter placement is treated as replicated, its gradient
    being left out by ``gradient_piece``).

    An object with its own ``replica_layout(rank, world_size)`` method (an FSDP v1
    original parameter, :class:`producer.adapters.torch_fsdp1.OriginalParameter`) gives it.

    Args:
        param: a parameter (plain tensor or DTensor), or an object with
            ``replica_layout``. rank, world_size: this rank and the default group's size.
        holders: the ranks holding a plain tensor (default: all of ``world_size``).

    Returns:
        The :class:`ReplicaLayout`.
    """
    own = getattr(param, "replica_layout", None)
    if callable(own):
        return own(rank, world_size)
    placements = getattr(param, "placements", None)
    mesh = getattr(param, "device_mesh", None)
    if placements is None or mesh is None:
        ranks = np.arange(world_size, dtype=np.int64) if holders is None \
            else np.asarray(holders, np.int64)
        where = np.flatnonzero(ranks == rank)
        return ReplicaLayout(ranks.reshape(1, -1), int(where[0]) if where.size else -1)
    grid = np.asarray(mesh.mesh.tolist(), dtype=np.int64).reshape(tuple(mesh.shape))
    shard_dims = [d for d, p in enumerate(placements) if p.is_shard()]
    replica_dims = [d for d in range(grid.ndim) if d not in shard_dims]
    pieces = math.prod(grid.shape[d] for d in shard_dims)
    table = grid.transpose(shard_dims + replica_dims).reshape(pieces, -1)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return ReplicaLayout(table, -1)
    sizes = [grid.shape[d] for d in replica_dims]
    slot = int(np.ravel_multi_index([coordinate[d] for d in replica_dims], sizes)) if sizes else 0
    return ReplicaLayout(table, slot)


def assign_owners(weights: np.ndarray, replicas: np.ndarray,
                  groups: np.ndarray | None = None) -> np.ndarray:
    """The replica slot that counts each layer, balanced by weight (LPT rule).

    Layers are taken largest first (ties: model order) and each goes to the slot with the
    least weight so far (ties: the lowest slot), separately for each replica set. The
    result depends only on its arguments, so every rank computes the same assignment.

    Args:
        weights: int64[L] elements per layer (the parameter's size). replicas: int64[L],
            R of each layer. groups: int64[L] replica-set keys (layers balanced together
            share one; :func:`producer.adapters.torch_run_layers.replica_group`; default:
            one set per replica count).

    Returns:
        int64[L] owner slot of each layer, in ``[0, R)``.

    Examples:
        >>> assign_owners(np.array([96, 16, 64, 4]), np.array([2, 2, 2, 2])).tolist()
        [0, 1, 1, 1]
    """
    owner = np.zeros(len(weights), np.int64)
    groups = replicas if groups is None else groups
    order = np.lexsort((np.arange(len(weights)), -np.asarray(weights, np.int64)))
    for group in np.unique(groups).tolist():
        members = order[groups[order] == group]
        count = int(replicas[members[0]])
        if count == 1:
            continue
        heap = [(0, slot) for slot in range(count)]
        for layer in members.tolist():
            load, slot = heapq.heappop(heap)
            owner[layer] = slot
            heapq.heappush(heap, (load + int(weights[layer]), slot))
    return owner


def check_slices_of(owner: np.ndarray, groups: np.ndarray, slices: int) -> np.ndarray:
    """Each layer's check slice: its position among the layers of its owner slot (model
    order, counted separately per replica set) modulo ``slices``.

    Args:
        owner: int64[L] owner slots. groups: int64[L] replica-set keys (or replica
            counts). slices: C >= 1.

    Returns:
        int64[L] in ``[0, C)``.
    """
    key = np.lexsort((np.arange(len(owner)), owner, groups))
    sorted_pair = np.column_stack([groups[key], owner[key]])
    order = key
    sorted_key = np.r_[0, np.cumsum((np.diff(sorted_pair, axis=0) != 0).any(axis=1))] \
        if len(key) else np.empty(0, np.int64)
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
    position = np.arange(len(key)) - np.repeat(starts, np.diff(np.r_[starts, len(key)]))
    out = np.empty(len(key), np.int64)
    out[order] = position % slices
    return out


@dataclass(slots=True)
class _InFlight:
    step: int
    sums: Any
    maxima: Any
    works: list[Any]
    checked: np.ndarray
    scalars: dict[str, float]
    ranks_block: Any


RANK_SCALAR_ORDER: tuple[str, ...] = tuple(sorted(RANK_SCALARS))
"""The per-rank scalars' columns in the gathered block (the same on every rank)."""


@dataclass(frozen=True, slots=True)
class Reduced:
    """What :meth:`InBandReducer.collect` returns for a step.

    Attributes:
        step: the optimiser step.
        summaries: on the sender, the whole parameters' statistics (None on the other
            ranks, or when no layer had a gradient).
        scalars: the sender's step scalars of the step (learning rates, loss scale).
        rank_scalars: on the sender, the per-rank scalars of every rank (None elsewhere or
            when no rank had any).
    """

    step: int
    summaries: LayerSummaries | None
    scalars: dict[str, float]
    rank_scalars: RankScalars | None


class InBandReducer:
    """The in-band reduction of a run's layers (see the module docstring).

    Args:
        layers: the run's layer list and replica sets
            (:func:`producer.adapters.torch_run_layers.gather_run_layers`), the same on every
            rank; ``layers.positions`` are this rank's layers.
        layouts: the :class:`ReplicaLayout` of each of this rank's layers (aligned with
            ``layers.positions``).
        group: the process group the collectives run on (a gloo group spanning the
            default group; :meth:`create` makes one).
        rank, world_size: this rank and the default group's size.
        check_slices: C, the number of slices a replica's layers are cross-checked in
            (>= 1; extra reading about ``1 / (C R)`` of the gradient per rank, detection
            within ``C (R - 1)`` steps).
        sender: the rank that hands the reduced statistics to its producer.

    Raises:
        ValueError: ``check_slices < 1``, ``sender`` outside the group, or a layout per
            layer missing.

    Attributes:
        elements_summarised: gradient elements this rank read so far (owned and checked
            pieces).
        steps_reduced: steps whose reduction this rank launched.
    """

    def __init__(
        self, layers: RunLayers, layouts: Sequence[ReplicaLayout], *, group: Any,
        rank: int, world_size: int, check_slices: int = 4, sender: int = 0,
    ) -> None:
        if check_slices < 1:
            raise ValueError(f"check_slices must be >= 1, got {check_slices}")
        if not 0 <= sender < world_size:
            raise ValueError(f"sender {sender} must be a rank in [0, {world_size})")
        if len(layouts) != len(layers.positions):
            raise ValueError("one replica layout per layer of this rank is needed")
        self.names = layers.names
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.sender = sender
        self.check_slices = check_slices
        self.replicas = np.asarray(layers.replicas, np.int64)
        self.slot = np.full(len(self.names), -1, np.int64)
        self.slot[layers.positions] = [lay.slot for lay in layouts]
        self.owner = assign_owners(layers.numel, self.replicas, layers.groups)
        self.check_slice = check_slices_of(self.owner, layers.groups, check_slices)
        self.elements_summarised = 0
        self.steps_reduced = 0
        self._in_flight: _InFlight | None = None

    @classmethod
    def create(cls, layers: RunLayers, layouts: Sequence[ReplicaLayout], *,
               check_slices: int = 4) -> InBandReducer:
        """A reducer over the default group, with its own gloo group (collective: every
        rank of the default group must call it, in the same order as its other
        ``new_group`` calls).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised.
        """
        dist = import_torch().distributed
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the in-band reduction needs torch.distributed initialised")
        group = dist.new_group(backend="gloo")
        return cls(layers, layouts, group=group, rank=dist.get_rank(),
                   world_size=dist.get_world_size(), check_slices=check_slices)

    def _checked_layers(self, step: int) -> np.ndarray:
        """bool[L]: the layers some replica cross-checks at ``step``."""
        spread = np.maximum(self.replicas - 1, 1)
        return (self.replicas > 1) & (
            self.check_slice == (step // spread) % self.check_slices)

    def select(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Which of the run's layers this rank summarises at ``step``.

        Returns:
            ``(owned, checked)``, bool[L] each: the layers whose pieces this rank counts,
            and those it summarises as the cross-check of another replica.
        """
        owned = (self.slot >= 0) & (self.slot == self.owner)
        spread = np.maximum(self.replicas - 1, 1)
        k = 1 + step % spread
        checker = (self.owner - k) % self.replicas
        checked = self._checked_layers(step) & (self.slot >= 0) & (self.slot == checker)
        return owned, checked & ~owned

    def launch(
        self, step: int, positions: np.ndarray, summaries: LayerSummaries | None,
        owned: np.ndarray, checked: np.ndarray, scalars: Mapping[str, float] | None = None,
    ) -> None:
        """Start the reductions of ``step`` (after collecting the previous one's).

        Args:
            step: the optimiser step.
            positions: int64[k] the run's layer positions of ``summaries``' rows (k may
                be 0).
            summaries: this rank's statistics of those layers' local pieces, or None.
            owned, checked: :meth:`select`'s masks for ``step``.
            scalars: this rank's training scalars of ``step`` (``schemas.scalars``): the
                per-rank ones are gathered from every rank by a third all-reduce, a
                float64 [W, 2K] block in which each rank fills its own row (K values, K
                presence flags) and zeros elsewhere, so the sum is every rank's row
                exactly (NaN included); the step ones are the sender's.
        """
        torch = import_torch()
        dist = torch.distributed
        n = len(self.names)
        sums = np.zeros((n, SUM_COLUMNS), np.float64)
        maxima = np.zeros((n, MAX_COLUMNS), np.float64)
        if summaries is not None and len(positions):
            numel = summaries.numel.astype(np.float64)
            nonfinite = summaries.nonfinite.astype(np.float64)
            sum_abs = np.zeros(len(positions)) if summaries.sum_abs is None \
                else summaries.sum_abs
            max_abs = np.zeros(len(positions)) if summaries.max_abs is None \
                else summaries.max_abs
            nan_known = summaries.nan is not None
            nan = summaries.nan.astype(np.float64) if nan_known else np.zeros(len(positions))
            counted = owned[positions]
            rows = positions[counted]
            sums[rows, 0] = numel[counted]
            sums[rows, 1] = nonfinite[counted]
            sums[rows, 2] = nan[counted]
            sums[rows, 3] = sum_abs[counted]
            sums[rows, 4] = summaries.sum_sq[counted]
            sums[rows, 5] = 0.0 if nan_known else (nonfinite[counted] > 0)
            maxima[rows, 0] = max_abs[counted]
            maxima[rows, 2] = self.rank + 1
            check = checked[positions]
            rows = positions[check]
            sums[rows, 6] = numel[check]
            sums[rows, 7] = nonfinite[check]
            sums[rows, 8] = sum_abs[check]
            sums[rows, 9] = summaries.sum_sq[check]
            maxima[rows, 1] = max_abs[check]
            maxima[rows, 3] = self.rank + 1
            self.elements_summarised += int(summaries.numel.sum())
        step_values, own = split_scalars(scalars or {})
        k = len(RANK_SCALAR_ORDER)
        block = np.zeros((self.world_size, 2 * k), np.float64)
        for j, name in enumerate(RANK_SCALAR_ORDER):
            if name in own:
                block[self.rank, j], block[self.rank, k + j] = own[name], 1.0
        sums_t, maxima_t = torch.from_numpy(sums), torch.from_numpy(maxima)
        block_t = torch.from_numpy(block)
        works = [
            dist.all_reduce(sums_t, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
            dist.all_reduce(maxima_t, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
            dist.all_reduce(block_t, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
        ]
        self._in_flight = _InFlight(step, sums_t, maxima_t, works, self._checked_layers(step),
                                    step_values, block_t)
        self.steps_reduced += 1

    @property
    def in_flight(self) -> bool:
        """Whether a launched reduction has not been collected yet."""
        return self._in_flight is not None

    def collect(self, norms_only: bool = False) -> Reduced | None:
        """Wait for the launched reduction and return its result.

        Args:
            norms_only: the statistics carry no sum |g| / max |g| (norms mode).

        Returns:
            None when nothing was in flight; else the :class:`Reduced` step, whose
            ``summaries`` are, on the sender, the whole parameters' statistics of the layers
            some rank counted (piece 0 of 1, marked reduced over ``[0, world_size)``, with
            the cross-check's disagreements), and None on the other ranks or when no
            layer had a gradient.
        """
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return None
        for work in flight.works:
            work.wait()
        if self.rank != self.sender:
            return Reduced(flight.step, None, flight.scalars, None)
        ranks = _gathered_rank_scalars(flight.ranks_block.numpy())
        sums, maxima = flight.sums.numpy(), flight.maxima.numpy()
        present = np.flatnonzero(sums[:, 0] > 0)
        if present.size == 0:
            return Reduced(flight.step, None, flight.scalars, ranks)
        s, m = sums[present], maxima[present]
        summaries = LayerSummaries(
            tuple(self.names[i] for i in present.tolist()), s[:, 0].astype(np.int64),
            None if norms_only else s[:, 3], s[:, 4], None if norms_only else m[:, 0],
            s[:, 1].astype(np.int64),
            nan=None if (s[:, 5] > 0).any() else s[:, 2].astype(np.int64),
        ).with_layout(0, 1)
        divergence = self._divergence(sums, maxima, flight.checked)
        return Reduced(flight.step, summaries.with_reduction(
            np.array([0, self.world_size], np.int64), divergence), flight.scalars, ranks)

    @staticmethod
    def _divergence(sums: np.ndarray, maxima: np.ndarray, checked: np.ndarray
                    ) -> np.ndarray | None:
        """int64[d, 3] rows (layer, checking rank, counting rank) of the checked layers
        whose two copies disagree; None when all agree. A layer cut into several pieces
        names its highest checking and counting ranks."""
        layers = np.flatnonzero(checked & (sums[:, 0] > 0))
        if layers.size == 0:
            return None
        counted = np.column_stack([sums[layers, 0], sums[layers, 1], sums[layers, 3],
                                   sums[layers, 4], maxima[layers, 0]])
        copy = np.column_stack([sums[layers, 6], sums[layers, 7], sums[layers, 8],
                                sums[layers, 9], maxima[layers, 1]])
        bad = layers[replicas_disagree(counted, copy)]
        if bad.size == 0:
            return None
        return np.column_stack([bad, maxima[bad, 3] - 1, maxima[bad, 2] - 1]).astype(np.int64)


def _gathered_rank_scalars(block: np.ndarray) -> RankScalars | None:
    """The per-rank scalars of a gathered float64 [W, 2K] block (:meth:`InBandReducer.
    launch`): the rows (rank, name, value) whose presence flag is set; None when none is."""
    k = len(RANK_SCALAR_ORDER)
    rank, column = np.nonzero(block[:, k:] > 0)
    if rank.size == 0:
        return None
    return RankScalars(RANK_SCALAR_ORDER, rank.astype(np.int64), column.astype(np.int64),
                       block[rank, column])
