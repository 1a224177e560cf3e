"""Enhanced per-layer gradient analysis (statistics, convergence, stability, hierarchy,
priorities), computed from the stored history of a run. Semantics follow the reference
implementation (trustformers-debug, module ``gradient_debugger::enhanced_analysis``,
``EnhancedGradientAnalyzer``).

:func:`build_enhanced_analysis` loads the run once, computes every per-layer fact in
vectorised passes (:mod:`analysis.analyses.layer_facts`), then the network level
(:mod:`analysis.analyses.network`), the hierarchy (:mod:`analysis.analyses.hierarchy`),
the comparisons (one sort of the layers' means instead of the reference implementation's
rescan of every layer for every layer) and the priorities. Total cost O(layers x steps).
Report models and field formulas: :mod:`analysis.analyses.enhanced_models`.

Options the reference's analyzer has: ``convergence_window`` (``window``, default 100),
``stability_threshold`` (default 0.8) and ``AnalysisDepth`` (``depth``, default Standard;
the reference stores it and never reads it, see
:class:`~analysis.analyses.enhanced_models.AnalysisDepth` for what each level computes).

Differences from the reference (with reasons in ``analysis/REFERENCE_DIFFERENCES.md``;
the option ``rules="reference"`` restores those marked R, from
:mod:`analysis.analyses.enhanced_reference`):

- Placeholders computed from data under both rules: ``parameter_convergence = 0.8 x``
  (fit of the update-to-weight ratio), ``loss_convergence = 0.9 x`` (left out: no loss
  in the telemetry), ``gradient_momentum`` / ``learning_velocity`` / ``adaptation_rate``
  (autocorrelation, decay rate, update ratio), ``plateau_duration 10`` (measured band),
  ``estimated_steps = (1 - score) x 1000`` (fitted decay to a floor), the hierarchy group
  constants (computed from the members), the empty cross-level interactions (lagged
  correlations), ``impact_score = 0.5 x strength``, ``expected_improvement`` /
  ``expected_impact`` (left out: not observable before the change).
- (R) risk factors and ``LayerHealth``: the run's flags (vanishing, zero, exploding,
  NaN/Inf, as health, report and alerts) plus instability and a significant
  turning-point test, instead of mean norm < 1e-5 / > 100, stability < 0.5, oscillation
  frequency > 0.5; NaN/Inf or exploding is Critical; fewer than 3 samples is Unknown.
- (R) ``smoothness_index`` divided by the mean norm; ``trend_strength`` the R^2 of the
  trend, not ``min(|slope|, 1)``; ``stability_measure`` 1 (not 0) for an all-zero layer.
- (R) ``convergence_indicator``: share by which the fitted norm fell over the window
  (``None`` below 3 samples) instead of the clipped slope of the newest-first window
  (0.5 below W samples; as written it is positive when the norm rises).
- (R) ``neuron_activity_ratio``: share of non-zero gradient elements (exponent
  histogram) instead of ``mean / (mean + 1e-5)``.
- (R) ``ComparativeAnalysis``: similar layers by a Welch z-test, not the ratio 1.2;
  ``optimization_potential`` the share of flagged samples, not 0.8 / 0.6 / 0.3 by
  relative performance.
- (R) network health also Critical on NaN/Inf and Warning on any flagged layer.
- (R) ``DistributionType``: significance tests of skewness and kurtosis and the
  bimodality coefficient, not ``|skew| > 2``, ``kurtosis > 3`` / ``< -1``.
- (R) ``LayerInteraction``: correlation of log-norm changes and a Fisher test
  (Cooperative / Competitive / Disruptive / Neutral), not ``1 / (1 + |mean difference| +
  |stability difference|)`` and the convergence difference < 0.1 / > 0.5.
- (R) ``ConvergenceTrend``, ``LearningPhase``, ``PlateauDetection``: fits of the
  whole-model norm, not the mean convergence indicator against 0.8 / 0.6 / 0.3, 0.2 /
  0.4 / 0.6 / 0.8 and 0.9 / 0.95; ``PlateauSeverity`` by the plateau's share of the range.
- (R) ``StabilityTrend``: a variance-ratio test of the recent log changes, not
  ``overall_stability > stability_threshold`` (that comparison is reported beside it);
  forecast from the trends, not 0.7 / 0.8 cut-offs; instability sources from the flags.
- (R) hierarchy: one group per decade of mean norm, not the bands > 1, [0.1, 1], < 0.1.
- (R) priorities: only layers with a risk (plus groups and the network), score ``1 - (1 -
  f) x s``, urgency from the last step, instead of every layer scored ``0.4 health +
  0.3 (1 - stability) + 0.2 potential + 0.1 flow rate / mean norm`` with urgency by
  health.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from analysis.analyses.enhanced_models import (
    ActionType,
    AnalysisDepth,
    ComparativeAnalysis,
    EnhancedLayerGradientAnalysis,
    FlowCharacteristics,
    GradientHierarchy,
    GradientStatistics,
    ImplementationComplexity,
    ImplementationEffort,
    InteractionType,
    LayerGradientDetails,
    LayerHealth,
    LayerHealthMetrics,
    LayerOptimizationSuggestion,
    OptimizationDifficulty,
    OptimizationPriority,
    OptimizationTarget,
    PrioritizedAction,
    SuggestionType,
    UrgencyLevel,
)
from analysis.analyses.hierarchy import build_hierarchy
from analysis.analyses.history import (
    FLAG_DEAD,
    FLAG_EXPLODING,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    GradientHistory,
    load_history,
)
from analysis.analyses.layer_facts import (
    RISK_DEAD,
    RISK_EXPLODING,
    RISK_NONFINITE,
    RISK_OSCILLATING,
    RISK_UNSTABLE,
    RISK_VANISHING,
    LayerFacts,
    compute_layer_facts,
    finite_or,
)
from analysis.analyses.network import (
    global_fit,
    issue_step_ratio,
    measured_plateau_duration,
    network_level,
)
from analysis.analyses.reference import DEFAULT_RULES, Rules
from analysis.analyses.render import (
    ROWS_IN_TABLE,
    add_more_row,
    excluded_text,
    names_text,
    num,
    show_name,
    table,
)
from analysis.analyses.stats import DEFAULT_ALPHA, z_critical
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from analysis.analyses import enhanced_reference
from analysis.read.connect import StoreError
from analysis.read.exclusion import split_patterns
from analysis.registry import Analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb

__all__ = [
    "ANALYSIS",
    "EnhancedLayerGradientAnalysis",
    "EnhancedOptions",
    "build_enhanced_analysis",
    "enhanced_from_history",
    "render_enhanced",
]

DEFAULT_CONVERGENCE_WINDOW = 100
"""Samples in the convergence window (the reference ``EnhancedGradientAnalyzer`` default)."""
DEFAULT_INTERACTION_WINDOW = 2
"""Model-order distance of the layer pairs tested for interactions: 2 reaches a layer's
neighbours and, where parameters come as weight/bias pairs, the next layer's weight."""
DEFAULT_SIMILAR_COUNT = 5
"""Most similar layers listed per layer."""
DEFAULT_STABILITY_THRESHOLD = 0.8
"""The analyzer's ``stability_threshold`` (the reference ``EnhancedGradientAnalyzer``
default)."""


