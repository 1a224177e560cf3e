"""The enhanced per-layer analysis computed from a loaded gradient history (see
:mod:`analysis.analyses.enhanced` for the sections and the differences from the reference).
"""

from __future__ import annotations

import math

import numpy as np

from analysis.analyses.enhanced import reference as enhanced_reference
from analysis.analyses.enhanced.hierarchy import build_hierarchy
from analysis.analyses.enhanced.layer_facts import (
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
from analysis.analyses.enhanced.models import (
    ActionType,
    AnalysisDepth,
    ComparativeAnalysis,
    EnhancedLayerGradientAnalysis,
    FlowCharacteristics,
    GradientHierarchy,
    GradientStatistics,
    ImplementationComplexity,
    ImplementationEffort,
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
from analysis.analyses.enhanced.network import (
    global_fit,
    issue_step_ratio,
    measured_plateau_duration,
    network_level,
)
from analysis.blocks.gradient_arrays import (
    FLAG_DEAD,
    FLAG_EXPLODING,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    GradientHistory,
)
from analysis.blocks.rules import DEFAULT_RULES, Rules
from analysis.blocks.significance import DEFAULT_ALPHA, z_critical
from analysis.read.connect import StoreError

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
    """The enhanced analysis of a loaded history (:mod:`analysis.analyses.enhanced`).

    Args:
        history: from :func:`analysis.blocks.gradient_arrays.load_history`.
        convergence_window: W, samples used by the convergence and trend fits (>= 3).
        interaction_window: model-order distance of the layer pairs tested (>= 1).
        similar_count: similar layers listed per layer (>= 0).
        alpha: significance level of the tests, in (0, 1).
        rules: ``"gradstream"`` or ``"reference"`` (the reference's verdicts; see the
            package docstring).
        depth: :class:`~analysis.analyses.enhanced.models.AnalysisDepth`, the sections
            computed.
        stability_threshold: the analyzer's stability threshold, in [0, 1].

    Returns:
        The :class:`~analysis.analyses.enhanced.models.EnhancedLayerGradientAnalysis`.

    Raises:
        StoreError: the history has no rows.
        ValueError: a parameter out of range.
    """
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
        **history.report_header(),
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


_ACTIONS: dict[str, list[tuple[str, ActionType, ImplementationEffort, list[str]]]] = {
    RISK_VANISHING: [
        ("Re-initialise the layer (He/Xavier) or add a residual path",
         ActionType.PARAMETER_ADJUSTMENT, ImplementationEffort.MODERATE,
         ["Restart training from the new initialisation"]),
    ],
    RISK_DEAD: [
        ("Replace dying activations (e.g. LeakyReLU) or reconnect the layer",
         ActionType.ARCHITECTURAL_CHANGE, ImplementationEffort.HIGH,
         ["Model code change", "Retraining"]),
    ],
    RISK_EXPLODING: [
        ("Reduce the learning rate", ActionType.LEARNING_RATE_SCHEDULING,
         ImplementationEffort.MINIMAL, []),
        ("Clip the global gradient norm", ActionType.OPTIMIZATION_TECHNIQUE,
         ImplementationEffort.LOW, []),
    ],
    RISK_NONFINITE: [
        ("Skip non-finite steps; dynamic loss scaling under mixed precision",
         ActionType.OPTIMIZATION_TECHNIQUE, ImplementationEffort.LOW, []),
    ],
    RISK_UNSTABLE: [
        ("Clip the gradient norm", ActionType.OPTIMIZATION_TECHNIQUE,
         ImplementationEffort.LOW, []),
    ],
    RISK_OSCILLATING: [
        ("Lower the learning rate or lengthen the warm-up", ActionType.LEARNING_RATE_SCHEDULING,
         ImplementationEffort.MINIMAL, []),
    ],
}
"""Actions per risk factor: (action name, type, effort, prerequisites)."""

_URGENCY_RANK = {u: k for k, u in enumerate(UrgencyLevel)}


def _actions(risks: list[str]) -> list[PrioritizedAction]:
    seen: dict[str, PrioritizedAction] = {}
    for risk in risks:
        for name, kind, effort, prerequisites in _ACTIONS[risk]:
            seen.setdefault(name, PrioritizedAction(
                action_name=name, action_type=kind, implementation_effort=effort,
                prerequisites=prerequisites,
            ))
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

