"""Shard merge: the ranks of one (run, step) become one GradientFrame.

A frame is complete when every rank of ``world_size`` has reported. A frame still
incomplete ``shard_timeout_s`` after its first shard is finalised as *partial*, its
missing ranks recorded. A shard arriving later for a partial frame is merged into the
stored sums and the frame is finalised again (the store rewrites it). A duplicate shard
(same run, step, rank) changes nothing (README.md, "How it works").

Parts. A rank whose summary was too large for one Kafka message sends it as
``part_count`` messages over disjoint layer ranges. Pieces are keyed by (rank, part): each
part is merged once (a repeated part is a duplicate), and the rank counts as reported only
when all its parts arrived. A frame finalised as partial lists only complete ranks in
``ranks_seen`` (the parts that did arrive are in its sums); the parts still missing merge
into it later like a late rank.

Replicas count once. A StepSummary with a shard layout (``shard_index``/``shard_count``)
says which disjoint piece of each parameter its statistics cover; the first rank to report
a piece (layer, shard_index) of a frame has it counted, and every later rank reporting the
same piece holds a replica: its statistics are compared with the counted ones
(:class:`PieceLedger`) and not added. Replicas that disagree beyond
:data:`REPLICA_RTOL` are recorded on the frame (``replica_divergence``). Without a layout
each rank's statistics are a disjoint shard of their own.

Pieces must fit their parameter (:func:`check_shard`, :func:`check_layout`). A summary
whose entries cannot be pieces of the parameters RunStarted declared (more elements than
the parameter, a whole-parameter piece of another size) is refused before the merge, from
the message alone. At finalisation the counted pieces of every reported layer must hold
no more elements than the parameter, and, in a frame every rank reported, exactly as many;
the replicas of one piece must hold as many elements as the counted one, and every rank
must cut a layer into the same number of pieces. A frame breaking any of these carries the
rows in ``GradientFrame.layout_violations``: it is stored as partial (never complete) and
raises the ``shard_layout`` alert. The checks are NumPy expressions over the layers.

Refused ranks. A rank whose RunStarted was refused (:meth:`ShardMerger.refuse`), or whose
summary of one step was refused (:meth:`ShardMerger.reject`), will send nothing usable for
those frames: a frame waits only for the other ranks, is finalised as partial at once, and
names why each such rank is missing (``GradientFrame.refused_ranks``).

Training scalars. The summaries' step scalars (learning rates, loss scale) and per-rank
scalars (loss, step and compute time) join the frame (:func:`frame_scalars`): a step
scalar from the lowest rank that sent it, the per-rank rows of every rank, and the step's
value of each per-rank scalar aggregated over them (``schemas.scalars``).

The merger also tracks, per Kafka partition, the earliest offset of every pending frame:
a worker must never store or commit a position past it, so that a crash or a rebalance
rebuilds pending frames from Kafka instead of losing them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from consumer.frames import GradientFrame, LocalRows, MergedShards, compute_frame
from consumer.runs import RunInfo
from consumer.topic_admin import PartitionKey
from schemas.replicas import REPLICA_RTOL
from schemas.scalars import RankScalars, step_scalars
from schemas.wire import StepSummary

VIOLATION_NUMEL = 1
"""Layout violation: the counted pieces of a layer hold more elements than the parameter
(any frame), or fewer (a frame every rank reported). Row: (layer, kind, -1, elements
counted, parameter's numel)."""
VIOLATION_REPLICA_NUMEL = 2
"""Layout violation: a replica of a piece holds another number of elements than the counted
replica. Row: (layer, kind, rank, its numel, the counted replica's numel)."""
VIOLATION_SHARD_COUNT = 3
"""Layout violation: a rank cuts a layer into another number of pieces than the first rank
that reported it in the frame. Row: (layer, kind, rank, its shard_count, the first one)."""
VIOLATION_KINDS: dict[int, str] = {
    VIOLATION_NUMEL: "numel", VIOLATION_REPLICA_NUMEL: "replica_numel",
    VIOLATION_SHARD_COUNT: "shard_count",
}
"""Names of the layout-violation kinds (alert values)."""

_NO_VIOLATIONS = np.empty((0, 5), np.int64)

SumsLoader = Callable[[RunInfo, int], MergedShards | None]
"""Loads the stored merged sums of a finalised frame (run, step), or None if absent."""


class PieceLedger:
    """The pieces (layer, shard_index) of one frame already counted, with the statistics of
    the replica that was counted, for the agreement check of later replicas.

    A layer's pieces get ``shard_count`` consecutive slots (the count the first rank to
    report the layer declared; ``shard_index < shard_count`` is checked when a message is
    decoded) the first time the layer is reported: piece (layer, i) is slot
    ``base[layer] + i``. The slot arrays grow by doubling, so a frame holds one slot per
    piece that exists (a pipeline stage's layers: one each), not L x W. A summary whose
    layers are all reported for the first time in the frame (a pipeline stage's first
    replica) holds only new pieces: it is queued, and the queued summaries' pieces are
    entered in one batch when a summary reports an already seen layer (a replica), so a
    frame of disjoint summaries costs two NumPy operations per summary here.

    Args:
        num_layers: L. world_size: W (kept for the callers' reference; no table is sized
            by it).
    """

    __slots__ = ("base", "count", "divergence", "nan", "nonfinite", "numel", "owner",
                 "queued", "seen", "size", "sums", "violations", "world_size")

    def __init__(self, num_layers: int, world_size: int) -> None:
        self.world_size = world_size
        self.count = np.zeros(num_layers, np.int64)  # first shard_count seen (0: none)
        self.base = np.zeros(num_layers, np.int64)  # slot of piece 0 (valid where count > 0)
        self.size = 0  # slots handed out
        self.seen = np.zeros(0, bool)
        self.owner = np.zeros(0, np.int32)
        self.numel = np.zeros(0, np.int64)
        self.nonfinite = np.zeros(0, np.int64)
        self.nan = np.zeros(0, np.int64)  # -1: the counted replica sent no NaN count
        self.sums = np.zeros((0, 3))  # sum_abs, sum_sq, max_abs
        self.divergence: list[np.ndarray] = []
        self.violations: list[np.ndarray] = []
        self.queued: list[StepSummary] = []  # summaries of new layers only, not entered yet

    def _reserve(self, size: int) -> None:
        """Grow the slot arrays (doubling) to hold at least ``size`` slots."""
        cap = len(self.seen)
        if size <= cap:
            return
        cap = max(size, 2 * cap, 64)
        grow = cap - len(self.seen)
        self.seen = np.concatenate([self.seen, np.zeros(grow, bool)])
        self.owner = np.concatenate([self.owner, np.full(grow, -1, np.int32)])
        self.numel = np.concatenate([self.numel, np.zeros(grow, np.int64)])
        self.nonfinite = np.concatenate([self.nonfinite, np.zeros(grow, np.int64)])
        self.nan = np.concatenate([self.nan, np.full(grow, -1, np.int64)])
        self.sums = np.concatenate([self.sums, np.full((grow, 3), np.nan)])

    def admit(self, shard: StepSummary) -> np.ndarray:
        """Record the pieces of ``shard`` (which must carry a layout) and return which of its
        layer entries to count.

        Returns:
            bool[k] aligned with ``shard.layer_indices``: True for a piece seen for the
            first time (count it), False for a replica of a counted piece (compared with it;
            a disagreement of the sums or the non-finite (or NaN) count is appended to
            :attr:`divergence` as rows (layer_index, rank, reference_rank), one of the
            element count to :attr:`violations`). An entry whose ``shard_count`` differs
            from the first one seen for its layer is recorded in :attr:`violations` and not
            counted (False).
        """
        layers = np.asarray(shard.layer_indices, np.int64)
        first = self.count[layers]
        if not np.count_nonzero(first):  # only new layers, so only new pieces: queue it
            self.count[layers] = shard.shard_count
            self.queued.append(shard)
            return np.ones(len(layers), bool)
        if self.queued:
            self._enter_queued()
        return self._admit(shard, layers, self.count[layers])

    def _enter_queued(self) -> None:
        """Enter the pieces of the queued summaries (every one new, their layers' counts
        set already) into the slot arrays, in one batch."""
        shards, self.queued = self.queued, []
        layers = np.concatenate([np.asarray(m.layer_indices, np.int64) for m in shards])
        if not len(layers):  # summaries of no layer
            return
        cuts = self.count[layers]
        ends = self.size + np.cumsum(cuts)
        self.base[layers] = ends - cuts
        self.size = int(ends[-1])
        self._reserve(self.size)
        keys = self.base[layers] + np.concatenate(
            [np.asarray(m.shard_index, np.int64) for m in shards])
        columns = [_ledger_columns(m) for m in shards]
        self.seen[keys] = True
        self.owner[keys] = np.repeat([m.rank for m in shards], [len(m.layer_indices)
                                                                 for m in shards])
        self.numel[keys] = np.concatenate([np.asarray(m.numel, np.int64) for m in shards])
        self.nonfinite[keys] = np.concatenate([c[0] for c in columns])
        self.nan[keys] = np.concatenate([c[1] for c in columns])
        self.sums[keys] = np.concatenate([c[2] for c in columns])

    def _admit(self, shard: StepSummary, layers: np.ndarray, first: np.ndarray) -> np.ndarray:
        """:meth:`admit` of a summary reporting some layer already seen (nothing queued):
        ``layers`` int64[k] its layer indices, ``first`` int64[k] their first
        ``shard_count`` (0: none yet)."""
        index = np.asarray(shard.shard_index, np.int64)
        numel = np.asarray(shard.numel, np.int64)
        count = np.asarray(shard.shard_count, np.int64)
        unset = first == 0
        if unset.any():  # the layers' first report: their pieces get slots
            cuts = count[unset]
            ends = self.size + np.cumsum(cuts)
            self.base[layers[unset]] = ends - cuts
            self.count[layers[unset]] = cuts
            self.size = int(ends[-1])
            self._reserve(self.size)
            first = np.where(unset, count, first)
        other_cut = first != count
        if other_cut.any():
            self.violations.append(_violation_rows(
                layers[other_cut], VIOLATION_SHARD_COUNT, shard.rank, count[other_cut],
                first[other_cut]))
            index = np.where(other_cut, 0, index)  # a slot of the layer; never counted
        keys = self.base[layers] + index
        new = ~self.seen[keys] & ~other_cut
        nonfinite, nan, sums = _ledger_columns(shard)
        fresh = keys[new]
        self.seen[fresh] = True
        self.owner[fresh] = shard.rank
        self.numel[fresh] = numel[new]
        self.nonfinite[fresh] = nonfinite[new]
        self.nan[fresh] = nan[new]
        self.sums[fresh] = sums[new]
        old = ~new & ~other_cut
        if old.any():
            ref = keys[old]
            a, b = self.sums[ref], sums[old]
            other_size = self.numel[ref] != numel[old]
            if other_size.any():
                self.violations.append(_violation_rows(
                    layers[old][other_size], VIOLATION_REPLICA_NUMEL, shard.rank,
                    numel[old][other_size], self.numel[ref][other_size]))
            with np.errstate(invalid="ignore"):
                far = np.abs(a - b) > REPLICA_RTOL * np.maximum(np.abs(a), np.abs(b))
            mine, theirs = self.nan[ref], nan[old]
            differs = ((far.any(axis=1) & ~other_size) | (self.nonfinite[ref] != nonfinite[old])
                       | ((mine >= 0) & (theirs >= 0) & (mine != theirs)))
            if differs.any():
                rows = np.column_stack([
                    layers[old][differs], np.full(int(differs.sum()), shard.rank),
                    self.owner[ref][differs],
                ]).astype(np.int32)
                self.divergence.append(rows)
        return new

    def divergence_rows(self) -> np.ndarray:
        """int32[d, 3] rows (layer_index, rank, reference_rank) of the disagreeing replicas."""
        if not self.divergence:
            return _NO_DIVERGENCE
        return np.concatenate(self.divergence)

    def violation_rows(self) -> np.ndarray:
        """int64[v, 5] layout-violation rows (layer_index, kind, rank, got, expected) of the
        replicas and cuts that did not fit (kinds :data:`VIOLATION_REPLICA_NUMEL`,
        :data:`VIOLATION_SHARD_COUNT`)."""
        if not self.violations:
            return _NO_VIOLATIONS
        return np.concatenate(self.violations)


_NO_DIVERGENCE = np.empty((0, 3), np.int32)


def _ledger_columns(shard: StepSummary) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the ledger compares of ``shard``'s k entries: (int64[k] non-finite counts,
    int64[k] NaN counts (-1 where the summary sent none for a non-finite entry),
    float64[k, 3] sum_abs, sum_sq, max_abs (NaN where not sent))."""
    nonfinite = np.asarray(shard.nonfinite, np.int64)
    nan = (np.where(nonfinite == 0, 0, -1) if shard.nan is None
           else np.asarray(shard.nan, np.int64))
    sums = np.empty((len(nonfinite), 3))
    sums[:, 0] = np.nan if shard.sum_abs is None else shard.sum_abs
    sums[:, 1] = shard.sum_sq
    sums[:, 2] = np.nan if shard.max_abs is None else shard.max_abs
    return nonfinite, nan, sums


def _violation_rows(layers: np.ndarray, kind: int, rank: int, got: np.ndarray,
                    expected: np.ndarray) -> np.ndarray:
    """int64[k, 5] rows (layer, kind, rank, got, expected) for ``k`` layers."""
    k = len(layers)
    return np.column_stack([layers, np.full(k, kind), np.full(k, rank), got,
                            expected]).astype(np.int64)


def check_shard(shard: StepSummary, full_numel: np.ndarray) -> str | None:
    """Why ``shard``'s entries cannot be pieces of the run's parameters, judged from the
    message alone, or None when they can.

    A piece holds at most the parameter's elements; a piece that is the whole parameter
    (``shard_count == 1``, or no layout in a run of one rank) holds exactly as many.
    (``shard_index < shard_count <= world_size`` is checked when the message is decoded.)

    Args:
        shard: a validated StepSummary whose layer indices are within the run.
        full_numel: int64[L] the parameters' sizes (RunStarted).

    Returns:
        One line naming the first offending entry and how many there are, or None.
    """
    layers = np.asarray(shard.layer_indices, np.int64)
    numel = np.asarray(shard.numel, np.int64)
    full = full_numel[layers]
    over = numel > full
    if shard.shard_count is not None:
        whole = np.asarray(shard.shard_count, np.int64) == 1
        wrong = over | (whole & (numel != full))
    elif shard.world_size == 1:  # no layout, one rank: its piece is the whole parameter
        wrong = numel != full
    else:
        wrong = over
    if not np.count_nonzero(wrong):  # the cheapest test of a small bool array
        return None
    bad = np.flatnonzero(wrong)
    i = int(bad[0])
    what = ("exceeds" if over[i] else "differs from") + " the parameter's"
    piece = "a piece" if over[i] else "the whole parameter (shard_count 1)"
    return (f"rank {shard.rank} step {shard.step}: layer {int(layers[i])} holds "
            f"{int(numel[i])} elements as {piece}, which {what} {int(full[i])} from "
            f"RunStarted ({bad.size} such layer(s)); the summary does not fit the run's "
            "layer list")


def check_layout(numel: np.ndarray, full_numel: np.ndarray, every_rank: bool) -> np.ndarray:
    """Layout-violation rows of a frame's merged element counts (kind
    :data:`VIOLATION_NUMEL`).

    The counted pieces of a parameter are disjoint, so together they hold at most its
    elements, and once every rank reported, exactly its elements (a layer no rank reported,
    ``numel == 0``, had no gradient: not a violation).

    Args:
        numel: int64[L] elements merged per layer. full_numel: int64[L] the parameters'
            sizes (RunStarted). every_rank: every rank of the run reported.

    Returns:
        int64[v, 5] rows (layer_index, kind, -1, merged numel, parameter numel).
    """
    bad = numel > full_numel
    if every_rank:
        bad |= (numel > 0) & (numel < full_numel)
    if not bad.any():
        return _NO_VIOLATIONS
    layers = np.flatnonzero(bad)
    return _violation_rows(layers, VIOLATION_NUMEL, -1, numel[layers], full_numel[layers])


@dataclass(slots=True)
class _Pending:
    merged: MergedShards
    ranks: set[int]
    partition: PartitionKey
    first_offset: int
    first_seen: float
    wall_time: float
    ledger: PieceLedger | None = None
    local: list[LocalRows] = field(default_factory=list)
    divergence: list[np.ndarray] = field(default_factory=list)
    """int32[d, 3] rows (layer_index, rank, reference_rank) that in-band reduced summaries
    carried (``StepSummary.replica_divergence``)."""
    nonfinite: list[np.ndarray] = field(default_factory=list)
    """int64[p, 2] rows (rank, layer_index) of per-rank summaries holding NaN/Inf."""
    parts: dict[int, set[int]] = field(default_factory=dict)
    """rank -> part indices arrived, for ranks with some but not all of their parts."""
    step_scalars: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    """(sending rank, step scalars) of the summaries that carried some."""
    rank_scalars: list[StepSummary] = field(default_factory=list)
    """The summaries that carried per-rank scalars (their rows are built once, per frame:
    :func:`rank_rows`)."""


@dataclass(slots=True)
class _RunFrames:
    """Finalised frames of one run: complete steps, and partial steps with their ranks."""

    complete: set[int] = field(default_factory=set)
    partial: dict[int, frozenset[int]] = field(default_factory=dict)
    parts: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    """step -> rank -> part indices already merged into a partial frame (incomplete ranks)."""


def _admit(complete: set[int] | frozenset[int], parts: dict[int, set[int]],
           shard: StepSummary) -> tuple[bool, bool]:
    """(new, rank_complete) for ``shard`` given the complete ranks and the parts of
    incomplete ranks; records a new part in ``parts`` (and forgets the rank there once it
    is complete). A shard without parts is the whole of its rank."""
    if shard.rank in complete:
        return False, True
    if shard.part_index is None or shard.part_count is None:
        if shard.rank in parts:  # a whole summary after some parts: parts win
            return False, False
        return True, True
    seen = parts.setdefault(shard.rank, set())
    if shard.part_index in seen:
        return False, False
    seen.add(shard.part_index)
    if len(seen) >= shard.part_count:
        del parts[shard.rank]
        return True, True
    return True, False


class ShardMerger:
    """Merges StepSummary shards into frames.

    Args:
        shard_timeout_s: seconds after a frame's first shard before it is finalised
            as partial.
        load_sums: how to fetch the stored sums of a partial frame when a late shard
            arrives (the DuckDB sink's loader in a worker).
    """

    def __init__(self, shard_timeout_s: float, load_sums: SumsLoader) -> None:
        self.shard_timeout_s = shard_timeout_s
        self._load_sums = load_sums
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._finalised: dict[str, _RunFrames] = {}
        # Sums of recently finalised partial frames, so that a late shard arriving before
        # the frame reached the store still merges with them; older ones come from the store.
        self._partial_sums: OrderedDict[tuple[str, int], _Pending] = OrderedDict()
        self.partial_cache_size = 4096
        self.duplicates = 0
        self._refused: dict[str, dict[int, str]] = {}
        # (run, step) -> rank -> why its summary of that step was refused; bounded like
        # the partial cache (a step whose frame never forms is forgotten eventually).
        self._rejected: OrderedDict[tuple[str, int], dict[int, str]] = OrderedDict()

    # -- refused ranks -------------------------------------------------------------------

    def refuse(self, run_id: str, rank: int, reason: str) -> None:
        """Record that ``rank``'s RunStarted for ``run_id`` was refused (``reason``): its
        summaries are refused from now on (:meth:`refusal`) and the run's frames stop
        waiting for it."""
        self._refused.setdefault(run_id, {})[rank] = reason

    def refusal(self, run_id: str, rank: int) -> str | None:
        """Why ``rank``'s RunStarted for ``run_id`` was refused, or None."""
        return self._refused.get(run_id, {}).get(rank)

    def reject(self, run_id: str, step: int, rank: int, reason: str) -> None:
        """Record that ``rank``'s summary of ``step`` was refused (dead-lettered for
        ``reason``): that frame stops waiting for the rank and names the reason."""
        key = (run_id, step)
        self._rejected.setdefault(key, {})[rank] = reason
        self._rejected.move_to_end(key)
        while len(self._rejected) > self.partial_cache_size:
            self._rejected.popitem(last=False)

    def _excused(self, run_id: str, step: int) -> dict[int, str]:
        """Ranks of (run, step) whose data was refused, with why (run-level refusals
        first named)."""
        out = {r: f"its RunStarted was refused: {why}"
               for r, why in self._refused.get(run_id, {}).items()}
        for r, why in self._rejected.get((run_id, step), {}).items():
            out.setdefault(r, f"its summary was dead-lettered: {why}")
        return out

    def _covered(self, run: RunInfo, step: int, ranks: set[int] | frozenset[int]) -> bool:
        """Every rank of the run reported ``step`` or had its data refused."""
        if len(ranks) >= run.world_size:
            return True
        refused = self._refused.get(run.run_id)
        rejected = self._rejected.get((run.run_id, step))
        if not refused and not rejected:
            return False
        return len(set(ranks).union(refused or (), rejected or ())) >= run.world_size

    # -- restore -------------------------------------------------------------------------

    def restore_finalised(
        self, run_id: str, steps: np.ndarray, complete: np.ndarray, ranks: list[list[int]]
    ) -> None:
        """Register a run's stored frames (worker restart).

        Args:
            run_id: the run. steps: int[F]. complete: bool[F].
            ranks: F lists of the ranks seen (used for partial frames).
        """
        record = self._finalised.setdefault(run_id, _RunFrames())
        record.complete.update(steps[complete].tolist())
        for i in np.flatnonzero(~complete).tolist():
            record.partial[int(steps[i])] = frozenset(ranks[i])

    # -- shards --------------------------------------------------------------------------

    def add(
        self,
        run: RunInfo,
        shard: StepSummary,
        partition: PartitionKey,
        offset: int,
        now: float,
    ) -> GradientFrame | None:
        """Merge one validated shard.

        Args:
            run: the run's description (layer count, thresholds, world size).
            shard: a StepSummary whose indices were checked against ``run``.
            partition: where the shard was read. offset: its Kafka offset.
            now: monotonic clock (s), for the shard timeout.

        Returns:
            The finalised frame when this shard completes it (or rewrites a partial frame
            with a late shard); None while the frame waits for more ranks or for a
            duplicate.
        """
        key = (run.run_id, shard.step)
        record = self._finalised.get(run.run_id)
        if record is None:  # not setdefault: no _RunFrames built per shard
            record = self._finalised[run.run_id] = _RunFrames()
        pending = self._pending.get(key)
        if pending is None:
            if shard.step in record.complete:
                self.duplicates += 1
                return None
            late_ranks = record.partial.get(shard.step)
            if late_ranks is not None:
                return self._late_shard(run, shard, late_ranks, record)
            pending = _Pending(
                MergedShards.empty(run.num_layers), set(), partition, offset, now,
                shard.wall_time,
            )
            self._pending[key] = pending
        new, rank_complete = _admit(pending.ranks, pending.parts, shard)
        if not new:
            self.duplicates += 1
            return None
        _merge_counted(pending, shard, run.world_size)
        if rank_complete:
            _add_reporting(pending.ranks, shard)
        pending.wall_time = max(pending.wall_time, shard.wall_time)
        if len(pending.ranks) < run.world_size:
            if not self._covered(run, shard.step, pending.ranks):
                return None
            (frame,) = self._finalise_partial(run, [key])  # the others' data was refused
            return frame
        del self._pending[key]
        record.complete.add(shard.step)
        return self._frame(run, shard.step, pending, pending.ranks, pending.wall_time)

    def _late_shard(
        self, run: RunInfo, shard: StepSummary, ranks: frozenset[int], record: _RunFrames
    ) -> GradientFrame | None:
        parts = record.parts.setdefault(shard.step, {})
        new, rank_complete = _admit(ranks, parts, shard)
        if not parts:
            del record.parts[shard.step]
        if not new:
            self.duplicates += 1
            return None
        cached = self._partial_sums.pop((run.run_id, shard.step), None)
        if cached is None:
            stored = self._load_sums(run, shard.step)
            if stored is None:
                stored = MergedShards.empty(run.num_layers)
                ranks = frozenset()
            # The stored sums do not say which pieces they cover: with a layout, count only
            # what still fits in the parameter (not_yet_counted).
            pending = _Pending(stored, set(ranks), ("", -1), -1, 0.0, shard.wall_time)
            keep = None if shard.shard_index is None else not_yet_counted(
                stored, shard, run.numel)
            merge_shard(stored, shard, keep)
            pending.local = [LocalRows.from_shard(shard)] if shard.has_local else []
        else:
            pending = cached
            pending.local = []  # the rows of the earlier ranks are stored already
            _merge_counted(pending, shard, run.world_size)
        new_ranks = ranks | frozenset(shard.reporting_ranks()) if rank_complete else ranks
        if len(new_ranks) == run.world_size:
            del record.partial[shard.step]
            record.complete.add(shard.step)
        else:
            record.partial[shard.step] = new_ranks
            self._remember_partial(run.run_id, shard.step, pending)
        frame = self._frame(run, shard.step, pending, set(new_ranks), shard.wall_time)
        frame.rewrite = True  # the partial frame is stored already
        return frame

    def expire(self, runs: dict[str, RunInfo], now: float) -> list[GradientFrame]:
        """Finalise as partial every pending frame older than ``shard_timeout_s``.

        Args:
            runs: run id -> RunInfo. now: monotonic clock (s).

        Returns:
            The partial frames, missing ranks recorded in each.
        """
        limit = now - self.shard_timeout_s
        expired = [k for k, p in self._pending.items() if p.first_seen <= limit]
        frames = []
        for run_id, step in expired:
            frames += self._finalise_partial(runs[run_id], [(run_id, step)])
        return frames

    def settle(self, run: RunInfo) -> list[GradientFrame]:
        """Finalise as partial every pending frame of ``run`` that now waits only for
        ranks whose data was refused (after :meth:`refuse`)."""
        keys = [k for k, p in self._pending.items()
                if k[0] == run.run_id and self._covered(run, k[1], p.ranks)]
        return self._finalise_partial(run, keys)

    def settle_step(self, run: RunInfo, step: int) -> GradientFrame | None:
        """The pending frame of (``run``, ``step``) finalised as partial when it now waits
        only for ranks whose data was refused (after :meth:`reject`), else None."""
        key = (run.run_id, step)
        pending = self._pending.get(key)
        if pending is None or not self._covered(run, step, pending.ranks):
            return None
        (frame,) = self._finalise_partial(run, [key])
        return frame

    def _finalise_partial(self, run: RunInfo, keys: list[tuple[str, int]]
                          ) -> list[GradientFrame]:
        """Finalise the pending frames ``keys`` of ``run`` as partial."""
        frames = []
        for run_id, step in keys:
            pending = self._pending.pop((run_id, step))
            record = self._finalised.setdefault(run_id, _RunFrames())
            record.partial[step] = frozenset(pending.ranks)
            if pending.parts:
                record.parts[step] = {r: set(p) for r, p in pending.parts.items()}
            self._remember_partial(run_id, step, pending)
            frames.append(self._frame(run, step, pending, pending.ranks, pending.wall_time))
        return frames

    def _remember_partial(self, run_id: str, step: int, pending: _Pending) -> None:
        self._partial_sums[(run_id, step)] = pending
        while len(self._partial_sums) > self.partial_cache_size:
            self._partial_sums.popitem(last=False)

    def expire_run(self, runs: dict[str, RunInfo], run_id: str) -> list[GradientFrame]:
        """Finalise every pending frame of ``run_id`` now (all its ranks finished)."""
        keys = [k for k in self._pending if k[0] == run_id]
        frames = []
        for key in keys:
            pending = self._pending[key]
            pending.first_seen = float("-inf")
        if keys:
            frames = self.expire(runs, now=float("inf"))
        return frames

    def _frame(
        self, run: RunInfo, step: int, pending: _Pending, ranks: set[int], wall_time: float
    ) -> GradientFrame:
        """The frame of ``pending`` with its layout checked (:func:`check_layout`, the
        ledger's rows) and the refused ranks named."""
        frame = compute_frame(
            run.run_id,
            step,
            pending.merged,
            vanishing_threshold=run.vanishing_threshold,
            exploding_threshold=run.exploding_threshold,
            ranks_seen=tuple(ranks),
            world_size=run.world_size,
            wall_time=wall_time,
        )
        violations = check_layout(pending.merged.numel, run.numel,
                                  len(ranks) >= run.world_size)
        if pending.ledger is not None or pending.divergence:
            ledger_divergence = ([] if pending.ledger is None
                                 else [pending.ledger.divergence_rows()])
            frame.replica_divergence = np.concatenate(
                [*ledger_divergence, *pending.divergence]).astype(np.int32)
        if pending.ledger is not None:
            ledger_rows = pending.ledger.violation_rows()
            if len(ledger_rows):
                violations = np.concatenate([violations, ledger_rows])
        frame.layout_violations = violations
        if pending.nonfinite:
            frame.nonfinite_pieces = np.concatenate(pending.nonfinite)
        if len(ranks) < run.world_size:
            excused = self._excused(run.run_id, step)
            frame.refused_ranks = {r: excused[r] for r in frame.missing_ranks if r in excused}
        else:
            self._rejected.pop((run.run_id, step), None)
        if pending.local:
            frame.local = LocalRows.concat(pending.local)
        if pending.step_scalars or pending.rank_scalars:
            frame.scalars, frame.rank_scalars = frame_scalars(
                pending.step_scalars,
                [rank_rows(pending.rank_scalars)] if pending.rank_scalars else [])
        return frame

    # -- offsets -------------------------------------------------------------------------

    def earliest_pending_offsets(self) -> dict[PartitionKey, int]:
        """Per partition, the smallest first offset among pending frames."""
        out: dict[PartitionKey, int] = {}
        for p in self._pending.values():
            cur = out.get(p.partition)
            if cur is None or p.first_offset < cur:
                out[p.partition] = p.first_offset
        return out

    def drop_partitions(self, partitions: set[PartitionKey]) -> int:
        """Forget pending frames read from ``partitions`` (revoked in a rebalance; their
        new owner rebuilds them from Kafka). Returns how many were dropped."""
        doomed = [k for k, p in self._pending.items() if p.partition in partitions]
        for k in doomed:
            del self._pending[k]
        return len(doomed)

    @property
    def pending_count(self) -> int:
        """Frames waiting for ranks."""
        return len(self._pending)


def _merge_counted(pending: _Pending, shard: StepSummary, world_size: int) -> None:
    """Merge the pieces of ``shard`` not counted yet into ``pending`` (replicas are checked
    by the ledger, not added) and keep its local rows. A summary reduced in-band holds the
    whole parameters of its ranks, counted once already: it needs no ledger (whose L x W
    piece table would cost O(W) per frame); a second summary over the same layers shows in
    the element counts (:func:`check_layout`)."""
    keep = None
    if shard.shard_index is not None and shard.reduced_ranks is None:
        if pending.ledger is None:
            pending.ledger = PieceLedger(len(pending.merged.numel), world_size)
        keep = pending.ledger.admit(shard)
    merge_shard(pending.merged, shard, keep)
    if shard.has_local:
        pending.local.append(LocalRows.from_shard(shard))
    if shard.scalars:
        pending.step_scalars.append((shard.rank, shard.scalars))
    if shard.rank_scalar_names is not None:
        pending.rank_scalars.append(shard)
    if shard.replica_divergence is not None and len(shard.replica_divergence):
        pending.divergence.append(
            np.asarray(shard.replica_divergence, np.int64).reshape(-1, 3).astype(np.int32))
    if shard.reduced_ranks is None:
        bad = np.asarray(shard.nonfinite) > 0
        if bad.any():
            layers = np.asarray(shard.layer_indices, np.int64)[bad]
            pending.nonfinite.append(np.column_stack([np.full(len(layers), shard.rank),
                                                      layers]))


def rank_rows(shards: list[StepSummary]) -> RankScalars:
    """The per-rank scalar rows of a frame's ``shards`` (each carrying some, disjoint
    ranks). Summaries of one rank each in the dense form with the same names (per-rank
    sending, the usual case) become one table with one concatenation; others go through
    their own rows (:meth:`schemas.wire.StepSummary.rank_scalar_rows`).

    Raises:
        ValueError: ``shards`` is empty.
    """
    if not shards:
        raise ValueError("rank_rows needs at least one summary")
    names = shards[0].rank_scalar_names
    if all(s.rank_scalar_ranks is None and s.reduced_ranks is None
           and s.rank_scalar_names == names for s in shards):
        ranks = np.fromiter((s.rank for s in shards), np.int64, count=len(shards))
        values = np.concatenate([np.asarray(s.rank_scalar_values, np.float64)
                                 for s in shards])
        return RankScalars.from_dense(names or (), ranks, values)
    return RankScalars.concat([s.rank_scalar_rows() for s in shards])  # type: ignore[misc]


def frame_scalars(step: list[tuple[int, dict[str, float]]], ranks: list[RankScalars]
                  ) -> tuple[dict[str, float], RankScalars | None]:
    """A frame's training scalars from its summaries': (the step's scalars, the per-rank
    rows or None).

    Args:
        step: (sending rank, step scalars) of each summary that carried some; a name sent
            by several ranks takes the lowest rank's value.
        ranks: the per-rank rows of each summary (disjoint ranks).

    Returns:
        ``schemas.scalars.step_scalars`` of the step scalars and the concatenated rows.
    """
    values: dict[str, float] = {}
    for _, sent in sorted(step, key=lambda item: -item[0]):  # the lowest rank last: it wins
        values.update(sent)
    rows = RankScalars.concat(ranks) if ranks else None
    return step_scalars(values, rows), rows


def _add_reporting(ranks: set[int], shard: StepSummary) -> None:
    """Count the ranks ``shard`` reports for as reported: its own rank, or every rank of
    an in-band reduced summary (``StepSummary.reduced_ranks``)."""
    if shard.reduced_ranks is None:
        ranks.add(shard.rank)
    else:
        ranks.update(shard.reporting_ranks())


def not_yet_counted(
    merged: MergedShards, shard: StepSummary, full_numel: np.ndarray
) -> np.ndarray:
    """Which layer entries of ``shard`` can still be added to stored sums whose pieces are
    unknown (a late rank merged into a stored partial frame).

    Pieces of a parameter are disjoint and together hold ``full_numel`` elements, so an
    entry whose elements no longer fit (``stored numel + shard numel > full numel``) repeats
    a piece already counted: a replica. Exact for DDP (one piece), FSDP and tensor parallel
    (no replicated piece); for HSDP a late replica can be mistaken for a missing shard of
    the same size while the stored frame still misses a piece.

    Args:
        merged: the stored sums over the run's L layers. shard: the late StepSummary or
            MergedFrame. full_numel: int64[L], the parameters' sizes (RunStarted).

    Returns:
        bool[k] aligned with ``shard.layer_indices``.
    """
    idx = np.asarray(shard.layer_indices, np.int64)
    return merged.numel[idx] + np.asarray(shard.numel, np.int64) <= full_numel[idx]


def merge_shard(merged: MergedShards, shard: StepSummary, keep: np.ndarray | None = None) -> None:
    """Merge one validated shard (or MergedFrame) into ``merged`` in place: every
    statistic it carries (:meth:`MergedShards.merge_message`), each exactly mergeable
    (sums add, extremes min/max, counts add; ``schemas.stats``).

    Args:
        merged: the frame's sums so far. shard: a StepSummary or MergedFrame.
        keep: bool[k] aligned with ``shard.layer_indices``: merge only these entries
            (None: all).
    """
    if keep is None or keep.all():
        merged.merge_message(shard)
    elif keep.any():  # some entries are replicas: merge the other layers only
        layers = np.asarray(shard.layer_indices, dtype=np.int64)[keep]
        merged.merge_at(layers, MergedShards.from_message(shard).take(keep))