def build_enhanced_analysis(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    *,
    convergence_window: int = DEFAULT_CONVERGENCE_WINDOW,
    interaction_window: int = DEFAULT_INTERACTION_WINDOW,
    similar_count: int = DEFAULT_SIMILAR_COUNT,
    alpha: float = DEFAULT_ALPHA,
    rules: Rules = DEFAULT_RULES,
    depth: AnalysisDepth = AnalysisDepth.STANDARD,
    stability_threshold: float = DEFAULT_STABILITY_THRESHOLD,
    ignore_layers: Sequence[str] = (),
) -> EnhancedLayerGradientAnalysis:
    """The enhanced analysis (``generate_enhanced_analysis``) over one run's stored history.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        convergence_window: W, samples used by the convergence and trend fits (>= 3).
        interaction_window: model-order distance of the layer pairs tested (>= 1).
        similar_count: similar layers listed per layer (>= 0).
        alpha: significance level of the tests, in (0, 1).
        rules: ``"gradstream"`` or ``"reference"`` (the reference's verdicts; see the
            module docstring).
        depth: :class:`~analysis.analyses.enhanced_models.AnalysisDepth`, the sections
            computed.
        stability_threshold: the analyzer's stability threshold, in [0, 1].
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``: the
            layers of the report's exclusion have no vanishing, exploding or dead flag here
            (:func:`analysis.analyses.history.load_history`), so they count in no risk and
            in no network health.

    Returns:
        The :class:`EnhancedLayerGradientAnalysis`.

    Raises:
        StoreError: unknown run, invalid step range, or no gradient rows in the range.
        ValueError: a parameter out of range.
    """
    history = load_history(con, run_id, from_step, to_step, ignore_layers)
    return enhanced_from_history(
        history,
        convergence_window=convergence_window,
        interaction_window=interaction_window,
        similar_count=similar_count,
        alpha=alpha,
        rules=rules,
        depth=depth,
        stability_threshold=stability_threshold,
    )


