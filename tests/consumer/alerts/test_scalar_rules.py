"""The training-scalar rules (``loss_spike``, ``nonfinite_loss``, ``loss_scale_collapse``,
``straggler``) on real frames (shards -> merge -> compute_frame) carrying the step's
scalars and the ranks' own values (``schemas.scalars``), fed to a real AlertEngine."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from consumer.alerts.config import AlertRulesBase, load_alert_rules
from consumer.alerts.engine import AlertEngine
from consumer.alerts.rules import Rule, rule_names
from consumer.alerts.rules.loss_scale_collapse import LossScaleCollapseRule
from consumer.alerts.rules.loss_spike import LossSpikeRule
from consumer.alerts.rules.straggler import StragglerRule, median_of_others
from consumer.frames import MergedShards, compute_frame
from schemas.alert import Alert, AlertSeverity, AlertState
from schemas.scalars import COMPUTE_TIME, LOSS, LOSS_SCALE, RankScalars, step_scalars
from tests.consumer.alerts.helpers import FIRING, LAYERS, RESOLVED, Run, shard, states

RuleT = TypeVar("RuleT", bound=Rule)

SCALAR_RULES = ("nonfinite_loss", "loss_spike", "loss_scale_collapse", "straggler")


def rules(*enabled: str, **fields: object) -> AlertRulesBase:
    """Rules with only ``enabled`` on; ``fields`` as ``"rule.field": value``."""
    overrides = [f"{n}.enabled=false" for n in rule_names() if n not in enabled]
    overrides += [f"{k}={v}" for k, v in fields.items()]
    return load_alert_rules(None, overrides)


class ScalarRun(Run):
    """A :class:`Run` whose frames carry training scalars."""

    def scalar_step(self, step: int, *, scale: dict[str, float] | None = None,
                    ranks: list[int] | None = None,
                    per_rank: dict[int, dict[str, float]] | None = None,
                    step_values: dict[str, float] | None = None) -> list[Alert]:
        """Feed one step over ``ranks`` (default all): gradients as ``Run.step``, the ranks'
        own scalars ``per_rank`` (rank -> name -> value; ranks not in ``ranks`` are left
        out, as a partial frame does) and step scalars ``step_values``; the frame's
        ``scalars`` are ``schemas.scalars.step_scalars`` of both."""
        merged = MergedShards.empty(len(LAYERS))
        seen = list(range(self.world)) if ranks is None else ranks
        wall = 0.0
        for rank in seen:
            msg = shard(self.info.run_id, step, rank, self.world, self.grads(scale))
            self.engine.note_shard(self.info, msg)
            merged.add(np.asarray(msg.layer_indices), np.asarray(msg.numel),
                       np.asarray(msg.sum_abs), np.asarray(msg.sum_sq),
                       np.asarray(msg.max_abs), np.asarray(msg.nonfinite))
            wall = msg.wall_time
        frame = compute_frame(self.info.run_id, step, merged, vanishing_threshold=1e-7,
                              exploding_threshold=1e3, ranks_seen=tuple(seen),
                              world_size=self.world, wall_time=wall)
        rank_scalars = RankScalars()
        for rank in seen:
            values = (per_rank or {}).get(rank)
            if values:
                rank_scalars += RankScalars.of_rank(rank, values)
        frame.rank_scalars = rank_scalars if len(rank_scalars) else None
        frame.scalars = step_scalars(step_values or {}, frame.rank_scalars)
        return self.feed(frame)

    def rule(self, kind: type[RuleT]) -> RuleT:
        """The run's instance of a rule class."""
        return next(r for r in self.engine._runs[self.info.run_id].rules
                    if isinstance(r, kind))


def losses(values: dict[int, float]) -> dict[int, dict[str, float]]:
    """rank -> {"loss": value}."""
    return {r: {LOSS: v} for r, v in values.items()}


# -- loss_spike ----------------------------------------------------------------------------


def spike_run(seed: int = 11, **fields: object) -> ScalarRun:
    """A run with only ``loss_spike`` (window 30, min_history 10, lookback 3) on."""
    settings_ = {"loss_spike.window": 30, "loss_spike.min_history": 10,
                 "loss_spike.lookback_steps": 3, "loss_spike.resolve_after": 2, **fields}
    return ScalarRun(AlertEngine(rules("loss_spike", **settings_)), seed=seed)


