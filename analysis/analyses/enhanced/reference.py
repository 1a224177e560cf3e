"""The reference's rules of the enhanced analysis (trustformers-debug,
``gradient_debugger::enhanced_analysis``, ``EnhancedGradientAnalyzer``), used by
:mod:`analysis.analyses.enhanced` with ``rules="reference"``.

:func:`reference_facts` computes the reference's per-layer figures (vectorised over the
layers, O(layers x steps)); :func:`apply_reference_rules` rewrites the parts of a report
built with gradstream's rules whose verdicts the reference decides differently: per-layer
risk factors and health, flow characteristics, suggestions and comparisons; the network
health, distribution type, interaction types, convergence trend, learning phase, plateau,
stability trend and forecast, instability sources; the hierarchy bands; the priorities.
Figures the reference fills with placeholders (``0.8 x``, ``1.2 x``, ``* 1000``, a
plateau of 10 steps, constant group characteristics, ``impact = 0.5 x strength``) keep
gradstream's measured values under both rules. Each cut-off below is the reference's
constant, in gradient-norm units where it compares a norm.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from analysis.analyses.enhanced.layer_facts import LayerFacts
from analysis.analyses.enhanced.models import (
    ActionType,
    ComparativeAnalysis,
    ConvergenceTrend,
    DistributionType,
    EnhancedLayerGradientAnalysis,
    ImplementationComplexity,
    ImplementationEffort,
    InstabilitySource,
    InstabilityType,
    InteractionType,
    LayerHealth,
    LayerOptimizationSuggestion,
    LearningPhase,
    OptimizationPriority,
    OptimizationTarget,
    PlateauSeverity,
    PrioritizedAction,
    StabilityOutlook,
    StabilityTrend,
    SuggestionType,
    UrgencyLevel,
)
from analysis.blocks.gradient_arrays import GradientHistory, layer_chunks

__all__ = [
    "HIGH_MEAN",
    "LOW_MEAN",
    "ReferenceFacts",
    "apply_reference_rules",
    "classify_distribution_reference",
    "classify_interaction_reference",
    "learning_phase_reference",
    "reference_bands",
    "reference_facts",
]

LOW_MEAN = 1e-5
"""Mean norm below which the reference calls a layer's gradient "very low"."""
HIGH_MEAN = 100.0
"""Mean norm above which the reference calls it "very high" (and an explosion source)."""
SUGGEST_LR_MEAN = 10.0
"""Mean norm above which the reference suggests (and prioritises) a lower learning rate."""
EPSILON = 1e-8
"""The reference's guard in its ratios (``mean + 1e-8``)."""


@dataclass(frozen=True)
class ReferenceFacts:
    """Per-layer figures of the reference (float64 ``[L]`` unless stated, model order).

    Attributes:
        mean, std: population mean and standard deviation of the layer's norms.
        stability: ``min(1 / (1 + std / mean), 1)``; 0 when the mean is 0 or no sample.
        smoothness: ``min(1 / (1 + mean_t |n_t - 2 n_{t-1} + n_{t-2}|), 1)``; 1 for < 3.
        trend_strength: ``min(|b|, 1)``, ``b`` the least-squares slope of the norms
            against the sample index; 0 for < 3 samples. (The reference calls
            ``GradientHistory::get_trend_slope``, whose body is not part of the ported
            module; the analyzer's own ``compute_trend_for_values`` formula is used.)
        oscillation: direction reversals / samples (0 for < 4), as gradstream's.
        convergence: ``compute_convergence_indicator``: 0.5 with fewer than W samples;
            else the slope ``b'`` of the last W norms taken newest first against their
            index, ``min(-b', 1)`` if ``b' < 0``, else 0. As written, ``b' = -b`` (``b``
            the slope in time order), so the indicator is positive when the norm *rises*.
        activity: ``min(mean / (mean + 1e-5), 1)`` (``estimate_neuron_activity_ratio``).
        risks: per layer, the reference's risk-factor texts (gradstream's wording).
        health: per layer: Critical with more than two risk factors, Warning with one or
            two, Healthy without (the reference never says Unknown).
    """

    mean: np.ndarray
    std: np.ndarray
    stability: np.ndarray
    smoothness: np.ndarray
    trend_strength: np.ndarray
    oscillation: np.ndarray
    convergence: np.ndarray
    activity: np.ndarray
    risks: list[list[str]]
    health: list[LayerHealth]