def enhanced_from_history(
    history: GradientHistory,
    *,
    convergence_window: int = DEFAULT_CONVERGENCE_WINDOW,
    interaction_window: int = DEFAULT_INTERACTION_WINDOW,
    similar_count: int = DEFAULT_SIMILAR_COUNT,
    alpha: float = DEFAULT_ALPHA,
    rules: Rules = DEFAULT_RULES,
    depth: AnalysisDepth = AnalysisDepth.STANDARD,
    stability_threshold: float = DEFAULT_STABILITY_THRESHOLD,
) -> EnhancedLayerGradientAnalysis:
    """The analysis of an already loaded history (see :func:`build_enhanced_analysis`)."""
    if convergence_window < 3:
        raise ValueError(f"convergence_window must be >= 3, got {convergence_window}")
    if interaction_window < 1:
        raise ValueError(f"interaction_window must be >= 1, got {interaction_window}")
    if similar_count < 0:
        raise ValueError(f"similar_count must be >= 0, got {similar_count}")
    if not 0.0 <= stability_threshold <= 1.0:
        raise ValueError(f"stability_threshold must be in [0, 1], got {stability_threshold}")
    if history.num_layers == 0:
        raise StoreError(f"run {history.run_id!r} has no gradient rows in the step range")
    depth = AnalysisDepth(depth)
    if depth in (AnalysisDepth.COMPREHENSIVE, AnalysisDepth.EXPERT):
        interaction_window = max(history.num_layers - 1, 1)  # every pair, as the reference
    if depth is AnalysisDepth.EXPERT:
        similar_count = max(history.num_layers - 1, 0)
    facts = compute_layer_facts(history, convergence_window, alpha)
    comparisons = _comparisons(history, facts, similar_count, alpha)
    details = [
        LayerGradientDetails(
            layer_name=history.names[i],
            layer_index=int(history.layer_index[i]),
            gradient_statistics=_statistics(facts, i),
            flow_characteristics=_flow(facts, i),
            health_metrics=_health(history, facts, i),
            optimization_suggestions=_suggestions(history, facts, i),
            comparative_analysis=comparisons[i],
        )
        for i in range(history.num_layers)
    ]
    basic = depth is AnalysisDepth.BASIC
    network = network_level(
        history, facts, convergence_window, 0 if basic else interaction_window, alpha
    )
    stab = network.stability_assessment
    network = network.model_copy(update={"stability_assessment": stab.model_copy(update={
        "stability_threshold": stability_threshold,
        "above_stability_threshold": stab.overall_stability > stability_threshold,
    })})
    hierarchy = (
        GradientHierarchy(layer_groups=[], hierarchy_levels=[], cross_level_interactions=[])
        if basic else build_hierarchy(history, facts, alpha)
    )
    priorities = _priorities(history, facts, network, hierarchy.layer_groups)
    report = EnhancedLayerGradientAnalysis(
        run_id=history.run_id,
        from_step=history.from_step,
        to_step=history.to_step,
        steps=history.num_steps,
        layers=history.num_layers,
        convergence_window=convergence_window,
        interaction_window=interaction_window,
        alpha=alpha,
        layer_details=details,
        network_level_analysis=network,
        gradient_hierarchy=hierarchy,
        optimization_priorities=priorities,
        rules=rules,
        analysis_depth=depth,
        stability_threshold=stability_threshold,
        ignore_layers=history.exclusion.patterns,
        layers_excluded=[n for n, x in zip(history.names, history.excluded.tolist(),
                                           strict=True) if x],
    )
    if rules != "reference":
        return report
    fits = global_fit(history, convergence_window, alpha)
    return enhanced_reference.apply_reference_rules(
        report, history, facts,
        enhanced_reference.reference_facts(history, facts, convergence_window),
        stability_threshold=stability_threshold,
        similar_count=similar_count,
        plateau_duration=measured_plateau_duration(
            fits["log_g"], fits["recent"], alpha  # type: ignore[arg-type]
        ),
        hierarchy_builder=lambda f, groups: build_hierarchy(history, f, alpha, groups),
    )