def test_loss_spike_names_the_layers_whose_gradient_spiked_first():
    noise = np.random.default_rng(5).normal(0, 0.02, 40)
    # attn.q spikes at 33 (before the lookback of 3 steps), ffn.out at 37, embed at 39 and
    # again at 40; the loss spikes at 40. Earliest first is not model order here.
    plan = {33: {"attn.q": 100.0}, 37: {"ffn.out": 100.0}, 39: {"embed": 50.0},
            40: {"embed": 50.0}}
    run = spike_run()
    for s in range(40):
        assert run.scalar_step(s, scale=plan.get(s),
                               per_rank=losses({0: 2.0 + noise[s], 1: 2.1 + noise[s]})) == []
    loss = {0: 6.0, 1: 6.2}
    (fired,) = run.scalar_step(40, scale=plan[40], per_rank=losses(loss))
    assert (fired.rule, fired.state, fired.step) == ("loss_spike", AlertState.FIRING, 40)
    assert fired.layers == ["ffn.out", "embed"]  # earliest first; not attn.q, not head
    v = fired.values
    assert v["layers_spiked_first"] == ["ffn.out", "embed"] and v["first_spike_step"] == 37
    assert v["loss"] == pytest.approx(6.1)  # the mean of the ranks' losses
    assert v["median"] == pytest.approx(2.05, abs=0.03) and v["z"] > 50
    assert v["samples"] == 30
    assert v["layers"]["ffn.out"]["spike_step"] == 37 and v["layers"]["ffn.out"]["spike_z"] > 20
    assert v["layers"]["embed"]["spike_step"] == 39  # its first spike, not the one at 40
    assert "ffn.out (step 37), embed (step 39)" in fired.message
    assert fired.severity is AlertSeverity.WARNING
    for s in (41, 42):
        run.scalar_step(s, per_rank=losses({0: 2.0, 1: 2.1}))
    assert states(run.events) == [(FIRING, 40), (RESOLVED, 42)]


def test_loss_spike_without_a_gradient_spike_says_so():
    run = spike_run()
    for s in range(20):
        run.scalar_step(s, per_rank=losses({0: 3.0 + 0.01 * (s % 3), 1: 3.0}))
    (fired,) = run.scalar_step(20, per_rank=losses({0: 4.0, 1: 4.0}))
    assert fired.layers == [] and fired.values["layers_spiked_first"] == []
    assert fired.values["first_spike_step"] is None
    assert "no layer's gradient norm spiked in steps 17..20" in fired.message
    assert "without a gradient spike" in fired.message


def test_loss_spike_stays_quiet_on_a_steady_noisy_decreasing_loss():
    """Default thresholds, 400 steps of a falling loss with Gaussian noise and gradients
    of every layer scattered as usual: no event."""
    run = ScalarRun(AlertEngine(rules("loss_spike")), seed=2)
    noise = np.random.default_rng(9).normal(0, 0.05, 400)
    for s in range(400):
        curve = 2.0 + 3.0 * np.exp(-s / 150)
        run.scalar_step(s, per_rank=losses({0: curve + noise[s], 1: curve - noise[s] / 2}))
    assert run.events == []
    assert run.rule(LossSpikeRule).loss_history.samples[0] == 100  # the window is full


def test_non_finite_loss_is_skipped_and_does_not_enter_the_window():
    run = spike_run()
    for s in range(15):
        run.scalar_step(s, per_rank=losses({0: 2.0 + 0.01 * (s % 4), 1: 2.0}))
    history = run.rule(LossSpikeRule).loss_history
    before = history.samples[0]
    assert run.scalar_step(15, per_rank=losses({0: float("nan"), 1: 2.0})) == []
    assert run.scalar_step(16, per_rank=losses({0: float("inf"), 1: 2.0})) == []
    assert history.samples[0] == before  # nothing pushed
    (fired,) = run.scalar_step(17, per_rank=losses({0: 9.0, 1: 9.0}))
    assert fired.step == 17