def _index_slope(values: np.ndarray) -> np.ndarray:
    """Least-squares slope of each row against the column index over its non-NaN entries
    (the reference's ``compute_trend_for_values``); 0 for rows with fewer than 3."""
    ok = ~np.isnan(values)
    x = np.broadcast_to(np.arange(values.shape[1], dtype=np.float64), values.shape)
    y = np.where(ok, values, 0.0)
    xm = np.where(ok, x, 0.0)
    n = ok.sum(axis=1).astype(np.float64)
    sx, sy = xm.sum(axis=1), y.sum(axis=1)
    sxy, sx2 = (xm * y).sum(axis=1), (xm * xm).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = (n * sxy - sx * sy) / (n * sx2 - sx * sx)
    return np.where(n >= 3, np.nan_to_num(slope), 0.0)


def reference_facts(history: GradientHistory, facts: LayerFacts, window: int) -> ReferenceFacts:
    """The reference's per-layer figures (see :class:`ReferenceFacts`).

    Args:
        history: the loaded run history; facts: its gradstream :class:`LayerFacts`
            (moments, flow rate and oscillation frequency are shared).
        window: the convergence window W (the reference's ``convergence_window``).

    Returns:
        :class:`ReferenceFacts`.
    """
    packed = history.packed
    x, n = packed.values, packed.counts
    mean, std = facts.moments.mean, facts.moments.std
    with np.errstate(invalid="ignore", divide="ignore"):
        stability = np.minimum(1.0 / (1.0 + std / mean), 1.0)
    stability = np.where((n > 0) & (mean != 0), stability, 0.0)
    # Both row-wise: a chunk of layers at a time, the [L, W] temporaries (second
    # differences, masked products) stay within one chunk, with the bits of one pass.
    avg_d2, slope = np.empty(history.num_layers), np.empty(history.num_layers)
    for rows in layer_chunks(history.num_layers, x.shape[1]):
        part = x[rows]
        d2 = np.abs(part[:, 2:] - 2.0 * part[:, 1:-1] + part[:, :-2])
        valid = ~np.isnan(d2)
        with np.errstate(invalid="ignore", divide="ignore"):
            avg_d2[rows] = np.where(valid, d2, 0.0).sum(axis=1) / valid.sum(axis=1)
        del d2, valid
        slope[rows] = _index_slope(part)
    with np.errstate(invalid="ignore", divide="ignore"):
        smooth = np.minimum(1.0 / (1.0 + avg_d2), 1.0)
    smooth = np.where(n >= 3, smooth, 1.0)
    trend_strength = np.minimum(np.abs(slope), 1.0)
    newest_first = x[:, -window:][:, ::-1] if x.shape[1] else x
    slope_rev = _index_slope(newest_first)
    convergence = np.where(slope_rev < 0, np.minimum(-slope_rev, 1.0), 0.0)
    convergence = np.where(n >= window, convergence, 0.5)
    with np.errstate(invalid="ignore", divide="ignore"):
        activity = np.minimum(mean / (mean + LOW_MEAN), 1.0)
    oscillation = facts.turning.frequency
    risks: list[list[str]] = []
    health: list[LayerHealth] = []
    for i in range(history.num_layers):
        found = []
        if mean[i] < LOW_MEAN:
            found.append(f"Very low gradient magnitude: mean norm {mean[i]:.3g} below 1e-5")
        if mean[i] > HIGH_MEAN:
            found.append(f"Very high gradient magnitude: mean norm {mean[i]:.3g} above 100")
        if stability[i] < 0.5:
            found.append(f"High gradient instability: stability {stability[i]:.2f} below 0.5")
        if oscillation[i] > 0.5:
            found.append(f"High oscillation frequency: {oscillation[i]:.2f} above 0.5")
        risks.append(found)
        health.append(
            LayerHealth.CRITICAL if len(found) > 2
            else LayerHealth.WARNING if found
            else LayerHealth.HEALTHY
        )
    return ReferenceFacts(
        mean=mean, std=std, stability=stability, smoothness=smooth,
        trend_strength=trend_strength, oscillation=oscillation, convergence=convergence,
        activity=np.nan_to_num(activity), risks=risks, health=health,
    )