def _statistics(facts: LayerFacts, i: int) -> GradientStatistics:
    m = facts.moments
    return GradientStatistics(
        mean=float(m.mean[i]), std=float(m.std[i]), median=float(facts.median[i]),
        percentile_95=float(facts.p95[i]), percentile_5=float(facts.p5[i]),
        samples=int(m.n[i]), variance=float(m.variance[i]), skewness=float(m.skewness[i]),
        kurtosis=float(m.kurtosis[i]),
    )


def _flow(facts: LayerFacts, i: int) -> FlowCharacteristics:
    return FlowCharacteristics(
        consistency_score=float(facts.consistency[i]),
        smoothness_index=float(facts.smoothness[i]),
        trend_strength=finite_or(float(facts.fit.r2[i]), 0.0),
        trend_slope=finite_or(float(facts.fit.slope[i]), 0.0),
        oscillation_frequency=float(facts.turning.frequency[i]),
        oscillation_significant=bool(facts.turning.oscillating[i]),
        stability_measure=float(facts.stability[i]),
    )


def _health(history: GradientHistory, facts: LayerFacts, i: int) -> LayerHealthMetrics:
    activity = float(history.active_fraction[i])
    convergence = float(facts.convergence[i])
    return LayerHealthMetrics(
        overall_health=facts.health[i],
        gradient_stability=float(facts.stability[i]),
        information_flow_rate=float(facts.flow_rate[i]),
        neuron_activity_ratio=activity if math.isfinite(activity) else None,
        convergence_indicator=convergence if math.isfinite(convergence) else None,
        vanishing_fraction=float(facts.vanishing_fraction[i]),
        dead_fraction=float(facts.dead_fraction[i]),
        exploding_steps=int(facts.exploding_steps[i]),
        nonfinite_steps=int(facts.nonfinite_steps[i]),
        risk_factors=[_risk_text(history, facts, i, r) for r in facts.risks[i]],
    )


def _risk_text(history: GradientHistory, facts: LayerFacts, i: int, risk: str) -> str:
    n = int(facts.moments.n[i])
    if risk == RISK_VANISHING:
        return (f"Vanishing gradient: mean |g| below {history.vanishing_threshold:g} in "
                f"{facts.vanishing_fraction[i]:.0%} of {n} steps")
    if risk == RISK_DEAD:
        return f"Zero gradient in {facts.dead_fraction[i]:.0%} of {n} steps"
    if risk == RISK_EXPLODING:
        return (f"Exploding gradient: max |g| above {history.exploding_threshold:g} in "
                f"{facts.exploding_steps[i]} step(s)")
    if risk == RISK_NONFINITE:
        return f"NaN/Inf gradient elements in {facts.nonfinite_steps[i]} step(s)"
    if risk == RISK_UNSTABLE:
        cv = facts.moments.std[i] / facts.moments.mean[i]
        return f"Unstable gradient norm: its std is {cv:.2g} x its mean"
    return (f"Oscillating gradient norm: {facts.turning.count[i]} direction reversals in "
            f"{n} steps (turning-point z = {facts.turning.z[i]:.1f})")


_SUGGESTIONS: dict[str, tuple[SuggestionType, str, ImplementationComplexity, list[str]]] = {
    RISK_VANISHING: (
        SuggestionType.WEIGHT_INITIALIZATION,
        "Re-initialise with a scheme matched to the activation (He/Kaiming for ReLU-like "
        "units, Xavier/Glorot for tanh or sigmoid), or add a residual path around it.",
        ImplementationComplexity.REQUIRES_RETRAINING,
        ["Training restarts from new weights."],
    ),
    RISK_DEAD: (
        SuggestionType.ARCHITECTURAL_MODIFICATION,
        "Check that the layer reaches the loss; if it does, replace activations that can "
        "die (ReLU) by leaky variants or lower the learning rate that killed them.",
        ImplementationComplexity.REQUIRES_RETRAINING,
        ["Changes the model's function; earlier checkpoints no longer match."],
    ),
    RISK_EXPLODING: (
        SuggestionType.LEARNING_RATE_ADJUSTMENT,
        "Lower this layer's learning rate (its own parameter group) and clip the gradient "
        "norm before the optimiser step.",
        ImplementationComplexity.SIMPLE,
        ["Slower progress while the learning rate is lower."],
    ),
    RISK_NONFINITE: (
        SuggestionType.OPTIMIZATION_ALGORITHM,
        "Skip optimiser steps with NaN/Inf gradients and, under mixed precision, use "
        "dynamic loss scaling.",
        ImplementationComplexity.MODERATE,
        ["Skipped steps waste their batch."],
    ),
    RISK_UNSTABLE: (
        SuggestionType.OPTIMIZATION_ALGORITHM,
        "Clip the gradient norm or use an adaptive optimiser (Adam-type) to even out the "
        "update sizes.",
        ImplementationComplexity.SIMPLE,
        ["Clipping biases the update direction when it triggers often."],
    ),
    RISK_OSCILLATING: (
        SuggestionType.LEARNING_RATE_ADJUSTMENT,
        "Lower the learning rate or lengthen its warm-up: the gradient norm flips "
        "direction more often than noise would.",
        ImplementationComplexity.SIMPLE,
        ["Slower progress while the learning rate is lower."],
    ),
}


