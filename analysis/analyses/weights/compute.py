"""Computation of the weight analysis from loaded statistics (no I/O): per-layer and
pooled statistics, outliers and health scores at one step, and the drift between two steps.

Inputs are the :class:`~analysis.analyses.weights.load.StepWeights` of
:func:`analysis.analyses.weights.load.fetch_step` (model order); every statistic is read from one
copy of each tensor (:meth:`~analysis.analyses.weights.load.StepWeights.one_copy`) with
:meth:`schemas.stats.WeightMoments.get` per layer and, for the whole model, from the
layers merged into one (:meth:`schemas.stats.LayerStatistic.pooled`). Each function is
O(layers). Scores and thresholds follow the reference (trustformers-debug,
``utilities::weight_analysis``, ``WeightAnalyzer``; documented on the report models,
:mod:`analysis.analyses.weights.models`); the outlier bound is the extreme-value bound of
:func:`analysis.blocks.significance.max_normal_z`.

Differences from the reference (listed with reasons in :mod:`analysis.analyses.weights.models` and
``analysis/REFERENCE_DIFFERENCES.md``; ``rules="reference"`` restores those marked R):

- (R) outliers: the extremes against an extreme-value bound that grows with the layer
  size, instead of ``|z| > 3`` (Medium) / ``> 5`` (High) for every weight;
- (R) the health deduction for extreme values: "the layer has an outlier" instead of
  ``|min|`` or ``|max| > 10`` (pooled: ``> 5``);
- (R) ``overall_statistics``: the pooled statistics of all weights instead of the
  average of the per-layer statistics;
- (R) ``entropy``: the Shannon entropy of the exponent histogram instead of
  ``max(log2 std, 0)``;
- NaN/Inf weights score 0 (both rules); the reference's statistics turn NaN.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from analysis.analyses.weights.models import (
    DistributionHealth,
    DistributionHealthStatus,
    LayerWeightAnalysis,
    LayerWeightDrift,
    OutlierSeverity,
    WeightDistributionAnalysis,
    WeightDriftAnalysis,
    WeightDriftSeverity,
    WeightHealth,
    WeightOutlier,
    WeightStatistics,
)
from analysis.blocks.rules import DEFAULT_RULES, Rules
from analysis.blocks.significance import max_normal_z

if TYPE_CHECKING:
    from analysis.analyses.weights.load import StepWeights

__all__ = [
    "FLOAT32_EPSILON",
    "REFERENCE_EXTREME",
    "REFERENCE_POOLED_EXTREME",
    "REFERENCE_Z_HIGH",
    "REFERENCE_Z_MEDIUM",
    "distribution_at",
    "distribution_status",
    "drift_between",
    "weight_health",
]

FLOAT32_EPSILON = 2.0**-23
"""Machine epsilon of IEEE 754 binary32: the relative spacing of float32 values at 1."""


REFERENCE_Z_MEDIUM = 3.0
"""The reference's outlier cut-off ``|z| > 3`` (Medium), used with ``rules="reference"``."""
REFERENCE_Z_HIGH = 5.0
"""The reference's ``|z| > 5`` (High), used with ``rules="reference"``."""
REFERENCE_EXTREME = 10.0
"""The reference's per-layer extreme-value deduction: ``|min|`` or ``|max| > 10``."""
REFERENCE_POOLED_EXTREME = 5.0
"""The reference's distribution-health deduction: pooled ``|min|`` or ``|max| > 5``."""


