"""Network-level part of the enhanced analysis: distribution of the layers, layer
interactions, convergence, training dynamics and stability (formulas in
:mod:`analysis.analyses.enhanced.models`). Semantics follow trustformers-debug's
``enhanced_analysis`` module; where the rules differ, and the reference's rules behind the
option ``rules="reference"``: :mod:`analysis.analyses.enhanced`,
:mod:`analysis.analyses.enhanced.reference` and ``analysis/REFERENCE_DIFFERENCES.md``."""

from __future__ import annotations

import math

import numpy as np

from analysis.analyses.enhanced.layer_facts import (
    RISK_DEAD,
    RISK_EXPLODING,
    RISK_NONFINITE,
    RISK_OSCILLATING,
    RISK_VANISHING,
    LayerFacts,
    convergence_score,
    finite_or,
)
from analysis.analyses.enhanced.models import (
    ConvergenceIndicators,
    ConvergenceTrend,
    DistributionType,
    GradientDistribution,
    InstabilitySource,
    InstabilityType,
    InteractionType,
    LayerHealth,
    LayerInteraction,
    LearningPhase,
    NetworkLevelAnalysis,
    PlateauDetection,
    PlateauSeverity,
    StabilityAssessment,
    StabilityForecast,
    StabilityOutlook,
    StabilityTrend,
    TrainingDynamics,
)
from analysis.blocks import series
from analysis.blocks.gradient_arrays import (
    FLAG_ISSUE,
    FLAG_NONFINITE,
    GradientHistory,
    layer_chunks,
)
from analysis.blocks.significance import family_alpha, pearson_significant, z_critical


def overall_health(health: list[LayerHealth], risks: list[list[str]]) -> LayerHealth:
    """Network health (see :class:`NetworkLevelAnalysis`): the reference
    ``assess_overall_health`` over the judged (not Unknown) layers, raised to Critical by
    any NaN/Inf gradient and to at least Warning by any threshold risk (vanishing, zero,
    exploding), as the run health (``schemas.health``) never calls such a run Healthy;
    Unknown when no layer was judged."""
    judged = [h for h in health if h is not LayerHealth.UNKNOWN]
    if not judged:
        return LayerHealth.UNKNOWN
    found = {r for layer in risks for r in layer}
    critical = sum(h is LayerHealth.CRITICAL for h in judged) / len(judged)
    warning = sum(h is LayerHealth.WARNING for h in judged) / len(judged)
    if critical > 0.3 or RISK_NONFINITE in found:
        return LayerHealth.CRITICAL
    if critical > 0.1 or warning > 0.5 or found & {RISK_VANISHING, RISK_DEAD, RISK_EXPLODING}:
        return LayerHealth.WARNING
    return LayerHealth.HEALTHY


def classify_distribution(values: np.ndarray, alpha: float) -> DistributionType:
    """:class:`DistributionType` of a sample (formulas in its docstring).

    Args:
        values: float64 sample (e.g. the layers' mean norms).
        alpha: significance level.
    """
    n = values.size
    if n < 2 or float(np.var(values)) == 0.0:
        return DistributionType.DEGENERATE
    if n < 4:
        return DistributionType.NORMAL
    mom = series.moments(values[None, :])
    g1, g2 = float(mom.skewness[0]), float(mom.kurtosis[0])
    big_g1 = g1 * math.sqrt(n * (n - 1)) / (n - 2)
    big_g2 = ((n + 1) * g2 + 6) * (n - 1) / ((n - 2) * (n - 3))
    ses = math.sqrt(6.0 * n * (n - 1) / ((n - 2) * (n + 1) * (n + 3)))
    sek = 2.0 * ses * math.sqrt((n * n - 1.0) / ((n - 3) * (n + 5)))
    z = z_critical(alpha)
    if abs(big_g1) / ses > z:
        return DistributionType.SKEWED
    if big_g2 / sek > z:
        return DistributionType.HEAVY_TAILED
    bimodality = (big_g1**2 + 1.0) / (big_g2 + 3.0 * (n - 1) ** 2 / ((n - 2) * (n - 3)))
    if bimodality > 5.0 / 9.0:
        return DistributionType.MULTIMODAL
    return DistributionType.NORMAL