def test_loss_spike_direction():
    down = spike_run(**{"loss_spike.direction": "down"})
    up = spike_run()
    for run in (down, up):
        for s in range(20):
            run.scalar_step(s, per_rank=losses({0: 3.0 + 0.01 * (s % 5), 1: 3.0}))
    assert up.scalar_step(20, per_rank=losses({0: 0.5, 1: 0.5})) == []
    (fired,) = down.scalar_step(20, per_rank=losses({0: 0.5, 1: 0.5}))
    assert fired.values["z"] < -5 and fired.message.startswith("run run-1: loss drop")


# -- nonfinite_loss ------------------------------------------------------------------------


def test_nonfinite_loss_names_the_nan_rank_then_resolves():
    run = ScalarRun(AlertEngine(rules("nonfinite_loss", **{
        "nonfinite_loss.resolve_after": 2})), world=4)
    ok = {0: 2.0, 1: 2.1, 2: 1.9, 3: 2.0}
    for s in range(3):
        assert run.scalar_step(s, per_rank=losses(ok)) == []
    (fired,) = run.scalar_step(3, per_rank=losses({**ok, 2: float("nan")}))
    assert (fired.rule, fired.step, fired.ranks) == ("nonfinite_loss", 3, [2])
    assert fired.severity is AlertSeverity.CRITICAL
    v = fired.values
    assert v["nonfinite_loss_by_rank"] == {"2": "nan"}
    assert v["loss"] is None and v["loss_kind"] == "nan"  # the mean is NaN too
    assert v["ranks_reporting"] == 4 and v["world_size"] == 4
    assert "NaN on rank(s) [2] of 4 reporting" in fired.message
    # another rank goes to +Inf: same incident; then two clean steps resolve it
    assert run.scalar_step(4, per_rank=losses({**ok, 1: float("inf")})) == []
    run.scalar_step(5, per_rank=losses(ok))
    (resolved,) = run.scalar_step(6, per_rank=losses(ok))
    assert resolved.state.value == RESOLVED and resolved.ranks == [1, 2]


def test_nonfinite_step_loss_without_rank_values_names_no_rank():
    run = ScalarRun(AlertEngine(rules("nonfinite_loss")))
    (fired,) = run.scalar_step(0, step_values={LOSS: float("-inf")})
    assert fired.ranks == [] and fired.values["loss_kind"] == "-inf"
    assert "ranks unknown" in fired.message


# -- loss_scale_collapse -------------------------------------------------------------------


def scale_run(**fields: object) -> ScalarRun:
    """A run with only ``loss_scale_collapse`` (k = 3 within 100 steps) on."""
    settings_ = {"loss_scale_collapse.backoffs": 3, "loss_scale_collapse.within_steps": 100,
                 "loss_scale_collapse.resolve_after": 2, **fields}
    return ScalarRun(AlertEngine(rules("loss_scale_collapse", **settings_)))


def feed_scales(run: ScalarRun, scales: dict[int, float]) -> None:
    """Feed one frame per step of ``scales`` (step -> loss scale), in step order."""
    for step, value in sorted(scales.items()):
        run.scalar_step(step, step_values={LOSS_SCALE: value})


CALIBRATION = {0: 65536.0, 1: 32768.0, 2: 16384.0, 3: 8192.0, 4: 4096.0, 5: 4096.0}
"""GradScaler's start: backing off from init_scale 2**16 on the first steps."""


def test_loss_scale_collapse_fires_on_the_kth_backoff_within_the_window():
    run = scale_run()
    feed_scales(run, CALIBRATION)
    assert run.events == []  # the calibration descent is not a collapse
    feed_scales(run, {10: 4096.0, 12: 8192.0})  # first growth: calibrated
    # k - 1 = 2 backoffs within 100 steps, then a third outside the window of the first
    feed_scales(run, {20: 4096.0, 50: 2048.0, 60: 2048.0, 130: 1024.0})
    assert run.events == []
    assert list(run.rule(LossScaleCollapseRule).backoff_steps) == [50, 130]
    (fired,) = run.scalar_step(140, step_values={LOSS_SCALE: 512.0})
    assert (fired.rule, fired.step) == ("loss_scale_collapse", 140)
    v = fired.values
    assert v["backoff_steps"] == [50, 130, 140] and v["backoffs"] == 3
    assert v["loss_scale"] == 512.0 and v["previous_scale"] == 1024.0 and v["calibrated"]
    assert "backed off 3 times within the last 100 steps" in fired.message
    # step 150: the backoff of step 50 leaves the window (150 - 100): clear twice, resolved
    feed_scales(run, {150: 512.0, 151: 512.0})
    assert states(run.events) == [(FIRING, 140), (RESOLVED, 151)]


