"""Building real frames for the alert tests: per-rank gradients -> StepSummary shards ->
the consumer's own merge (MergedShards) and frame computation (compute_frame)."""

from __future__ import annotations

import numpy as np

from consumer.alerts.config import AlertRulesBase, load_alert_rules
from consumer.alerts.engine import AlertEngine
from consumer.alerts.rules import rule_names
from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.health_tracker import RunHealthTracker
from consumer.runs import RunInfo
from schemas.alert import Alert, AlertRule, AlertState
from schemas.wire import StepSummary

LAYERS = ("embed", "attn.q", "ffn.out", "head")
NUMEL = 32  # elements per layer per rank


def shard(run_id: str, step: int, rank: int, world: int,
          grads: dict[str, np.ndarray]) -> StepSummary:
    """A rank's StepSummary of ``grads`` (sums over the finite elements, NaN/Inf counted)."""
    names = list(grads)
    idx = [LAYERS.index(n) for n in names]
    finite = [g[np.isfinite(g)].astype(np.float64) for g in grads.values()]
    return StepSummary(
        run_id=run_id, step=step, rank=rank, world_size=world, wall_time=1.7e9 + step,
        layer_indices=idx, numel=[g.size for g in grads.values()],
        sum_abs=[float(np.abs(f).sum()) for f in finite],
        sum_sq=[float((f * f).sum()) for f in finite],
        max_abs=[float(np.abs(f).max()) if f.size else 0.0 for f in finite],
        nonfinite=[int(g.size - f.size) for g, f in zip(grads.values(), finite, strict=True)],
    )


class Run:
    """One run fed step by step to an AlertEngine, the way a worker does it."""

    def __init__(self, engine: AlertEngine, world: int = 2, run_id: str = "run-1",
                 max_frames: int = 0, seed: int = 0) -> None:
        self.engine = engine
        self.world = world
        self.info = RunInfo(run_id, world, LAYERS, np.full(len(LAYERS), NUMEL * world),
                            1e-7, 1e3)
        self.tracker = RunHealthTracker(len(LAYERS), max_frames)
        self.rng = np.random.default_rng(seed)
        self.events: list[Alert] = []

    def grads(self, scale: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """Healthy gradients (|g| ~ 1e-2), some layers scaled by ``scale``."""
        scale = scale or {}
        return {n: (self.rng.standard_normal(NUMEL) * 1e-2 * scale.get(n, 1.0))
                for n in LAYERS}

    def step(self, step: int, *, scale: dict[str, float] | None = None,
             nan: dict[int, list[str]] | None = None, ranks: list[int] | None = None,
             now: float | None = None) -> list[Alert]:
        """Feed one step: every rank's shard (``nan``: rank -> layers with a NaN), merged
        into a frame over ``ranks`` (default all), then health and alerts."""
        merged = MergedShards.empty(len(LAYERS))
        seen = list(range(self.world)) if ranks is None else ranks
        wall = 0.0
        for rank in seen:
            g = self.grads(scale)
            for name in (nan or {}).get(rank, []):
                g[name][3] = np.nan
            msg = shard(self.info.run_id, step, rank, self.world, g)
            self.engine.note_shard(self.info, msg)
            merged.add(np.asarray(msg.layer_indices), np.asarray(msg.numel),
                       np.asarray(msg.sum_abs), np.asarray(msg.sum_sq),
                       np.asarray(msg.max_abs), np.asarray(msg.nonfinite))
            wall = msg.wall_time
        frame = compute_frame(self.info.run_id, step, merged, vanishing_threshold=1e-7,
                              exploding_threshold=1e3, ranks_seen=tuple(seen),
                              world_size=self.world, wall_time=wall)
        return self.feed(frame, now)

    def feed(self, frame: GradientFrame, now: float | None = None) -> list[Alert]:
        """Update the health tracker with ``frame`` and evaluate it."""
        self.tracker.update(frame.step, frame.layer_index, frame.is_vanishing,
                            frame.is_exploding, frame.nonfinite)
        out = self.engine.on_frame(frame, self.info, self.tracker,
                                   now=float(frame.step) if now is None else now)
        self.events.extend(out)
        return out

    def of(self, rule: AlertRule | str) -> list[Alert]:
        """Events of one rule so far."""
        return [e for e in self.events if e.rule == rule]


def only(rule: str, **fields: object) -> AlertRulesBase:
    """Rules with only ``rule`` enabled (of the registered rules), with ``fields`` set on
    it."""
    overrides = [f"{name}.enabled=false" for name in rule_names() if name != rule]
    overrides += [f"{rule}.{k}={v}" for k, v in fields.items()]
    return load_alert_rules(None, overrides)


def states(events: list[Alert]) -> list[tuple[str, int]]:
    """(state, step) of each event."""
    return [(e.state.value, e.step) for e in events]


FIRING, RESOLVED = AlertState.FIRING.value, AlertState.RESOLVED.value
