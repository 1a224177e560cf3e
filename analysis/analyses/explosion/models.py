"""The report models of the gradient explosion analysis, with the rule of every field."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from analysis.blocks.rules import DEFAULT_RULES, Rules


class ExplosionSeverity(StrEnum):
    """Severity from the ratio ``r = norm / threshold`` (fixed multiples of the threshold, as
    the reference uses): ``Critical`` if r > 10 or any NaN/Inf gradient,
    ``High`` if r > 5, ``Medium`` if r > 2, ``Low`` otherwise."""

    LOW = "Low"
    MEDIUM = "Medium"
    HIGH = "High"
    CRITICAL = "Critical"


def severity_above(value: float, critical: float, high: float, medium: float) -> ExplosionSeverity:
    """The severity ladder every explosion rule uses: Critical if ``value > critical``,
    High if ``> high``, Medium if ``> medium``, Low otherwise (cut-offs descending)."""
    if value > critical:
        return ExplosionSeverity.CRITICAL
    if value > high:
        return ExplosionSeverity.HIGH
    if value > medium:
        return ExplosionSeverity.MEDIUM
    return ExplosionSeverity.LOW


def worst(*severities: ExplosionSeverity) -> ExplosionSeverity:
    """The most severe of ``severities`` (Low < Medium < High < Critical)."""
    order = list(ExplosionSeverity)
    return max(severities, key=order.index)


class ExplodingLayer(BaseModel):
    """A layer whose gradient norm exceeded the threshold, or held NaN/Inf, in the range.

    - ``gradient_norm``: its largest ``grad_norm`` in the range; ``step``: where (the
      earliest such step on ties).
    - ``exploding_steps``: steps with ``grad_norm > threshold``; ``nonfinite_steps``:
      steps with NaN/Inf gradient elements (``grad_norm`` covers the finite ones only);
      ``first_step``: the first step with either.
    - ``severity``: :func:`classify_severity` of ``gradient_norm / threshold``; with
      ``rules="reference"``, :func:`classify_severity_reference` against the mean of the
      peak norms of the layers up to this one in model order (the reference's running mean,
      which depends on the layer order). NaN/Inf: Critical under both rules.
    - ``recommended_action``: advice for that severity (``rules="reference"``:
      :func:`reference_action` of the norm).
    """

    model_config = ConfigDict(frozen=True)

    layer_index: int
    layer_name: str
    gradient_norm: float
    step: int
    exploding_steps: int
    nonfinite_steps: int
    first_step: int
    severity: ExplosionSeverity
    recommended_action: str


class GradientExplosionAnalysis(BaseModel):
    """Gradient explosion analysis (``GradientExplosionAnalysis``) of one run over an
    inclusive step range.

    - ``threshold``: the L2-norm threshold used (default: the run's exploding threshold;
      as ``max|g| <= ||g||_2``, every layer the run's frames flag as exploding also
      exceeds it here).
    - ``exploding_layers``: :class:`ExplodingLayer` in model order.
    - ``max_gradient_norm``, ``mean_gradient_norm``, ``std_gradient_norm``: maximum, mean
      and population standard deviation of ``grad_norm`` over every (layer, step) row.
    - ``explosion_ratio``: exploding layers / layers with rows in the range.
    - ``overall_severity`` (the reference rule, plus NaN/Inf): Critical if any NaN/Inf, ratio
      > 0.5 or max > 10 x threshold; High if ratio > 0.3 or max > 5 x threshold; Medium
      if ratio > 0.1 or max > 2 x threshold; else Low.
    - ``first_explosion_step``: first step with any layer above the threshold or NaN/Inf.
    - ``clip_norm_suggestion``: the largest whole-model gradient norm
      ``sqrt(sum_l grad_norm^2)`` over the steps before ``first_explosion_step`` (a clip
      value training never needed to exceed while it was healthy); ``None`` without an
      explosion or without earlier steps.
    - ``mitigation_recommendations``: advice derived from the figures above
      (``rules="reference"``: the reference's list, by ratio > 0.3 and max norm > 100).
    - ``rules``: which rules classified the layers (:mod:`analysis.blocks.rules`).
    - ``ignore_layers``: the patterns applied (the run's own ``ignore_layers``, then the
      reader's); ``layers_excluded``: the layers they match (model order). As in
      ``gradstream report``, their norms above the threshold count nowhere (not in
      ``exploding_layers``, ``first_explosion_step``, the severity or the
      recommendations, which use the largest norm of the other layers);
      their NaN/Inf rows still do. ``max_gradient_norm``, ``mean_gradient_norm`` and
      ``std_gradient_norm`` describe every row.
    """

    model_config = ConfigDict(frozen=True)

    run_id: str
    from_step: int | None
    to_step: int | None
    threshold: float
    steps: int
    layers: int
    exploding_layers: list[ExplodingLayer]
    max_gradient_norm: float
    mean_gradient_norm: float
    std_gradient_norm: float
    explosion_ratio: float
    overall_severity: ExplosionSeverity
    first_explosion_step: int | None
    clip_norm_suggestion: float | None
    mitigation_recommendations: list[str]
    rules: Rules = DEFAULT_RULES
    ignore_layers: list[str] = Field(default_factory=list)
    layers_excluded: list[str] = Field(default_factory=list)
