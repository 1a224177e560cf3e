"""``run_health``: the run's health (``consumer.health_tracker``) is at least ``level``.

Values: ``layers`` (flagged layers, worst first: most non-finite frames, then exploding,
then vanishing; each with ``exploding_frames``, ``vanishing_frames``,
``nonfinite_frames``), ``health``, ``level``, ``frames``, ``issue_frames``,
``issue_ratio``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from consumer.alerts.rules.base import CriticalRuleConfig, Finding, FrameContext, Rule
from consumer.alerts.rules.shared import json_number
from schemas.alert import AlertRule, RuleName
from schemas.wire import GradientHealth


class RunHealthRuleConfig(CriticalRuleConfig):
    """Run health (the health rule, see ``consumer.health_tracker``) at or above ``level``.
    The default level Critical is the most severe class."""

    level: GradientHealth = GradientHealth.CRITICAL


class RunHealthRule(Rule[RunHealthRuleConfig]):
    """The run's health at or above ``level`` (module doc)."""

    name: ClassVar[RuleName] = AlertRule.RUN_HEALTH
    title: ClassVar[str] = "run health"
    description: ClassVar[str] = "The run's health (consumer.health_tracker) at or above `level`."

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Bad while the tracker's health is at least ``level``."""
        level: GradientHealth = self.config.level
        tracker = ctx.tracker
        health = tracker.health
        if health.severity < level.severity:
            return Finding(False, values={"health": health.value})
        flagged = np.flatnonzero(
            (tracker.exploding_frames > 0) | (tracker.nonfinite_frames > 0)
            | (tracker.vanishing_frames > 0)
        )
        names = [str(n) for n in self.run.names[flagged]]
        ratio = tracker.issue_frames / max(tracker.frames, 1)
        # worst first: most non-finite frames, then exploding, then vanishing frames
        order = np.lexsort((tracker.vanishing_frames[flagged],
                            tracker.exploding_frames[flagged],
                            tracker.nonfinite_frames[flagged]))
        key = np.empty(flagged.size, np.float64)
        key[order] = np.arange(flagged.size)
        return Finding(
            True, names, [],
            {
                "layers": ctx.view.layer_values(flagged, key, {
                    "exploding_frames": tracker.exploding_frames[flagged],
                    "vanishing_frames": tracker.vanishing_frames[flagged],
                    "nonfinite_frames": tracker.nonfinite_frames[flagged],
                }),
                "health": health.value,
                "level": level.value,
                "frames": tracker.frames,
                "issue_frames": tracker.issue_frames,
                "issue_ratio": json_number(ratio),
            },
            f"run health {health.value} at step {ctx.frame.step} (alert level "
            f"{level.value}): {tracker.issue_frames} of {tracker.frames} frames with "
            f"issues ({ratio:.0%}), {int((tracker.exploding_frames > 0).sum())} layer(s) "
            f"exploding, {int((tracker.nonfinite_frames > 0).sum())} non-finite, "
            f"{int((tracker.vanishing_frames > 0).sum())} vanishing",
        )
