"""``vanishing``: some layer's mean |g| below the run's vanishing threshold in at least
``consecutive`` frames in a row (streak semantics: ``consumer.alerts.rules.streak``; a
NaN/Inf frame keeps a layer's count as it is).

Every layer counts, as in the reference, except those the run health
leaves out explicitly (:attr:`consumer.health_tracker.RunHealthTracker.left_out`: the run's
``ignore_layers``, and, only with the consumer's ``--exclude-rounding-level``, layers with
no gradient by construction so far, ``schemas.rounding``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field

from consumer.alerts.rules.base import FrameContext
from consumer.alerts.rules.streak import StreakRule, StreakRuleConfig
from schemas.alert import AlertRule, RuleName


class VanishingRuleConfig(StreakRuleConfig):
    """Vanishing layers (mean |g| below the run's vanishing threshold). Default 10 frames:
    vanishing is a slow failure, and layers can start small at initialisation."""

    consecutive: int = Field(default=10, ge=1)


class VanishingRule(StreakRule[VanishingRuleConfig]):
    """Layers vanishing for ``consecutive`` frames (module doc)."""

    name: ClassVar[RuleName] = AlertRule.VANISHING
    title: ClassVar[str] = "vanishing layers"
    description: ClassVar[str] = (
        "A layer's mean |g| below the run's vanishing threshold for `consecutive` frames "
        "in a row (layers excluded by the run's ignore_layers excepted)."
    )
    adjective: ClassVar[str] = "vanishing"
    comparison: ClassVar[str] = "mean |g| <"

    def flags(self, ctx: FrameContext) -> np.ndarray:
        """The frame's ``is_vanishing``, minus the layers the run health leaves out."""
        f = ctx.frame
        return f.is_vanishing & ~ctx.tracker.left_out[f.layer_index]

    def order_key(self, ctx: FrameContext) -> np.ndarray:
        """-mean |g|: the smallest first."""
        return -ctx.frame.mean_abs_grad

    def threshold(self) -> float:
        """The run's vanishing threshold."""
        return self.run.info.vanishing_threshold