def gradient_distribution(
    history: GradientHistory, facts: LayerFacts, alpha: float
) -> GradientDistribution:
    """Distribution of the layers' mean norms (``analyze_gradient_distribution``)."""
    means = facts.moments.mean
    if means.size == 0:
        return GradientDistribution(
            mean_gradient_norm=0.0, gradient_variance=0.0, gradient_skewness=0.0,
            gradient_kurtosis=0.0, layer_gradient_ratios={},
            distribution_type=DistributionType.DEGENERATE,
        )
    mom = series.moments(means[None, :])
    overall = float(mom.mean[0])
    ratios = means / overall if overall > 0 else np.ones_like(means)
    return GradientDistribution(
        mean_gradient_norm=overall,
        gradient_variance=float(mom.variance[0]),
        gradient_skewness=float(mom.skewness[0]),
        gradient_kurtosis=float(mom.kurtosis[0]),
        layer_gradient_ratios=dict(zip(history.names, ratios.tolist(), strict=True)),
        distribution_type=classify_distribution(means, alpha),
    )


def layer_interactions(
    history: GradientHistory, facts: LayerFacts, window: int, alpha: float
) -> list[LayerInteraction]:
    """Correlations of the log-norm changes of layers ``i`` and ``i + d``,
    ``1 <= d <= window`` (see :class:`LayerInteraction`). O(window x L x T)."""
    changes = facts.log_changes
    count = history.num_layers
    means = facts.moments.mean
    top = float(means.max()) if count else 0.0
    unstable = np.array(
        [RISK_EXPLODING in r or RISK_NONFINITE in r for r in facts.risks], dtype=bool
    )
    distances = range(1, min(window, count - 1) + 1)
    per_pair = family_alpha(alpha, sum(count - d for d in distances))
    tested = []
    for d in distances:
        # Row-wise (pair i is rows i and i + d): a chunk of pairs at a time, the
        # correlation's [pairs, T] temporaries stay within one chunk.
        chunks = layer_chunks(count - d, changes.shape[1])
        r, n = series.concat_rows([
            series.row_pearson(changes[rows], changes[rows.start + d : rows.stop + d])
            for rows in chunks
        ])
        tested.append((r, n, pearson_significant(r, n, per_pair)))
    out: list[LayerInteraction] = []
    for i in range(count):
        for d, (r, n, significant) in enumerate(tested, start=1):
            j = i + d
            if j >= count:
                break
            corr = float(r[i]) if math.isfinite(r[i]) else 0.0
            if not significant[i]:
                kind = InteractionType.NEUTRAL
            elif unstable[i] or unstable[j]:
                kind = InteractionType.DISRUPTIVE
            elif corr > 0:
                kind = InteractionType.COOPERATIVE
            else:
                kind = InteractionType.COMPETITIVE
            impact = abs(corr) * max(means[i], means[j]) / top if top > 0 else 0.0
            out.append(
                LayerInteraction(
                    layer1=history.names[i], layer2=history.names[j], correlation=corr,
                    samples=int(n[i]), interaction_strength=abs(corr), interaction_type=kind,
                    impact_score=float(impact),
                )
            )
    return out


def global_fit(history: GradientHistory, window: int, alpha: float) -> dict[str, object]:
    """Fits of ``ln G`` (``G`` the whole-model gradient norm per step) over the last
    ``window`` steps and over the whole range.

    Returns:
        ``{"log_g": float64 [T], "fit": Trend (last window), "whole": Trend (all steps),
        "turning": TurningPoints (last window), "recent": float64 [<= window]}``.
    """
    with np.errstate(divide="ignore"):
        log_g = np.log(history.global_norm)
    steps = history.steps.astype(np.float64)
    recent_y, recent_x = log_g[-window:], steps[-window:]
    fit = series.trend(recent_y[None, :], recent_x[None, :], alpha)
    whole = series.trend(log_g[None, :], steps[None, :], alpha)
    turning = series.turning_points(
        recent_y[None, :], np.array([np.isfinite(recent_y).sum()]), alpha
    )
    return {"log_g": log_g, "fit": fit, "whole": whole, "turning": turning,
            "recent": recent_y}


