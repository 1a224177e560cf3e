"""``missing_ranks``: ``consecutive`` frames in a row finalised without every rank
(partial frames, after the worker's shard timeout, or at once when the missing ranks' data
was refused).

The message says what happened to each missing rank: a rank whose data was refused (its
RunStarted was refused, or its summary of the step was dead-lettered;
``GradientFrame.refused_ranks``) is named with the reason, the others sent nothing for the
step. A frame with every rank but a shard-layout violation is the ``shard_layout`` rule's,
not this one's.

Values: ``missing_ranks``, ``silent_ranks`` (sent nothing), ``refused_ranks`` (rank ->
reason), ``ranks_seen``, ``world_size``, ``consecutive`` (partial frames in a row so far).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from schemas.alert import AlertRule, RuleName


class MissingRanksRuleConfig(RuleConfig):
    """Frames finalised without every rank (partial, after the worker's shard timeout) in
    at least ``consecutive`` frames in a row."""

    consecutive: int = Field(default=1, ge=1)


class MissingRanksRule(Rule[MissingRanksRuleConfig]):
    """Partial frames in a row (module doc).

    Attributes:
        partial_streak: partial frames in a row so far.
    """

    name: ClassVar[RuleName] = AlertRule.MISSING_RANKS
    title: ClassVar[str] = "missing ranks"
    description: ClassVar[str] = (
        "`consecutive` frames in a row finalised without every rank (partial frames)."
    )

    def __init__(self, run: RunContext, config: MissingRanksRuleConfig) -> None:
        super().__init__(run, config)
        self.partial_streak = 0

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Count partial frames in a row; bad from the ``consecutive``-th one."""
        frame = ctx.frame
        k = self.config.consecutive
        self.partial_streak = 0 if frame.all_ranks_seen else self.partial_streak + 1
        if self.partial_streak < k:
            return Finding(False)
        missing = list(frame.missing_ranks)
        refused = {r: why for r, why in frame.refused_ranks.items() if r in missing}
        silent = [r for r in missing if r not in refused]
        what = []
        if silent:
            what.append(f"rank(s) {silent} sent nothing for it")
        what += [f"rank {r}'s data was refused: {why}" for r, why in sorted(refused.items())]
        return Finding(
            True, [], missing,
            {
                "missing_ranks": missing,
                "silent_ranks": silent,
                "refused_ranks": {str(r): why for r, why in sorted(refused.items())},
                "ranks_seen": list(frame.ranks_seen),
                "world_size": frame.world_size,
                "consecutive": self.partial_streak,
            },
            f"step {frame.step} finalised without rank(s) {missing} of world size "
            f"{frame.world_size} ({self.partial_streak} partial frame(s) in a row): "
            + "; ".join(what),
        )
