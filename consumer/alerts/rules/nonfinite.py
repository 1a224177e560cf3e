"""``nonfinite``: any layer of the frame holds NaN/Inf gradient elements.

The ranks are those whose shard of that step counted non-finite elements (seen by
:meth:`NonfiniteRule.note_shard` before the frame). When the producers send the per-rank
local view (every step in ``GradientFrame.local``, or a rank's flight recorder's
``LocalSummary``, :meth:`NonfiniteRule.note_local`), the message also names where it
started: the ranks whose *local* gradient held NaN/Inf at the run's earliest such step
(:class:`LocalOrigin`; under DDP every rank's averaged gradient is NaN, the local view tells
whose was first). A recorder sends its dump before the StepSummary of the step that fired,
so a frame's verdict already knows it when that rank also sends the step's summary.

Values: ``layers`` (worst: most non-finite elements), ``nonfinite_by_rank`` (rank ->
layer names), ``nonfinite_elements``, ``local_origin`` (``{"step", "ranks"}``, when known).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from consumer.alerts.rules.base import (
    CriticalRuleConfig,
    Finding,
    FrameContext,
    Rule,
    RunContext,
)
from consumer.alerts.rules.shared import LocalOrigin, preview
from schemas.alert import AlertRule, RuleName
from schemas.wire import LocalSummary, StepSummary

SHARD_STEPS_PER_RANK = 64
"""Steps with shard notes remembered per rank of the world (oldest dropped first): notes
wait only for their frame, which comes within the worker's shard timeout."""


class NonfiniteRuleConfig(CriticalRuleConfig):
    """Any NaN/Inf gradient element in any layer of a frame (a non-finite gradient
    makes the frame Critical at once, ``consumer.health_tracker``)."""


class NonfiniteRule(Rule[NonfiniteRuleConfig]):
    """NaN/Inf in a frame, with the ranks whose shards held them (module doc)."""

    name: ClassVar[RuleName] = AlertRule.NONFINITE
    title: ClassVar[str] = "non-finite gradients"
    description: ClassVar[str] = "NaN/Inf gradient elements in any layer of a frame."

    def __init__(self, run: RunContext, config: NonfiniteRuleConfig) -> None:
        super().__init__(run, config)
        self.origin = LocalOrigin()
        self._shard_nonfinite: dict[int, dict[int, np.ndarray]] = {}

    def note_shard(self, shard: StepSummary) -> None:
        """Remember the layers (int64[k]) in which ``shard`` counted non-finite elements,
        until that step's frame is evaluated; at most ``world_size *``
        :data:`SHARD_STEPS_PER_RANK` steps are kept. One pass over a finite shard's
        ``nonfinite`` counts, nothing stored. A summary reduced in-band over several ranks
        (``reduced_ranks``) does not say which rank held them: it names none (the ranks'
        flight recorders do)."""
        if shard.reduced_ranks is not None:
            return
        nonfinite = np.asarray(shard.nonfinite)
        if not np.count_nonzero(nonfinite):  # a finite shard: one cheap pass
            return
        bad = nonfinite > 0
        layers = np.asarray(shard.layer_indices, np.int64)[bad]
        by_rank = self._shard_nonfinite.setdefault(shard.step, {})
        earlier = by_rank.get(shard.rank)  # a summary split into parts: union of the parts
        by_rank[shard.rank] = layers if earlier is None else np.union1d(earlier, layers)
        if len(self._shard_nonfinite) > SHARD_STEPS_PER_RANK * self.run.info.world_size:
            self._shard_nonfinite.pop(next(iter(self._shard_nonfinite)))

    def note_local(self, local: LocalSummary) -> None:
        """Learn where NaN/Inf started from a flight recorder's entry: the rank, at the
        entry's step, when some layer of its local gradient held NaN/Inf."""
        if (np.asarray(local.local_nonfinite) > 0).any():
            self.origin.update(local.step, np.array([local.rank]))

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Bad when any row of the frame counts non-finite elements."""
        f = ctx.frame
        local = f.local
        if local is not None and len(local) > 0:
            self.origin.update(f.step, local.rank[local.nonfinite > 0])
        notes = self._shard_nonfinite.pop(f.step, {})
        for rank in np.unique(f.nonfinite_pieces[:, 0]).tolist():  # carried by the frame
            layers = f.nonfinite_pieces[f.nonfinite_pieces[:, 0] == rank, 1]
            notes[rank] = layers if rank not in notes else np.union1d(notes[rank], layers)
        rows = np.flatnonzero(f.nonfinite > 0)
        if rows.size == 0:
            return Finding(False)
        names_all = self.run.names
        layers = f.layer_index[rows].astype(np.int64)
        names = [str(n) for n in names_all[layers]]
        ranks = sorted(notes)
        by_rank = {
            str(rank): [str(n) for n in names_all[np.sort(notes[rank])]] for rank in ranks
        }
        total = int(f.nonfinite[rows].sum())
        on = f"on rank(s) {ranks}" if ranks else "(ranks unknown)"
        return Finding(
            True, names, ranks,
            {
                "layers": ctx.view.layer_values(layers, f.nonfinite[rows].astype(np.float64)),
                "nonfinite_by_rank": by_rank,
                "nonfinite_elements": total,
                **self.origin.values(),
            },
            f"non-finite gradients (NaN/Inf) at step {f.step}: {total} element(s) in "
            f"{len(names)} layer(s) {preview(names)} {on}"
            f"{self.origin.phrase('NaN/Inf')}",
        )