def convergence_indicators(
    history: GradientHistory, window: int, alpha: float, fits: dict[str, object]
) -> ConvergenceIndicators:
    """Fitted gradient and parameter convergence (see :class:`ConvergenceIndicators`)."""
    fit: series.Trend = fits["fit"]  # type: ignore[assignment]
    turning: series.TurningPoints = fits["turning"]  # type: ignore[assignment]
    elements = float(history.row_numel.sum())
    floor = history.vanishing_threshold * math.sqrt(max(elements, 1.0))
    n_fit = int(fit.n[0])
    slope = float(fit.slope[0])
    overflow = bool(((history.flags[:, -window:] & FLAG_NONFINITE) != 0).any())
    if overflow:
        trend = ConvergenceTrend.DIVERGING
    elif n_fit < 3 or not math.isfinite(slope):
        trend = ConvergenceTrend.UNKNOWN
    elif turning.oscillating[0]:
        trend = ConvergenceTrend.OSCILLATING
    elif fit.significant[0] and slope < 0:
        trend = ConvergenceTrend.CONVERGING
    elif fit.significant[0] and slope > 0:
        trend = ConvergenceTrend.DIVERGING
    else:
        trend = ConvergenceTrend.STABLE
    score = float(convergence_score(fit.slope, fit.span)[0]) if n_fit >= 3 else 0.0
    steps_left: int | None = None
    if trend is ConvergenceTrend.CONVERGING:
        gap = math.log(floor) - float(fit.intercept_last[0])
        steps_left = 0 if gap >= 0 else math.ceil(gap / slope)

    parameter: float | None = None
    ratio = history.update_ratio[-window:]
    if ratio.size >= 3:
        with np.errstate(divide="ignore"):
            log_r = np.log(ratio)
        pfit = series.trend(
            log_r[None, :], history.update_ratio_steps[-window:].astype(np.float64)[None, :],
            alpha,
        )
        if pfit.n[0] >= 3 and math.isfinite(pfit.slope[0]):
            parameter = float(convergence_score(pfit.slope, pfit.span)[0])
    return ConvergenceIndicators(
        gradient_convergence_score=finite_or(score, 0.0),
        parameter_convergence_score=parameter,
        convergence_trend=trend,
        convergence_floor=floor,
        estimated_steps_to_convergence=steps_left,
        decay_rate=-slope if n_fit >= 3 and math.isfinite(slope) else None,
    )