def weight_health(
    stats: WeightStatistics, outlier: bool, rules: Rules = DEFAULT_RULES
) -> WeightHealth:
    """The health of one layer's weights (the reference's ``WeightHealth``: score from
    ``compute_weight_health_score``, issues from ``identify_weight_issues``,
    recommendations from ``generate_weight_recommendations``).

    Score 100, minus 20 for extreme values (gradstream: ``outlier``, an extreme beyond the
    extreme-value bound; ``rules="reference"``: ``|min|`` or ``|max| > 10``), minus 30 if
    ``zero_fraction > 0.5``, minus 15 if ``|skewness| > 2``, minus 15 if ``kurtosis >
    10``; at least 0. Any NaN/Inf weight: score 0 with that issue alone (both rules).

    Args:
        stats: the layer's statistics.
        outlier: an outlier was found among the layer's extremes (gradstream's rule).
        rules: ``"gradstream"`` or ``"reference"``.

    Returns:
        :class:`~analysis.analyses.weights.models.WeightHealth`, one recommendation per issue.
    """
    score, issues, recs = 100.0, [], []
    if stats.nonfinite:
        share = stats.nonfinite / (stats.nonfinite + stats.count)
        issues.append(f"{stats.nonfinite} weights ({share:.1%}) are NaN/Inf")
        recs.append("The weights diverged: resume from a checkpoint before the first "
                    "non-finite step with a lower learning rate or gradient clipping, and "
                    "skip optimiser steps whose gradients are not finite.")
        return WeightHealth(score=0.0, issues=issues, recommendations=recs)
    if rules == "reference":
        extreme = max(abs(stats.min), abs(stats.max)) > REFERENCE_EXTREME
        what = f"Extreme weight values (|w| above {REFERENCE_EXTREME:g})"
    else:
        extreme = outlier
        what = "Extreme weight values beyond what the layer's distribution explains"
    if extreme:
        score -= 20
        issues.append(what)
        recs.append("Add weight decay or weight clipping, and check the layer's updates.")
    if stats.zero_fraction > 0.5:
        score -= 30
        issues.append(f"{stats.zero_fraction:.0%} of the weights are exactly zero")
        recs.append("Lower the learning rate or change the activation; zeroed weights often "
                    "come from dead units or aggressive pruning.")
    if abs(stats.skewness) > 2:
        score -= 15
        issues.append(f"Highly skewed weight distribution (skewness {stats.skewness:.2g})")
        recs.append("Consider weight normalisation or a different initialisation.")
    if stats.kurtosis > 10:
        score -= 15
        issues.append(f"Heavy-tailed weight distribution (excess kurtosis {stats.kurtosis:.2g})")
        recs.append("Watch for gradient instability: a few large weights dominate.")
    return WeightHealth(score=max(score, 0.0), issues=issues, recommendations=recs)


def distribution_at(
    step: int, data: StepWeights, alpha: float, rules: Rules = DEFAULT_RULES
) -> WeightDistributionAnalysis:
    """The weight distribution at ``step``: per-layer statistics, health and outliers,
    and the pooled statistics of all the model's weights (one copy of each tensor).

    Args:
        step: the optimiser step the statistics belong to.
        data: :func:`analysis.analyses.weights.load.fetch_step` at ``step`` (``L`` layers).
        alpha: significance level of the outlier bound, in (0, 1).
        rules: ``"gradstream"``, or ``"reference"``: outliers at ``|z| > 3`` / ``> 5``,
            extremes above 10 (layer) / 5 (pooled), ``overall_statistics`` the average of
            the layers' statistics and ``entropy = max(log2 std, 0)``.

    Returns:
        The :class:`~analysis.analyses.weights.models.WeightDistributionAnalysis`. The pooled
        ``entropy`` is that of the layers' exponent histograms summed bin by bin, and
        ``None`` when some layer has no finite weight.

    Raises:
        ValueError: ``alpha`` outside (0, 1).
    """
    one = data.one_copy()
    per_layer = one.get()
    n = per_layer["count"]
    z_layer = max_normal_z(n, alpha)
    z_model = float(max_normal_z(float(n.sum()), alpha))
    reference = rules == "reference"
    if reference:
        with np.errstate(divide="ignore", invalid="ignore"):
            per_layer["entropy"] = np.maximum(np.log2(per_layer["std_dev"]), 0.0)
    layers, outliers = [], []
    for i in range(n.size):
        stats = _stats(per_layer, i)
        found = []
        if stats.std_dev > 0:
            for side, value in (("min", stats.min), ("max", stats.max)):
                z = abs(value - stats.mean) / stats.std_dev
                if reference:
                    medium, high = REFERENCE_Z_MEDIUM, REFERENCE_Z_HIGH
                else:
                    medium, high = z_layer[i], z_model
                if z > medium:
                    severity = OutlierSeverity.HIGH if z > high else OutlierSeverity.MEDIUM
                    found.append(WeightOutlier(
                        layer_index=int(data.layer_index[i]), layer_name=data.name[i],
                        side=side, value=value, z_score=z, severity=severity,
                    ))
        outliers += found
        health = weight_health(stats, bool(found), rules)
        layers.append(LayerWeightAnalysis(
            layer_index=int(data.layer_index[i]), layer_name=data.name[i],
            statistics=stats, health_score=health.score, issues=health.issues,
            recommendations=health.recommendations,
        ))
    if reference:
        overall = _averaged(layers)
        extreme = max(abs(overall.min), abs(overall.max)) > REFERENCE_POOLED_EXTREME
    else:
        pooled = one.pooled().get()
        if np.isnan(per_layer["entropy"]).any():
            pooled["entropy"] = np.array([math.nan])
        overall = _stats(pooled, 0)
        extreme = bool(outliers)
    score = 100.0
    score -= 25 if overall.zero_fraction > 0.3 else 0
    score -= 15 if abs(overall.skewness) > 1 else 0
    score -= 15 if overall.kurtosis > 5 else 0
    score -= 20 if extreme else 0
    score = 0.0 if overall.nonfinite else score
    return WeightDistributionAnalysis(
        step=step, layer_analyses=layers, overall_statistics=overall,
        distribution_health=DistributionHealth(score=score, status=distribution_status(score)),
        outlier_detection=outliers,
    )


