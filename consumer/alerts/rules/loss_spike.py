"""``loss_spike``: the step's training loss far from its recent history, with the layers
whose gradient norm spiked at or before that step, earliest first.

The loss is ``GradientFrame.scalars["loss"]`` (the mean of the ranks' losses,
``schemas.scalars``). It spikes when its modified z-score (Iglewicz & Hoaglin, median and
MAD; ``consumer.alerts.robust``) against the run's last ``window`` finite losses, once there
are ``min_history`` of them, is above ``z_threshold`` (``direction="up"``, the default),
below ``-z_threshold`` (``"down"``) or either (``"both"``). A non-finite loss is the
``nonfinite_loss`` rule's: it is neither judged nor added to the window (``Finding(None)``).
A loss at the end of a flat, identical history has an infinite z-score for any change
(``consumer.alerts.robust``), so any rise of it is a spike.

Where it came from: on every frame, each layer's ``ln grad_norm`` is scored against that
layer's own last ``window`` testable values (a finite, positive norm without non-finite
elements, as in ``grad_norm_spike``), once it has ``min_history`` of them; a layer whose
z-score is above ``layer_z_threshold`` has a gradient spike at that step. The rule keeps
those z-scores for the last ``lookback_steps + 1`` steps (a ring of [lookback_steps + 1, L]
float64) and, when the loss spikes at step ``s``, names the layers that spiked at a step in
``[s - lookback_steps, s]``, ordered by the first such step (earliest first; ties in model
order). The finding's ``layers`` are in that order, not in model order: which layer went
first is the point of the alert. No such layer: the message says so (the loss spiked
without a gradient spike, e.g. a bad batch or a data-loading change).

Cost: a run whose frames never carry a loss costs one dictionary lookup per frame and
allocates nothing; from its first frame with a loss on, every frame is O(layers) NumPy
(no per-layer Python loop) plus the layers' window statistics every ``refresh_frames``
frames, and the loss's, O(window), on frames with a finite loss.

Values: ``loss``, ``z``, ``median`` (of the window), ``samples`` (losses in the window),
``direction``, ``z_threshold``, ``window``, ``layers_spiked_first`` (names, earliest
first), ``first_spike_step`` (the earliest of their spike steps, None when none spiked),
``lookback_steps``, ``layers`` (the frame's values of at most ``max_layer_values`` of those
layers, the earliest, each with ``spike_step`` and ``spike_z``).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from consumer.alerts.robust import RollingRobustZ
from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.shared import json_number, preview
from consumer.frames import GradientFrame
from schemas.alert import AlertRule, RuleName
from schemas.scalars import LOSS

_ONE_SERIES = np.zeros(1, np.int64)
"""int64[1]: the row of the loss in its one-row :class:`RollingRobustZ`."""
_NEVER = np.iinfo(np.int64).max
"""Stands for "no spike" in a minimum over spike steps."""


class LossSpikeRuleConfig(RuleConfig):
    """The training loss far from its recent history, with the layers whose gradient
    norm spiked first.

    Attributes:
        window: steps of history (finite losses; per layer, testable gradient norms).
        min_history: history needed before the loss (or a layer) is tested.
        z_threshold: modified z-score beyond which the loss spikes. 5: the loss is one
            series tested once per step, so the threshold sets the false-alarm rate of a
            whole run. For Gaussian noise P(Z > 5) = 2.9e-7 with an exactly known sigma;
            against a window of 100 (sigma estimated from the MAD) 200 000 steps of
            standard normal noise scored by ``RollingRobustZ`` exceeded 5 once (5e-6 per
            step) and Iglewicz & Hoaglin's 3.5 (which ``grad_norm_spike`` combines with a
            second criterion) 144 times (7.2e-4 per step: one false alarm every ~1400
            steps of a steady noisy loss).
        direction: ``"up"`` (a rise: the loss spikes of unstable training), ``"down"``
            or ``"both"``.
        lookback_steps: how many steps before the loss spike a layer's gradient spike
            still counts as its cause. 5: a gradient spike shows in the loss of the same
            step (a bad batch raises both) or, through the update it causes, of the next
            steps; Adam's normalisation by the running second moment can delay the
            effect by a few steps, beyond which a coincidence is more likely.
        layer_z_threshold: modified z-score of a layer's ``ln grad_norm`` above which the
            layer spiked. 3.5: the outlier cut-off recommended by Iglewicz & Hoaglin
            (1993), as in ``grad_norm_spike``; it only names suspects of a loss spike
            already detected, so it may be more sensitive than the loss's own threshold.
        refresh_every: frames between recomputations of the layers' window statistics
            (``consumer.alerts.robust.RollingRobustZ``); None = ``max(1, window // 10)``,
            as in ``grad_norm_spike``. The loss's statistics are exact on every frame.
    """

    window: int = Field(default=100, ge=3)
    min_history: int = Field(default=20, ge=3)
    z_threshold: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    direction: Literal["up", "down", "both"] = "up"
    lookback_steps: int = Field(default=5, ge=0)
    layer_z_threshold: float = Field(default=3.5, gt=0, allow_inf_nan=False)
    refresh_every: int | None = Field(default=None, ge=1)

    @property
    def refresh_frames(self) -> int:
        """``refresh_every``, or its default ``max(1, window // 10)``."""
        return self.refresh_every or max(1, self.window // 10)

    @model_validator(mode="after")
    def _history_fits(self) -> LossSpikeRuleConfig:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history ({self.min_history}) must not exceed window ({self.window})"
            )
        return self


class LossSpikeRule(Rule[LossSpikeRuleConfig]):
    """Loss spikes, named by the layers whose gradient spiked first (module doc).

    Attributes:
        loss_history: the run's rolling finite losses (one-row ``RollingRobustZ``), None
            until a frame carries a loss.
        layer_history: the layers' rolling ``ln grad_norm`` (``RollingRobustZ``, [L,
            window]), None until a frame carries a loss.
        spike_z: float64[lookback_steps + 1, L], each layer's z-score at the step of the
            row when it spiked, NaN otherwise (row ``step % (lookback_steps + 1)``).
        spike_row_step: int64[lookback_steps + 1], the step of each row (-1: none yet).
    """

    name: ClassVar[RuleName] = AlertRule.LOSS_SPIKE
    title: ClassVar[str] = "loss spike"
    description: ClassVar[str] = (
        "The training loss far from its recent history (robust z-score over a rolling "
        "`window`), naming the layers whose gradient norm spiked first within "
        "`lookback_steps` before it."
    )

    def __init__(self, run: RunContext, config: LossSpikeRuleConfig) -> None:
        super().__init__(run, config)
        self.loss_history: RollingRobustZ | None = None
        self.layer_history: RollingRobustZ | None = None
        self.spike_z = np.empty((0, 0))
        self.spike_row_step = np.empty(0, np.int64)

    def _start(self) -> tuple[RollingRobustZ, RollingRobustZ]:
        """Allocate the run's state (on its first frame with a loss); returns the loss's
        and the layers' histories."""
        cfg = self.config
        rows = cfg.lookback_steps + 1
        self.loss_history = RollingRobustZ(1, cfg.window, 1, cfg.min_history)
        self.layer_history = RollingRobustZ(self.run.info.num_layers, cfg.window,
                                            cfg.refresh_frames, cfg.min_history)
        self.spike_z = np.full((rows, self.run.info.num_layers), np.nan)
        self.spike_row_step = np.full(rows, -1, np.int64)
        return self.loss_history, self.layer_history

    def _note_layer_spikes(self, history: RollingRobustZ, f: GradientFrame) -> None:
        """Score the frame's testable layers against their ``history``, add them to it,
        and record the spiking ones in the ring row of ``f.step``."""
        cfg = self.config
        norm = f.grad_norm
        testable = np.isfinite(norm) & (norm > 0) & (f.nonfinite == 0)
        layers = f.layer_index[testable].astype(np.int64)
        x = np.log(norm[testable])
        z, _, samples = history.score(layers, x)
        history.push(layers, x)
        row = f.step % len(self.spike_row_step)
        if self.spike_row_step[row] > f.step:
            return  # an old step, outside the lookback of every newer one
        if self.spike_row_step[row] != f.step:
            self.spike_z[row] = np.nan
            self.spike_row_step[row] = f.step
        hit = (samples >= cfg.min_history) & (z > cfg.layer_z_threshold)
        self.spike_z[row, layers[hit]] = z[hit]

    def _spiked_first(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layers that spiked at a step in ``[step - lookback_steps, step]``.

        Returns:
            (layers int64[k] ordered by first spike step then model order, their first
            spike steps int64[k], their z-scores at that step float64[k]).
        """
        rows = np.flatnonzero((self.spike_row_step >= step - self.config.lookback_steps)
                              & (self.spike_row_step <= step) & (self.spike_row_step >= 0))
        spiked = ~np.isnan(self.spike_z[rows])                      # [r, L]
        steps = np.where(spiked, self.spike_row_step[rows][:, None], _NEVER)
        first_row = np.argmin(steps, axis=0) if rows.size else np.zeros(0, np.int64)
        first = steps[first_row, np.arange(steps.shape[1])] if rows.size else first_row
        layers = np.flatnonzero(first != _NEVER)
        layers = layers[np.lexsort((layers, first[layers]))]
        z = self.spike_z[rows[first_row[layers]], layers]
        return layers, first[layers], z

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Track the layers' gradient spikes, then test the frame's loss against its
        window (and add it); bad when it spikes in the configured direction."""
        cfg = self.config
        f = ctx.frame
        loss = f.scalars.get(LOSS)
        if self.loss_history is None or self.layer_history is None:
            if loss is None:
                return Finding(None)
            loss_history, layer_history = self._start()
        else:
            loss_history, layer_history = self.loss_history, self.layer_history
        self._note_layer_spikes(layer_history, f)
        if loss is None or not math.isfinite(loss):
            return Finding(None)
        value = np.array([loss], np.float64)
        z_all, med_all, samples_all = loss_history.score(_ONE_SERIES, value)
        loss_history.push(_ONE_SERIES, value)
        z, med, samples = float(z_all[0]), float(med_all[0]), int(samples_all[0])
        spike = {"up": z > cfg.z_threshold, "down": z < -cfg.z_threshold,
                 "both": abs(z) > cfg.z_threshold}[cfg.direction]
        if samples < cfg.min_history or not spike:
            return Finding(False)
        layers, first_step, layer_z = self._spiked_first(f.step)
        names = [str(n) for n in self.run.names[layers]]
        side = "above" if z > 0 else "below"
        head = (f"loss {'spike' if z > 0 else 'drop'} at step {f.step}: loss {loss:.4g} is "
                f"{abs(z):.3g} robust sigma {side} its median {med:.4g} over the last "
                f"{samples} steps (threshold {cfg.z_threshold:g})")
        if names:
            shown = [f"{n} (step {s})" for n, s in zip(names, first_step.tolist(), strict=True)]
            tail = f"; gradient norm spiked first in {preview(shown)}"
        else:
            tail = (f"; no layer's gradient norm spiked in steps "
                    f"{f.step - cfg.lookback_steps}..{f.step}: the loss moved without a "
                    f"gradient spike")
        return Finding(
            True, names, [],
            {
                "loss": json_number(loss),
                "z": json_number(z),
                "median": json_number(med),
                "samples": samples,
                "direction": cfg.direction,
                "z_threshold": cfg.z_threshold,
                "window": cfg.window,
                "layers_spiked_first": names,
                "first_spike_step": int(first_step[0]) if names else None,
                "lookback_steps": cfg.lookback_steps,
                "layers": ctx.view.layer_values(
                    layers, -first_step.astype(np.float64),
                    {"spike_step": first_step, "spike_z": layer_z},
                ),
            },
            head + tail,
        )