def _suggestions(
    history: GradientHistory, facts: LayerFacts, i: int
) -> list[LayerOptimizationSuggestion]:
    out = []
    for risk in facts.risks[i]:
        kind, text, complexity, side = _SUGGESTIONS[risk]
        out.append(
            LayerOptimizationSuggestion(
                suggestion_type=kind, description=text,
                rationale=_risk_text(history, facts, i, risk),
                implementation_complexity=complexity, side_effects=side,
            )
        )
    return out


def _comparisons(
    history: GradientHistory, facts: LayerFacts, similar_count: int, alpha: float
) -> list[ComparativeAnalysis]:
    means = facts.moments.mean
    count = means.size
    se2 = np.where(facts.moments.n > 0, facts.moments.variance / facts.moments.n, 0.0)
    order = np.argsort(means, kind="stable")
    position = np.empty(count, dtype=np.int64)
    position[order] = np.arange(count)
    ascending = means[order]
    larger = count - np.searchsorted(ascending, means, side="right")
    total = float(means.sum())
    z = z_critical(alpha)
    out = []
    for i in range(count):
        others = count - 1
        avg_other = (total - means[i]) / others if others else 0.0
        relative = means[i] / avg_other if avg_other > 0 else 1.0
        similar: list[str] = []
        if similar_count and others:
            p = position[i]
            lo, hi = max(p - similar_count, 0), min(p + similar_count + 1, count)
            candidates = [int(order[q]) for q in range(lo, hi) if q != p]
            ok = [
                j for j in candidates
                if abs(means[i] - means[j]) <= z * math.sqrt(se2[i] + se2[j])
            ]
            ok.sort(key=lambda j: (abs(means[i] - means[j]), j))
            similar = [history.names[j] for j in ok[:similar_count]]
        out.append(
            ComparativeAnalysis(
                relative_performance=float(relative),
                rank_among_layers=int(larger[i]) + 1,
                similar_layers=similar,
                performance_gap=float(abs(means[i] - avg_other)) if others else 0.0,
                optimization_potential=float(facts.issue_fraction[i]),
            )
        )
    return out


_ACTIONS: dict[str, list[PrioritizedAction]] = {
    RISK_VANISHING: [PrioritizedAction(
        action_name="Re-initialise the layer (He/Xavier) or add a residual path",
        action_type=ActionType.PARAMETER_ADJUSTMENT,
        implementation_effort=ImplementationEffort.MODERATE,
        prerequisites=["Restart training from the new initialisation"],
    )],
    RISK_DEAD: [PrioritizedAction(
        action_name="Replace dying activations (e.g. LeakyReLU) or reconnect the layer",
        action_type=ActionType.ARCHITECTURAL_CHANGE,
        implementation_effort=ImplementationEffort.HIGH,
        prerequisites=["Model code change", "Retraining"],
    )],
    RISK_EXPLODING: [
        PrioritizedAction(
            action_name="Reduce the learning rate",
            action_type=ActionType.LEARNING_RATE_SCHEDULING,
            implementation_effort=ImplementationEffort.MINIMAL, prerequisites=[],
        ),
        PrioritizedAction(
            action_name="Clip the global gradient norm",
            action_type=ActionType.OPTIMIZATION_TECHNIQUE,
            implementation_effort=ImplementationEffort.LOW, prerequisites=[],
        ),
    ],
    RISK_NONFINITE: [PrioritizedAction(
        action_name="Skip non-finite steps; dynamic loss scaling under mixed precision",
        action_type=ActionType.OPTIMIZATION_TECHNIQUE,
        implementation_effort=ImplementationEffort.LOW, prerequisites=[],
    )],
    RISK_UNSTABLE: [PrioritizedAction(
        action_name="Clip the gradient norm",
        action_type=ActionType.OPTIMIZATION_TECHNIQUE,
        implementation_effort=ImplementationEffort.LOW, prerequisites=[],
    )],
    RISK_OSCILLATING: [PrioritizedAction(
        action_name="Lower the learning rate or lengthen the warm-up",
        action_type=ActionType.LEARNING_RATE_SCHEDULING,
        implementation_effort=ImplementationEffort.MINIMAL, prerequisites=[],
    )],
}