def distribution_status(score: float) -> DistributionHealthStatus:
    """The reference's bands of the distribution health score (``assess_distribution_health``,
    kept under both rules): Excellent >= 90, Good >= 75, Fair >= 60, Poor >= 40, Critical
    below."""
    return (
        DistributionHealthStatus.EXCELLENT if score >= 90
        else DistributionHealthStatus.GOOD if score >= 75
        else DistributionHealthStatus.FAIR if score >= 60
        else DistributionHealthStatus.POOR if score >= 40
        else DistributionHealthStatus.CRITICAL
    )


def _averaged(layers: list[LayerWeightAnalysis]) -> WeightStatistics:
    """The reference's overall statistics (``WeightStatistics::accumulate`` then
    ``finalize``): the unweighted mean over layers of mean, std, skewness, kurtosis,
    entropy and zero fraction; the min of the minima and the max of the maxima, both folded
    from the reference's zero-initialised accumulator (so the min is at most 0 and the max
    at least 0, as written there); ``count`` and ``nonfinite`` summed. A layer without an
    entropy counts as 0."""
    stats = [x.statistics for x in layers]
    k = max(len(stats), 1)

    def avg(name: str) -> float:
        return sum(float(getattr(s, name) or 0.0) for s in stats) / k

    return WeightStatistics(
        mean=avg("mean"), std_dev=avg("std_dev"), skewness=avg("skewness"),
        kurtosis=avg("kurtosis"), entropy=avg("entropy"),
        min=min([0.0, *(s.min for s in stats)]),
        max=max([0.0, *(s.max for s in stats)]),
        zero_fraction=avg("zero_fraction"), count=sum(s.count for s in stats),
        nonfinite=sum(s.nonfinite for s in stats),
    )


def _stats(values: dict[str, np.ndarray], i: int) -> WeightStatistics:
    """Entry ``i`` of :meth:`schemas.stats.WeightMoments.get` as the report model (a NaN
    entropy, from a set without finite weights, becomes ``None``)."""
    entropy = float(values["entropy"][i])
    return WeightStatistics(
        mean=float(values["mean"][i]), std_dev=float(values["std_dev"][i]),
        skewness=float(values["skewness"][i]), kurtosis=float(values["kurtosis"][i]),
        entropy=None if math.isnan(entropy) else entropy,
        min=float(values["min"][i]), max=float(values["max"][i]),
        zero_fraction=float(values["zero_fraction"][i]),
        count=round(float(values["count"][i])), nonfinite=round(float(values["nonfinite"][i])),
    )


