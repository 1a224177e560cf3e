"""``replica_divergence``: replicas of a piece of some layer disagreed in this frame
(``GradientFrame.replica_divergence``, tolerance ``consumer.merge.REPLICA_RTOL``); names
the layers and the ranks on both sides.

Values: ``layers``, ``diverged_pairs`` (layer name -> sorted ``[rank, reference_rank]``
pairs).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from consumer.alerts.rules.base import CriticalRuleConfig, Finding, FrameContext, Rule
from consumer.alerts.rules.shared import preview
from schemas.alert import AlertRule, RuleName


class ReplicaDivergenceRuleConfig(CriticalRuleConfig):
    """Replicas of one piece of a parameter (DDP ranks, the replicate dimension of HSDP, a
    DTensor ``Replicate`` placement) whose statistics disagree beyond
    ``consumer.merge.REPLICA_RTOL`` in a frame. After an all-reduce they are bitwise
    identical, so any disagreement is a desynchronised replica (a skipped all-reduce,
    non-deterministic kernels after the reduction, a rank that loaded other weights).
    Critical: the ranks no longer train the same model."""


class ReplicaDivergenceRule(Rule[ReplicaDivergenceRuleConfig]):
    """Replicas that disagree after the all-reduce (module doc)."""

    name: ClassVar[RuleName] = AlertRule.REPLICA_DIVERGENCE
    title: ClassVar[str] = "replica divergence"
    description: ClassVar[str] = (
        "Replicas of a layer whose statistics disagree after the all-reduce (a "
        "desynchronised rank)."
    )

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Bad when the frame has replica-divergence rows."""
        rows = ctx.frame.replica_divergence
        if rows.size == 0:
            return Finding(False)
        # unique (layer, rank, reference) rows, sorted by layer then pair: one group per
        # diverged layer, each group's pairs sorted
        unique = np.unique(rows.astype(np.int64), axis=0)
        starts = np.flatnonzero(np.diff(unique[:, 0])) + 1
        layers = unique[np.concatenate(([0], starts)), 0]
        names = [str(n) for n in self.run.names[layers]]
        ranks = sorted(set(rows[:, 1].tolist()) | set(rows[:, 2].tolist()))
        pairs = np.split(unique[:, 1:], starts)
        first = rows[0]
        return Finding(
            True, names, ranks,
            {
                "layers": ctx.view.layer_values(layers, np.zeros(layers.size)),
                "diverged_pairs": {
                    n: p.tolist() for n, p in zip(names, pairs, strict=True)
                },
            },
            f"replicas disagree at step {ctx.frame.step} in {len(names)} layer(s) "
            f"({preview(names)}): rank {int(first[1])} differs from rank {int(first[2])}",
        )