_URGENCY_RANK = {u: k for k, u in enumerate(UrgencyLevel)}


def _actions(risks: list[str]) -> list[PrioritizedAction]:
    seen: dict[str, PrioritizedAction] = {}
    for risk in risks:
        for action in _ACTIONS[risk]:
            seen.setdefault(action.action_name, action)
    return list(seen.values())


def _layer_urgency(facts: LayerFacts, i: int) -> UrgencyLevel:
    last = int(facts.last_flags[i])
    if last & (FLAG_EXPLODING | FLAG_NONFINITE):
        return UrgencyLevel.CRITICAL
    if last & (FLAG_VANISHING | FLAG_DEAD) or facts.health[i] is LayerHealth.CRITICAL:
        return UrgencyLevel.HIGH
    return UrgencyLevel.MEDIUM if facts.risks[i] else UrgencyLevel.LOW


def _priorities(
    history: GradientHistory,
    facts: LayerFacts,
    network: object,
    groups: list,
) -> list[OptimizationPriority]:
    score = 1.0 - (1.0 - facts.issue_fraction) * np.nan_to_num(facts.stability, nan=1.0)
    urgency = [_layer_urgency(facts, i) for i in range(history.num_layers)]
    entries: list[tuple[OptimizationPriority, int]] = []
    for i in range(history.num_layers):
        if not facts.risks[i]:
            continue
        entries.append((OptimizationPriority(
            target_name=history.names[i],
            target_type=OptimizationTarget.INDIVIDUAL_LAYER,
            priority_score=float(score[i]),
            urgency_level=urgency[i],
            optimization_potential=float(facts.issue_fraction[i]),
            recommended_actions=_actions(facts.risks[i]),
        ), int(history.numel[i])))
    position = {name: k for k, name in enumerate(history.names)}
    for group in groups:
        difficulty = group.group_characteristics.optimization_difficulty
        if len(group.layers) < 2 or difficulty not in (OptimizationDifficulty.DIFFICULT,
                                                       OptimizationDifficulty.VERY_DIFFICULT):
            continue  # a one-layer group repeats its layer's entry
        members = np.array([position[n] for n in group.layers], dtype=np.int64)
        weight = history.numel[members].astype(np.float64)
        weight = weight / weight.sum() if weight.sum() > 0 else np.full(members.size,
                                                                        1 / members.size)
        risks = [r for m in members for r in facts.risks[m]]
        entries.append((OptimizationPriority(
            target_name=group.group_name,
            target_type=OptimizationTarget.LAYER_GROUP,
            priority_score=float((score[members] * weight).sum()),
            urgency_level=max((urgency[m] for m in members), key=_URGENCY_RANK.__getitem__),
            optimization_potential=float((facts.issue_fraction[members] * weight).sum()),
            recommended_actions=_actions(risks),
        ), int(history.numel[members].sum())))
    health = network.overall_gradient_health  # type: ignore[attr-defined]
    if health is not LayerHealth.HEALTHY:
        q = issue_step_ratio(history)
        stability = network.stability_assessment.overall_stability  # type: ignore[attr-defined]
        entries.append((OptimizationPriority(
            target_name="network",
            target_type=OptimizationTarget.NETWORK_LEVEL,
            priority_score=float(1.0 - (1.0 - q) * stability),
            urgency_level={LayerHealth.CRITICAL: UrgencyLevel.CRITICAL,
                           LayerHealth.WARNING: UrgencyLevel.HIGH}.get(health,
                                                                       UrgencyLevel.MEDIUM),
            optimization_potential=q,
            recommended_actions=_actions([r for rs in facts.risks for r in rs]),
        ), int(history.numel.sum())))
    entries.sort(key=lambda e: (-_URGENCY_RANK[e[0].urgency_level], -e[0].priority_score,
                                -e[1]))
    return [e[0] for e in entries]


# -- terminal rendering -------------------------------------------------------------------

