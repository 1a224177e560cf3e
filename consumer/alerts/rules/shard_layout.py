"""``shard_layout``: the pieces merged into a frame do not fit their parameters
(``GradientFrame.layout_violations``, checked by ``consumer.merge``): the counted pieces of
a layer hold more elements than the parameter, or fewer once every rank reported; a replica
holds another number of elements than the counted piece; a rank cuts a layer into another
number of pieces than the others. Such a frame is stored as partial: its values are not
the statistics of the whole gradient. Critical, because every frame of the run is
affected until the producers are fixed (ranks that disagree on what the parameters are:
per-rank layer lists, a wrapping the producer does not resolve).

Values: ``layers`` (frame values plus ``elements`` and ``expected``: the elements counted
and the parameter's, for the worst layers), ``violations`` (kind -> number of rows; kinds
``numel``, ``replica_numel``, ``shard_count``), ``ranks`` (ranks named by a violation).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from consumer.alerts.rules.base import CriticalRuleConfig, Finding, FrameContext, Rule
from consumer.alerts.rules.shared import preview
from consumer.merge import (
    VIOLATION_KINDS,
    VIOLATION_NUMEL,
    VIOLATION_REPLICA_NUMEL,
    VIOLATION_SHARD_COUNT,
)
from schemas.alert import AlertRule, RuleName


class ShardLayoutRuleConfig(CriticalRuleConfig):
    """Frames whose merged pieces do not fit the parameters' sizes or shard layout.
    Critical: the frame is stored as partial and its values mix or miss pieces."""


class ShardLayoutRule(Rule[ShardLayoutRuleConfig]):
    """Pieces that do not fit their parameter (module doc)."""

    name: ClassVar[RuleName] = AlertRule.SHARD_LAYOUT
    title: ClassVar[str] = "shard layout"
    description: ClassVar[str] = (
        "Pieces merged into a frame that do not fit their parameter's size or shard layout "
        "(the frame is stored as partial)."
    )

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Bad when the frame has layout-violation rows."""
        rows = ctx.frame.layout_violations
        if not len(rows):
            return Finding(False)
        layers, first = np.unique(rows[:, 0], return_index=True)
        names = [str(n) for n in self.run.names[layers]]
        ranks = sorted(set(rows[rows[:, 2] >= 0, 2].tolist()))
        kinds, counts = np.unique(rows[:, 1], return_counts=True)
        got, expected = rows[first, 3], rows[first, 4]
        lead = rows[0]
        return Finding(
            True, names, ranks,
            {
                "layers": ctx.view.layer_values(
                    layers, np.abs(got - expected).astype(np.float64),
                    {"elements": got, "expected": expected}),
                "violations": {VIOLATION_KINDS[int(k)]: int(c)
                               for k, c in zip(kinds, counts, strict=True)},
                "ranks": ranks,
            },
            f"step {ctx.frame.step}: the pieces of {len(names)} layer(s) do not fit their "
            f"parameter ({preview(names)}): {_describe(lead, str(self.run.names[lead[0]]))}; "
            "the frame is stored as partial",
        )


def _describe(row: np.ndarray, name: str) -> str:
    """One violation row (layer, kind, rank, got, expected) in words."""
    kind, rank, got, expected = (int(v) for v in row[1:])
    if kind == VIOLATION_NUMEL:
        return (f"{name}'s pieces hold {got} elements, the parameter {expected} "
                "(RunStarted)")
    if kind == VIOLATION_REPLICA_NUMEL:
        return (f"rank {rank}'s replica of a piece of {name} holds {got} elements, the "
                f"counted replica {expected}")
    if kind == VIOLATION_SHARD_COUNT:
        return (f"rank {rank} cuts {name} into {got} pieces where another rank cuts it into "
                f"{expected}")
    return f"{name}: violation kind {kind}"
