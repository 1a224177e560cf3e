"""``grad_norm_spike``: some layer's gradient norm far above its recent history.

A layer spikes when its ``grad_norm`` (``ln`` of it with ``log_scale``) has a modified
z-score above ``z_threshold`` against that layer's last ``window`` testable frames, once
it has ``min_samples`` of them (``consumer.alerts.robust``), and is at least ``min_ratio``
times that history's median norm. Testable: a finite, positive norm and no non-finite
element. A frame in which a layer of the last spike is not testable neither clears nor
extends the incident. Per frame: O(layers) NumPy, plus the window's medians every
``refresh_frames`` frames.

Values: ``layers`` (worst: largest z; each with ``z``, ``median_grad_norm``, ``ratio``,
``samples``), ``z_threshold``, ``min_ratio``, ``window``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from pydantic import Field, model_validator

from consumer.alerts.robust import RollingRobustZ
from consumer.alerts.rules.base import Finding, FrameContext, Rule, RuleConfig, RunContext
from consumer.alerts.rules.shared import NO_LAYERS, preview
from schemas.alert import AlertRule, RuleName


class SpikeRuleConfig(RuleConfig):
    """A layer's gradient norm far above its recent history (``consumer.alerts.robust``).

    Attributes:
        window: frames of history per layer (rolling).
        min_samples: history needed before a layer is tested.
        z_threshold: modified z-score above which a norm is a spike. 3.5 is the cut-off
            recommended by Iglewicz & Hoaglin (1993), "How to Detect and Handle Outliers".
        min_ratio: the norm must also be at least this many times the layer's median
            norm: statistical unusualness and a practically large change together, like
            the fold-change-plus-significance criterion of volcano plots (2-fold is that
            criterion's conventional cut). Without it, a layer whose norm is very steady
            flags harmless 20% wobbles, and with many layers and a short history the
            z-score alone fires on noise.
        log_scale: test ``ln(grad_norm)`` instead of ``grad_norm`` (gradient norms vary
            multiplicatively: a 10x jump is as notable at 1e-3 as at 1e2).
        refresh_every: frames between recomputations of the window's median and MAD
            (``consumer.alerts.robust.RollingRobustZ``); None = ``max(1, window // 10)``,
            so at most a tenth of the window is newer than the statistics (costs in
            ``bench/README.md``). Nothing is computed before ``min_samples`` frames.
    """

    window: int = Field(default=100, ge=3)
    min_samples: int = Field(default=20, ge=3)
    z_threshold: float = Field(default=3.5, gt=0, allow_inf_nan=False)
    min_ratio: float = Field(default=2.0, ge=1, allow_inf_nan=False)
    log_scale: bool = True
    refresh_every: int | None = Field(default=None, ge=1)

    @property
    def refresh_frames(self) -> int:
        """``refresh_every``, or its default ``max(1, window // 10)``."""
        return self.refresh_every or max(1, self.window // 10)

    @model_validator(mode="after")
    def _samples_fit(self) -> SpikeRuleConfig:
        if self.min_samples > self.window:
            raise ValueError(
                f"min_samples ({self.min_samples}) must not exceed window ({self.window})"
            )
        return self


class GradNormSpikeRule(Rule[SpikeRuleConfig]):
    """Gradient-norm spikes per layer (module doc).

    Attributes:
        history: the layers' rolling norms (``RollingRobustZ``, float64[L, window]).
    """

    name: ClassVar[RuleName] = AlertRule.GRAD_NORM_SPIKE
    title: ClassVar[str] = "gradient-norm spike"
    description: ClassVar[str] = (
        "A layer's gradient norm far above its recent history: robust z-score of ln "
        "grad_norm over a rolling `window`, and at least `min_ratio` times its median."
    )

    def __init__(self, run: RunContext, config: SpikeRuleConfig) -> None:
        super().__init__(run, config)
        self.history = RollingRobustZ(run.info.num_layers, config.window,
                                      config.refresh_frames, config.min_samples)
        self._spiked = NO_LAYERS

    def evaluate(self, ctx: FrameContext) -> Finding:
        """Score the frame's testable layers against their history, then add them to it."""
        cfg = self.config
        f = ctx.frame
        norm = f.grad_norm
        testable = np.isfinite(norm) & (norm > 0) & (f.nonfinite == 0)
        layers = f.layer_index[testable].astype(np.int64)
        with np.errstate(divide="ignore"):
            x = np.log(norm[testable]) if cfg.log_scale else norm[testable]
        z, med, samples = self.history.score(layers, x)
        self.history.push(layers, x)
        with np.errstate(divide="ignore", invalid="ignore"):
            all_ratio = norm[testable] / (np.exp(med) if cfg.log_scale else med)
        hit = (samples >= cfg.min_samples) & (z > cfg.z_threshold) & (all_ratio >= cfg.min_ratio)
        if not hit.any():
            # A layer that spiked and is now non-finite (or absent) has not calmed down:
            # the frame says nothing about it (neither clear nor bad).
            if self._spiked.size and np.isin(self._spiked, layers, invert=True).any():
                return Finding(None)
            self._spiked = NO_LAYERS
            return Finding(False)
        spiking = layers[hit]
        self._spiked = spiking
        median_norm = np.exp(med[hit]) if cfg.log_scale else med[hit]
        names = [str(n) for n in self.run.names[spiking]]
        ratio = all_ratio[hit]
        top = int(np.argmax(z[hit]))
        return Finding(
            True, names, [],
            {
                "layers": ctx.view.layer_values(
                    spiking, z[hit],
                    {"z": z[hit], "median_grad_norm": median_norm, "ratio": ratio,
                     "samples": samples[hit]},
                ),
                "z_threshold": cfg.z_threshold,
                "min_ratio": cfg.min_ratio,
                "window": cfg.window,
            },
            f"gradient-norm spike at step {f.step} in {len(names)} layer(s) "
            f"{preview(names)}: {names[top]} norm {norm[testable][hit][top]:.4g} is "
            f"{ratio[top]:.3g}x its median {median_norm[top]:.4g} over the last "
            f"{int(samples[hit][top])} steps (robust z {z[hit][top]:.3g} > {cfg.z_threshold:g})",
        )
