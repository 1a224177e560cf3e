"""``stalled``: no new frame of a run for longer than the stall threshold, although not
every rank has finished.

Judged from the worker's poll loop (:meth:`StalledRule.check_idle`) and cleared by each
new frame; an open incident resolves when the run finishes, and sets
``RunStatus.stalled``. The threshold is ``after_s`` when given, otherwise
``max(min_after_s, interval_factor * median interval between the run's last frames)``
(median over the last ``window`` intervals, worker clock).

Values: ``seconds_since_last_frame``, ``threshold_s``, ``median_frame_interval_s`` (None
before two frames), ``last_step``.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

import numpy as np
from pydantic import Field

from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.shared import json_number
from schemas.alert import AlertRule, RuleName


class StalledRuleConfig(RuleConfig):
    """No new frame of a run for a while, although not every rank has finished.

    The threshold is ``after_s`` when given; otherwise it is computed from the run's own
    pace: ``max(min_after_s, interval_factor * median interval between its last frames)``
    (median over the last ``window`` intervals, worker clock), so a run doing one step a
    minute is not declared stalled after ten seconds.

    Attributes:
        after_s: fixed threshold (s), or None for the data-driven one.
        interval_factor: how many median step intervals without a frame make a stall.
        min_after_s: floor of the data-driven threshold (s).
        window: intervals kept per run for the median.
    """

    resolve_after: int = Field(default=1, ge=1)
    after_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    interval_factor: float = Field(default=10.0, gt=1, allow_inf_nan=False)
    min_after_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    window: int = Field(default=32, ge=1)


class StalledRule(Rule[StalledRuleConfig]):
    """A run that stopped sending frames (module doc).

    Attributes:
        intervals: the last ``window`` intervals between frames of new steps (s).
    """

    name: ClassVar[RuleName] = AlertRule.STALLED
    title: ClassVar[str] = "stalled run"
    description: ClassVar[str] = (
        "No frame for `after_s`, or `interval_factor` x the run's median step interval, "
        "although the run has not finished."
    )
    resolves_when_run_finishes: ClassVar[bool] = True
    marks_run_stalled: ClassVar[bool] = True

    def __init__(self, run: RunContext, config: StalledRuleConfig) -> None:
        super().__init__(run, config)
        self.intervals: deque[float] = deque(maxlen=config.window)

    def evaluate(self, ctx: FrameContext) -> Finding:
        """A frame arrived: record its interval; the run is not stalled."""
        if ctx.interval_s is not None:
            self.intervals.append(ctx.interval_s)
        return Finding(False)

    def stall_threshold(self) -> tuple[float, float | None]:
        """(threshold s, median frame interval s or None)."""
        cfg = self.config
        median = float(np.median(np.fromiter(self.intervals, float))) if self.intervals \
            else None
        if cfg.after_s is not None:
            return cfg.after_s, median
        if median is None:
            return cfg.min_after_s, None
        return max(cfg.min_after_s, cfg.interval_factor * median), median

    def check_idle(self, now: float) -> Finding | None:
        """Bad when the run has had no frame for longer than the threshold; None (no
        verdict: only a frame clears a stall) otherwise."""
        run = self.run
        if run.last_frame_at is None or run.last_step is None:
            return None
        idle = now - run.last_frame_at
        threshold, median = self.stall_threshold()
        if idle <= threshold:
            return None
        return Finding(
            True, [], [],
            {
                "seconds_since_last_frame": json_number(idle),
                "threshold_s": json_number(threshold),
                "median_frame_interval_s": None if median is None else json_number(median),
                "last_step": run.last_step,
            },
            f"no frame for {idle:.0f} s after step {run.last_step} (threshold "
            f"{threshold:.0f} s) although the run has not finished",
        )
