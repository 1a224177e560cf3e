"""Report models of the weight analysis (:mod:`analysis.analyses.weights`): the weight
distribution at one step and the drift between two steps.

Field names and semantics follow the reference (trustformers-debug,
``utilities::weight_analysis``, the ``WeightAnalyzer`` reports); the formula of every field
is in its class docstring. The statistics are computed in :mod:`analysis.analyses.weights.compute`
from the mergeable weight statistics that :mod:`analysis.analyses.weights.load` reads
(:class:`schemas.stats.WeightMoments`).

Differences from the reference (also in ``analysis/REFERENCE_DIFFERENCES.md``; the option
``rules="reference"`` restores those marked R):

- Inputs: the telemetry carries per-layer power sums, extremes, zero counts and an exponent
  histogram, not every weight; the statistics are exact, but per-element results (which
  weight is an outlier: ``weight_index``) are not available.
- (R) ``WeightOutlier``: a layer's min and max tested against an extreme-value bound that
  grows with the layer's size (a normal tensor of n weights has a largest ``|z|`` near
  ``sqrt(2 ln n)``, so ``|z| > 3`` flags about 0.27 % of any healthy tensor); reference:
  ``|z| > 3`` Medium, ``> 5`` High.
- (R) health deduction for extreme values: "the layer has an outlier" (scale-free);
  reference: ``|min|`` or ``|max| > 10`` per layer and ``> 5`` pooled, in weight units.
- (R) ``overall_statistics``: pooled statistics of all weights (each weight once);
  reference: the unweighted average of the per-layer statistics.
- (R) ``entropy``: Shannon entropy (bits) of the exponent histogram; reference:
  ``max(log2 std, 0)``, a scale, not an entropy.
- Skewness and kurtosis need no minimum count (the reference returns 0 below 3 and 4
  weights; with exact power sums a set of 1 or 2 weights has well-defined moments).
- Recommendations: one per issue (the reference matches them to the issue texts by
  case-sensitive substrings, which leaves the heavy-tail and extreme-value issues without
  advice).
- NaN/Inf weights (both rules): counted in ``nonfinite``, excluded from the statistics,
  the layer scores 0 and the distribution is Critical; the reference's statistics turn NaN.
- ``WeightHealth``: declared by the reference and never filled; here it is what
  :func:`analysis.analyses.weights.compute.weight_health` returns, and each
  :class:`LayerWeightAnalysis` copies its ``health_score``, ``issues`` and
  ``recommendations`` from it (the reference's flat fields are kept).
- ``WeightDriftAnalysis``: the reference declares the fields (``mean_drift``,
  ``max_drift``, ``severity``, ``affected_layers``) but no formula; gradstream's
  formulas are in the class docstring. ``WeightDriftSeverity`` bands are gradstream's.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "DistributionHealth",
    "DistributionHealthStatus",
    "LayerWeightAnalysis",
    "LayerWeightDrift",
    "OutlierSeverity",
    "WeightAnalysisReport",
    "WeightDistributionAnalysis",
    "WeightDriftAnalysis",
    "WeightDriftSeverity",
    "WeightHealth",
    "WeightOutlier",
    "WeightStatistics",
]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class WeightStatistics(_Model):
    """Distribution of a set of weights (``WeightStatistics``): ``mean``,
    ``std_dev`` (population), ``skewness``, excess ``kurtosis`` from the power sums
    (:meth:`schemas.stats.PowerSums.get`); ``min``, ``max`` of the
    finite weights; ``zero_fraction`` = exact zeros / finite weights; ``count``: finite
    weights.

    ``entropy``: Shannon entropy in bits of the distribution of |w| over base-2 exponent
    bins (the exponent histogram: one bin per binade [2^k, 2^(k+1)), plus exact zeros,
    underflow and overflow): ``-sum_k p_k log2 p_k``. 0 when every weight lies in one
    binade; each doubling of the number of binades used adds up to one bit. ``None``
    without a histogram. (The reference's ``max(log2 std, 0)`` is a scale, not an
    entropy; ``rules="reference"`` reports it instead.)

    ``nonfinite``: NaN/Inf weights, which none of the other fields include (the
    reference statistics would all be NaN). With no finite weight (``count = 0``) every statistic is
    NaN (``null`` in JSON).
    """

    mean: float
    std_dev: float
    skewness: float
    kurtosis: float
    entropy: float | None
    min: float
    max: float
    zero_fraction: float
    count: int
    nonfinite: int


class OutlierSeverity(StrEnum):
    """``Medium``: the extreme lies beyond what the largest |z| of the layer's own ``n``
    normal samples reaches with probability 1 - alpha; ``High``: beyond that bound even
    for all ``N`` weights of the model (:func:`analysis.blocks.significance.max_normal_z`)."""

    MEDIUM = "Medium"
    HIGH = "High"


class WeightOutlier(_Model):
    """An extreme weight of a layer (its min or max, ``side``) whose z-score
    ``|w - mean| / std`` exceeds the extreme-value bound of :class:`OutlierSeverity`.

    The reference tests every weight against ``|z| > 3``, which flags about
    0.27 % of any normal tensor; the telemetry carries each layer's extremes, and a normal
    sample of n weights has a largest |z| near ``sqrt(2 ln n)``, so the bound grows with n.
    The reference's ``weight_index`` is left out: which element holds the extreme is not sent.
    """

    layer_index: int
    layer_name: str
    side: str
    value: float
    z_score: float
    severity: OutlierSeverity


class WeightHealth(_Model):
    """Health of one layer's weights (the reference's ``WeightHealth``): ``score`` in
    [0, 100] (100 minus the deductions listed on :class:`LayerWeightAnalysis`),
    ``issues`` one line per deduction, ``recommendations`` one line per issue."""

    score: float
    issues: list[str]
    recommendations: list[str]


class LayerWeightAnalysis(_Model):
    """The weight analysis of one layer (``LayerWeightAnalysis``).

    ``health_score`` (``compute_weight_health_score``): 100, minus 20 if the
    layer has an outlier (``rules="reference"``: ``|min|`` or ``|max| > 10``, a
    scale-dependent constant), minus 30 if ``zero_fraction > 0.5``, minus 15 if
    ``|skewness| > 2``, minus 15 if ``kurtosis > 10``; at least 0. A layer with any NaN/Inf
    weight scores 0 (beyond the reference, whose statistics turn NaN there): the layer no
    longer computes anything. ``issues`` / ``recommendations``: one line per deduction.
    The three fields are the layer's :class:`WeightHealth`.
    """

    layer_index: int
    layer_name: str
    statistics: WeightStatistics
    health_score: float
    issues: list[str]
    recommendations: list[str]


class DistributionHealthStatus(StrEnum):
    """Bands of the distribution health score: Excellent >= 90, Good >= 75,
    Fair >= 60, Poor >= 40, Critical below."""

    EXCELLENT = "Excellent"
    GOOD = "Good"
    FAIR = "Fair"
    POOR = "Poor"
    CRITICAL = "Critical"


class DistributionHealth(_Model):
    """Distribution health (``assess_distribution_health``) of the pooled statistics: 100,
    minus 25 if ``zero_fraction > 0.3``, minus 15 if ``|skewness| > 1``, minus 15 if
    ``kurtosis > 5``, minus 20 if any layer has an outlier (``rules="reference"``: the
    overall ``|min|`` or ``|max| > 5``); 0 (Critical) if any weight is NaN/Inf."""

    score: float
    status: DistributionHealthStatus


class WeightDistributionAnalysis(_Model):
    """Weight distribution of the model (``WeightDistributionAnalysis``) at one step.

    ``overall_statistics`` pools the power sums, extremes, zeros and histograms of all
    layers (the exact statistics of all the model's weights; the reference, and
    ``rules="reference"``, averages the per-layer statistics, which mixes layers of any
    size with equal weight).
    ``layer_analyses`` and ``outlier_detection`` are in model order.
    """

    step: int
    layer_analyses: list[LayerWeightAnalysis]
    overall_statistics: WeightStatistics
    distribution_health: DistributionHealth
    outlier_detection: list[WeightOutlier]


class WeightDriftSeverity(StrEnum):
    """Orders of magnitude of the largest relative drift ``d``: Minimal ``d < 0.1 %``,
    Low ``d < 1 %``, Medium ``d < 10 %``, High otherwise."""

    MINIMAL = "Minimal"
    LOW = "Low"
    MEDIUM = "Medium"
    HIGH = "High"


class LayerWeightDrift(_Model):
    """How one layer's weights moved from step A to step B.

    - ``relative_norm_change``: ``(||w_B|| - ||w_A||) / ||w_A||``; its absolute value is a
      lower bound of the true relative drift ``||w_B - w_A|| / ||w_A||`` (reverse
      triangle inequality). ``None`` if ``||w_A|| = 0``.
    - ``mean_shift``: ``(mean_B - mean_A) / std_A`` (``None`` if ``std_A = 0``).
    - ``std_ratio``: ``std_B / std_A`` (``None`` if ``std_A = 0``).
    - ``relative_path_length``: ``sum_t ||w_t - w_prev|| / ||w_A||`` over the recorded
      steps in (A, B] (from ``update_sum_sq``): an upper bound of the true relative drift;
      ``None`` unless every such step of the layer carries an update norm.
    - ``mean_update_ratio``: mean over the recorded steps in (A, B] of the per-step
      update-to-weight ratio ``||w_t - w_prev|| / ||w_prev||`` (``update_to_weight``; a
      common rule of thumb puts healthy training near 1e-3, CS231n "Neural Networks 3");
      ``None`` without update norms.
    - ``stalled``: ``mean_update_ratio`` is below float32's machine epsilon 2^-23 (IEEE
      754 binary32): a typical element moves by less than one unit in the last place of
      its own float32 value per step, so the layer's weights barely train at all (what
      vanishing gradients do to the layers far from the loss).
    - ``nonfinite``: the layer has NaN/Inf weights at B; its other fields are then
      ``None`` (the norms, mean and std of a diverged tensor mean nothing).
    """

    layer_index: int
    layer_name: str
    relative_norm_change: float | None
    mean_shift: float | None
    std_ratio: float | None
    relative_path_length: float | None
    mean_update_ratio: float | None
    stalled: bool
    nonfinite: bool


class WeightDriftAnalysis(_Model):
    """Weight drift (``WeightDriftAnalysis``) between two steps with weight statistics.

    With ``d_l = |relative_norm_change|`` per layer (layers with ``||w_A|| > 0`` and
    finite weights at B): ``mean_drift`` = mean of ``d_l``, ``max_drift`` = max,
    ``severity`` = :class:`WeightDriftSeverity` of ``max_drift``, High if any layer's
    weights became NaN/Inf; ``affected_layers``: model-order indices of the layers whose
    own ``d_l`` is Medium or High or whose weights became NaN/Inf (``affected_layer_names``
    their names); ``stalled_layers`` / ``stalled_layer_names``: the layers marked
    ``stalled`` (:class:`LayerWeightDrift`). The true drift needs the inner product of
    w_A and w_B, which per-layer sums do not carry; ``d_l`` and ``relative_path_length``
    bracket it.
    """

    from_step: int
    to_step: int
    mean_drift: float
    max_drift: float
    severity: WeightDriftSeverity
    affected_layers: list[int]
    affected_layer_names: list[str]
    stalled_layers: list[int]
    stalled_layer_names: list[str]
    layer_drifts: list[LayerWeightDrift]


class WeightAnalysisReport(_Model):
    """The weight distribution at the last step with weight statistics in the range, and
    the drift from the first such step to it (``None`` with a single such step).
    ``first_nonfinite_step``: the first step in the range at which some layer had NaN/Inf
    weights (``None`` if none did), with those layers in ``first_nonfinite_layers``
    (names, model order). ``rules``: the rules the distribution was judged by
    (:mod:`analysis.blocks.rules`)."""

    run_id: str
    from_step: int | None
    to_step: int | None
    alpha: float
    first_nonfinite_step: int | None
    first_nonfinite_layers: list[str]
    distribution: WeightDistributionAnalysis
    drift: WeightDriftAnalysis | None
    rules: Literal["gradstream", "reference"] = "gradstream"