def classify_distribution_reference(skewness: float, kurtosis: float) -> DistributionType:
    """``classify_distribution_type`` (first match): Skewed if ``|skewness| > 2``,
    HeavyTailed if excess ``kurtosis > 3``, Multimodal if ``kurtosis < -1``, Normal
    otherwise (population moments of the layers' mean norms)."""
    if abs(skewness) > 2.0:
        return DistributionType.SKEWED
    if kurtosis > 3.0:
        return DistributionType.HEAVY_TAILED
    if kurtosis < -1.0:
        return DistributionType.MULTIMODAL
    return DistributionType.NORMAL


def classify_interaction_reference(conv1: float, conv2: float) -> InteractionType:
    """``classify_interaction_type``: with ``d = |conv1 - conv2|`` of the two layers'
    convergence indicators, Cooperative if ``d < 0.1``, Competitive if ``d > 0.5``,
    Neutral otherwise."""
    d = abs(conv1 - conv2)
    if d < 0.1:
        return InteractionType.COOPERATIVE
    if d > 0.5:
        return InteractionType.COMPETITIVE
    return InteractionType.NEUTRAL


def learning_phase_reference(avg_convergence: float) -> LearningPhase:
    """``analyze_training_dynamics``: by the mean convergence indicator, InitialLearning
    < 0.2, RapidLearning < 0.4, Refinement < 0.6, Convergence < 0.8, else Plateau."""
    for bound, phase in ((0.2, LearningPhase.INITIAL_LEARNING),
                         (0.4, LearningPhase.RAPID_LEARNING),
                         (0.6, LearningPhase.REFINEMENT),
                         (0.8, LearningPhase.CONVERGENCE)):
        if avg_convergence < bound:
            return phase
    return LearningPhase.PLATEAU


