"""Enhanced per-layer gradient analysis over crafted histories in a real DuckDB file."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from analysis.analyses.enhanced import build_enhanced_analysis
from analysis.analyses.enhanced.models import (
    ConvergenceTrend,
    DistributionType,
    EnhancedLayerGradientAnalysis,
    InstabilityType,
    InteractionDirection,
    InteractionType,
    LayerHealth,
    LearningPhase,
    OptimizationTarget,
    UrgencyLevel,
)
from analysis.read.connect import StoreError
from tests.analysis.crafted import open_read, write_history


def analysis_of(path: Path, run: str = "r", **kw: object) -> EnhancedLayerGradientAnalysis:
    con = open_read(path)
    try:
        return build_enhanced_analysis(con, run, **kw)  # type: ignore[arg-type]
    finally:
        con.close()


def details(report: EnhancedLayerGradientAnalysis) -> dict[str, object]:
    return {d.layer_name: d for d in report.layer_details}


def test_gradient_statistics_by_hand(tmp_path: Path) -> None:
    """Norms 1, 1, 1, 1, 6: mean 2, m2 4 (std 2), m3 12 (skew 1.5), m4 52 (kurt 0.25);
    median s[2] = 1, p5 = s[0] = 1, p95 = s[min(4, 4)] = 6."""
    path = write_history(tmp_path / "s.duckdb", np.array([[1.0, 1.0, 6.0, 1.0, 1.0]]))
    stats = analysis_of(path).layer_details[0].gradient_statistics
    assert (stats.mean, stats.variance, stats.std) == pytest.approx((2.0, 4.0, 2.0))
    assert (stats.skewness, stats.kurtosis) == pytest.approx((1.5, 0.25))
    assert (stats.median, stats.percentile_5, stats.percentile_95) == (1.0, 1.0, 6.0)
    assert stats.samples == 5


def test_even_count_median_and_percentiles(tmp_path: Path) -> None:
    norms = np.arange(1.0, 21.0)[None, ::-1].copy()  # 20 samples, descending in time
    stats = analysis_of(write_history(tmp_path / "s.duckdb", norms)).layer_details[0]
    s = stats.gradient_statistics
    assert s.median == 10.5  # (s[9] + s[10]) / 2
    assert s.percentile_5 == 2.0  # s[floor(1.0)]
    assert s.percentile_95 == 20.0  # s[min(19, 19)]


def test_flow_characteristics_by_hand(tmp_path: Path) -> None:
    """Norms 1, 2, 4, 8: relative changes all 1 -> consistency 1/2; second differences
    1, 2 (mean 1.5) over the mean norm 15/4 -> smoothness 1 / (1 + 1.5 / 3.75); the
    trend strength is the R^2 of the straight-line fit."""
    norms = np.array([[1.0, 2.0, 4.0, 8.0]])
    flow = analysis_of(write_history(tmp_path / "s.duckdb", norms)).layer_details[0]
    f = flow.flow_characteristics
    assert f.consistency_score == pytest.approx(0.5)
    assert f.smoothness_index == pytest.approx(1 / (1 + 1.5 / 3.75))
    x, y = np.arange(4.0), norms[0]
    r = np.corrcoef(x, y)[0, 1]
    assert f.trend_strength == pytest.approx(r**2)
    assert f.trend_slope == pytest.approx(np.polyfit(x, y, 1)[0])
    assert f.oscillation_frequency == 0.0
    std = y.std()
    assert f.stability_measure == pytest.approx(1 / (1 + std / y.mean()))
    assert flow.health_metrics.information_flow_rate == pytest.approx(7 / 4)


def test_alternating_series_oscillates(tmp_path: Path) -> None:
    t = np.arange(60)
    norms = np.vstack([np.where(t % 2 == 0, 1.0, 3.0), np.full(60, 2.0)])
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, names=["alt", "flat"]))
    alt = details(report)["alt"]
    assert alt.flow_characteristics.oscillation_frequency == pytest.approx(58 / 60)
    assert alt.flow_characteristics.oscillation_significant
    assert alt.health_metrics.overall_health is LayerHealth.WARNING
    assert len(alt.health_metrics.risk_factors) == 1
    assert "Oscillating" in alt.health_metrics.risk_factors[0]
    assert alt.optimization_suggestions[0].suggestion_type.value == "LearningRateAdjustment"
    flat = details(report)["flat"]
    assert flat.health_metrics.overall_health is LayerHealth.HEALTHY
    assert flat.flow_characteristics.stability_measure == 1.0
    sources = report.network_level_analysis.stability_assessment.instability_sources
    assert [(s.source_type, s.affected_layers) for s in sources] == [
        (InstabilityType.OSCILLATION, ["alt"])
    ]
    assert sources[0].severity == pytest.approx(0.5)  # half of the parameters


def test_steadily_falling_norm_converges_with_the_right_estimate(tmp_path: Path) -> None:
    """G_t = 0.95^t over 150 steps, one layer of 100 elements, vanishing threshold 1e-7:
    floor 1e-7 * sqrt(100) = 1e-6; the fit over the last 100 steps is exact, so the decay
    reaches the floor ceil(ln(1e-6) / ln(0.95) - 149) steps after the last one."""
    norms = (0.95 ** np.arange(150.0))[None, :]
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms))
    conv = report.network_level_analysis.convergence_indicators
    assert conv.convergence_trend is ConvergenceTrend.CONVERGING
    assert conv.convergence_floor == pytest.approx(1e-6)
    expected = math.ceil(math.log(1e-6) / math.log(0.95) - 149)
    assert expected == 121
    assert conv.estimated_steps_to_convergence == expected
    assert conv.decay_rate == pytest.approx(-math.log(0.95))
    assert conv.gradient_convergence_score == pytest.approx(1 - 0.95**99)
    assert conv.parameter_convergence_score is None  # no weight statistics
    layer = report.layer_details[0].health_metrics
    assert layer.convergence_indicator == pytest.approx(1 - 0.95**99)
    dyn = report.network_level_analysis.training_dynamics
    assert dyn.learning_velocity == pytest.approx(-math.log(0.95))
    assert dyn.learning_phase in (LearningPhase.REFINEMENT, LearningPhase.RAPID_LEARNING)
    assert not dyn.plateau_detection.is_plateau
    forecast = report.network_level_analysis.stability_assessment.stability_forecast
    assert forecast.long_term_outlook.value == "Improving"
    assert forecast.confidence_level == pytest.approx(1.0)


def test_near_the_floor_is_convergence_phase(tmp_path: Path) -> None:
    norms = (1e-4 * 0.95 ** np.arange(150.0))[None, :]  # floor reached within the window
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms))
    conv = report.network_level_analysis.convergence_indicators
    assert conv.estimated_steps_to_convergence == 0  # already below 1e-6
    assert report.network_level_analysis.training_dynamics.learning_phase is (
        LearningPhase.CONVERGENCE
    )


def test_first_window_of_the_run_is_initial_learning(tmp_path: Path) -> None:
    norms = (0.95 ** np.arange(50.0))[None, :]
    path = write_history(tmp_path / "s.duckdb", norms)
    assert analysis_of(path).network_level_analysis.training_dynamics.learning_phase is (
        LearningPhase.INITIAL_LEARNING
    )
    later = analysis_of(path, from_step=10)  # does not start at the run's first step
    assert later.network_level_analysis.training_dynamics.learning_phase is not (
        LearningPhase.INITIAL_LEARNING
    )


def test_fall_then_flat_is_a_plateau(tmp_path: Path) -> None:
    g = np.r_[0.97 ** np.arange(100.0), np.full(100, 0.01)]
    report = analysis_of(write_history(tmp_path / "s.duckdb", g[None, :]))
    dyn = report.network_level_analysis.training_dynamics
    assert dyn.learning_phase is LearningPhase.PLATEAU
    assert dyn.plateau_detection.is_plateau
    assert dyn.plateau_detection.plateau_duration == 100
    assert dyn.plateau_detection.plateau_severity.value == "Moderate"  # 100 of 200 steps
    assert dyn.plateau_detection.suggested_actions
    conv = report.network_level_analysis.convergence_indicators
    assert conv.convergence_trend is ConvergenceTrend.STABLE
    assert conv.estimated_steps_to_convergence is None


def test_layers_driven_by_one_signal_interact_strongly(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    signal = np.exp(rng.normal(0.0, 0.3, 200))
    other = np.exp(rng.normal(0.0, 0.3, 200))
    norms = np.vstack([signal, 3.0 * signal, other, 1.0 / signal])
    names = ["a", "b", "c", "d"]
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, names=names))
    pairs = {(x.layer1, x.layer2): x for x in report.network_level_analysis.layer_interactions}
    assert list(pairs) == [("a", "b"), ("a", "c"), ("b", "c"), ("b", "d"), ("c", "d")]
    ab = pairs[("a", "b")]
    assert ab.correlation == pytest.approx(1.0)
    assert ab.interaction_strength == pytest.approx(1.0)
    assert ab.interaction_type is InteractionType.COOPERATIVE
    assert ab.samples == 199
    strongest = max(np.mean(3.0 * signal), np.mean(1.0 / signal), np.mean(other))
    assert ab.impact_score == pytest.approx(np.mean(3.0 * signal) / strongest)
    assert pairs[("b", "d")].interaction_type is InteractionType.COMPETITIVE
    assert pairs[("b", "d")].correlation == pytest.approx(-1.0)
    for key in [("a", "c"), ("b", "c"), ("c", "d")]:
        assert pairs[key].interaction_type is InteractionType.NEUTRAL
        assert pairs[key].interaction_strength < 0.3


def test_interaction_with_an_exploding_layer_is_disruptive(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    signal = np.exp(rng.normal(0.0, 0.3, 100))
    norms = np.vstack([signal, 2.0 * signal])
    peak = norms / 10.0
    peak[0, 50] = 5e3  # max |g| above the exploding threshold once
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, max_abs=peak))
    (pair,) = report.network_level_analysis.layer_interactions
    assert pair.interaction_type is InteractionType.DISRUPTIVE
    layer0 = report.layer_details[0].health_metrics
    assert layer0.exploding_steps == 1
    assert layer0.overall_health is LayerHealth.CRITICAL


def test_interaction_window(tmp_path: Path) -> None:
    norms = np.exp(np.random.default_rng(1).normal(0, 0.2, (5, 30)))
    path = write_history(tmp_path / "s.duckdb", norms)
    one = analysis_of(path, interaction_window=1).network_level_analysis.layer_interactions
    assert len(one) == 4
    everything = analysis_of(path, interaction_window=10)
    assert len(everything.network_level_analysis.layer_interactions) == 10
    assert everything.interaction_window == 10


def test_comparative_analysis(tmp_path: Path) -> None:
    t = np.arange(40)
    norms = np.vstack([
        np.where(t % 2 == 0, 0.9, 1.1),   # mean 1
        np.where(t % 2 == 0, 1.1, 0.9),   # mean 1, same spread: similar
        np.full(40, 10.0),
        np.full(40, 100.0),
    ])
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, names=list("abcd")))
    comp = {d.layer_name: d.comparative_analysis for d in report.layer_details}
    assert [comp[n].rank_among_layers for n in "abcd"] == [3, 3, 2, 1]
    assert comp["d"].relative_performance == pytest.approx(100 / 4)
    assert comp["d"].performance_gap == pytest.approx(96)
    assert comp["a"].relative_performance == pytest.approx(1 / 37)
    assert comp["a"].similar_layers == ["b"]
    assert comp["b"].similar_layers == ["a"]
    assert comp["c"].similar_layers == []
    none = analysis_of(write_history(tmp_path / "t.duckdb", norms), similar_count=0)
    assert all(d.comparative_analysis.similar_layers == [] for d in none.layer_details)


def test_gradient_distribution(tmp_path: Path) -> None:
    same = analysis_of(write_history(tmp_path / "s.duckdb", np.ones((5, 10))))
    dist = same.network_level_analysis.gradient_distribution
    assert dist.distribution_type is DistributionType.DEGENERATE
    assert dist.layer_gradient_ratios == {f"layer{i}": 1.0 for i in range(5)}
    means = np.r_[np.ones(19), 100.0][:, None] * np.ones((20, 10))
    skewed = analysis_of(write_history(tmp_path / "t.duckdb", means))
    dist = skewed.network_level_analysis.gradient_distribution
    assert dist.distribution_type is DistributionType.SKEWED
    assert dist.mean_gradient_norm == pytest.approx(119 / 20)
    assert dist.layer_gradient_ratios["layer19"] == pytest.approx(100 / (119 / 20))


def test_hierarchy_groups_levels_and_cross_level_direction(tmp_path: Path) -> None:
    """Level 0 (mean ~40) leads level 1 (means ~0.5, ~0.3) by one step; a zero layer
    forms its own group."""
    rng = np.random.default_rng(11)
    s = np.exp(rng.normal(0.0, 0.2, 301))
    lead, lagged = s[1:], s[:-1]
    norms = np.vstack([40.0 * lead, 0.5 * lagged, 0.3 * lagged, np.zeros(300)])
    names = ["big", "mid_a", "mid_b", "dead"]
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, names=names,
                                       numel=[100, 200, 300, 400]))
    h = report.gradient_hierarchy
    assert [g.layers for g in h.layer_groups] == [["big"], ["mid_a", "mid_b"], ["dead"]]
    assert [g.group_name for g in h.layer_groups] == [
        "mean norm [1e1, 1e2)", "mean norm [1e-1, 1e0)", "zero gradient"]
    mid = h.layer_groups[1]
    assert mid.group_characteristics.gradient_synchronization == pytest.approx(1.0)
    assert mid.internal_coherence == pytest.approx(1 - abs(math.log10(0.5 / 0.3)))
    assert mid.group_characteristics.average_gradient_norm == pytest.approx(
        (0.5 * lagged.mean() + 0.3 * lagged.mean()) / 2)
    assert h.layer_groups[0].group_characteristics.gradient_synchronization is None
    assert [lv.level_id for lv in h.hierarchy_levels] == [0, 1, 2]
    energy = np.array([1600 * (lead**2).sum(), 0.34 * (lagged**2).sum(), 0.0])
    assert [lv.level_importance for lv in h.hierarchy_levels] == pytest.approx(
        list(energy / energy.sum()))
    assert [lv.optimization_impact for lv in h.hierarchy_levels] == pytest.approx(
        [0.1, 0.5, 0.4])
    (link,) = [c for c in h.cross_level_interactions if (c.from_level, c.to_level) == (0, 1)]
    assert link.interaction_direction is InteractionDirection.TOP_DOWN
    assert link.interaction_strength == pytest.approx(1.0)


def test_priorities_urgency_and_order(tmp_path: Path) -> None:
    t = np.arange(40)
    mean = np.full((4, 40), 1e-2)
    mean[1] = 1e-9                      # vanishing throughout: High
    peak = mean.copy()
    peak[2, -1] = 5e3                   # exploding at the last step: Critical
    norms = mean * 10.0
    norms[3] = np.where(t % 2 == 0, 0.1, 0.3)  # oscillating only: Medium
    mean[3], peak[3] = norms[3] / 10, norms[3] / 10
    names = ["ok", "vanish", "boom", "wobble"]
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, names=names,
                                       mean_abs=mean, max_abs=peak))
    layers = [p for p in report.optimization_priorities
              if p.target_type is OptimizationTarget.INDIVIDUAL_LAYER]
    assert [p.target_name for p in layers] == ["boom", "vanish", "wobble"]
    assert [p.urgency_level for p in layers] == [
        UrgencyLevel.CRITICAL, UrgencyLevel.HIGH, UrgencyLevel.MEDIUM]
    vanish = layers[1]
    assert vanish.priority_score == pytest.approx(1.0)  # flagged at every step
    assert vanish.optimization_potential == pytest.approx(1.0)
    assert vanish.recommended_actions[0].action_type.value == "ParameterAdjustment"
    boom = layers[0]
    assert boom.optimization_potential == pytest.approx(1 / 40)
    # ok, boom and wobble share a decade: 2 of 3 members at risk makes the group Difficult,
    # with the urgency of its worst member and the parameter-weighted mean score.
    group = [p for p in report.optimization_priorities
             if p.target_type is OptimizationTarget.LAYER_GROUP]
    assert [g.target_name for g in group] == ["mean norm [1e-1, 1e0)"]
    assert group[0].urgency_level is UrgencyLevel.CRITICAL
    wobble = layers[2].priority_score
    assert group[0].priority_score == pytest.approx((0.0 + 1 / 40 + wobble) / 3)
    assert [p.urgency_level for p in report.optimization_priorities][:2] == [
        UrgencyLevel.CRITICAL, UrgencyLevel.CRITICAL]
    net = [p for p in report.optimization_priorities
           if p.target_type is OptimizationTarget.NETWORK_LEVEL]
    assert len(net) == 1 and net[0].optimization_potential == pytest.approx(1.0)


def test_neuron_activity_from_the_exponent_histogram(tmp_path: Path) -> None:
    norms = np.ones((2, 3))
    hist = {(0, t): ([0, 130], [25, 75]) for t in range(3)}
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, grad_hist=hist))
    assert report.layer_details[0].health_metrics.neuron_activity_ratio == pytest.approx(0.75)
    assert report.layer_details[1].health_metrics.neuron_activity_ratio is None


def test_parameter_convergence_and_adaptation_from_update_norms(tmp_path: Path) -> None:
    """Weights of norm^2 100 and updates of norm^2 100 * 0.9^(2t): update-to-weight 0.9^t."""
    steps = 30
    norms = np.ones((1, steps))
    weights = {(0, t): np.ones(100) for t in range(steps)}
    update = (100.0 * 0.81 ** np.arange(steps))[None, :]
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, weights=weights,
                                       update_sum_sq=update))
    conv = report.network_level_analysis.convergence_indicators
    assert conv.parameter_convergence_score == pytest.approx(1 - 0.9 ** (steps - 1))
    dyn = report.network_level_analysis.training_dynamics
    assert dyn.adaptation_rate == pytest.approx(np.mean(0.9 ** np.arange(steps)))
    group = report.gradient_hierarchy.layer_groups[0].group_characteristics
    assert group.learning_rate_sensitivity == pytest.approx(np.mean(0.9 ** np.arange(steps)))


def test_nonfinite_is_critical_chaos(tmp_path: Path) -> None:
    bad = np.zeros((2, 10), np.int64)
    bad[1, 4] = 2
    report = analysis_of(write_history(tmp_path / "s.duckdb", np.ones((2, 10)), nonfinite=bad))
    layer = report.layer_details[1].health_metrics
    assert layer.overall_health is LayerHealth.CRITICAL and layer.nonfinite_steps == 1
    kinds = [s.source_type for s in
             report.network_level_analysis.stability_assessment.instability_sources]
    assert kinds == [InstabilityType.CHAOS]
    assert report.network_level_analysis.overall_gradient_health is LayerHealth.CRITICAL


def test_too_few_samples_is_unknown(tmp_path: Path) -> None:
    report = analysis_of(write_history(tmp_path / "s.duckdb", np.ones((2, 2))))
    assert {d.health_metrics.overall_health for d in report.layer_details} == {
        LayerHealth.UNKNOWN}
    assert report.network_level_analysis.overall_gradient_health is LayerHealth.UNKNOWN
    conv = report.network_level_analysis.convergence_indicators
    assert conv.convergence_trend is ConvergenceTrend.UNKNOWN


def test_parameters_and_errors(tmp_path: Path) -> None:
    path = write_history(tmp_path / "s.duckdb", np.ones((1, 5)))
    with pytest.raises(ValueError, match="convergence_window"):
        analysis_of(path, convergence_window=2)
    with pytest.raises(ValueError, match="interaction_window"):
        analysis_of(path, interaction_window=0)
    with pytest.raises(StoreError, match="no gradient rows"):
        analysis_of(path, from_step=100)


def test_model_order_and_strict_json(tmp_path: Path) -> None:
    names = ["z", "m", "a"]
    norms = np.exp(np.random.default_rng(5).normal(0, 0.3, (3, 50)))
    norms[1] = 0.0
    report = analysis_of(write_history(tmp_path / "s.duckdb", norms, names=names))
    assert [d.layer_name for d in report.layer_details] == names
    assert list(report.network_level_analysis.gradient_distribution.layer_gradient_ratios) == (
        names)

    def reject(value: str) -> float:
        raise ValueError(value)

    json.loads(report.model_dump_json(), parse_constant=reject)


# -- the reference's rules (rules="reference"), answers worked out by hand from its formulas


def reference_case(tmp_path: Path, **kw: object) -> EnhancedLayerGradientAnalysis:
    """a rises 1..5; b flat at 1e-6; c flat at 200; d alternates 0, 1000 (5 samples, W = 3).

    Per layer (mean, stability 1 / (1 + std / mean), oscillation reversals / n, risks):
    a: 3, 1 / (1 + sqrt(2) / 3), 0, none -> Healthy; newest-first window 5, 4, 3 has
    slope -1, so its convergence indicator is min(1, 1) = 1 (as written, a rising norm).
    b: 1e-6 < 1e-5 -> Warning; c: 200 > 100 -> Warning; d: 400 > 100, stability 1 / (1 +
    sqrt(240000) / 400) < 0.5, oscillation 3/5 > 0.5 -> three risks, Critical.
    """
    norms = np.array([
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [1e-6] * 5,
        [200.0] * 5,
        [0.0, 1000.0, 0.0, 1000.0, 0.0],
    ])
    path = write_history(tmp_path / "s.duckdb", norms, names=list("abcd"))
    return analysis_of(path, convergence_window=3, rules="reference", **kw)


STAB_A = 1 / (1 + math.sqrt(2) / 3)
STAB_D = 1 / (1 + math.sqrt(240000) / 400)


def test_reference_layer_rules(tmp_path: Path) -> None:
    report = reference_case(tmp_path)
    assert report.rules == "reference"
    by = details(report)
    assert [by[n].health_metrics.overall_health for n in "abcd"] == [
        LayerHealth.HEALTHY, LayerHealth.WARNING, LayerHealth.WARNING, LayerHealth.CRITICAL]
    assert [len(by[n].health_metrics.risk_factors) for n in "abcd"] == [0, 1, 1, 3]
    a, b, d = by["a"], by["b"], by["d"]
    assert a.flow_characteristics.stability_measure == pytest.approx(STAB_A)
    assert d.flow_characteristics.stability_measure == pytest.approx(STAB_D)
    assert a.flow_characteristics.trend_strength == 1.0  # min(|slope 1|, 1)
    assert a.flow_characteristics.smoothness_index == 1.0  # no second difference
    # d: second differences 2000, 2000, 2000 -> 1 / (1 + 2000), in norm units.
    assert d.flow_characteristics.smoothness_index == pytest.approx(1 / 2001)
    assert [by[n].health_metrics.convergence_indicator for n in "abcd"] == [1.0, 0, 0, 0]
    assert b.health_metrics.neuron_activity_ratio == pytest.approx(1 / 11)
    # a: 3 / mean(1e-6, 200, 400) < 0.5 -> potential 0.8; c: 200 / 134.3 -> 0.3.
    assert a.comparative_analysis.optimization_potential == 0.8
    assert by["c"].comparative_analysis.optimization_potential == 0.3
    assert [s.suggestion_type.value for s in d.optimization_suggestions] == [
        "LearningRateAdjustment", "RegularizationAdd"]
    assert [s.suggestion_type.value for s in b.optimization_suggestions] == [
        "WeightInitialization"]


def test_reference_network_rules(tmp_path: Path) -> None:
    """Health: 1 of 4 Critical (> 0.1, not > 0.3) -> Warning. Mean convergence 1/4:
    Diverging (< 0.3), RapidLearning (< 0.4), no plateau. Overall stability (STAB_A + 1 +
    1 + STAB_D) / 4 = 0.782: Degrading at the threshold 0.8, Stable at 0.7; short outlook
    Stable (> 0.7), long Uncertain (not > 0.8)."""
    report = reference_case(tmp_path)
    net = report.network_level_analysis
    assert net.overall_gradient_health is LayerHealth.WARNING
    conv = net.convergence_indicators
    assert conv.gradient_convergence_score == pytest.approx(0.25)
    assert conv.convergence_trend is ConvergenceTrend.DIVERGING
    assert net.training_dynamics.learning_phase is LearningPhase.RAPID_LEARNING
    assert not net.training_dynamics.plateau_detection.is_plateau
    stab = net.stability_assessment
    overall = (STAB_A + 1 + 1 + STAB_D) / 4
    assert stab.overall_stability == pytest.approx(overall)
    assert stab.stability_trend.value == "Degrading" and not stab.above_stability_threshold
    forecast = stab.stability_forecast
    assert (forecast.short_term_outlook.value, forecast.long_term_outlook.value) == (
        "Stable", "Uncertain")
    assert forecast.confidence_level == pytest.approx(overall)
    sources = [(s.source_type, s.affected_layers[0], s.severity)
               for s in stab.instability_sources]
    assert sources == [
        (InstabilityType.GRADIENT_VANISHING, "b", pytest.approx(0.9)),
        (InstabilityType.GRADIENT_EXPLOSION, "c", pytest.approx(2.0)),
        (InstabilityType.GRADIENT_EXPLOSION, "d", pytest.approx(4.0)),
        (InstabilityType.OSCILLATION, "d", pytest.approx(0.6)),
    ]
    (tmp_path / "t").mkdir()
    lower = reference_case(tmp_path / "t", stability_threshold=0.7)
    assert lower.network_level_analysis.stability_assessment.stability_trend.value == "Stable"
    # Interactions by the convergence difference: a (1) vs b (0) Competitive, b vs c
    # Cooperative; strength 1 / (1 + |1e-6 - 200| + 0).
    inter = {(x.layer1, x.layer2): x for x in net.layer_interactions}
    assert inter[("a", "b")].interaction_type is InteractionType.COMPETITIVE
    assert inter[("b", "c")].interaction_type is InteractionType.COOPERATIVE
    assert inter[("b", "c")].interaction_strength == pytest.approx(1 / (1 + 200 - 1e-6))
    groups = [(g.group_name, g.layers) for g in report.gradient_hierarchy.layer_groups]
    assert groups == [("High Gradient Layers", ["a", "c", "d"]),
                      ("Low Gradient Layers", ["b"])]


def test_reference_priority_weighting(tmp_path: Path) -> None:
    """score = min(0.4 w_health + 0.3 (1 - stability) + 0.2 potential + 0.1 flow rate /
    mean norm, 1), w = 1 / 0.7 / 0.3 for Critical / Warning / Healthy; mean norm (3 + 1e-6
    + 200 + 400) / 4; flow rates 4/5, 0, 0, 4000/5."""
    report = reference_case(tmp_path)
    mean_norm = (3 + 1e-6 + 200 + 400) / 4
    expected = {
        "a": 0.4 * 0.3 + 0.3 * (1 - STAB_A) + 0.2 * 0.8 + 0.1 * 0.8 / mean_norm,
        "b": 0.4 * 0.7 + 0.2 * 0.8,
        "c": 0.4 * 0.7 + 0.2 * 0.3,
        "d": 1.0,
    }
    prio = report.optimization_priorities
    assert [p.target_name for p in prio] == ["d", "b", "a", "c"]
    assert {p.target_name: p.priority_score for p in prio} == pytest.approx(expected)
    assert [p.urgency_level for p in prio] == [
        UrgencyLevel.CRITICAL, UrgencyLevel.MEDIUM, UrgencyLevel.LOW, UrgencyLevel.MEDIUM]
    assert all(p.target_type is OptimizationTarget.INDIVIDUAL_LAYER for p in prio)
    assert [a.action_name for a in prio[0].recommended_actions] == [
        "Reduce the learning rate", "Clip the gradient norm"]


def test_reference_convergence_indicator_needs_a_full_window(tmp_path: Path) -> None:
    """Fewer samples than W: 0.5 (the reference's neutral value)."""
    path = write_history(tmp_path / "s.duckdb", np.array([[3.0, 2.0, 1.0]]))
    report = analysis_of(path, convergence_window=5, rules="reference")
    assert report.layer_details[0].health_metrics.convergence_indicator == 0.5
    assert report.network_level_analysis.training_dynamics.learning_phase is \
        LearningPhase.REFINEMENT  # 0.5 < 0.6


@pytest.mark.parametrize(
    ("skew", "kurt", "expected"),
    [(2.01, 0.0, DistributionType.SKEWED), (-2.01, 5.0, DistributionType.SKEWED),
     (2.0, 3.01, DistributionType.HEAVY_TAILED), (0.0, 3.0, DistributionType.NORMAL),
     (0.0, -1.01, DistributionType.MULTIMODAL), (0.0, -1.0, DistributionType.NORMAL)],
)
def test_reference_distribution_type(skew: float, kurt: float,
                                     expected: DistributionType) -> None:
    from analysis.analyses.enhanced.reference import classify_distribution_reference

    assert classify_distribution_reference(skew, kurt) is expected


@pytest.mark.parametrize(
    ("avg", "phase"),
    [(0.19, "InitialLearning"), (0.2, "RapidLearning"), (0.4, "Refinement"),
     (0.6, "Convergence"), (0.8, "Plateau")],
)
def test_reference_learning_phase_bands(avg: float, phase: str) -> None:
    from analysis.analyses.enhanced.reference import learning_phase_reference

    assert learning_phase_reference(avg).value == phase


def test_analysis_depth_and_stability_threshold(tmp_path: Path) -> None:
    norms = np.vstack([np.linspace(1, 2, 8) * k for k in (1.0, 2.0, 3.0, 4.0)])
    path = write_history(tmp_path / "s.duckdb", norms)
    standard = analysis_of(path)
    assert standard.analysis_depth.value == "Standard" and standard.rules == "gradstream"
    assert len(standard.network_level_analysis.layer_interactions) == 3 + 2  # d <= 2
    basic = analysis_of(path, depth="Basic")
    assert basic.network_level_analysis.layer_interactions == []
    assert basic.gradient_hierarchy.layer_groups == []
    full = analysis_of(path, depth="Comprehensive")
    assert len(full.network_level_analysis.layer_interactions) == 6  # every pair
    assert full.interaction_window == 3
    stab = standard.network_level_analysis.stability_assessment
    assert stab.stability_threshold == 0.8
    assert stab.above_stability_threshold == (stab.overall_stability > 0.8)
    strict = analysis_of(path, stability_threshold=1.0)
    assert not strict.network_level_analysis.stability_assessment.above_stability_threshold
    with pytest.raises(ValueError, match="stability_threshold"):
        analysis_of(path, stability_threshold=1.5)


def test_reference_similar_layers_by_ratio(tmp_path: Path) -> None:
    """Means 1.0, 1.1, 1.25, 5: similar when max(m / m', m' / m) <= 1.2 (with the 1e-8
    guard): 1.0 ~ 1.1 (1.1) but not 1.25 (1.25); 1.1 ~ 1.0 and 1.25 (1.14), nearest
    first; 5 has none."""
    norms = np.array([[1.0] * 4, [1.1] * 4, [1.25] * 4, [5.0] * 4])
    path = write_history(tmp_path / "s.duckdb", norms, names=list("abcd"))
    by = details(analysis_of(path, rules="reference"))
    assert by["a"].comparative_analysis.similar_layers == ["b"]
    assert by["b"].comparative_analysis.similar_layers == ["a", "c"]
    assert by["c"].comparative_analysis.similar_layers == ["b"]
    assert by["d"].comparative_analysis.similar_layers == []
    assert by["d"].comparative_analysis.rank_among_layers == 1


@pytest.mark.parametrize(
    ("critical", "warning", "expected"),
    [(4, 0, LayerHealth.CRITICAL), (3, 0, LayerHealth.WARNING), (2, 0, LayerHealth.WARNING),
     (1, 5, LayerHealth.HEALTHY), (1, 6, LayerHealth.WARNING), (0, 0, LayerHealth.HEALTHY)],
)
def test_network_health_keeps_the_reference_ratios(
    critical: int, warning: int, expected: LayerHealth
) -> None:
    """Ten judged layers without threshold risks: Critical above 30 % Critical, Warning
    above 10 % Critical or above 50 % Warning (the reference's rule, kept)."""
    from analysis.analyses.enhanced.network import overall_health

    health = ([LayerHealth.CRITICAL] * critical + [LayerHealth.WARNING] * warning
              + [LayerHealth.HEALTHY] * (10 - critical - warning))
    assert overall_health(health, [["unstable"]] * 10) is expected


def test_reference_rules_agree_with_an_independent_port(tmp_path: Path) -> None:
    """``rules="reference"`` against the straight port of the reference analyzer in
    ``bench/reference_enhanced_port.py`` (written separately, used for the scaling
    benchmark), on random histories at different scales (120 steps, W = 100): per-layer
    health, risks, stability, smoothness, trend strength, oscillation, convergence,
    activity, suggestions, comparisons (every similar layer at Expert depth), every
    pair's interaction, the hierarchy bands."""
    from bench import reference_enhanced_port as port

    rng = np.random.default_rng(7)
    t = np.arange(120, dtype=np.float64)
    rows = [
        rng.lognormal(0.0, 0.3, 120),                     # ~1
        1e-6 * rng.lognormal(0.0, 0.1, 120),              # very low
        200.0 * rng.lognormal(0.0, 0.05, 120),            # very high
        np.where(t % 2 == 0, 0.0, np.where(t % 4 == 1, 1000.0, 3000.0)),  # 3 risks
        0.3 * t + 0.5,                                    # rising: reference convergence
        2.0 * t + 1.0,                                    # rising faster: convergence 1
        5.0 - 0.03 * t,                                   # falling
        0.3 * rng.lognormal(0.0, 0.02, 120),              # medium band
        0.3 * rng.lognormal(0.0, 0.02, 120),              # its twin: similar
        np.full(120, 0.05),                               # low band
    ]
    norms = np.vstack(rows)
    names = [f"l{i}" for i in range(len(rows))]
    path = write_history(tmp_path / "s.duckdb", norms, names=names)
    ours = analysis_of(path, rules="reference", depth="Expert")
    theirs = port.generate_enhanced_analysis(dict(zip(names, norms, strict=True)))
    for d in ours.layer_details:
        ref = theirs["details"][d.layer_name]
        h, f, c = d.health_metrics, d.flow_characteristics, d.comparative_analysis
        assert h.overall_health.value == ref["health"]["health"], d.layer_name
        assert len(h.risk_factors) == len(ref["health"]["risks"]), d.layer_name
        assert h.convergence_indicator == pytest.approx(ref["health"]["convergence"])
        assert h.neuron_activity_ratio == pytest.approx(ref["health"]["activity"])
        assert h.information_flow_rate == pytest.approx(ref["health"]["flow_rate"])
        assert f.stability_measure == pytest.approx(ref["flow"]["stability"])
        assert f.smoothness_index == pytest.approx(ref["flow"]["smoothness"])
        assert f.trend_strength == pytest.approx(ref["flow"]["trend"])
        assert f.oscillation_frequency == pytest.approx(ref["flow"]["oscillation"])
        assert [s.suggestion_type.value for s in d.optimization_suggestions] == \
            ref["suggestions"]
        assert c.relative_performance == pytest.approx(ref["compare"]["relative"])
        assert c.rank_among_layers == ref["compare"]["rank"]
        assert c.optimization_potential == ref["compare"]["potential"]
        assert sorted(c.similar_layers) == sorted(ref["compare"]["similar"])
    assert "l8" in details(ours)["l7"].comparative_analysis.similar_layers
    kinds = {x.interaction_type.value for x in ours.network_level_analysis.layer_interactions}
    assert kinds == {"Cooperative", "Competitive", "Neutral"}
    assert {d.health_metrics.overall_health.value for d in ours.layer_details} == {
        "Healthy", "Warning", "Critical"}
    pairs = {(x.layer1, x.layer2): x for x in ours.network_level_analysis.layer_interactions}
    assert len(pairs) == len(theirs["interactions"]) == len(rows) * (len(rows) - 1) // 2
    for a, b, strength, kind, _ in theirs["interactions"]:
        x = pairs[(a, b)]
        assert x.interaction_strength == pytest.approx(strength)
        assert x.interaction_type.value == kind
    assert ours.network_level_analysis.convergence_indicators.gradient_convergence_score == \
        pytest.approx(theirs["convergence"])
    groups = {g.group_name.split()[0].lower(): sorted(g.layers)
              for g in ours.gradient_hierarchy.layer_groups}
    assert groups == {k: sorted(v) for k, v in theirs["groups"].items() if v}