def test_loss_scale_calibration_counts_when_asked():
    run = scale_run(**{"loss_scale_collapse.skip_calibration": "false"})
    feed_scales(run, CALIBRATION)
    assert states(run.events) == [(FIRING, 3)]


def test_loss_scale_below_min_scale_fires_at_once():
    run = scale_run()
    feed_scales(run, {0: 2.0})
    (fired,) = run.scalar_step(1, step_values={LOSS_SCALE: 0.5})
    assert "below min_scale 1" in fired.message and fired.values["backoffs"] == 0


def test_loss_scale_older_step_is_not_judged():
    run = scale_run(**{"loss_scale_collapse.skip_calibration": "false",
                       "loss_scale_collapse.backoffs": 1})
    feed_scales(run, {5: 1024.0})
    assert run.scalar_step(3, step_values={LOSS_SCALE: 4096.0}) == []  # older: ignored
    assert run.rule(LossScaleCollapseRule).scale == 1024.0


# -- straggler -----------------------------------------------------------------------------


def straggler_run(world: int = 4, **fields: object) -> ScalarRun:
    """A run with only ``straggler`` (factor 1.5, 3 in a row) on."""
    settings_ = {"straggler.consecutive": 3, "straggler.factor": 1.5,
                 "straggler.resolve_after": 2, **fields}
    return ScalarRun(AlertEngine(rules("straggler", **settings_)), world=world)


def times(values: list[float], step_time: float | None = None) -> dict[int, dict[str, float]]:
    """rank -> compute time (and the same step time on every rank, as DDP makes it)."""
    step = max(values) if step_time is None else step_time
    return {r: {COMPUTE_TIME: t, "step_time_s": step} for r, t in enumerate(values)}


def test_straggler_names_the_slow_rank_after_consecutive_steps_and_resolves():
    run = straggler_run()
    normal = [1.00, 1.02, 0.98, 1.01]
    slow = [1.00, 1.02, 2.40, 1.01]
    for s in range(3):
        assert run.scalar_step(s, per_rank=times(normal)) == []
    # slow for k - 1 = 2 steps, then one normal step: the count restarts
    run.scalar_step(3, per_rank=times(slow))
    run.scalar_step(4, per_rank=times(slow))
    run.scalar_step(5, per_rank=times(normal))
    assert run.events == []
    assert run.scalar_step(6, per_rank=times(slow)) == []
    assert run.scalar_step(7, per_rank=times(slow)) == []
    (fired,) = run.scalar_step(8, per_rank=times(slow))
    assert (fired.rule, fired.step, fired.ranks) == ("straggler", 8, [2])
    one = fired.values["stragglers"]["2"]
    assert one["compute_time_s"] == 2.40 and one["median_of_others_s"] == 1.01
    assert one["ratio"] == pytest.approx(2.40 / 1.01) and one["consecutive"] == 3
    assert fired.values["factor"] == 1.5 and fired.values["ranks_reporting"] == 4
    assert "rank 2 took 2.4 s against 1.01 s" in fired.message
    # rank 2 absent (partial frame): its count is kept, the frame judges nothing
    assert run.scalar_step(9, ranks=[0, 1, 3], per_rank=times(normal)) == []
    assert run.rule(StragglerRule).slow_streak.tolist() == [0, 0, 3, 0]
    run.scalar_step(10, per_rank=times(normal))  # recovered: first clear frame
    assert len(run.events) == 1
    (resolved,) = run.scalar_step(11, per_rank=times(normal))
    assert resolved.state.value == RESOLVED and resolved.ranks == [2]


