"""Enhanced per-layer gradient analysis (statistics, convergence, stability, hierarchy,
priorities), computed from the stored history of a run, as the reference
(trustformers-debug, ``gradient_debugger::enhanced_analysis``, ``EnhancedGradientAnalyzer``)
defines it.

:func:`build_enhanced_analysis` loads the run once; :mod:`.compute` computes every
per-layer fact in vectorised passes (:mod:`.layer_facts`), then the network level
(:mod:`.network`), the hierarchy (:mod:`.hierarchy`), the comparisons (one sort of the
layers' means instead of the reference's rescan of every layer for every layer) and the
priorities, O(layers x steps) in total. Report models and field formulas:
:mod:`.models`; terminal tables: :mod:`.render`.

Options the reference's analyzer has: ``convergence_window`` (``window``, default 100),
``stability_threshold`` (default 0.8) and ``AnalysisDepth`` (``depth``, default Standard;
the reference stores it and never reads it, see
:class:`~analysis.analyses.enhanced.models.AnalysisDepth` for what each level computes).

Differences from the reference (with reasons in ``analysis/REFERENCE_DIFFERENCES.md``;
the option ``rules="reference"`` restores those marked R, from
:mod:`analysis.analyses.enhanced.reference`):

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

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from analysis.analyses.enhanced.compute import (
    DEFAULT_CONVERGENCE_WINDOW,
    DEFAULT_INTERACTION_WINDOW,
    DEFAULT_STABILITY_THRESHOLD,
    enhanced_from_history,
)
from analysis.analyses.enhanced.models import (
    AnalysisDepth,
    EnhancedLayerGradientAnalysis,
)
from analysis.analyses.enhanced.render import render_enhanced
from analysis.blocks.gradient_arrays import load_history
from analysis.blocks.rules import DEFAULT_RULES, Rules
from analysis.blocks.significance import DEFAULT_ALPHA
from analysis.read.exclusion import split_patterns
from analysis.registry import Analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb


def build_enhanced_analysis(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    *,
    ignore_layers: Sequence[str] = (),
    **settings: Any,
) -> EnhancedLayerGradientAnalysis:
    """The enhanced analysis (``generate_enhanced_analysis``) over one run's stored history.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        settings: the keyword settings of :func:`.compute.enhanced_from_history`
            (``convergence_window``, ``interaction_window``, ``similar_count``, ``alpha``,
            ``rules``, ``depth``, ``stability_threshold``), each with its default there.
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``: the
            layers of the report's exclusion have no vanishing, exploding or dead flag here
            (:func:`analysis.blocks.gradient_arrays.load_history`), so they count in no risk and
            in no network health.

    Returns:
        The :class:`EnhancedLayerGradientAnalysis`.

    Raises:
        StoreError: unknown run, invalid step range, or no gradient rows in the range.
        ValueError: a parameter out of range.
    """
    history = load_history(con, run_id, from_step, to_step, ignore_layers)
    return enhanced_from_history(history, **settings)


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
    - ``depth``: :class:`~analysis.analyses.enhanced.models.AnalysisDepth` (Basic,
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
