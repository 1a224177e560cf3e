"""``missing_ranks``: ``consecutive`` frames in a row finalised without every rank
(partial frames, after the worker's shard timeout).

Values: ``missing_ranks``, ``ranks_seen``, ``world_size``, ``consecutive`` (partial
frames in a row so far).
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
    config_model: ClassVar[type[RuleConfig]] = MissingRanksRuleConfig

    def __init__(self, run: RunContext, config: MissingRanksRuleConfig) -> None:
        super().__init__(run, config)
        self.partial_streak = 0

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Count partial frames in a row; bad from the ``consecutive``-th one."""
        frame = ctx.frame
        k = self.config.consecutive
        self.partial_streak = 0 if frame.complete else self.partial_streak + 1
        if self.partial_streak < k:
            return Finding(False)
        missing = list(frame.missing_ranks)
        return Finding(
            True, [], missing,
            {
                "missing_ranks": missing,
                "ranks_seen": list(frame.ranks_seen),
                "world_size": frame.world_size,
                "consecutive": self.partial_streak,
            },
            f"step {frame.step} finalised without rank(s) {missing} of world size "
            f"{frame.world_size} ({self.partial_streak} partial frame(s) in a row)",
        )