def training_dynamics(
    history: GradientHistory,
    window: int,
    alpha: float,
    fits: dict[str, object],
    convergence: ConvergenceIndicators,
) -> TrainingDynamics:
    """Learning phase, momentum, velocity, adaptation and plateau (see
    :class:`TrainingDynamics`)."""
    fit: series.Trend = fits["fit"]  # type: ignore[assignment]
    whole: series.Trend = fits["whole"]  # type: ignore[assignment]
    log_g: np.ndarray = fits["log_g"]  # type: ignore[assignment]
    recent: np.ndarray = fits["recent"]  # type: ignore[assignment]
    slope = float(fit.slope[0])
    decreasing = bool(fit.significant[0]) and slope < 0
    at_start = (
        history.run_first_step is not None
        and history.num_steps > 0
        and int(history.steps[0]) <= history.run_first_step
    )
    steps_left = convergence.estimated_steps_to_convergence
    if history.num_steps <= window and at_start:
        phase = LearningPhase.INITIAL_LEARNING
    elif steps_left is not None and steps_left <= window:
        phase = LearningPhase.CONVERGENCE
    elif decreasing and slope < float(whole.slope[0]):
        phase = LearningPhase.RAPID_LEARNING
    elif decreasing:
        phase = LearningPhase.REFINEMENT
    else:
        phase = LearningPhase.PLATEAU

    with np.errstate(invalid="ignore"):
        changes = np.diff(recent)
    changes[~np.isfinite(changes)] = np.nan
    momentum = float(series.lag1_autocorrelation(changes[None, :])[0])
    adaptation = history.update_ratio[-window:]
    is_plateau = phase is LearningPhase.PLATEAU
    duration = measured_plateau_duration(log_g, recent, alpha) if is_plateau else 0
    share = duration / max(history.num_steps, 1)
    severity = (
        PlateauSeverity.MILD if share < 1 / 3
        else PlateauSeverity.MODERATE if share < 2 / 3
        else PlateauSeverity.SEVERE
    )
    actions = []
    if is_plateau:
        actions = [
            "The whole-model gradient norm has stopped falling: try a learning-rate "
            "schedule step (decay or warm restart) to leave the plateau.",
            "Check whether the loss still improves; if it does not, revisit the data "
            "pipeline and regularisation before training longer.",
        ]
    return TrainingDynamics(
        learning_phase=phase,
        gradient_momentum=momentum if math.isfinite(momentum) else None,
        learning_velocity=-slope if math.isfinite(slope) and fit.n[0] >= 3 else None,
        adaptation_rate=float(adaptation.mean()) if adaptation.size else None,
        plateau_detection=PlateauDetection(
            is_plateau=is_plateau, plateau_duration=duration, plateau_severity=severity,
            suggested_actions=actions,
        ),
    )


def measured_plateau_duration(log_g: np.ndarray, recent: np.ndarray, alpha: float) -> int:
    """Plateau length: steps counted back from the last whose ``ln G`` lies within
    ``c +- z s`` of the last window, ``z`` Bonferroni-corrected over the window so that
    noise alone ends the count with probability ``alpha`` (O(T))."""
    finite = recent[np.isfinite(recent)]
    if finite.size == 0:
        return 0
    centre, spread = float(finite.mean()), float(finite.std())
    inside = np.abs(log_g - centre) <= z_critical(family_alpha(alpha, finite.size)) * spread
    outside = np.flatnonzero(~inside)
    return int(log_g.size - (outside[-1] + 1)) if outside.size else int(log_g.size)


def stability_assessment(
    history: GradientHistory,
    facts: LayerFacts,
    window: int,
    alpha: float,
    fits: dict[str, object],
    convergence: ConvergenceIndicators,
) -> StabilityAssessment:
    """Overall stability, its trend, the instability sources and the forecast."""
    overall = float(np.nanmean(facts.stability)) if facts.stability.size else 0.0
    log_g: np.ndarray = fits["log_g"]  # type: ignore[assignment]
    fit: series.Trend = fits["fit"]  # type: ignore[assignment]
    with np.errstate(invalid="ignore"):
        changes = np.diff(log_g)
    changes = changes[np.isfinite(changes)]
    trend = StabilityTrend.STABLE
    enough = changes.size >= 2 * window and window >= 3
    if enough:
        recent, before = changes[-window:], changes[-2 * window : -window]
        v1, v0 = float(recent.var(ddof=1)), float(before.var(ddof=1))
        if v1 > 0 and v0 > 0:
            z = math.log(v1 / v0) / math.sqrt(2.0 / (recent.size - 1) + 2.0 / (before.size - 1))
            if z < -z_critical(alpha):
                trend = StabilityTrend.IMPROVING
            elif z > z_critical(alpha):
                trend = StabilityTrend.DEGRADING
    short = (
        StabilityOutlook.UNCERTAIN if not enough
        else {StabilityTrend.IMPROVING: StabilityOutlook.IMPROVING,
              StabilityTrend.DEGRADING: StabilityOutlook.DETERIORATING,
              StabilityTrend.STABLE: StabilityOutlook.STABLE}[trend]
    )
    long = {
        ConvergenceTrend.CONVERGING: StabilityOutlook.IMPROVING,
        ConvergenceTrend.DIVERGING: StabilityOutlook.DETERIORATING,
        ConvergenceTrend.STABLE: StabilityOutlook.STABLE,
    }.get(convergence.convergence_trend, StabilityOutlook.UNCERTAIN)
    sources = instability_sources(history, facts)
    monitoring = ["Watch the whole-model gradient norm and its trend (gradstream analyze "
                  "--kind enhanced)."]
    for source in sources:
        monitoring.append(
            f"Watch {source.source_type.value} in {len(source.affected_layers)} layer(s) "
            f"({source.severity:.1%} of the parameters)."
        )
    r2 = float(fit.r2[0]) if fit.r2.size else float("nan")
    return StabilityAssessment(
        overall_stability=finite_or(overall, 0.0),
        stability_trend=trend,
        instability_sources=sources,
        stability_forecast=StabilityForecast(
            short_term_outlook=short,
            long_term_outlook=long,
            confidence_level=finite_or(r2, 0.0),
            recommended_monitoring=monitoring,
        ),
    )


