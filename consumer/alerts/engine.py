"""AlertEngine: every run's rules and incidents, fed frame by frame by a worker.

The worker calls :meth:`AlertEngine.note_shard` for each validated StepSummary (so the
engine knows which rank's shard held NaN/Inf), :meth:`AlertEngine.on_frame` for each
finalised frame (after the run's health tracker has seen it) and :meth:`AlertEngine.tick`
from its poll loop (stalled runs, finished runs). Each returns the alert events it caused;
:meth:`AlertEngine.take_statuses` returns the run-status records for the alerts topic.

Which frames are evaluated: every frame in arrival order, except a frame rewritten by a
late shard (a step this engine already saw as partial): its step has been evaluated, and
the late rank's later steps will be. Cost per frame: O(layers) NumPy, plus
O(layers x window) for the spike rule's medians.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from consumer.alerts.config import AlertRulesConfig
from consumer.alerts.incident import ActiveIncident, Incident, Transition
from consumer.alerts.rules import Finding, RunRules, preview
from consumer.frames import GradientFrame
from consumer.health import RunHealthTracker
from consumer.runs import RunInfo
from schemas.alert import Alert, AlertRule, AlertState, RunStatus
from schemas.wire import GradientHealth, StepSummary

RULE_TITLES: dict[AlertRule, str] = {
    AlertRule.RUN_HEALTH: "run health",
    AlertRule.NONFINITE: "non-finite gradients",
    AlertRule.EXPLODING: "exploding layers",
    AlertRule.VANISHING: "vanishing layers",
    AlertRule.GRAD_NORM_SPIKE: "gradient-norm spike",
    AlertRule.STALLED: "stalled run",
    AlertRule.MISSING_RANKS: "missing ranks",
    AlertRule.REPLICA_DIVERGENCE: "replica divergence",
}
"""Short human names of the rules (messages, terminal views)."""

PARTIAL_STEPS_KEPT = 4096
"""Partial steps remembered per run to recognise their rewrites (oldest forgotten first;
the same bound as the merger's cache of partial sums)."""


@dataclass(slots=True)
class EngineCounters:
    """Totals since start: frames evaluated / skipped (rewrites), events fired / resolved."""

    frames: int = 0
    skipped: int = 0
    fired: int = 0
    resolved: int = 0


@dataclass(slots=True)
class _LastFrame:
    step: int
    world_size: int
    health: GradientHealth
    frames: int
    ranks_seen: list[int]
    wall_time: float


class AlertEngine:
    """Evaluates the alert rules of every run a worker sees.

    Args:
        rules: the rule configuration.
        status_interval_s: at most one routine RunStatus per run per this many seconds
            (transitions always publish one).
        is_finished: run id -> whether every rank of the run has finished (the worker's
            knowledge); finished runs are no longer checked for stalls.
        clock: monotonic clock (s) used when ``now`` is not given.
        wall_clock: unix time (s) for ``created_at`` / ``emitted_at``.
    """

    def __init__(
        self,
        rules: AlertRulesConfig,
        *,
        status_interval_s: float = 1.0,
        is_finished: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.rules = rules
        self.status_interval_s = status_interval_s
        self._is_finished = is_finished or (lambda _run_id: False)
        self._clock = clock
        self._wall = wall_clock
        self._runs: dict[str, RunRules] = {}
        self._incidents: dict[tuple[str, AlertRule], Incident] = {}
        self._partial: dict[str, OrderedDict[int, None]] = {}
        self._finished: set[str] = set()
        self._last: dict[str, _LastFrame] = {}
        self._last_status: dict[str, float] = {}
        self._statuses: list[RunStatus] = []
        self.counters = EngineCounters()

    # -- inputs --------------------------------------------------------------------------

    def restore(self, active: list[ActiveIncident]) -> None:
        """Re-open incidents fired before a restart (their last stored event is
        ``firing``), so they are not fired twice and still resolve. Their count of clear
        frames starts again at zero: a restart can delay a resolution, never repeat a
        firing."""
        for a in active:
            self._incident(a.run_id, a.rule).restore(a.incident_id, a.first_step,
                                                     a.layers, a.ranks)

    def note_shard(self, run: RunInfo, shard: StepSummary) -> None:
        """Remember the layers in which ``shard`` counted non-finite elements (nothing to
        do for a finite shard: one pass over its ``nonfinite`` list)."""
        if not any(shard.nonfinite):
            return
        bad = np.asarray(shard.nonfinite) > 0
        layers = np.asarray(shard.layer_indices, np.int64)[bad]
        self._state(run).note_shard(shard.step, shard.rank, layers)

    def on_frame(
        self, frame: GradientFrame, run: RunInfo, tracker: RunHealthTracker,
        now: float | None = None,
    ) -> list[Alert]:
        """Evaluate the rules on a finalised frame.

        Args:
            frame: the frame (complete or partial, possibly a rewrite).
            run: its run. tracker: the run's health tracker, already updated with it.
            now: monotonic time (s) of arrival; the engine's clock by default.

        Returns:
            The firing / resolved events this frame caused (usually none).
        """
        now = self._clock() if now is None else now
        partial = self._partial.setdefault(run.run_id, OrderedDict())
        if frame.step in partial:
            if frame.complete:
                del partial[frame.step]
            self.counters.skipped += 1
            return []
        if not frame.complete:
            partial[frame.step] = None
            if len(partial) > PARTIAL_STEPS_KEPT:
                partial.popitem(last=False)
        state = self._state(run)
        state.frame_arrived(frame.step, now)
        self.counters.frames += 1
        alerts: list[Alert] = []
        for rule, finding in state.evaluate(frame, tracker).items():
            event = self._observe(state, rule, finding, frame.step, frame.wall_time)
            if event is not None:
                alerts.append(event)
        health = tracker.health
        previous = self._last.get(run.run_id)
        self._last[run.run_id] = _LastFrame(
            frame.step if previous is None else max(previous.step, frame.step),
            run.world_size, health, tracker.frames, list(frame.ranks_seen), frame.wall_time,
        )
        changed = previous is None or previous.health is not health or bool(alerts)
        self._status(run.run_id, now, force=changed)
        return alerts

    def tick(self, now: float | None = None) -> list[Alert]:
        """Check every unfinished run for a stall; retire runs that finished.

        Args:
            now: monotonic time (s); the engine's clock by default.

        Returns:
            Stalled events fired, and stalled incidents resolved because the run finished.
        """
        now = self._clock() if now is None else now
        alerts: list[Alert] = []
        stalled_cfg = self.rules.stalled
        retired = []
        for run_id, state in self._runs.items():
            if self._is_finished(run_id):
                # Every rank finished: resolve a stall, publish the final status and drop
                # the run's per-layer state (a late frame would start it afresh).
                self._finished.add(run_id)
                retired.append(run_id)
                inc = self._incidents.get((run_id, AlertRule.STALLED))
                if inc is not None and inc.active:
                    alerts.append(self._resolve_now(state, inc, "the run finished"))
                self._status(run_id, now, force=True)
                continue
            if not stalled_cfg.enabled:
                continue
            finding = state.check_stall(now)
            if finding.bad and state.last_step is not None:
                event = self._observe(state, AlertRule.STALLED, finding, state.last_step, None)
                if event is not None:
                    alerts.append(event)
                    self._status(run_id, now, force=True)
        for run_id in retired:
            del self._runs[run_id]
            self._partial.pop(run_id, None)
        return alerts

    def take_statuses(self) -> list[RunStatus]:
        """The RunStatus records made since the last call (then forgotten)."""
        out, self._statuses = self._statuses, []
        return out

    def active(self, run_id: str | None = None) -> list[Incident]:
        """Open incidents (of one run, or all)."""
        return [
            inc for (r, _), inc in self._incidents.items()
            if inc.active and (run_id is None or r == run_id)
        ]

    # -- internals -----------------------------------------------------------------------

    def _state(self, run: RunInfo) -> RunRules:
        state = self._runs.get(run.run_id)
        if state is None:
            state = self._runs[run.run_id] = RunRules(run, self.rules)
        return state

    def _incident(self, run_id: str, rule: AlertRule) -> Incident:
        key = (run_id, rule)
        inc = self._incidents.get(key)
        if inc is None:
            inc = self._incidents[key] = Incident(run_id, rule)
        return inc

    def _observe(
        self, state: RunRules, rule: AlertRule, finding: Finding, step: int,
        wall_time: float | None,
    ) -> Alert | None:
        if finding.bad is None:
            return None
        run_id = state.run.run_id
        cfg = self.rules.rule(rule)
        inc = self._incident(run_id, rule)
        transition = inc.observe(finding.bad, step, cfg.resolve_after, finding.layers,
                                 finding.ranks)
        if transition is Transition.FIRE:
            self.counters.fired += 1
            return self._alert(
                inc, AlertState.FIRING, step, finding.layers, finding.ranks, finding.values,
                f"run {run_id}: {finding.message}", wall_time,
            )
        if transition is Transition.RESOLVE:
            return self._resolved(
                state, inc, step, wall_time,
                f"clear for {cfg.resolve_after} step(s) at step {step}", finding.values,
            )
        return None

    def _resolve_now(self, state: RunRules, inc: Incident, why: str) -> Alert:
        inc.active = False
        inc.clear = 0
        step = state.last_step if state.last_step is not None else inc.first_step
        return self._resolved(state, inc, step, None, why, {})

    def _resolved(
        self, state: RunRules, inc: Incident, step: int, wall_time: float | None, why: str,
        values: dict,
    ) -> Alert:
        self.counters.resolved += 1
        layers = state.model_order(inc.layers)
        ranks = sorted(inc.ranks)
        involved = ""
        if layers:
            involved += f"; layers {preview(layers)}"
        if ranks:
            involved += f"; ranks {ranks}"
        merged = {**values, "layers": state.current_values(layers)} if layers else dict(values)
        merged["incident_first_step"] = inc.first_step
        event = self._alert(
            inc, AlertState.RESOLVED, step, layers, ranks, merged,
            f"run {inc.run_id}: {RULE_TITLES[inc.rule]} resolved, {why} (began at step "
            f"{inc.first_step}{involved})", wall_time,
        )
        inc.reset_involved()
        return event

    def _alert(
        self, inc: Incident, state: AlertState, step: int, layers: list[str], ranks: list[int],
        values: dict, message: str, wall_time: float | None,
    ) -> Alert:
        return Alert(
            alert_id=f"{inc.incident_id}-{state.value}",
            incident_id=inc.incident_id,
            run_id=inc.run_id,
            step=max(step, 0),
            first_step=inc.first_step,
            rule=inc.rule,
            severity=self.rules.rule(inc.rule).severity,
            state=state,
            layers=layers,
            ranks=ranks,
            message=message,
            values=values,
            created_at=self._wall(),
            wall_time=wall_time,
        )

    def _status(self, run_id: str, now: float, force: bool) -> None:
        last = self._last.get(run_id)
        if last is None:
            return
        if not force and now - self._last_status.get(run_id, -np.inf) < self.status_interval_s:
            return
        self._last_status[run_id] = now
        stalled = self._incidents.get((run_id, AlertRule.STALLED))
        self._statuses.append(RunStatus(
            run_id=run_id,
            step=last.step,
            world_size=last.world_size,
            health=last.health,
            frames=last.frames,
            ranks_seen=last.ranks_seen,
            wall_time=last.wall_time,
            finished=run_id in self._finished,
            stalled=bool(stalled is not None and stalled.active),
            active_rules=[inc.rule for inc in self.active(run_id)],
            emitted_at=self._wall(),
        ))