def reference_bands(means: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """``build_gradient_hierarchy``'s groups: mean norm above 1 ("High Gradient Layers"),
    within [0.1, 1] ("Medium"), below 0.1 ("Low"); empty groups left out.

    Returns:
        ``[(group_name, positions int64[m]), ...]``, high first.
    """
    bands = (
        ("High Gradient Layers", means > 1.0),
        ("Medium Gradient Layers", (means >= 0.1) & (means <= 1.0)),
        ("Low Gradient Layers", means < 0.1),
    )
    return [(name, np.flatnonzero(mask)) for name, mask in bands if mask.any()]


_HEALTH_WEIGHT = {
    LayerHealth.CRITICAL: 1.0, LayerHealth.WARNING: 0.7, LayerHealth.HEALTHY: 0.3,
    LayerHealth.UNKNOWN: 0.5,
}


def _overall_health(health: list[LayerHealth]) -> LayerHealth:
    """``assess_overall_health``: Critical if more than 30 % of the layers are Critical,
    Warning if more than 10 % are Critical or more than 50 % Warning, else Healthy."""
    judged = [h for h in health if h is not LayerHealth.UNKNOWN]
    if not judged:
        return LayerHealth.HEALTHY
    critical = sum(h is LayerHealth.CRITICAL for h in judged) / len(judged)
    warning = sum(h is LayerHealth.WARNING for h in judged) / len(judged)
    if critical > 0.3:
        return LayerHealth.CRITICAL
    if critical > 0.1 or warning > 0.5:
        return LayerHealth.WARNING
    return LayerHealth.HEALTHY


def _comparisons(
    history: GradientHistory, ref: ReferenceFacts, similar_count: int
) -> list[ComparativeAnalysis]:
    """``compare_with_other_layers``: relative performance, rank and gap as gradstream's;
    similar layers those with ``max(m / (m' + 1e-8), m' / (m + 1e-8)) <= 1.2`` (nearest
    first, at most ``similar_count``); ``optimization_potential`` 0.8 if the relative
    performance is below 0.5, 0.6 below 0.8, else 0.3 (one layer alone: 0.5).

    The ratio test is the pair of bounds ``m / 1.2 - 1e-8 <= m' <= 1.2 (m + 1e-8)``, so
    the nearest similar layers are found among the ``similar_count`` neighbours on each
    side in sorted order: O(L log L + L x similar_count) instead of the reference's
    O(L^2).
    """
    means = ref.mean
    count = means.size
    total = float(means.sum())
    order = np.argsort(means, kind="stable")
    position = np.empty(count, dtype=np.int64)
    position[order] = np.arange(count)
    ascending = means[order]
    larger = count - np.searchsorted(ascending, means, side="right")
    out = []
    for i in range(count):
        if count == 1:
            out.append(ComparativeAnalysis(
                relative_performance=1.0, rank_among_layers=1, similar_layers=[],
                performance_gap=0.0, optimization_potential=0.5,
            ))
            continue
        m = float(means[i])
        avg_other = (total - m) / (count - 1)
        relative = m / avg_other if avg_other > 0 else 1.0
        p = int(position[i])
        lo, hi = max(p - similar_count, 0), min(p + similar_count + 1, count)
        candidates = [int(order[q]) for q in range(lo, hi) if q != p]
        close = [
            j for j in candidates
            if max(m / (means[j] + EPSILON), means[j] / (m + EPSILON)) <= 1.2
        ]
        close.sort(key=lambda j: (abs(m - means[j]), j))
        potential = 0.8 if relative < 0.5 else 0.6 if relative < 0.8 else 0.3
        out.append(ComparativeAnalysis(
            relative_performance=float(relative),
            rank_among_layers=int(larger[i]) + 1,
            similar_layers=[history.names[j] for j in close[:similar_count]],
            performance_gap=float(abs(m - avg_other)),
            optimization_potential=potential,
        ))
    return out


def _suggestions(ref: ReferenceFacts, i: int) -> list[LayerOptimizationSuggestion]:
    """``generate_layer_optimization_suggestions``: mean below 1e-5, above 10,
    oscillation frequency above 0.5 (gradstream's wording)."""
    mean, oscillation = ref.mean[i], ref.oscillation[i]
    rules = (
        (mean < LOW_MEAN, SuggestionType.WEIGHT_INITIALIZATION,
         "Re-initialise the layer with a better scheme.",
         f"Mean gradient norm {mean:.3g} is below 1e-5.",
         ImplementationComplexity.SIMPLE, ["Training may have to restart from scratch."]),
        (mean > SUGGEST_LR_MEAN, SuggestionType.LEARNING_RATE_ADJUSTMENT,
         "Lower this layer's learning rate.",
         f"Mean gradient norm {mean:.3g} is above 10.",
         ImplementationComplexity.SIMPLE, ["Convergence may slow down."]),
        (oscillation > 0.5, SuggestionType.REGULARIZATION_ADD,
         "Add dropout or weight decay.",
         f"Oscillation frequency {oscillation:.2f} is above 0.5.",
         ImplementationComplexity.MODERATE, ["May reduce the model's capacity."]),
    )
    return [
        LayerOptimizationSuggestion(
            suggestion_type=kind, description=text, rationale=why,
            implementation_complexity=complexity, side_effects=side,
        )
        for hit, kind, text, why, complexity, side in rules if hit
    ]


def _actions(ref: ReferenceFacts, i: int) -> list[PrioritizedAction]:
    """``generate_prioritized_actions``: mean below 1e-5, above 10, stability below 0.5."""
    rules = (
        (ref.mean[i] < LOW_MEAN, "Improve the weight initialisation",
         ActionType.PARAMETER_ADJUSTMENT, ImplementationEffort.MODERATE,
         ["Review of the model architecture"]),
        (ref.mean[i] > SUGGEST_LR_MEAN, "Reduce the learning rate",
         ActionType.LEARNING_RATE_SCHEDULING, ImplementationEffort.MINIMAL, []),
        (ref.stability[i] < 0.5, "Clip the gradient norm",
         ActionType.OPTIMIZATION_TECHNIQUE, ImplementationEffort.LOW,
         ["Hyperparameter tuning"]),
    )
    return [
        PrioritizedAction(
            action_name=name, action_type=kind, implementation_effort=effort,
            prerequisites=prerequisites,
        )
        for hit, name, kind, effort, prerequisites in rules if hit
    ]


def _urgency(health: LayerHealth, stability: float) -> UrgencyLevel:
    """``determine_urgency_level``: Critical health -> Critical; Warning -> High if the
    stability is below 0.3, else Medium; Healthy -> Low; Unknown -> Medium."""
    if health is LayerHealth.CRITICAL:
        return UrgencyLevel.CRITICAL
    if health is LayerHealth.WARNING:
        return UrgencyLevel.HIGH if stability < 0.3 else UrgencyLevel.MEDIUM
    if health is LayerHealth.HEALTHY:
        return UrgencyLevel.LOW
    return UrgencyLevel.MEDIUM


def _instability_sources(history: GradientHistory, ref: ReferenceFacts) -> list[InstabilitySource]:
    """``identify_instability_sources``: per layer, an explosion source if the mean norm
    is above 100 (severity mean / 100), a vanishing source below 1e-5 (severity ``1 - mean
    x 1e5``), an oscillation source above frequency 0.5 (severity the frequency)."""
    out = []
    for i, name in enumerate(history.names):
        m = float(ref.mean[i])
        if m > HIGH_MEAN:
            out.append(InstabilitySource(
                source_type=InstabilityType.GRADIENT_EXPLOSION, affected_layers=[name],
                severity=m / HIGH_MEAN, description=f"High gradient magnitude in {name}.",
            ))
        if m < LOW_MEAN:
            out.append(InstabilitySource(
                source_type=InstabilityType.GRADIENT_VANISHING, affected_layers=[name],
                severity=1.0 - m / LOW_MEAN,
                description=f"Very low gradient magnitude in {name}.",
            ))
        if ref.oscillation[i] > 0.5:
            out.append(InstabilitySource(
                source_type=InstabilityType.OSCILLATION, affected_layers=[name],
                severity=float(ref.oscillation[i]),
                description=f"High oscillation frequency in {name}.",
            ))
    return out


def apply_reference_rules(
    report: EnhancedLayerGradientAnalysis,
    history: GradientHistory,
    facts: LayerFacts,
    ref: ReferenceFacts,
    *,
    stability_threshold: float,
    similar_count: int,
    plateau_duration: int,
    hierarchy_builder: object,
) -> EnhancedLayerGradientAnalysis:
    """The report with the reference's verdicts (see the module docstring).

    Args:
        report: the analysis built with gradstream's rules (same history and facts).
        history, facts: what it was built from; ref: :func:`reference_facts`.
        stability_threshold: the analyzer's ``stability_threshold``: the network's
            stability trend is Stable above it, Degrading otherwise.
        similar_count: most similar layers listed per layer.
        plateau_duration: steps of the measured plateau (gradstream's band rule, used for
            the duration the reference fixes at 10).
        hierarchy_builder: ``callable(facts, groups) -> GradientHierarchy`` (the
            gradstream builder with the reference's bands and health).

    Returns:
        A new :class:`EnhancedLayerGradientAnalysis`.
    """
    comparisons = _comparisons(history, ref, similar_count)
    layers = []
    for i, d in enumerate(report.layer_details):
        flow = d.flow_characteristics.model_copy(update={
            "smoothness_index": float(ref.smoothness[i]),
            "trend_strength": float(ref.trend_strength[i]),
            "stability_measure": float(ref.stability[i]),
        })
        health = d.health_metrics.model_copy(update={
            "overall_health": ref.health[i],
            "gradient_stability": float(ref.stability[i]),
            "neuron_activity_ratio": float(ref.activity[i]),
            "convergence_indicator": float(ref.convergence[i]),
            "risk_factors": ref.risks[i],
        })
        layers.append(d.model_copy(update={
            "flow_characteristics": flow, "health_metrics": health,
            "optimization_suggestions": _suggestions(ref, i),
            "comparative_analysis": comparisons[i],
        }))

    net = report.network_level_analysis
    position = {name: k for k, name in enumerate(history.names)}
    top = float(ref.mean.max()) if ref.mean.size else 0.0
    interactions = []
    for x in net.layer_interactions:
        i, j = position[x.layer1], position[x.layer2]
        strength = 1.0 / (1.0 + abs(ref.mean[i] - ref.mean[j])
                          + abs(ref.stability[i] - ref.stability[j]))
        impact = strength * max(ref.mean[i], ref.mean[j]) / top if top > 0 else 0.0
        interactions.append(x.model_copy(update={
            "interaction_strength": float(strength),
            "interaction_type": classify_interaction_reference(
                float(ref.convergence[i]), float(ref.convergence[j])),
            "impact_score": float(impact),
        }))
    avg_conv = float(ref.convergence.mean()) if ref.convergence.size else 0.0
    conv_trend = (
        ConvergenceTrend.CONVERGING if avg_conv > 0.8
        else ConvergenceTrend.STABLE if avg_conv > 0.6
        else ConvergenceTrend.DIVERGING if avg_conv < 0.3
        else ConvergenceTrend.UNKNOWN
    )
    convergence = net.convergence_indicators.model_copy(update={
        "gradient_convergence_score": avg_conv, "convergence_trend": conv_trend,
    })
    is_plateau = avg_conv > 0.9
    plateau = net.training_dynamics.plateau_detection.model_copy(update={
        "is_plateau": is_plateau,
        "plateau_duration": plateau_duration if is_plateau else 0,
        "plateau_severity": PlateauSeverity.SEVERE if avg_conv > 0.95 else PlateauSeverity.MILD,
        "suggested_actions": (
            ["Consider lowering the learning rate.", "Consider adding regularisation."]
            if is_plateau else []
        ),
    })
    dynamics = net.training_dynamics.model_copy(update={
        "learning_phase": learning_phase_reference(avg_conv), "plateau_detection": plateau,
    })
    overall = float(ref.stability.mean()) if ref.stability.size else 0.0
    stability = net.stability_assessment.model_copy(update={
        "overall_stability": overall,
        "stability_trend": (StabilityTrend.STABLE if overall > stability_threshold
                            else StabilityTrend.DEGRADING),
        "stability_threshold": stability_threshold,
        "above_stability_threshold": overall > stability_threshold,
        "instability_sources": _instability_sources(history, ref),
        "stability_forecast": net.stability_assessment.stability_forecast.model_copy(update={
            "short_term_outlook": (StabilityOutlook.STABLE if overall > 0.7
                                   else StabilityOutlook.DETERIORATING),
            "long_term_outlook": (StabilityOutlook.STABLE if overall > 0.8
                                  else StabilityOutlook.UNCERTAIN),
            "confidence_level": overall,
            "recommended_monitoring": ["Monitor the gradient norms.",
                                       "Track the convergence indicators."],
        }),
    })
    dist = net.gradient_distribution
    distribution = dist.model_copy(update={
        "distribution_type": (
            DistributionType.DEGENERATE if not history.num_layers
            else classify_distribution_reference(dist.gradient_skewness,
                                                 dist.gradient_kurtosis)
        ),
    })
    network = net.model_copy(update={
        "overall_gradient_health": _overall_health(ref.health),
        "gradient_distribution": distribution,
        "layer_interactions": interactions,
        "convergence_indicators": convergence,
        "training_dynamics": dynamics,
        "stability_assessment": stability,
    })

    mean_norm = max(dist.mean_gradient_norm, EPSILON)
    entries = []
    for i, name in enumerate(history.names):
        score = min(
            _HEALTH_WEIGHT[ref.health[i]] * 0.4
            + (1.0 - float(ref.stability[i])) * 0.3
            + comparisons[i].optimization_potential * 0.2
            + float(facts.flow_rate[i]) / mean_norm * 0.1,
            1.0,
        )
        entries.append(OptimizationPriority(
            target_name=name, target_type=OptimizationTarget.INDIVIDUAL_LAYER,
            priority_score=float(score),
            urgency_level=_urgency(ref.health[i], float(ref.stability[i])),
            optimization_potential=comparisons[i].optimization_potential,
            recommended_actions=_actions(ref, i),
        ))
    entries.sort(key=lambda p: -p.priority_score)
    ref_layer_facts = dataclasses.replace(facts, health=ref.health)
    hierarchy = (
        hierarchy_builder(ref_layer_facts, reference_bands(ref.mean))  # type: ignore[operator]
        if report.gradient_hierarchy.layer_groups else report.gradient_hierarchy
    )
    return report.model_copy(update={
        "layer_details": layers, "network_level_analysis": network,
        "gradient_hierarchy": hierarchy, "optimization_priorities": entries,
    })