_SOURCES = (
    (InstabilityType.GRADIENT_EXPLOSION, RISK_EXPLODING, "exploded in at least one step"),
    (InstabilityType.GRADIENT_VANISHING, RISK_VANISHING, "vanished in at least half of "
     "their steps"),
    (InstabilityType.OSCILLATION, RISK_OSCILLATING, "reverse direction more often than "
     "noise would"),
    (InstabilityType.STAGNATION, RISK_DEAD, "had an exactly zero gradient in at least half "
     "of their steps"),
    (InstabilityType.CHAOS, RISK_NONFINITE, "produced NaN/Inf gradients"),
)


def instability_sources(history: GradientHistory, facts: LayerFacts) -> list[InstabilitySource]:
    """One :class:`InstabilitySource` per kind found (layers in model order)."""
    total = max(float(history.numel.sum()), 1.0)
    out = []
    for kind, risk, what in _SOURCES:
        members = [i for i, r in enumerate(facts.risks) if risk in r]
        if not members:
            continue
        share = float(history.numel[members].sum()) / total
        out.append(
            InstabilitySource(
                source_type=kind,
                affected_layers=[history.names[i] for i in members],
                severity=share,
                description=f"{len(members)} layer(s) holding {share:.1%} of the "
                f"parameters {what}.",
            )
        )
    return out


def issue_step_ratio(history: GradientHistory) -> float:
    """Share of steps with any flagged layer (vanishing, exploding, NaN/Inf, zero)."""
    if history.num_steps == 0:
        return 0.0
    # A chunk of layers at a time: the [L, T] mask stays within one chunk.
    flagged = np.zeros(history.num_steps, dtype=bool)
    for rows in layer_chunks(history.num_layers, history.num_steps):
        flagged |= ((history.flags[rows] & FLAG_ISSUE) != 0).any(axis=0)
    return float(flagged.mean())


def network_level(
    history: GradientHistory,
    facts: LayerFacts,
    window: int,
    interaction_window: int,
    alpha: float,
) -> NetworkLevelAnalysis:
    """Network-level analysis (``analyze_network_level_gradients``) from the facts and the
    whole-model norm."""
    fits = global_fit(history, window, alpha)
    convergence = convergence_indicators(history, window, alpha, fits)
    return NetworkLevelAnalysis(
        overall_gradient_health=overall_health(facts.health, facts.risks),
        gradient_distribution=gradient_distribution(history, facts, alpha),
        layer_interactions=layer_interactions(history, facts, interaction_window, alpha),
        convergence_indicators=convergence,
        training_dynamics=training_dynamics(history, window, alpha, fits, convergence),
        stability_assessment=stability_assessment(
            history, facts, window, alpha, fits, convergence
        ),
    )