_HEALTH_STYLE = {
    LayerHealth.HEALTHY: "green", LayerHealth.WARNING: "yellow",
    LayerHealth.CRITICAL: "bold red", LayerHealth.UNKNOWN: "dim",
}
_KIND = {
    OptimizationTarget.INDIVIDUAL_LAYER: "layer", OptimizationTarget.LAYER_GROUP: "group",
    OptimizationTarget.NETWORK_LEVEL: "network",
}
_URGENCY_STYLE = {
    UrgencyLevel.LOW: "green", UrgencyLevel.MEDIUM: "yellow",
    UrgencyLevel.HIGH: "dark_orange", UrgencyLevel.CRITICAL: "bold red",
}


def render_enhanced(report: EnhancedLayerGradientAnalysis) -> RenderableType:
    """Tables of the enhanced analysis for a terminal: network summary, priorities,
    layers (at most ``ROWS_IN_TABLE`` rows each), instability sources, hierarchy and the
    strongest significant interactions.

    Args:
        report: from :func:`build_enhanced_analysis`.

    Returns:
        A rich renderable.
    """
    net = report.network_level_analysis
    conv = net.convergence_indicators
    dyn = net.training_dynamics
    stab = net.stability_assessment
    head = Text("enhanced gradient analysis of run ", style="bold")
    head.append(show_name(report.run_id))
    head.append(f"  ({report.layers} layers, {report.steps} steps, {report.rules} rules, "
                f"{report.analysis_depth.value} depth)", style="dim")
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column()
    health = net.overall_gradient_health
    summary.add_row("overall health", Text(health.value, style=_HEALTH_STYLE[health]))
    if report.ignore_layers:
        summary.add_row("excluded", excluded_text(report.ignore_layers, report.layers_excluded))
    dist = net.gradient_distribution
    summary.add_row("layer norms", f"mean {num(dist.mean_gradient_norm)}, distribution "
                    f"{dist.distribution_type.value}")
    steps_left = conv.estimated_steps_to_convergence
    summary.add_row(
        "convergence",
        f"{conv.convergence_trend.value}, score {num(conv.gradient_convergence_score)}, "
        f"decay {num(conv.decay_rate)}/step, "
        + (f"~{steps_left} steps to floor {num(conv.convergence_floor)}"
           if steps_left is not None else "no floor estimate"),
    )
    if conv.parameter_convergence_score is not None:
        summary.add_row("parameters", f"convergence score {num(conv.parameter_convergence_score)}")
    plateau = dyn.plateau_detection
    summary.add_row(
        "training phase",
        f"{dyn.learning_phase.value}"
        + (f", plateau for {plateau.plateau_duration} steps ({plateau.plateau_severity.value})"
           if plateau.is_plateau else ""),
    )
    summary.add_row(
        "stability",
        f"{num(stab.overall_stability)} "
        f"({'above' if stab.above_stability_threshold else 'not above'} "
        f"{stab.stability_threshold:g}), trend {stab.stability_trend.value}, outlook "
        f"{stab.stability_forecast.short_term_outlook.value} (short) / "
        f"{stab.stability_forecast.long_term_outlook.value} (long)",
    )
    parts: list[RenderableType] = [head, summary]

    prio = table("optimisation priorities", ["target", "kind", "urgency", "score",
                                             "first action"],
                 [False, False, False, True, False])
    for p in report.optimization_priorities[:ROWS_IN_TABLE]:
        actions = p.recommended_actions
        first = actions[0].action_name if actions else "-"
        more = f" (+{len(actions) - 1} more)" if len(actions) > 1 else ""
        prio.add_row(
            show_name(p.target_name), _KIND[p.target_type],
            Text(p.urgency_level.value, style=_URGENCY_STYLE[p.urgency_level]),
            num(p.priority_score), first + more,
        )
    add_more_row(prio, len(report.optimization_priorities), ROWS_IN_TABLE)
    parts.append(prio if report.optimization_priorities
                 else Text("no optimisation priorities: no layer shows a risk", style="green"))

    layers = table(
        "layers (model order): gradient norm statistics",
        ["layer", "health", "mean", "median", "p95", "stability", "risks"],
        [False, False, True, True, True, True, True],
    )
    for d in report.layer_details[:ROWS_IN_TABLE]:
        s, h = d.gradient_statistics, d.health_metrics
        layers.add_row(
            show_name(d.layer_name),
            Text(h.overall_health.value, style=_HEALTH_STYLE[h.overall_health]),
            num(s.mean, 2), num(s.median, 2), num(s.percentile_95, 2),
            num(h.gradient_stability, 2), str(len(h.risk_factors)),
        )
    add_more_row(layers, len(report.layer_details), ROWS_IN_TABLE)
    parts.append(layers)

    if stab.instability_sources:
        src = table("instability sources", ["kind", "layers", "share of params"],
                    [False, False, True])
        for s in stab.instability_sources:
            src.add_row(s.source_type.value, names_text(s.affected_layers), f"{s.severity:.1%}")
        parts.append(src)

    levels = table("gradient hierarchy (levels by mean norm)",
                   ["level", "group", "layers", "sync", "difficulty", "|g|^2", "params"],
                   [True, False, True, True, False, True, True])
    for level, group in zip(report.gradient_hierarchy.hierarchy_levels,
                            report.gradient_hierarchy.layer_groups, strict=True):
        ch = group.group_characteristics
        levels.add_row(str(level.level_id), group.group_name.removeprefix("mean norm "),
                       str(len(group.layers)), num(ch.gradient_synchronization),
                       ch.optimization_difficulty.value, f"{level.level_importance:.1%}",
                       f"{level.optimization_impact:.1%}")
    parts.append(levels)

    strong = sorted((x for x in net.layer_interactions
                     if x.interaction_type is not InteractionType.NEUTRAL),
                    key=lambda x: -x.impact_score)
    if strong:
        inter = table("strongest layer interactions", ["layer 1", "layer 2", "type", "r",
                                                       "impact"],
                      [False, False, False, True, True])
        for x in strong[:ROWS_IN_TABLE]:
            inter.add_row(show_name(x.layer1), show_name(x.layer2), x.interaction_type.value,
                          num(x.correlation), num(x.impact_score))
        add_more_row(inter, len(strong), ROWS_IN_TABLE)
        parts.append(inter)
    return Group(*parts)