def _drift_class(d: float) -> WeightDriftSeverity:
    if d < 1e-3:
        return WeightDriftSeverity.MINIMAL
    if d < 1e-2:
        return WeightDriftSeverity.LOW
    if d < 1e-1:
        return WeightDriftSeverity.MEDIUM
    return WeightDriftSeverity.HIGH


def drift_between(
    a: int,
    b: int,
    first: StepWeights,
    last: StepWeights,
    paths: dict[int, tuple[float | None, int, float | None]],
) -> WeightDriftAnalysis:
    """How each layer's weights moved from step ``a`` to step ``b`` (formulas:
    :class:`~analysis.analyses.weights.models.LayerWeightDrift`).

    Args:
        a, b: the two optimiser steps, ``a < b``.
        first, last: :func:`analysis.analyses.weights.load.fetch_step` at ``a`` and at ``b``; only
            layers present at both are compared.
        paths: :func:`analysis.analyses.weights.load.update_paths` over ``(a, b]``.

    Returns:
        The :class:`~analysis.analyses.weights.models.WeightDriftAnalysis` (layers in model order).
    """
    first_one, last_one = first.one_copy(), last.one_copy()
    first_m, last_m = first_one.get(), last_one.get()
    at_b = {int(k): i for i, k in enumerate(last.layer_index.tolist())}
    drifts, values, diverged = [], [], []
    for i, index in enumerate(first.layer_index.tolist()):
        j = at_b.get(index)
        if j is None:
            continue
        name = first.name[i]
        path, missing, ratio = paths.get(index, (None, 1, None))
        ratio = None if ratio is None or math.isnan(ratio) else float(ratio)
        stalled = ratio is not None and ratio < FLOAT32_EPSILON
        if last_m["nonfinite"][j] > 0 or first_m["nonfinite"][i] > 0:
            diverged.append((index, name))
            drifts.append(LayerWeightDrift(
                layer_index=index, layer_name=name, relative_norm_change=None,
                mean_shift=None, std_ratio=None, relative_path_length=None,
                mean_update_ratio=ratio, stalled=stalled, nonfinite=True,
            ))
            continue
        norm_a = math.sqrt(first_one.power.s2[i])
        norm_b = math.sqrt(last_one.power.s2[j])
        std_a = first_m["std_dev"][i]
        change = (norm_b - norm_a) / norm_a if norm_a > 0 else None
        if change is not None:
            values.append((abs(change), index, name))
        drifts.append(LayerWeightDrift(
            layer_index=index, layer_name=name, relative_norm_change=change,
            mean_shift=(last_m["mean"][j] - first_m["mean"][i]) / std_a if std_a > 0 else None,
            std_ratio=last_m["std_dev"][j] / std_a if std_a > 0 else None,
            relative_path_length=(
                path / norm_a if norm_a > 0 and missing == 0 and path is not None else None
            ),
            mean_update_ratio=ratio, stalled=stalled, nonfinite=False,
        ))
    magnitudes = np.array([v[0] for v in values])
    top = float(magnitudes.max()) if magnitudes.size else 0.0
    drifting = {index for d, index, _ in values
                if _drift_class(d) in (WeightDriftSeverity.MEDIUM, WeightDriftSeverity.HIGH)}
    drifting |= {index for index, _ in diverged}
    affected = [(x.layer_index, x.layer_name) for x in drifts if x.layer_index in drifting]
    stalled_layers = [(x.layer_index, x.layer_name) for x in drifts if x.stalled]
    return WeightDriftAnalysis(
        from_step=a, to_step=b,
        mean_drift=float(magnitudes.mean()) if magnitudes.size else 0.0,
        max_drift=top,
        severity=WeightDriftSeverity.HIGH if diverged else _drift_class(top),
        affected_layers=[x[0] for x in affected],
        affected_layer_names=[x[1] for x in affected],
        stalled_layers=[x[0] for x in stalled_layers],
        stalled_layer_names=[x[1] for x in stalled_layers],
        layer_drifts=drifts,
    )
