"""Every rule fires exactly once per incident, stays quiet while it lasts, and resolves
after ``resolve_after`` clear frames; frames are real (shards -> merge -> compute_frame)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.alerts.engine import AlertEngine
from consumer.alerts.incident import ActiveIncident, Incident, Transition
from schemas.alert import AlertRule, AlertSeverity, AlertState, incident_id
from schemas.wire import LocalSummary
from tests.consumer.alerts.helpers import (
    FIRING,
    LAYERS,
    NUMEL,
    RESOLVED,
    Run,
    only,
    states,
)


def test_nonfinite_names_layers_ranks_and_first_step_then_resolves():
    run = Run(AlertEngine(only("nonfinite", resolve_after=3)), world=4)
    for s in range(5):
        assert run.step(s) == []
    fired = run.step(5, nan={2: ["attn.q"], 3: ["attn.q", "head"]})
    assert len(fired) == 1
    alert = fired[0]
    assert (alert.rule, alert.state, alert.step, alert.first_step) == (
        AlertRule.NONFINITE, AlertState.FIRING, 5, 5)
    assert alert.layers == ["attn.q", "head"] and alert.ranks == [2, 3]
    assert alert.severity is AlertSeverity.CRITICAL
    assert alert.values["nonfinite_by_rank"] == {"2": ["attn.q"], "3": ["attn.q", "head"]}
    assert alert.values["layers"]["attn.q"]["nonfinite"] == 2
    assert alert.values["layers"]["head"]["nonfinite"] == 1
    assert alert.wall_time == 1.7e9 + 5
    assert "step 5" in alert.message and "[2, 3]" in alert.message
    # persists two more steps (another rank): no new event; then 2 clean steps: not yet
    assert run.step(6, nan={0: ["embed"]}) == []
    assert run.step(7, nan={1: ["embed"]}) == []
    assert run.step(8) == [] and run.step(9) == []
    resolved = run.step(10)
    assert states(resolved) == [(RESOLVED, 10)]
    r = resolved[0]
    assert r.incident_id == alert.incident_id and r.first_step == 5
    assert r.alert_id == f"{alert.incident_id}-resolved"
    assert r.layers == ["embed", "attn.q", "head"] and r.ranks == [0, 1, 2, 3]
    assert r.values["layers"]["embed"]["nonfinite"] == 0
    # a second incident is a new one
    again = run.step(11, nan={1: ["head"]})
    assert states(again) == [(FIRING, 11)] and again[0].incident_id != alert.incident_id
    assert again[0].ranks == [1] and again[0].layers == ["head"]
    assert states(run.of(AlertRule.NONFINITE)) == [
        (FIRING, 5), (RESOLVED, 10), (FIRING, 11)]


def test_a_clean_step_inside_an_incident_does_not_resolve_it():
    run = Run(AlertEngine(only("nonfinite", resolve_after=3)))
    run.step(0, nan={0: ["head"]})
    run.step(1)
    run.step(2)
    run.step(3, nan={1: ["head"]})  # bad again before 3 clear steps: same incident
    for s in range(4, 7):
        run.step(s)
    assert states(run.events) == [(FIRING, 0), (RESOLVED, 6)]


@pytest.mark.parametrize(("rule", "scale", "k"), [
    ("exploding", 1e6, 3),   # |g| ~ 1e4 > 1e3
    ("vanishing", 1e-7, 4),  # mean |g| ~ 1e-9 < 1e-7
])
def test_streak_rules_fire_on_the_kth_consecutive_step(rule, scale, k):
    run = Run(AlertEngine(only(rule, consecutive=k, resolve_after=2)))
    for s in range(3):
        run.step(s)
    # k-1 flagged steps, one clean step: the streak restarts, nothing fires
    for s in range(3, 3 + k - 1):
        run.step(s, scale={"ffn.out": scale})
    run.step(3 + k - 1)
    assert run.events == []
    start = 10
    for s in range(start, start + k + 3):
        run.step(s, scale={"ffn.out": scale, "head": scale if s >= start + 2 else 1.0})
    events = run.of(AlertRule(rule))
    assert states(events) == [(FIRING, start + k - 1)]
    assert events[0].layers == ["ffn.out"]
    assert events[0].values["layers"]["ffn.out"]["consecutive"] == k
    assert events[0].values["consecutive"] == k
    end = start + k + 3
    run.step(end)
    run.step(end + 1)
    assert states(run.of(AlertRule(rule))) == [(FIRING, start + k - 1), (RESOLVED, end + 1)]
    assert run.of(AlertRule(rule))[1].layers == ["ffn.out", "head"]


def test_exploding_layer_turning_nan_has_not_recovered():
    """An exploding layer that turns non-finite keeps exploding: the incident stays open."""
    run = Run(AlertEngine(only("exploding", consecutive=2, resolve_after=2)))
    run.step(0, scale={"head": 1e6})
    run.step(1, scale={"head": 1e6})
    for s in range(2, 6):
        run.step(s, nan={0: ["head"], 1: ["head"]})
    assert states(run.events) == [(FIRING, 1)]
    run.step(6)
    run.step(7)
    assert states(run.events) == [(FIRING, 1), (RESOLVED, 7)]


def test_nan_continues_an_exploding_streak_but_never_starts_one():
    run = Run(AlertEngine(only("exploding", consecutive=3, resolve_after=2)))
    for s in range(4):
        run.step(s, nan={0: ["embed"]})   # NaN alone: no exploding streak
    assert run.events == []
    run.step(4, scale={"head": 1e6})      # streak 1
    run.step(5, scale={"head": 1e6})      # streak 2
    fired = run.step(6, nan={1: ["head"]})  # diverged to NaN: streak 3
    assert states(fired) == [(FIRING, 6)] and fired[0].layers == ["head"]


def test_nan_keeps_a_vanishing_streak_without_extending_it():
    run = Run(AlertEngine(only("vanishing", consecutive=3, resolve_after=1)))
    run.step(0, scale={"embed": 1e-7})
    run.step(1, scale={"embed": 1e-7})
    run.step(2, nan={0: ["embed"]})       # held at 2
    assert run.events == []
    assert states(run.step(3, scale={"embed": 1e-7})) == [(FIRING, 3)]


def test_missing_ranks_fire_with_the_missing_ranks_and_resolve():
    run = Run(AlertEngine(only("missing_ranks", consecutive=2, resolve_after=2)), world=4)
    run.step(0)
    run.step(1, ranks=[0, 1, 3])
    run.step(2)  # one partial frame, not two in a row
    run.step(3, ranks=[0, 3])
    fired = run.step(4, ranks=[0, 1])
    assert states(fired) == [(FIRING, 4)] and fired[0].ranks == [2, 3]
    assert fired[0].values["missing_ranks"] == [2, 3]
    assert fired[0].values["ranks_seen"] == [0, 1]
    run.step(5)
    resolved = run.step(6)
    assert states(resolved) == [(RESOLVED, 6)] and resolved[0].ranks == [2, 3]


def test_rewritten_partial_frame_is_not_evaluated_again():
    run = Run(AlertEngine(only("missing_ranks", resolve_after=1)), world=2)
    run.step(0, ranks=[0])
    assert states(run.events) == [(FIRING, 0)]
    assert run.step(0) == []  # the late rank's shard rewrites step 0: skipped
    assert run.engine.counters.skipped == 1
    assert states(run.step(1)) == [(RESOLVED, 1)]


def test_grad_norm_spike_fires_on_the_spiking_layer_only():
    run = Run(AlertEngine(only("grad_norm_spike", window=30, min_samples=10,
                               resolve_after=3)), seed=7)
    for s in range(40):
        run.step(s)
    assert run.events == []
    fired = run.step(40, scale={"attn.q": 100.0})
    assert states(fired) == [(FIRING, 40)] and fired[0].layers == ["attn.q"]
    values = fired[0].values["layers"]["attn.q"]
    # ln(100) against a history whose robust sigma is ~0.1: a very large z
    assert values["z"] > 20 and values["samples"] == 30
    assert values["grad_norm"] / values["median_grad_norm"] == pytest.approx(100, rel=0.3)
    for s in range(41, 44):
        run.step(s)
    assert states(run.events) == [(FIRING, 40), (RESOLVED, 43)]


def test_spiking_layer_turning_nan_does_not_resolve_the_spike():
    run = Run(AlertEngine(only("grad_norm_spike", window=30, min_samples=10,
                               resolve_after=2)), seed=3)
    for s in range(20):
        run.step(s)
    assert states(run.step(20, scale={"head": 1e4})) == [(FIRING, 20)]
    for s in range(21, 25):
        run.step(s, nan={0: ["head"]})  # untestable: neither clear nor bad
    assert len(run.events) == 1
    run.step(25, nan={0: ["embed"]})    # head testable and calm; embed never spiked
    assert states(run.step(26)) == [(RESOLVED, 26)]


def test_spike_waits_for_min_samples():
    run = Run(AlertEngine(only("grad_norm_spike", window=20, min_samples=10)))
    for s in range(5):
        run.step(s)
    assert run.step(5, scale={"head": 1e3}) == []


def test_run_health_fires_at_the_configured_level_and_resolves_in_a_window():
    run = Run(AlertEngine(only("run_health", level="ProblemsDetected", resolve_after=2)),
              max_frames=3)
    run.step(0)
    run.step(1, scale={"head": 1e6})  # any exploding layer -> ProblemsDetected
    fired = run.of(AlertRule.RUN_HEALTH)
    assert states(fired) == [(FIRING, 1)]
    assert fired[0].values["health"] in ("ProblemsDetected", "Critical")
    assert fired[0].layers == ["head"]
    assert fired[0].values["layers"]["head"]["exploding_frames"] == 1
    for s in range(2, 4):
        run.step(s)  # exploding frame still inside the 3-frame window
    assert len(run.events) == 1
    run.step(4)  # window [2, 4]: healthy, 1st clear frame
    run.step(5)  # 2nd clear frame
    assert states(run.events) == [(FIRING, 1), (RESOLVED, 5)]


def test_stalled_fires_once_after_the_threshold_and_resolves_on_the_next_frame():
    finished: set[str] = set()
    engine = AlertEngine(only("stalled", after_s=10), is_finished=finished.__contains__)
    run = Run(engine)
    for s in range(3):
        run.step(s, now=float(s))
    assert engine.tick(now=12.0) == []          # 10 s since the last frame: not over
    fired = engine.tick(now=12.5)
    assert states(fired) == [(FIRING, 2)] and fired[0].wall_time is None
    assert fired[0].values["seconds_since_last_frame"] == pytest.approx(10.5)
    assert engine.tick(now=30.0) == []          # still stalled: not repeated
    resolved = run.step(3, now=31.0)
    assert states(resolved) == [(RESOLVED, 3)]
    # stalls again, then the run finishes: the stall resolves, no more checks
    assert states(engine.tick(now=45.0)) == [(FIRING, 3)]
    finished.add("run-1")
    assert [e.state for e in engine.tick(now=46.0)] == [AlertState.RESOLVED]
    assert engine.tick(now=1000.0) == []
    assert engine.take_statuses()[-1].finished


def test_stall_threshold_follows_the_run_pace():
    engine = AlertEngine(only("stalled", interval_factor=10, min_after_s=5))
    run = Run(engine)
    for s in range(6):  # one frame every 2 s -> threshold max(5, 10 * 2) = 20 s
        run.step(s, now=2.0 * s)
    assert engine.tick(now=10.0 + 19.0) == []
    assert len(engine.tick(now=10.0 + 21.0)) == 1


def test_all_rules_together_make_one_event_each():
    engine = AlertEngine(only("nonfinite", resolve_after=2))
    run = Run(engine, world=3)
    for s in range(3):
        run.step(s, nan={1: list(LAYERS)})
    assert len(run.events) == 1  # one incident, one event, for three bad frames


def test_restored_incident_is_not_fired_again_and_resolves():
    engine = AlertEngine(only("nonfinite", resolve_after=2))
    iid = incident_id("run-1", AlertRule.NONFINITE, 3)
    engine.restore([ActiveIncident("run-1", AlertRule.NONFINITE, iid, 3, ["head"], [1])])
    run = Run(engine)
    assert run.step(7, nan={0: ["head"]}) == []
    run.step(8)
    resolved = run.step(9)
    assert states(resolved) == [(RESOLVED, 9)]
    assert resolved[0].incident_id == iid and resolved[0].first_step == 3
    assert resolved[0].ranks == [0, 1]


def test_statuses_on_change_and_throttled_otherwise():
    engine = AlertEngine(only("nonfinite"), status_interval_s=5.0)
    run = Run(engine)
    run.step(0, now=0.0)                       # first frame: status
    run.step(1, now=1.0)                       # nothing changed, within 5 s
    run.step(2, now=2.0, nan={0: ["head"]})    # health Critical + alert: status
    run.step(3, now=7.5)                       # interval elapsed
    got = [(st.step, st.health.value, st.active_rules) for st in engine.take_statuses()]
    assert got == [(0, "Healthy", []), (2, "Critical", [AlertRule.NONFINITE]),
                   (3, "Critical", [AlertRule.NONFINITE])]
    assert engine.take_statuses() == []


def test_disabled_rules_never_fire():
    engine = AlertEngine(only("stalled", enabled="false"))
    run = Run(engine)
    run.step(0, nan={0: ["head"]}, scale={"embed": 1e6}, ranks=[0])
    assert engine.tick(now=1e6) == [] and run.events == []


def _reference_incidents(bad: list[bool], resolve_after: int) -> list[tuple[str, int]]:
    """Incidents by run lengths: a bad run starts one unless the previous incident has
    not seen ``resolve_after`` clear observations yet."""
    events, active, clear = [], False, 0
    for i, b in enumerate(bad):
        if b:
            clear = 0
            if not active:
                events.append(("fire", i))
                active = True
        elif active:
            clear += 1
            if clear == resolve_after:
                events.append(("resolve", i))
                active, clear = False, 0
    return events


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=60), st.integers(1, 6))
def test_incident_machine_matches_the_run_length_reference(bad, resolve_after):
    inc = Incident("r", AlertRule.NONFINITE)
    got = []
    for i, b in enumerate(bad):
        t = inc.observe(b, i, resolve_after)
        if t is Transition.FIRE:
            got.append(("fire", i))
        elif t is Transition.RESOLVE:
            got.append(("resolve", i))
    assert got == _reference_incidents(bad, resolve_after)
    fires = [e for e in got if e[0] == "fire"]
    resolves = [e for e in got if e[0] == "resolve"]
    assert len(fires) - len(resolves) == int(inc.active)  # alternate, at most one open


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=25), st.integers(1, 4))
def test_engine_nonfinite_events_match_the_reference(bad, resolve_after):
    run = Run(AlertEngine(only("nonfinite", resolve_after=resolve_after)))
    for i, b in enumerate(bad):
        run.step(i, nan={0: ["embed"]} if b else None)
    expected = [(FIRING if kind == "fire" else RESOLVED, i)
                for kind, i in _reference_incidents(bad, resolve_after)]
    assert states(run.events) == expected
    assert len({e.alert_id for e in run.events}) == len(run.events)


def test_layer_values_are_limited_to_the_worst_layers():
    engine = AlertEngine(only("exploding", consecutive=1) .model_copy(
        update={"max_layer_values": 2}))
    run = Run(engine)
    scales = {"embed": 1e6, "attn.q": 1e8, "ffn.out": 1e7, "head": 1e6}
    fired = run.step(0, scale=scales)
    assert fired[0].layers == list(LAYERS)
    assert list(fired[0].values["layers"]) == ["attn.q", "ffn.out"]  # two largest max |g|
    assert np.isfinite(fired[0].values["layers"]["attn.q"]["max_abs_grad"])


def test_local_origin_keeps_the_earliest_bad_step_and_its_ranks():
    from consumer.alerts.rules import LocalOrigin

    origin = LocalOrigin()
    assert origin.values() == {} and origin.phrase("NaN/Inf") == ""
    origin.update(7, np.array([], np.int32))  # nothing bad: no origin
    assert origin.step is None
    origin.update(7, np.array([3, 3, 1], np.int32))
    assert (origin.step, origin.ranks) == (7, [1, 3])
    origin.update(9, np.array([0], np.int32))  # later: ignored
    origin.update(5, np.array([2, 2], np.int32))  # an earlier frame arrives late
    assert origin.phrase("NaN/Inf") == "; NaN/Inf first in rank 2's local gradient at step 5"
    origin.update(5, np.array([0], np.int32))  # a late rank of the same step
    assert origin.values() == {"local_origin": {"step": 5, "ranks": [0, 2]}}
    assert origin.phrase("NaN/Inf") == (
        "; NaN/Inf first in the local gradients of ranks 0, 2 at step 5")


def _local_summary(step: int, rank: int, *, nonfinite: int = 0,
                   max_abs: float = 0.1) -> LocalSummary:
    """A flight recorder's entry of rank ``rank``: one layer, ``nonfinite`` NaN/Inf."""
    return LocalSummary(
        run_id="run-1", step=step, rank=rank, world_size=2, wall_time=1.0,
        trigger="nonfinite" if nonfinite else "exploding", trigger_step=step + 1,
        local_layer_indices=[1], local_numel=[NUMEL], local_sum_abs=[1.0],
        local_sum_sq=[1.0], local_max_abs=[max_abs], local_nonfinite=[nonfinite])


def test_flight_recorder_entries_name_where_it_started():
    """A LocalSummary (no local rows in any frame) tells ``nonfinite`` and ``exploding``
    the rank and step where their trouble started: finite entries teach nothing, NaN/Inf
    teaches both, max |g| above the run's threshold only ``exploding``."""
    run = Run(AlertEngine(only("nonfinite")))
    run.engine.note_local(run.info, _local_summary(2, 0))  # finite: no origin
    run.engine.note_local(run.info, _local_summary(4, 1, max_abs=5e3))  # not NaN/Inf
    run.engine.note_local(run.info, _local_summary(3, 1, nonfinite=2))
    (fired,) = run.step(5, nan={0: ["embed"], 1: ["embed"]})
    assert fired.values["local_origin"] == {"step": 3, "ranks": [1]}
    assert "NaN/Inf first in rank 1's local gradient at step 3" in fired.message

    run = Run(AlertEngine(only("exploding", consecutive=1)))
    run.engine.note_local(run.info, _local_summary(4, 1, max_abs=5e3))
    (fired,) = run.step(5, scale={"head": 1e6})
    assert fired.values["local_origin"] == {"step": 4, "ranks": [1]}