# -- registry entry ------------------------------------------------------------------------


class EnhancedOptions(BaseModel):
    """Options of the enhanced analysis (``gradstream analyze --kind enhanced``,
    ``/api/analysis/enhanced``).

    - ``window``: convergence window W, samples used by the convergence and trend fits
      (``convergence_window`` of :func:`build_enhanced_analysis`), >= 3.
    - ``interaction_window``: model-order distance of the layer pairs tested, >= 1.
    - ``alpha``: significance level of the tests, in (0, 1).
    - ``rules``: ``"gradstream"`` (default) or ``"reference"``: the reference's risk
      factors, health, classifications, hierarchy bands and priority weighting (see the
      module docstring).
    - ``depth``: :class:`~analysis.analyses.enhanced_models.AnalysisDepth` (Basic,
      Standard (default), Comprehensive, Expert).
    - ``stability_threshold``: the analyzer's threshold on the overall stability, in
      [0, 1] (default 0.8, the reference's).
    - ``ignore_layers``: comma-separated layer-name patterns excluded besides the run's
      own ``ignore_layers`` (as ``gradstream report --ignore-layers``: the matched layers'
      vanishing, exploding and dead flags count nowhere, NaN/Inf still does;
      :func:`analysis.read.exclusion.run_exclusion`).
    """

    model_config = ConfigDict(frozen=True)

    window: int = Field(default=DEFAULT_CONVERGENCE_WINDOW, ge=3)
    interaction_window: int = Field(default=DEFAULT_INTERACTION_WINDOW, ge=1)
    alpha: float = Field(default=DEFAULT_ALPHA, gt=0.0, lt=1.0)
    rules: Rules = DEFAULT_RULES
    depth: AnalysisDepth = AnalysisDepth.STANDARD
    stability_threshold: float = Field(default=DEFAULT_STABILITY_THRESHOLD, ge=0.0, le=1.0)
    ignore_layers: str = ""


def _build(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    options: EnhancedOptions,
) -> EnhancedLayerGradientAnalysis:
    """:func:`build_enhanced_analysis` with ``options``; raises what it raises."""
    return build_enhanced_analysis(
        con, run_id, from_step, to_step, convergence_window=options.window,
        interaction_window=options.interaction_window, alpha=options.alpha,
        rules=options.rules, depth=options.depth,
        stability_threshold=options.stability_threshold,
        ignore_layers=split_patterns(options.ignore_layers),
    )


ANALYSIS = Analysis(
    name="enhanced",
    help="Per-layer statistics, convergence, stability, layer interactions, hierarchy and "
    "optimisation priorities.",
    options=EnhancedOptions,
    build=_build,
    render=render_enhanced,
)
"""The enhanced analysis's entry in :data:`analysis.registry.ANALYSES`."""