def test_straggler_uses_compute_time_not_step_time():
    """DDP evens out step time: every rank's is the slowest's. Only the compute time
    shows the straggler; equal compute times never fire whatever the step time."""
    run = straggler_run(**{"straggler.consecutive": 1})
    assert run.scalar_step(0, per_rank=times([1.0, 1.0, 1.0, 1.0], step_time=9.0)) == []
    (fired,) = run.scalar_step(1, per_rank=times([1.0, 3.0, 1.0, 1.0]))
    assert fired.ranks == [1]


def test_straggler_ignores_an_excess_below_min_excess():
    """Millisecond steps: 2 ms against 1 ms is twice as slow but one preemption's worth;
    it is not a straggler until it is also ``min_excess_s`` (6 ms) slower."""
    run = straggler_run(**{"straggler.consecutive": 1})
    assert run.scalar_step(0, per_rank=times([0.001, 0.001, 0.002, 0.001])) == []
    assert run.scalar_step(1, per_rank=times([0.001, 0.001, 0.0069, 0.001])) == []
    (fired,) = run.scalar_step(2, per_rank=times([0.001, 0.001, 0.0075, 0.001]))
    assert fired.ranks == [2]


def test_straggler_needs_min_ranks():
    run = straggler_run(world=2, **{"straggler.consecutive": 1, "straggler.min_ranks": 3})
    for s in range(3):
        assert run.scalar_step(s, per_rank=times([1.0, 5.0])) == []
    assert run.rule(StragglerRule).slow_streak.tolist() == [0, 0]
    run = straggler_run(world=2, **{"straggler.consecutive": 1})  # default min_ranks 2
    (fired,) = run.scalar_step(0, per_rank=times([1.0, 5.0]))
    assert fired.ranks == [1] and fired.values["stragglers"]["1"]["median_of_others_s"] == 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=2, max_size=12))
def test_median_of_others_is_the_median_without_each_element(values):
    x = np.asarray(values)
    expected = [np.median(np.delete(x, i)) for i in range(x.size)]
    np.testing.assert_allclose(median_of_others(x), expected, rtol=0, atol=1e-12)


def test_median_of_others_needs_two_values():
    with pytest.raises(ValueError, match="at least 2"):
        median_of_others(np.array([1.0]))


# -- frames without scalars, the registry --------------------------------------------------


def test_frames_without_scalars_never_fire_and_allocate_nothing():
    run = ScalarRun(AlertEngine(rules(*SCALAR_RULES, **{
        "straggler.consecutive": 1, "loss_scale_collapse.backoffs": 1,
        "loss_spike.min_history": 3, "loss_spike.window": 5})), world=3)
    for s in range(30):
        run.step(s, scale={"head": 1e4 if s % 7 == 6 else 1.0},
                 ranks=[0, 2] if s % 5 == 4 else None)
    assert run.events == []
    assert run.rule(LossSpikeRule).loss_history is None
    assert run.rule(LossSpikeRule).layer_history is None
    assert run.rule(LossScaleCollapseRule).newest_step is None
    assert run.rule(StragglerRule).slow_streak.tolist() == [0, 0, 0]
    # scalars that are none of theirs (a learning rate only) change nothing either
    run.scalar_step(30, step_values={"lr": 1e-4})
    assert run.events == [] and run.rule(LossSpikeRule).loss_history is None


def test_the_rules_are_registered_and_printed_by_alert_rules():
    from deploy.cli import app

    names = rule_names()
    assert set(SCALAR_RULES) <= set(names)
    assert names.index("nonfinite_loss") == names.index("nonfinite") + 1
    assert names.index("loss_spike") == names.index("grad_norm_spike") + 1
    result = CliRunner().invoke(app, ["alert-rules", "--alert-set", "straggler.factor=2"])
    assert result.exit_code == 0, result.output
    for text in ("loss_spike:\n  enabled: true\n  severity: warning\n",
                 "nonfinite_loss:\n  enabled: true\n  severity: critical\n",
                 "loss_scale_collapse:\n", "  within_steps: 2000\n",
                 "straggler:\n", "  factor: 2.0\n"):
        assert text in result.output
