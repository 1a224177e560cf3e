"""Report models of the enhanced gradient analysis (per-layer statistics, convergence,
stability, hierarchy, priorities).

Field names and semantics follow the reference (trustformers-debug,
``enhanced_analysis``). Each class docstring gives the formula of its fields; ``n_t``
is a layer's gradient norm (``grad_norm``) at its t-th sample in the range, ``G_t`` the
whole-model gradient norm ``sqrt(sum_l n_l,t^2)``, ``alpha`` the significance level of the
tests (default 0.01; tests repeated per layer or per layer pair use ``alpha`` divided by
their number, Bonferroni, so that a 1000-layer model does not flag layers by chance) and
``W`` the convergence window (default 100 samples, the reference's ``convergence_window``).

Fields of the reference that cannot be computed from gradient telemetry are left out:
``loss_convergence_score`` (the loss is not sent), ``expected_improvement`` and
``expected_impact`` (what a change would achieve is not observable before making it);
``LearningPhase.Overfitting`` is never assigned (it needs a validation loss).

Differences from the reference: each class below gives gradstream's rule and, where the
verdict differs, the reference's; the report option ``rules="reference"`` applies the
reference's rules (:mod:`analysis.analyses.enhanced.reference`). The full list with
reasons is in :mod:`analysis.analyses.enhanced` and ``analysis/REFERENCE_DIFFERENCES.md``. Added
here: :class:`AnalysisDepth` mapped to sections, ``StabilityAssessment.stability_threshold``
/ ``above_stability_threshold``, and fields the reference lacks (``layer_index``,
``trend_slope``, ``oscillation_significant``, the flag fractions and counts,
``correlation``, ``samples``, ``convergence_floor``, ``decay_rate``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class GradientStatistics(_Model):
    """Distribution of a layer's norms over its N samples (the reference
    ``compute_detailed_gradient_stats``): population ``mean``, ``variance``, ``std``;
    ``skewness = mean(((n - mean) / std)^3)``, excess ``kurtosis = mean(((n - mean) /
    std)^4) - 3`` (both 0 when std = 0); with ``s`` the sorted norms, ``median`` the
    middle one (mean of the two middle ones for even N), ``percentile_5 = s[floor(0.05
    N)]``, ``percentile_95 = s[min(floor(0.95 N), N - 1)]``; ``samples = N``."""

    mean: float
    std: float
    median: float
    percentile_95: float
    percentile_5: float
    samples: int
    variance: float
    skewness: float
    kurtosis: float


class FlowCharacteristics(_Model):
    """How a layer's norm moves over time.

    - ``consistency_score``: ``1 / (1 + mean_t |n_t - n_{t-1}| / n_{t-1})`` (as in the
      reference).
    - ``smoothness_index``: ``1 / (1 + mean_t |n_t - 2 n_{t-1} + n_{t-2}| / mean_t n_t)``
      (the reference's second differences, divided by the mean so the index is scale-free).
    - ``trend_strength``: R^2 of the least-squares line of ``n`` against the step (share of
      the variance a linear trend explains; the reference clips the raw slope to 1, which
      depends on the units); ``trend_slope``: that line's slope (norm per step, 0 when
      undefined).
    - ``oscillation_frequency``: direction reversals / N (reference: sign changes of consecutive
      differences over the history length); 0 for N < 4.
    - ``oscillation_significant``: the reversals exceed what an i.i.d. series shows
      (turning-point test at ``alpha / L``).
    - ``stability_measure``: ``1 / (1 + std / mean)`` (as in the reference); 1 for a
      constant series.
    """

    consistency_score: float
    smoothness_index: float
    trend_strength: float
    trend_slope: float
    oscillation_frequency: float
    oscillation_significant: bool
    stability_measure: float


class LayerHealth(StrEnum):
    """Health of one layer (``LayerHealth``):

    - ``Critical``: a NaN/Inf or exploding gradient, or more than two risk factors (as in
      the reference).
    - ``Unknown``: otherwise, fewer than 3 samples (no statistics to judge by).
    - ``Warning``: at least one risk factor.
    - ``Healthy``: none.

    Reference (``rules="reference"``): risk factors mean norm < 1e-5, mean norm > 100,
    ``stability_measure < 0.5``, oscillation frequency > 0.5; Critical with more than two,
    Warning with one or two, Healthy with none, never Unknown. Not the default: health,
    report and alerts judge vanishing and explosion per step by the run's thresholds, and
    a NaN/Inf gradient must never leave a layer Warning.
    """

    HEALTHY = "Healthy"
    WARNING = "Warning"
    CRITICAL = "Critical"
    UNKNOWN = "Unknown"


class LayerHealthMetrics(_Model):
    """Health of a layer.

    - ``gradient_stability``: ``stability_measure``; ``information_flow_rate``:
      ``sum_t |n_t - n_{t-1}| / N`` (as in the reference).
    - ``neuron_activity_ratio``: mean over steps of the share of finite gradient elements
      that are non-zero (``1 - zeros / finite``, zeros from column 0 of the exponent
      histogram); ``None`` when the producer sent no histograms. The reference's
      ``mean / (mean + 1e-5)`` is a squashed magnitude, not an activity.
    - ``convergence_indicator``: ``1 - exp(b x span)`` for ``b < 0``, else 0, with ``b``
      the least-squares slope of ``ln n`` over the layer's last W non-zero samples and
      ``span`` their step range: the share by which the fitted norm fell across the
      window. ``None`` with fewer than 3 such samples (reference: 0.5).
    - ``vanishing_fraction``, ``dead_fraction``: share of samples flagged vanishing
      (``mean_abs_grad < vanishing_threshold``) or exactly zero; ``exploding_steps``,
      ``nonfinite_steps``: samples with ``max_abs_grad > exploding_threshold`` or NaN/Inf.
    - ``risk_factors``: one line per finding: vanishing in at least half of the steps,
      zero in at least half, exploding in any step, NaN/Inf in any step, unstable
      (``stability_measure < 1/2``, i.e. std above mean), significant oscillation.
    """

    overall_health: LayerHealth
    gradient_stability: float
    information_flow_rate: float
    neuron_activity_ratio: float | None
    convergence_indicator: float | None
    vanishing_fraction: float
    dead_fraction: float
    exploding_steps: int
    nonfinite_steps: int
    risk_factors: list[str]


class SuggestionType(StrEnum):
    """Kinds of per-layer optimisation suggestions."""

    WEIGHT_INITIALIZATION = "WeightInitialization"
    LEARNING_RATE_ADJUSTMENT = "LearningRateAdjustment"
    REGULARIZATION_ADD = "RegularizationAdd"
    ARCHITECTURAL_MODIFICATION = "ArchitecturalModification"
    OPTIMIZATION_ALGORITHM = "OptimizationAlgorithm"
    BATCH_NORMALIZATION = "BatchNormalization"
    DROPOUT_ADJUSTMENT = "DropoutAdjustment"


class ImplementationComplexity(StrEnum):
    """What applying a suggestion involves (a property of the kind of change)."""

    SIMPLE = "Simple"
    MODERATE = "Moderate"
    COMPLEX = "Complex"
    REQUIRES_RETRAINING = "RequiresRetraining"


class LayerOptimizationSuggestion(_Model):
    """One suggestion per risk factor of the layer; ``rationale`` quotes the measured
    figure behind it. The reference's ``expected_improvement`` is left out: the effect
    of a change cannot be measured before it is made."""

    suggestion_type: SuggestionType
    description: str
    rationale: str
    implementation_complexity: ImplementationComplexity
    side_effects: list[str]


class ComparativeAnalysis(_Model):
    """A layer against the others (``compare_with_other_layers``), from the
    layers' mean norms ``m`` in one O(L log L) pass (the reference rescans every layer for
    every layer).

    - ``relative_performance``: ``m_l / mean_{k != l} m_k``; 1.0 if that mean is 0.
    - ``rank_among_layers``: 1 + number of layers with a larger mean norm.
    - ``similar_layers``: up to ``similar_count`` (default 5) layers nearest in mean norm
      whose mean is not significantly different (Welch z-test at ``alpha``:
      ``|m_l - m_k| <= z sqrt(s_l^2 / N_l + s_k^2 / N_k)``), nearest first; the reference's
      fixed ratio 1.2 is replaced by the test.
    - ``performance_gap``: ``|m_l - mean_{k != l} m_k|`` (as in the reference).
    - ``optimization_potential``: share of the layer's samples with a vanishing,
      exploding, NaN/Inf or zero gradient: the share of training a fix would recover.
    """

    relative_performance: float
    rank_among_layers: int
    similar_layers: list[str]
    performance_gap: float
    optimization_potential: float


class LayerGradientDetails(_Model):
    """Everything about one layer (``LayerGradientDetails``)."""

    layer_name: str
    layer_index: int
    gradient_statistics: GradientStatistics
    flow_characteristics: FlowCharacteristics
    health_metrics: LayerHealthMetrics
    optimization_suggestions: list[LayerOptimizationSuggestion]
    comparative_analysis: ComparativeAnalysis


class DistributionType(StrEnum):
    """Shape of the distribution of the layers' mean norms (first match wins), from the
    bias-corrected sample skewness ``G1`` and excess kurtosis ``G2`` and their standard
    errors (``SES = sqrt(6 n (n-1) / ((n-2)(n+1)(n+3)))``, ``SEK = 2 SES sqrt((n^2-1) /
    ((n-3)(n+5)))``):

    - ``Degenerate``: fewer than 2 layers or all means equal.
    - ``Skewed``: ``|G1| / SES > z_{1-alpha/2}``.
    - ``HeavyTailed``: ``G2 / SEK > z_{1-alpha/2}``.
    - ``Multimodal``: bimodality coefficient ``(G1^2 + 1) / (G2 + 3 (n-1)^2 / ((n-2)(n-3)))
      > 5/9``, the value of a uniform distribution (Pfister et al. 2013).
    - ``Normal``: none of these (also with fewer than 4 layers, too few to test).

    Reference (``rules="reference"``), population moments: Skewed if ``|skewness| > 2``,
    HeavyTailed if ``kurtosis > 3``, Multimodal if ``kurtosis < -1``, else Normal
    (Degenerate only without layers). Not the default: with tens of layers the sample
    moments scatter past these fixed cut-offs by chance, and ``kurtosis < -1`` is not
    bimodality (a uniform sample has -1.2).
    """

    NORMAL = "Normal"
    SKEWED = "Skewed"
    HEAVY_TAILED = "HeavyTailed"
    MULTIMODAL = "Multimodal"
    DEGENERATE = "Degenerate"


class GradientDistribution(_Model):
    """Distribution of the layers' mean norms ``m_l``: population mean,
    variance, skewness and excess kurtosis (0 when the variance is 0);
    ``layer_gradient_ratios[name] = m_l / mean(m)`` (1.0 when that mean is 0), in model
    order; ``distribution_type``: :class:`DistributionType`."""

    mean_gradient_norm: float
    gradient_variance: float
    gradient_skewness: float
    gradient_kurtosis: float
    layer_gradient_ratios: dict[str, float]
    distribution_type: DistributionType


class InteractionType(StrEnum):
    """Kind of a layer interaction (first match wins):

    - ``Neutral``: the correlation is not significant (Fisher z-test at ``alpha`` divided
      by the number of pairs tested).
    - ``Disruptive``: significant and one of the two layers exploded or had NaN/Inf
      gradients: the coupling carries the instability.
    - ``Cooperative``: significant and positive: the layers' gradients grow and shrink
      together.
    - ``Competitive``: significant and negative: one grows when the other shrinks.

    Reference (``rules="reference"``): from the two layers' convergence indicators,
    Cooperative if they differ by less than 0.1, Competitive by more than 0.5, else
    Neutral (never Disruptive), with ``interaction_strength = 1 / (1 + |mean difference| +
    |stability difference|)``. Not the default: two layers' indicators can be equal without
    their gradients moving together at all.
    """

    COOPERATIVE = "Cooperative"
    COMPETITIVE = "Competitive"
    NEUTRAL = "Neutral"
    DISRUPTIVE = "Disruptive"


class LayerInteraction(_Model):
    """Co-movement of two layers ``layer1`` (model index i) and ``layer2`` (i + d, ``1 <= d
    <= interaction_window``): Pearson correlation ``r`` of their step-to-step log-norm
    changes ``ln n_t - ln n_{t-1}`` over the steps both have one (log changes remove the
    shared downward trend of training that would make any two levels correlate).

    - ``correlation``: r; ``samples``: the paired changes.
    - ``interaction_strength``: ``|r|``.
    - ``interaction_type``: :class:`InteractionType`.
    - ``impact_score``: ``|r| x max(m_1, m_2) / max_l m_l``: strong couplings of layers
      carrying large gradients matter most.

    Only pairs within ``interaction_window`` positions are tested, which keeps the cost
    O(window x layers x steps); the reference compares all pairs (O(L^2)).
    """

    layer1: str
    layer2: str
    correlation: float
    samples: int
    interaction_strength: float
    interaction_type: InteractionType
    impact_score: float


class ConvergenceTrend(StrEnum):
    """Direction of the whole-model gradient norm over the last W steps (first match):
    ``Diverging`` if any gradient overflowed to NaN/Inf there, ``Unknown`` (fewer than 3
    steps), ``Oscillating`` (turning-point test), ``Converging`` / ``Diverging``
    (least-squares slope of ``ln G`` significantly negative / positive), ``Stable``
    (neither)."""

    CONVERGING = "Converging"
    STABLE = "Stable"
    DIVERGING = "Diverging"
    OSCILLATING = "Oscillating"
    UNKNOWN = "Unknown"


class ConvergenceIndicators(_Model):
    """Fitted trend of the gradient (and parameter) convergence.

    With ``ln G_t = a + b t`` fitted over the last W steps:

    - ``gradient_convergence_score``: ``1 - exp(b x span)`` if ``b < 0`` else 0: the share
      by which the fitted whole-model norm fell across the window (span = its steps).
    - ``parameter_convergence_score``: the same fit on the network-wide update-to-weight
      ratio ``sqrt(sum update_sum_sq / sum weight_sum_sq)`` (shrinking relative updates =
      parameters settling); ``None`` without weight statistics (reference: 0.8 x the gradient
      score).
    - ``convergence_trend``: :class:`ConvergenceTrend`.
    - ``convergence_floor``: the norm treated as converged: ``vanishing_threshold x
      sqrt(E)``, ``E`` the gradient elements per step (sum of the layers' merged
      ``numel``): a whole-model norm at which the per-element RMS gradient equals the
      run's vanishing threshold.
    - ``estimated_steps_to_convergence``: for a Converging trend,
      ``ceil((ln floor - (a + b t_last)) / b)`` (0 if the fitted norm is already below the
      floor): the steps until the fitted exponential decay reaches the floor; ``None``
      otherwise (reference: ``(1 - score) x 1000``).
    - ``decay_rate``: ``-b``, the fitted relative decrease of G per step.
    """

    gradient_convergence_score: float
    parameter_convergence_score: float | None
    convergence_trend: ConvergenceTrend
    convergence_floor: float
    estimated_steps_to_convergence: int | None
    decay_rate: float | None


class LearningPhase(StrEnum):
    """Phase of training judged from the whole-model gradient norm (first match):

    - ``InitialLearning``: the range starts at the run's first step and holds at most W
      steps (still inside the first window).
    - ``Convergence``: Converging and the fitted norm reaches the floor within W steps.
    - ``RapidLearning``: the norm falls significantly over the last W steps, faster
      (steeper log slope) than over the whole range.
    - ``Refinement``: it falls significantly, but slower than over the whole range.
    - ``Plateau``: it does not fall significantly.
    - ``Overfitting``: never assigned (needs a validation loss).

    Reference (``rules="reference"``): by the layers' mean convergence indicator,
    InitialLearning < 0.2, RapidLearning < 0.4, Refinement < 0.6, Convergence < 0.8,
    else Plateau. Not the default: that indicator is the clipped slope of the newest-first
    window (positive when the norm rises) or 0.5 before the window fills.
    """

    INITIAL_LEARNING = "InitialLearning"
    RAPID_LEARNING = "RapidLearning"
    REFINEMENT = "Refinement"
    CONVERGENCE = "Convergence"
    PLATEAU = "Plateau"
    OVERFITTING = "Overfitting"


class PlateauSeverity(StrEnum):
    """Length of a plateau as a share of the steps analysed: Mild < 1/3, Moderate < 2/3,
    Severe otherwise. Reference (``rules="reference"``): Severe if the mean convergence
    indicator is above 0.95, else Mild (never Moderate); a plateau when above 0.9."""

    MILD = "Mild"
    MODERATE = "Moderate"
    SEVERE = "Severe"


class PlateauDetection(_Model):
    """Plateau of the whole-model gradient norm.

    - ``is_plateau``: the learning phase is Plateau.
    - ``plateau_duration``: steps, counted back from the last, whose ``ln G`` stays within
      ``c +- z s`` (``c``, ``s``: mean and standard deviation of ``ln G`` over the last W
      steps; ``z = z_{1 - alpha / (2 W)}``, so that noise alone leaves the band within the
      window with probability alpha); 0 when not a plateau (reference: 10).
    - ``plateau_severity``: :class:`PlateauSeverity` of the duration.
    """

    is_plateau: bool
    plateau_duration: int
    plateau_severity: PlateauSeverity
    suggested_actions: list[str]


class TrainingDynamics(_Model):
    """Training dynamics from the whole-model gradient norm over the last W steps.

    - ``learning_phase``: :class:`LearningPhase`.
    - ``gradient_momentum``: lag-1 autocorrelation of the log changes of G: > 0 when a
      change tends to continue, < 0 when it tends to reverse (reference: 0.8 x
      convergence).
    - ``learning_velocity``: ``-b``, the fitted relative decrease of G per step (reference:
      1.2 x convergence).
    - ``adaptation_rate``: mean network-wide update-to-weight ratio: the relative change
      of the weights per step; ``None`` without weight statistics.
    """

    learning_phase: LearningPhase
    gradient_momentum: float | None
    learning_velocity: float | None
    adaptation_rate: float | None
    plateau_detection: PlateauDetection


class StabilityTrend(StrEnum):
    """Change in the volatility of ``ln G``: the variance of its log changes over the
    last W steps against the W before, ``z = ln(F) / sqrt(2 / (n1 - 1) + 2 / (n2 - 1))``
    (large-sample test of a variance ratio F): ``Improving`` if ``z < -z_{1-alpha/2}``,
    ``Degrading`` if ``z > z_{1-alpha/2}``, ``Stable`` otherwise or with too few steps.

    Reference (``rules="reference"``): Stable if ``overall_stability >
    stability_threshold`` (default 0.8), else Degrading (never Improving). Not the
    default: that compares a level with a constant and says nothing about a trend; the
    comparison is reported as ``StabilityAssessment.above_stability_threshold``."""

    IMPROVING = "Improving"
    STABLE = "Stable"
    DEGRADING = "Degrading"


class InstabilityType(StrEnum):
    """Kinds of instability."""

    GRADIENT_EXPLOSION = "GradientExplosion"
    GRADIENT_VANISHING = "GradientVanishing"
    OSCILLATION = "Oscillation"
    STAGNATION = "Stagnation"
    CHAOS = "Chaos"


class InstabilitySource(_Model):
    """One kind of instability and the layers showing it (model order): explosion
    (exploding in any step), vanishing (in at least half of the steps), oscillation
    (significant turning-point test), stagnation (gradient exactly zero in at least half
    of the steps), chaos (NaN/Inf gradients). ``severity``: share of the model's
    parameters in the affected layers."""

    source_type: InstabilityType
    affected_layers: list[str]
    severity: float
    description: str


class StabilityOutlook(StrEnum):
    """Outlook classes of the stability prediction."""

    STABLE = "Stable"
    IMPROVING = "Improving"
    DETERIORATING = "Deteriorating"
    UNCERTAIN = "Uncertain"


class StabilityForecast(_Model):
    """Forecast from the recent trends.

    - ``short_term_outlook``: from the stability trend (Improving -> Improving, Degrading
      -> Deteriorating, Stable -> Stable); Uncertain with fewer than 2 W steps.
    - ``long_term_outlook``: from the convergence trend (Converging -> Improving,
      Diverging -> Deteriorating, Stable -> Stable, else Uncertain).
    - ``confidence_level``: R^2 of the ``ln G`` fit over the last W steps (how much of the
      recent movement the extrapolated trend explains; reference: the stability itself).
    """

    short_term_outlook: StabilityOutlook
    long_term_outlook: StabilityOutlook
    confidence_level: float
    recommended_monitoring: list[str]


class StabilityAssessment(_Model):
    """``overall_stability``: mean of the layers' ``stability_measure`` (as in the
    reference);
    ``stability_trend``: :class:`StabilityTrend`; ``stability_threshold``: the analyzer's
    threshold (the reference's default 0.8) and ``above_stability_threshold``:
    ``overall_stability > stability_threshold``, the reference's test for a Stable trend
    (under ``rules="reference"`` it decides ``stability_trend``; under gradstream's rules
    it is reported beside the measured trend)."""

    overall_stability: float
    stability_trend: StabilityTrend
    instability_sources: list[InstabilitySource]
    stability_forecast: StabilityForecast
    stability_threshold: float = 0.8
    above_stability_threshold: bool = False


class NetworkLevelAnalysis(_Model):
    """Whole-network view. ``overall_gradient_health``: Critical if more than 30 % of the
    judged layers are Critical (as in the reference) or any layer had NaN/Inf gradients (as
    run health); Warning if more than 10 % are Critical or more than 50 % Warning (as in the
    reference) or any layer is vanishing, zero or exploding (the run health of
    ``schemas.health`` never calls that Healthy); Healthy otherwise; Unknown when no layer
    could be judged."""

    overall_gradient_health: LayerHealth
    gradient_distribution: GradientDistribution
    layer_interactions: list[LayerInteraction]
    convergence_indicators: ConvergenceIndicators
    training_dynamics: TrainingDynamics
    stability_assessment: StabilityAssessment


class OptimizationDifficulty(StrEnum):
    """From the share q of a group's layers that are not Healthy: Easy q = 0, Moderate
    q <= 1/3, Difficult q <= 2/3, VeryDifficult above."""

    EASY = "Easy"
    MODERATE = "Moderate"
    DIFFICULT = "Difficult"
    VERY_DIFFICULT = "VeryDifficult"


class GroupCharacteristics(_Model):
    """Characteristics computed from the group's members (the reference hard-codes them).

    - ``average_gradient_norm``: mean of the members' mean norms.
    - ``gradient_synchronization``: mean pairwise correlation of the members' log-norm
      changes, from ``(var(sum_i z_i) - m) / (m (m - 1))`` over the standardised changes
      ``z_i`` (exact when every member has a change at every step; missing changes count
      as zero deviations), O(m x steps); ``None`` for fewer than 2 varying members.
    - ``learning_rate_sensitivity``: mean ``update_to_weight`` of the members (the
      relative weight change per step, which scales with the learning rate); ``None``
      without weight statistics.
    - ``optimization_difficulty``: :class:`OptimizationDifficulty`.
    """

    average_gradient_norm: float
    gradient_synchronization: float | None
    learning_rate_sensitivity: float | None
    optimization_difficulty: OptimizationDifficulty


class LayerGroup(_Model):
    """Layers whose mean norm lies in the same decade ``[10^k, 10^(k+1))`` (a separate
    group for all-zero layers); ``internal_coherence = 1 - 2 std(log10 m)`` over the
    members (a decade-wide group has std <= 1/2, so it is in [0, 1]; 1 for a zero
    group)."""

    group_name: str
    layers: list[str]
    group_characteristics: GroupCharacteristics
    internal_coherence: float


class HierarchyLevel(_Model):
    """One level per group, ``level_id`` 0 for the largest gradients.
    ``level_importance``: the level's share of the squared gradient norm summed over
    layers and steps; ``optimization_impact``: its share of the parameters (``numel``)."""

    level_id: int
    level_name: str
    layer_groups: list[str]
    level_importance: float
    optimization_impact: float


class InteractionDirection(StrEnum):
    """Which level leads, from lag-1 cross-correlations of the levels' mean log-norm
    changes: ``TopDown`` if the larger-gradient level's changes predict the other's next
    change significantly better than the reverse (Fisher z difference test), ``BottomUp``
    the opposite, ``Bidirectional`` otherwise."""

    TOP_DOWN = "TopDown"
    BOTTOM_UP = "BottomUp"
    BIDIRECTIONAL = "Bidirectional"


class CrossLevelInteraction(_Model):
    """Two levels whose mean log-norm changes are significantly correlated at lag 0 or 1
    (Fisher z-tests at ``alpha`` divided by the number of tests); ``interaction_strength``:
    the largest of the three ``|r|`` (reference: always empty)."""

    from_level: int
    to_level: int
    interaction_strength: float
    interaction_direction: InteractionDirection


class GradientHierarchy(_Model):
    """Groups, levels and cross-level interactions."""

    layer_groups: list[LayerGroup]
    hierarchy_levels: list[HierarchyLevel]
    cross_level_interactions: list[CrossLevelInteraction]


class OptimizationTarget(StrEnum):
    """What a priority is about."""

    INDIVIDUAL_LAYER = "IndividualLayer"
    LAYER_GROUP = "LayerGroup"
    NETWORK_LEVEL = "NetworkLevel"


class UrgencyLevel(StrEnum):
    """How pressing a layer's problem is, from its last step in the range: ``Critical`` if
    its gradient is exploding or NaN/Inf there; ``High`` if it is vanishing or zero there,
    or its health is Critical; ``Medium`` for other risk factors; ``Low`` otherwise."""

    LOW = "Low"
    MEDIUM = "Medium"
    HIGH = "High"
    CRITICAL = "Critical"


class ActionType(StrEnum):
    """Kinds of prioritised actions."""

    PARAMETER_ADJUSTMENT = "ParameterAdjustment"
    ARCHITECTURAL_CHANGE = "ArchitecturalChange"
    OPTIMIZATION_TECHNIQUE = "OptimizationTechnique"
    REGULARIZATION_METHOD = "RegularizationMethod"
    LEARNING_RATE_SCHEDULING = "LearningRateScheduling"


class ImplementationEffort(StrEnum):
    """Effort of an action (a property of the kind of change)."""

    MINIMAL = "Minimal"
    LOW = "Low"
    MODERATE = "Moderate"
    HIGH = "High"
    EXTENSIVE = "Extensive"


class PrioritizedAction(_Model):
    """An action for a target; ``expected_impact`` is left out (not observable
    before the change)."""

    action_name: str
    action_type: ActionType
    implementation_effort: ImplementationEffort
    prerequisites: list[str]


class OptimizationPriority(_Model):
    """What to fix first.

    - Layers with at least one risk factor: ``priority_score = 1 - (1 - f) x s`` with
      ``f`` the layer's ``optimization_potential`` (share of flagged samples) and ``s``
      its ``stability_measure``: 0 for a never-flagged, perfectly stable layer, 1 for an
      always-flagged one; ``urgency_level``: :class:`UrgencyLevel`.
    - Groups of at least two layers with difficulty Difficult or VeryDifficult:
      parameter-weighted mean score of their members, urgency the highest of the
      members'.
    - The network, when its health is not Healthy: ``1 - (1 - q) x overall_stability`` with
      q the share of steps with any flagged layer.

    Sorted by urgency, then score, then parameters (descending).

    Reference (``rules="reference"``): every layer, ``priority_score = min(0.4 h + 0.3
    (1 - stability) + 0.2 optimization_potential + 0.1 information_flow_rate /
    mean_gradient_norm, 1)`` with ``h`` 1 / 0.7 / 0.3 / 0.5 for Critical / Warning /
    Healthy / Unknown; urgency Critical for Critical health, High for Warning with
    stability < 0.3, else Medium, Low for Healthy; sorted by score. Not the default: the
    flow-rate term is in units of the norm's variation per step and can alone saturate the
    score, and a healthy layer still gets a priority.
    """

    target_name: str
    target_type: OptimizationTarget
    priority_score: float
    urgency_level: UrgencyLevel
    optimization_potential: float
    recommended_actions: list[PrioritizedAction]


class AnalysisDepth(StrEnum):
    """How much the enhanced analysis computes (the reference's ``AnalysisDepth``, which
    its analyzer stores but never reads; here each level maps to sections):

    - ``Basic``: per-layer details, network health, distribution, convergence, dynamics,
      stability and the layers' priorities; no layer interactions, no hierarchy (empty
      lists).
    - ``Standard`` (default, as in the reference): everything, interactions between layers
      up to ``interaction_window`` apart.
    - ``Comprehensive``: Standard with every pair of layers tested for interactions (the
      reference's all pairs, O(L^2 x steps)).
    - ``Expert``: Comprehensive with every similar layer listed (no ``similar_count``
      cap).
    """

    BASIC = "Basic"
    STANDARD = "Standard"
    COMPREHENSIVE = "Comprehensive"
    EXPERT = "Expert"


class EnhancedLayerGradientAnalysis(_Model):
    """The enhanced analysis (``EnhancedLayerGradientAnalysis``) of one run over an inclusive
    step range.
    ``layer_details`` in model order; ``convergence_window``, ``interaction_window`` and
    ``alpha`` are the parameters used (``interaction_window`` as applied: all pairs at
    Comprehensive and Expert depth); ``rules``, ``analysis_depth`` and
    ``stability_threshold`` the options (:mod:`analysis.blocks.rules`,
    :class:`AnalysisDepth`). ``ignore_layers``: the patterns applied (the run's own,
    then the reader's); ``layers_excluded``: the layers of the range they match, whose
    vanishing, exploding and dead flags count nowhere here (as in ``gradstream
    report``)."""

    run_id: str
    from_step: int | None
    to_step: int | None
    steps: int
    layers: int
    convergence_window: int
    interaction_window: int
    alpha: float
    layer_details: list[LayerGradientDetails]
    network_level_analysis: NetworkLevelAnalysis
    gradient_hierarchy: GradientHierarchy
    optimization_priorities: list[OptimizationPriority]
    rules: Literal["gradstream", "reference"] = "gradstream"
    analysis_depth: AnalysisDepth = AnalysisDepth.STANDARD
    stability_threshold: float = 0.8
    ignore_layers: list[str] = []
    layers_excluded: list[str] = []
