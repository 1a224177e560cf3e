"""Streak rules (``exploding``, ``vanishing``): some layer flagged by the run's per-layer
flag threshold in at least ``consecutive`` frames in a row.

A frame in which a layer's gradient is non-finite says nothing from its finite part: for
a rule with ``nonfinite_extends`` (exploding) it continues a streak already under way
(Inf/NaN right after |g| > threshold is the divergence going on); otherwise it leaves the
layer's count as it is (a NaN layer has not recovered, and NaN alone is the ``nonfinite``
rule's). Per frame: O(layers) NumPy, no per-layer Python loop.

Values: ``layers`` (worst by the rule's statistic, each with its ``consecutive`` count),
``threshold``, ``consecutive`` (the configured k) and the subclass's extra keys.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import numpy as np
from pydantic import Field

from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.shared import preview


class StreakRuleConfig(RuleConfig):
    """A layer flagged (exploding / vanishing, by the run's flag thresholds) in at least
    ``consecutive`` frames in a row."""

    consecutive: int = Field(default=3, ge=1)


StreakConfigT = TypeVar("StreakConfigT", bound=StreakRuleConfig)


class StreakRule(Rule[StreakConfigT]):
    """Base of the streak rules: per-layer counts of consecutive flagged frames.

    Subclasses set ``adjective`` ("exploding"), ``comparison`` ("max |g| >"),
    ``nonfinite_extends`` and implement :meth:`flags`, :meth:`order_key` and
    :meth:`threshold`; :meth:`origin_values` / :meth:`origin_phrase` add where the
    condition started, when known.

    Attributes:
        streak: int64[L] consecutive flagged frames per layer.
    """

    adjective: ClassVar[str]
    comparison: ClassVar[str]
    nonfinite_extends: ClassVar[bool] = False

    def __init__(self, run: RunContext, config: StreakConfigT) -> None:
        super().__init__(run, config)
        self.streak = np.zeros(run.info.num_layers, np.int64)

    def flags(self, ctx: FrameContext) -> np.ndarray:
        """bool[rows]: the frame's rows flagged by the rule's threshold."""
        raise NotImplementedError(f"{type(self).__name__}.flags")

    def order_key(self, ctx: FrameContext) -> np.ndarray:
        """float[rows]: larger is worse (which layers get values in the event)."""
        raise NotImplementedError(f"{type(self).__name__}.order_key")

    def threshold(self) -> float:
        """The run's threshold of the rule (|g| units)."""
        raise NotImplementedError(f"{type(self).__name__}.threshold")

    def origin_values(self) -> dict[str, Any]:
        """Extra values on where the condition started (default none)."""
        return {}

    def origin_phrase(self) -> str:
        """Message suffix on where the condition started (default none)."""
        return ""

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Advance the streaks with the frame; bad when some layer's streak reaches
        ``consecutive``."""
        f = ctx.frame
        idx = f.layer_index
        k = self.config.consecutive
        streak = self.streak
        finite = f.nonfinite == 0
        # finite layers: +1 when flagged, 0 otherwise. Non-finite layers: an exploding
        # streak goes on (Inf/NaN after |g| > threshold is the explosion continuing), any
        # other count is kept as it is.
        current = streak[idx]
        nonfinite_next = current + 1 if self.nonfinite_extends else current
        nonfinite_next = np.where(current > 0, nonfinite_next, current)
        streak[idx] = np.where(finite, np.where(self.flags(ctx), current + 1, 0),
                               nonfinite_next)
        bad_layers = np.flatnonzero(streak >= k)
        if bad_layers.size == 0:
            return Finding(False)
        names = [str(n) for n in self.run.names[bad_layers]]
        rows = ctx.view.row[bad_layers]
        key = self.order_key(ctx)
        order_key = np.where(rows >= 0, key[np.maximum(rows, 0)], -np.inf)
        threshold = self.threshold()
        return Finding(
            True, names, [],
            {
                "layers": ctx.view.layer_values(
                    bad_layers, order_key, {"consecutive": streak[bad_layers]}
                ),
                "threshold": threshold,
                "consecutive": k,
                **self.origin_values(),
            },
            f"{len(names)} layer(s) {self.adjective} ({self.comparison} {threshold:g}) for "
            f">= {k} consecutive steps at step {f.step}: {preview(names)}"
            f"{self.origin_phrase()}",
        )
