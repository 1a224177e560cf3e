"""``exploding``: some layer's max |g| above the run's exploding threshold in at least
``consecutive`` frames in a row (streak semantics: ``consumer.alerts.rules.streak``; a
NaN/Inf frame continues a streak under way).

The message names the ranks whose local gradient first had max |g| above the threshold or
NaN/Inf, when the producers send the local view (``local_origin`` in the values): every
step inside the frames, or a rank's flight recorder's ``LocalSummary`` (:meth:`note_local`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from consumer.alerts.rules.base import Finding, FrameContext, RunContext
from consumer.alerts.rules.shared import LocalOrigin
from consumer.alerts.rules.streak import StreakRule, StreakRuleConfig
from schemas.alert import AlertRule, RuleName
from schemas.wire import LocalSummary


class ExplodingRuleConfig(StreakRuleConfig):
    """Exploding layers (max |g| above the run's exploding threshold). Default 3 frames: a
    single step above the threshold is common right after a learning-rate change; three in
    a row is a trend."""

    consecutive: int = Field(default=3, ge=1)


class ExplodingRule(StreakRule[ExplodingRuleConfig]):
    """Layers exploding for ``consecutive`` frames (module doc)."""

    name: ClassVar[RuleName] = AlertRule.EXPLODING
    title: ClassVar[str] = "exploding layers"
    description: ClassVar[str] = (
        "A layer's max |g| above the run's exploding threshold for `consecutive` frames "
        "in a row."
    )
    adjective: ClassVar[str] = "exploding"
    comparison: ClassVar[str] = "max |g| >"
    nonfinite_extends: ClassVar[bool] = True

    def __init__(self, run: RunContext, config: ExplodingRuleConfig) -> None:
        super().__init__(run, config)
        self.origin = LocalOrigin()

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Update where the explosion started (local rows with NaN/Inf or max |g| above
        the threshold: the report's ``first_bad_local_step`` criterion), then advance the
        streaks (:meth:`StreakRule.evaluate`)."""
        local = ctx.frame.local
        if local is not None and len(local) > 0:
            bad = (local.nonfinite > 0) | (local.max_abs > self.run.info.exploding_threshold)
            self.origin.update(ctx.frame.step, local.rank[bad])
        return super().evaluate(ctx)

    def note_local(self, local: LocalSummary) -> None:
        """Update where the explosion started from a flight recorder's entry (NaN/Inf or a
        max |g| above the threshold in some layer of the rank's local gradient)."""
        bad = ((np.asarray(local.local_nonfinite) > 0)
               | (np.asarray(local.local_max_abs) > self.run.info.exploding_threshold))
        if bad.any():
            self.origin.update(local.step, np.array([local.rank]))

    def flags(self, ctx: FrameContext) -> np.ndarray:
        """The frame's ``is_exploding``, minus the layers excluded by the run's
        ``ignore_layers`` (:attr:`consumer.health_tracker.RunHealthTracker.excluded`)."""
        f = ctx.frame
        return f.is_exploding & ~ctx.tracker.excluded[f.layer_index]

    def order_key(self, ctx: FrameContext) -> np.ndarray:
        """max |g|: the largest first."""
        return ctx.frame.max_abs_grad

    def threshold(self) -> float:
        """The run's exploding threshold."""
        return self.run.info.exploding_threshold

    def origin_values(self) -> dict[str, Any]:
        """``local_origin`` (``{"step", "ranks"}``) when known."""
        return self.origin.values()

    def origin_phrase(self) -> str:
        """``"; max |g| > 1000 or NaN/Inf first in rank 1's local gradient at step 7"``."""
        return self.origin.phrase(f"max |g| > {self.threshold():g} or NaN/Inf")
