"""AlertEngine: every run's rules and incidents, fed frame by frame by a worker.

The worker calls :meth:`AlertEngine.note_shard` for each validated StepSummary (so the
engine knows which rank's shard held NaN/Inf), :meth:`AlertEngine.note_local` for each
validated LocalSummary (a rank's flight recorder: where NaN/Inf or an explosion started),
:meth:`AlertEngine.on_frame` for each finalised frame (after the run's health tracker has
seen it) and :meth:`AlertEngine.tick` from its poll loop (stalled runs, finished runs).
Each returns the alert events it caused; :meth:`AlertEngine.take_statuses` returns the
run-status records for the alerts topic.

The rules are those the configuration was built from (``type(rules).rule_types``: the
registry ``consumer.alerts.rules.RULES`` unless a caller built its own model); the engine
knows nothing of any particular rule. Per run it holds a
:class:`~consumer.alerts.rules.RunContext` and one instance of each enabled rule; per (run,
rule) one :class:`~consumer.alerts.incident.Incident`.

Which frames are evaluated: every frame in arrival order, except a frame rewritten by a
late shard (a step this engine already saw as partial): its step has been evaluated, and
the late rank's later steps will be. The rules of a frame are evaluated, and their events
returned, in registry order. Cost per frame: O(layers) NumPy, plus O(layers x window) for
the spike rule's medians.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from consumer.alerts.config import AlertRulesBase
from consumer.alerts.incident import ActiveIncident, Incident, Transition
from consumer.alerts.rules import Finding, Rule, RunContext, preview
from consumer.frames import GradientFrame
from consumer.health_tracker import RunHealthTracker
from consumer.runs import RunInfo
from schemas.alert import Alert, AlertState, RuleName, RunStatus
from schemas.wire import GradientHealth, LocalSummary, StepSummary

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
class _RunRules:
    """A run's shared context, its enabled rules' instances (registry order), and those
    of them that want shards and local-view entries."""

    context: RunContext
    rules: list[Rule]
    shard_rules: list[Rule]
    local_rules: list[Rule]


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
        rules: the rule configuration (from ``consumer.alerts.config.load_alert_rules``);
            its model's ``rule_types`` are the rules evaluated.
        status_interval_s: at most one routine RunStatus per run per this many seconds
            (transitions always publish one).
        is_finished: run id -> whether every rank of the run has finished (the worker's
            knowledge); finished runs are retired (no more idle checks such as stalls).
        clock: monotonic clock (s) used when ``now`` is not given.
        wall_clock: unix time (s) for ``created_at`` / ``emitted_at``.
    """

    def __init__(
        self,
        rules: AlertRulesBase,
        *,
        status_interval_s: float = 1.0,
        is_finished: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.rules = rules
        self.rule_types: tuple[type[Rule], ...] = type(rules).rule_types
        self._enabled = [r for r in self.rule_types if rules.rule(r.name).enabled]
        self._by_name = {str(r.name): r for r in self.rule_types}
        self.status_interval_s = status_interval_s
        self._is_finished = is_finished or (lambda _run_id: False)
        self._clock = clock
        self._wall = wall_clock
        self._runs: dict[str, _RunRules] = {}
        self._incidents: dict[tuple[str, str], Incident] = {}
        self._partial: dict[str, OrderedDict[int, None]] = {}
        self._finished: set[str] = set()
        self._last: dict[str, _LastFrame] = {}
        self._last_status: dict[str, float] = {}
        self._statuses: list[RunStatus] = []
        self.counters = EngineCounters()

    # -- inputs --------------------------------------------------------------------------

    def restore(self, active: list[ActiveIncident]) -> None:
        """Re-open incidents fired before a restart (their last event is ``firing``: from
        the store, ``consumer.alerts.rows.load_active_incidents``, or from the alerts
        topic, ``consumer.alerts.incident.active_from_events``), so they are not fired
        twice and still resolve. Their count of clear frames starts again at zero: a
        restart can delay a resolution, never repeat a firing. Incidents of rules this
        engine does not have are skipped."""
        for a in active:
            rule = self._by_name.get(str(a.rule))
            if rule is None:
                continue
            self._incident(a.run_id, rule.name).restore(a.incident_id, a.first_step,
                                                        a.layers, a.ranks)

    def note_shard(self, run: RunInfo, shard: StepSummary) -> None:
        """Show a validated shard of ``run`` to the enabled rules that look at shards
        (:meth:`consumer.alerts.rules.Rule.note_shard`; e.g. ``nonfinite`` remembers
        which rank's shard held NaN/Inf), before its frame is evaluated."""
        for rule in self._state(run).shard_rules:
            rule.note_shard(shard)

    def note_local(self, run: RunInfo, local: LocalSummary) -> None:
        """Show a validated local-view entry of ``run`` (a flight recorder's
        ``LocalSummary``) to the enabled rules that look at them
        (:meth:`consumer.alerts.rules.Rule.note_local`; e.g. ``nonfinite`` learns the rank
        and step where NaN/Inf started). Evaluates nothing: the frames' verdicts carry it."""
        for rule in self._state(run).local_rules:
            rule.note_local(local)

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
        ctx = state.context.begin_frame(frame, tracker, now)
        self.counters.frames += 1
        alerts: list[Alert] = []
        for rule in state.rules:
            event = self._observe(state.context, rule, rule.evaluate(ctx), frame.step,
                                  frame.wall_time)
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
        """Ask every unfinished run's rules for idle verdicts (e.g. ``stalled``); retire
        runs that finished.

        Args:
            now: monotonic time (s); the engine's clock by default.

        Returns:
            Events of idle verdicts (observed at the run's newest step, no wall time), and
            incidents of ``resolves_when_run_finishes`` rules resolved because the run
            finished.
        """
        now = self._clock() if now is None else now
        alerts: list[Alert] = []
        retired = []
        for run_id, state in self._runs.items():
            ctx = state.context
            if self._is_finished(run_id):
                # Every rank finished: resolve what was about the run still sending (a
                # stall), publish the final status and drop the run's per-layer state (a
                # late frame would start it afresh).
                self._finished.add(run_id)
                retired.append(run_id)
                for rule_type in self.rule_types:
                    if not rule_type.resolves_when_run_finishes:
                        continue
                    inc = self._incidents.get((run_id, str(rule_type.name)))
                    if inc is not None and inc.active:
                        alerts.append(self._resolve_now(ctx, inc, "the run finished"))
                self._status(run_id, now, force=True)
                continue
            if ctx.last_step is None:
                continue
            for rule in state.rules:
                finding = rule.check_idle(now)
                if finding is None:
                    continue
                event = self._observe(ctx, rule, finding, ctx.last_step, None)
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

    def firing_by_rule(self) -> dict[str, int]:
        """Open incidents (fired, not resolved; restored ones included) per rule, for every
        rule of this engine (0 when none): the ``gradstream_firing_incidents`` gauge.

        Safe from another thread (the metrics server's) while the worker feeds the engine:
        the incidents are copied in one step (``tuple`` of a dict's values: C code under
        the GIL), then read.
        """
        counts = {str(r.name): 0 for r in self.rule_types}
        for inc in tuple(self._incidents.values()):
            if inc.active:
                counts[str(inc.rule)] = counts.get(str(inc.rule), 0) + 1
        return counts

    def active(self, run_id: str | None = None) -> list[Incident]:
        """Open incidents (of one run, or all)."""
        return [
            inc for (r, _), inc in self._incidents.items()
            if inc.active and (run_id is None or r == run_id)
        ]

    # -- internals -----------------------------------------------------------------------

    def _state(self, run: RunInfo) -> _RunRules:
        state = self._runs.get(run.run_id)
        if state is None:
            context = RunContext(run, self.rules.max_layer_values)
            rules = [r(context, self.rules.rule(r.name)) for r in self._enabled]
            shard_rules = [r for r in rules if type(r).note_shard is not Rule.note_shard]
            local_rules = [r for r in rules if type(r).note_local is not Rule.note_local]
            state = self._runs[run.run_id] = _RunRules(context, rules, shard_rules,
                                                       local_rules)
        return state

    def _incident(self, run_id: str, rule: RuleName) -> Incident:
        key = (run_id, str(rule))
        inc = self._incidents.get(key)
        if inc is None:
            inc = self._incidents[key] = Incident(run_id, rule)
        return inc

    def _observe(
        self, ctx: RunContext, rule: Rule, finding: Finding, step: int,
        wall_time: float | None,
    ) -> Alert | None:
        if finding.bad is None:
            return None
        run_id = ctx.info.run_id
        cfg = rule.config
        inc = self._incident(run_id, rule.name)
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
                ctx, inc, step, wall_time,
                f"clear for {cfg.resolve_after} step(s) at step {step}", finding.values,
            )
        return None

    def _resolve_now(self, ctx: RunContext, inc: Incident, why: str) -> Alert:
        inc.active = False
        inc.clear = 0
        step = ctx.last_step if ctx.last_step is not None else inc.first_step
        return self._resolved(ctx, inc, step, None, why, {})

    def _resolved(
        self, ctx: RunContext, inc: Incident, step: int, wall_time: float | None, why: str,
        values: dict,
    ) -> Alert:
        self.counters.resolved += 1
        layers = ctx.model_order(inc.layers)
        ranks = sorted(inc.ranks)
        involved = ""
        if layers:
            involved += f"; layers {preview(layers)}"
        if ranks:
            involved += f"; ranks {ranks}"
        merged = {**values, "layers": ctx.current_values(layers)} if layers else dict(values)
        merged["incident_first_step"] = inc.first_step
        event = self._alert(
            inc, AlertState.RESOLVED, step, layers, ranks, merged,
            f"run {inc.run_id}: {self._by_name[str(inc.rule)].title} resolved, {why} "
            f"(began at step {inc.first_step}{involved})", wall_time,
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
        stalled = any(
            inc.active and self._by_name[str(inc.rule)].marks_run_stalled
            for inc in self.active(run_id)
        )
        self._statuses.append(RunStatus(
            run_id=run_id,
            step=last.step,
            world_size=last.world_size,
            health=last.health,
            frames=last.frames,
            ranks_seen=last.ranks_seen,
            wall_time=last.wall_time,
            finished=run_id in self._finished,
            stalled=stalled,
            active_rules=[inc.rule for inc in self.active(run_id)],
            emitted_at=self._wall(),
        ))
