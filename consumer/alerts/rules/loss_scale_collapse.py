"""``loss_scale_collapse``: the AMP loss scale keeps backing off, or has fallen below
``min_scale``.

Dynamic loss scaling (PyTorch ``torch.amp.GradScaler``; Megatron's ``DynamicGradScaler``
works the same way) multiplies the loss by a scale before the backward pass so that small
fp16 gradients do not underflow. On a step whose scaled gradients hold inf/NaN the
optimiser step is skipped and the scale is multiplied by ``backoff_factor`` (0.5 by
default); after ``growth_interval`` (2000 by default) consecutive steps without inf/NaN it
is multiplied by ``growth_factor`` (2.0). The GradScaler documentation says that the first
iterations back off while the scale calibrates from ``init_scale`` (2**16), and that
afterwards "step skipping should occur rarely (once every few hundred or thousand
iterations)".

The rule reads the ``loss_scale`` step scalar (``schemas.scalars.LOSS_SCALE``) of frames in
increasing step order. A *backoff* is a frame whose scale is lower than the previous
frame's; a *growth* one whose scale is higher. The condition holds at step ``s`` when

- at least ``backoffs`` backoffs happened at steps in ``(s - within_steps, s]``, counting
  only those after the run's first growth when ``skip_calibration`` (the descent from
  ``init_scale`` at the start of a run is GradScaler's calibration, not a collapse), or
- the scale is below ``min_scale``.

With frames sent every step, backoffs are GradScaler's; with frames sent every few steps,
several backoffs between two frames count as one, so the count is a lower bound. A frame
without a finite loss scale (no scalars, bf16 / fp32 training without a scaler, or a
non-finite value), or of a step not newer than the newest one seen, cannot be judged:
``Finding(None)``. Per frame: O(1) (the backoff steps kept are at most those within
``within_steps``).

Values: ``loss_scale``, ``previous_scale`` (the scale of the previous frame),
``backoffs`` (counted within the window), ``backoff_steps`` (their steps, ascending),
``within_steps``, ``backoffs_threshold``, ``min_scale``, ``calibrated`` (a growth has been
seen).
"""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

from pydantic import Field

from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.shared import preview
from schemas.alert import AlertRule, RuleName
from schemas.scalars import LOSS_SCALE


class LossScaleCollapseRuleConfig(RuleConfig):
    """The AMP loss scale backing off ``backoffs`` times within ``within_steps`` steps,
    or below ``min_scale``.

    Attributes:
        backoffs: backoffs (scale decreases) within the window that make the condition
            (k). 3: with GradScaler's defaults (growth 2.0, backoff 0.5) a calibrated
            scale grows at most once per ``growth_interval`` clean steps, so a healthy run
            sees about one backoff per growth interval (the scale hovering at the largest
            value that does not overflow); three within one interval means at most one
            growth against three halvings, a net fall of the scale by at least 4x
            (2 * 0.5**3): inf/NaN gradients are becoming more frequent.
        within_steps: the window, in steps (n). 2000: GradScaler's default
            ``growth_interval``, the period over which a healthy scale rises and falls
            once (set it to your scaler's ``growth_interval``).
        min_scale: a scale below this holds by itself. 1.0: at scale 1 the scaled
            gradients are the gradients themselves; a scaler backing off below 1 is
            reacting to gradients that overflow fp16's largest finite value (65504) even
            unscaled, or to NaN that no scale removes: the run is diverging.
        skip_calibration: do not count backoffs before the run's first growth (GradScaler
            documents that the first iterations back off while the scale calibrates from
            ``init_scale``). A run whose frames start after its first growth (a resumed
            run, a consumer started late) is counted from its first observed growth on;
            ``min_scale`` holds from the first frame.
    """

    backoffs: int = Field(default=3, ge=1)
    within_steps: int = Field(default=2000, ge=1)
    min_scale: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    skip_calibration: bool = True


class LossScaleCollapseRule(Rule[LossScaleCollapseRuleConfig]):
    """AMP loss-scale backoffs in a row of steps, or a scale below ``min_scale`` (module
    doc).

    Attributes:
        newest_step: the newest step with a finite loss scale, or None.
        scale: its loss scale.
        calibrated: a growth of the scale has been seen.
        backoff_steps: steps of the counted backoffs within the window, ascending.
    """

    name: ClassVar[RuleName] = AlertRule.LOSS_SCALE_COLLAPSE
    title: ClassVar[str] = "loss-scale collapse"
    description: ClassVar[str] = (
        "The AMP loss scale backed off (decreased) at least `backoffs` times within "
        "`within_steps` steps, or fell below `min_scale`."
    )

    def __init__(self, run: RunContext, config: LossScaleCollapseRuleConfig) -> None:
        super().__init__(run, config)
        self.newest_step: int | None = None
        self.scale: float | None = None
        self.calibrated = False
        self.backoff_steps: deque[int] = deque()

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Compare the frame's loss scale with the previous frame's; bad when the backoffs
        within the window reach ``backoffs`` or the scale is below ``min_scale``."""
        cfg = self.config
        f = ctx.frame
        scale = f.scalars.get(LOSS_SCALE)
        if scale is None or not math.isfinite(scale):
            return Finding(None)
        if self.newest_step is not None and f.step <= self.newest_step:
            return Finding(None)  # an older step: the order of the changes is unknown
        previous = self.scale
        if previous is not None:
            if scale > previous:
                self.calibrated = True
            elif scale < previous and (self.calibrated or not cfg.skip_calibration):
                self.backoff_steps.append(f.step)
        self.newest_step, self.scale = f.step, scale
        while self.backoff_steps and self.backoff_steps[0] <= f.step - cfg.within_steps:
            self.backoff_steps.popleft()
        count = len(self.backoff_steps)
        collapsing = count >= cfg.backoffs
        below = scale < cfg.min_scale
        if not (collapsing or below):
            return Finding(False)
        why = []
        if collapsing:
            steps = [str(s) for s in self.backoff_steps]
            why.append(f"backed off {count} times within the last {cfg.within_steps} steps "
                       f"(at steps {preview(steps)})")
        if below:
            why.append(f"is below min_scale {cfg.min_scale:g}")
        return Finding(
            True, [], [],
            {
                "loss_scale": scale,
                "previous_scale": previous,
                "backoffs": count,
                "backoff_steps": list(self.backoff_steps),
                "within_steps": cfg.within_steps,
                "backoffs_threshold": cfg.backoffs,
                "min_scale": cfg.min_scale,
                "calibrated": self.calibrated,
            },
            f"AMP loss scale {scale:g} at step {f.step} " + " and ".join(why)
            + ": inf/NaN gradients keep forcing skipped optimiser steps",
        )
