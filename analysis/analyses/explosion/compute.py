"""Gradient explosion analysis over any step range of a stored run.

Semantics follow the reference implementation (trustformers-debug, module
``utilities::weight_analysis``, ``WeightAnalyzer::detect_gradient_explosion``). The
reference looks at one set of gradient tensors; here each layer contributes its largest
L2 norm (``grad_norm``) in the range, and everything is two SQL aggregates over
``layer_stats`` (per layer, per step): O(rows), run by DuckDB on every core.

Differences from the reference (all listed, with reasons, in
``analysis/REFERENCE_DIFFERENCES.md``; ``rules="reference"`` restores the ones marked R):

- One snapshot becomes a step range: a layer's norm is its largest ``grad_norm`` in the
  range, and the layer carries the step counts above the threshold.
- (R) ``ExplodingLayer.severity``: gradstream grades ``norm / threshold`` (> 10 / 5 / 2,
  the multiples the reference uses for the overall severity); the reference grades the
  norm against the mean norm of the layers iterated so far (``norm / (mean + 1e-8)`` >
  100 / 50 / 10), so a layer's class depends on the layers before it in model order.
- (R) ``recommended_action``: gradstream advises by severity; the reference by the
  absolute norm (> 100 / 10 / 5), whatever the threshold.
- (R) ``mitigation_recommendations``: gradstream's "largest norm" advice fires above
  10 x threshold and suggests a clip norm measured before the first explosion; the
  reference's fires at an absolute norm above 100 and suggests a clip below 1.0.
- NaN/Inf gradients (kept under both rules): a layer with NaN/Inf elements is listed as
  Critical and makes the run Critical (``grad_norm`` covers the finite elements; the
  reference's norm would be NaN, which compares false and hides the layer).
- Default threshold: the run's exploding threshold (the reference has no default).
- ``mean_gradient_norm`` / ``std_gradient_norm``: over every (layer, step) row of the
  range, not over one snapshot's layers.
- Added fields: ``step``, ``exploding_steps``, ``nonfinite_steps``, ``first_step``,
  ``first_explosion_step``, ``clip_norm_suggestion``, ``ignore_layers``,
  ``layers_excluded``.
- Explicit exclusions (kept under both rules): the layers the run's ``ignore_layers`` or
  the ``ignore_layers`` option match count as in ``gradstream report``: their norms above
  the threshold count nowhere, their NaN/Inf rows still do.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from analysis.analyses.reference import DEFAULT_RULES, Rules
from analysis.analyses.render import (
    ROWS_IN_TABLE,
    add_more_row,
    excluded_text,
    num,
    show_name,
    table,
)
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from analysis.read.connect import StoreError, require_run
from analysis.read.exclusion import run_exclusion, split_patterns
from analysis.read.sql import stats_params
from analysis.registry import Analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb

__all__ = [
    "ANALYSIS",
    "ExplodingLayer",
    "ExplosionOptions",
    "ExplosionSeverity",
    "GradientExplosionAnalysis",
    "build_explosion_analysis",
    "classify_severity",
    "classify_severity_reference",
    "reference_action",
    "render_explosion",
]


class ExplosionSeverity(StrEnum):
    """Severity from the ratio ``r = norm / threshold`` (fixed multiples of the threshold, as
    the reference implementation uses): ``Critical`` if r > 10 or any NaN/Inf gradient,
    ``High`` if r > 5, ``Medium`` if r > 2, ``Low`` otherwise."""

    LOW = "Low"
    MEDIUM = "Medium"
    HIGH = "High"
    CRITICAL = "Critical"


def classify_severity(ratio: float, nonfinite: bool) -> ExplosionSeverity:
    """:class:`ExplosionSeverity` of a norm-to-threshold ratio.

    Args:
        ratio: ``norm / threshold`` (>= 0).
        nonfinite: NaN/Inf gradients were seen.
    """
    if nonfinite or ratio > 10:
        return ExplosionSeverity.CRITICAL
    if ratio > 5:
        return ExplosionSeverity.HIGH
    if ratio > 2:
        return ExplosionSeverity.MEDIUM
    return ExplosionSeverity.LOW


REFERENCE_EPSILON = 1e-8
"""Guard added to the mean norm by the reference's severity ratio (``norm / (mean +
1e-8)``), kept as written under ``rules="reference"``."""


def classify_severity_reference(norm: float, mean_so_far: float) -> ExplosionSeverity:
    """The reference's per-layer severity (``classify_explosion_severity``): ``r = norm /
    (mean_so_far + 1e-8)``, Critical if r > 100, High if r > 50, Medium if r > 10, Low
    otherwise.

    Args:
        norm: the layer's L2 norm.
        mean_so_far: mean L2 norm of the layers up to and including this one in model
            order (the reference's running list of norms).
    """
    ratio = norm / (mean_so_far + REFERENCE_EPSILON)
    if ratio > 100:
        return ExplosionSeverity.CRITICAL
    if ratio > 50:
        return ExplosionSeverity.HIGH
    if ratio > 10:
        return ExplosionSeverity.MEDIUM
    return ExplosionSeverity.LOW


def reference_action(norm: float) -> str:
    """The reference's advice by absolute L2 norm (``recommend_explosion_mitigation``):
    above 100, above 10, above 5, otherwise (gradstream's wording)."""
    if norm > 100:
        return ("Critical explosion (norm above 100): lower the learning rate tenfold and "
                "clip the gradient norm.")
    if norm > 10:
        return "Strong explosion (norm above 10): lower the learning rate and clip the norm."
    if norm > 5:
        return "Moderate explosion (norm above 5): clip the norm or lower the learning rate."
    return "Keep watching this layer's gradient norm."


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
    - ``rules``: which rules classified the layers (:mod:`analysis.analyses.reference`).
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


_LAYERS_SQL = """
    WITH s AS (
        SELECT *, list_contains($excluded::INTEGER[], layer_index) AS excluded
        FROM layer_stats
        WHERE run_id = $run_id
          AND ($from_step IS NULL OR step >= $from_step)
          AND ($to_step IS NULL OR step <= $to_step)
    )
    SELECT s.layer_index,
           coalesce(any_value(l.name), 'layer[' || CAST(s.layer_index AS VARCHAR) || ']'),
           max(s.grad_norm) AS peak,
           min(s.step) FILTER (WHERE s.grad_norm = peak_norm) AS peak_step,
           count(*) FILTER (WHERE s.grad_norm > $threshold AND NOT s.excluded)
               AS exploding_steps,
           count(*) FILTER (WHERE s.nonfinite > 0) AS nonfinite_steps,
           min(s.step) FILTER (WHERE (s.grad_norm > $threshold AND NOT s.excluded)
                               OR s.nonfinite > 0) AS first_step
    FROM s
    JOIN (SELECT layer_index, max(grad_norm) AS peak_norm FROM s GROUP BY layer_index) AS p
      USING (layer_index)
    LEFT JOIN layers AS l ON l.run_id = $run_id AND l.layer_index = s.layer_index
    GROUP BY s.layer_index
    ORDER BY s.layer_index
"""

_TOTALS_SQL = """
    WITH s AS (
        SELECT *, list_contains($excluded::INTEGER[], layer_index) AS excluded
        FROM layer_stats
        WHERE run_id = $run_id
          AND ($from_step IS NULL OR step >= $from_step)
          AND ($to_step IS NULL OR step <= $to_step)
    ),
    per_step AS (
        SELECT step, sqrt(sum(sum_sq)) AS global_norm,
               bool_or((grad_norm > $threshold AND NOT excluded) OR nonfinite > 0) AS bad
        FROM s GROUP BY step
    ),
    first_bad AS (SELECT min(step) AS step FROM per_step WHERE bad)
    SELECT (SELECT max(grad_norm) FROM s),
           (SELECT avg(grad_norm) FROM s),
           (SELECT stddev_pop(grad_norm) FROM s),
           (SELECT count(*) FROM per_step),
           (SELECT step FROM first_bad),
           (SELECT max(global_norm) FROM per_step WHERE step < (SELECT step FROM first_bad)),
           (SELECT coalesce(max(grad_norm), 0.0) FROM s WHERE NOT excluded)
"""


def _layer_action(severity: ExplosionSeverity, nonfinite: bool) -> str:
    if nonfinite:
        return ("NaN/Inf gradients: skip optimiser steps whose gradients are not finite, "
                "then lower the learning rate and clip the gradient norm.")
    return {
        ExplosionSeverity.CRITICAL: "Lower the learning rate by an order of magnitude and "
        "clip the gradient norm.",
        ExplosionSeverity.HIGH: "Lower the learning rate and clip the gradient norm.",
        ExplosionSeverity.MEDIUM: "Clip the gradient norm or lower the learning rate.",
        ExplosionSeverity.LOW: "Just above the threshold: watch this layer's norm.",
    }[severity]


def build_explosion_analysis(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    threshold: float | None = None,
    rules: Rules = DEFAULT_RULES,
    ignore_layers: Sequence[str] = (),
) -> GradientExplosionAnalysis:
    """Explosion analysis (``detect_gradient_explosion``) over a step range of a stored run.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        threshold: L2-norm threshold (> 0); ``None`` = the run's exploding threshold.
        rules: ``"gradstream"`` or ``"reference"`` (per-layer severity, actions and
            recommendations; see :class:`ExplodingLayer`).
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``
            (:func:`analysis.read.exclusion.run_exclusion`, as ``gradstream report``): the matched
            layers' norms above the threshold count nowhere (no exploding step, no
            explosion step, not in the overall severity); their NaN/Inf rows still do.

    Returns:
        The :class:`GradientExplosionAnalysis`.

    Raises:
        StoreError: unknown run, invalid step range, no rows in the range.
        ValueError: a non-positive threshold.
    """
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    if threshold is None:
        rows = con.execute(
            "SELECT exploding_threshold FROM runs WHERE run_id = $run_id", {"run_id": run_id}
        ).fetchall()
        threshold = float(rows[0][0])
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    exclusion = run_exclusion(con, run_id, ignore_layers)
    params = {**params, "threshold": threshold, "excluded": exclusion.layer_index}
    layers = con.execute(_LAYERS_SQL, params).fetchall()
    if not layers:
        raise StoreError(f"run {run_id!r} has no gradient rows in the step range")
    top, mean, std, steps, first_bad, clip, counted_top = (
        con.execute(_TOTALS_SQL, params).fetchall()[0])
    exploding = []
    any_nonfinite = False
    running = 0.0
    for k, (index, name, peak, peak_step, n_exp, n_nonfinite, first) in enumerate(layers):
        running += peak
        if n_exp == 0 and n_nonfinite == 0:
            continue
        any_nonfinite |= n_nonfinite > 0
        if rules == "reference":
            severity = (ExplosionSeverity.CRITICAL if n_nonfinite > 0
                        else classify_severity_reference(peak, running / (k + 1)))
            action = (_layer_action(severity, True) if n_nonfinite > 0
                      else reference_action(peak))
        else:
            severity = classify_severity(peak / threshold, n_nonfinite > 0)
            action = _layer_action(severity, n_nonfinite > 0)
        exploding.append(
            ExplodingLayer(
                layer_index=index, layer_name=name, gradient_norm=peak, step=peak_step,
                exploding_steps=n_exp, nonfinite_steps=n_nonfinite, first_step=first,
                severity=severity, recommended_action=action,
            )
        )
    ratio = len(exploding) / len(layers)
    if any_nonfinite or ratio > 0.5 or counted_top > 10 * threshold:
        overall = ExplosionSeverity.CRITICAL
    elif ratio > 0.3 or counted_top > 5 * threshold:
        overall = ExplosionSeverity.HIGH
    elif ratio > 0.1 or counted_top > 2 * threshold:
        overall = ExplosionSeverity.MEDIUM
    else:
        overall = ExplosionSeverity.LOW
    return GradientExplosionAnalysis(
        run_id=run_id,
        from_step=from_step,
        to_step=to_step,
        threshold=threshold,
        steps=steps,
        layers=len(layers),
        exploding_layers=exploding,
        max_gradient_norm=top,
        mean_gradient_norm=mean,
        std_gradient_norm=std or 0.0,
        explosion_ratio=ratio,
        overall_severity=overall,
        first_explosion_step=first_bad,
        clip_norm_suggestion=clip,
        mitigation_recommendations=(
            _reference_recommendations(ratio, counted_top) if rules == "reference"
            else _recommendations(
                ratio, counted_top, threshold, any_nonfinite, first_bad, clip,
                len(exploding)
            )
        ),
        rules=rules,
        ignore_layers=exclusion.patterns,
        layers_excluded=exclusion.names,
    )


def _reference_recommendations(ratio: float, top: float) -> list[str]:
    """The reference's list (``generate_explosion_recommendations``), gradstream's wording:
    two lines if more than 30 % of the layers explode, two if the largest norm is above
    100, and always the two monitoring lines."""
    recs = []
    if ratio > 0.3:
        recs += ["Many layers' gradients explode at once.",
                 "Lower the learning rate substantially."]
    if top > 100:
        recs += ["Very large gradient norms (above 100).",
                 "Clip the gradient norm, at a threshold below 1.0."]
    recs += ["Keep monitoring the gradient norms during training.",
             "Consider batch or layer normalisation."]
    return recs


def _recommendations(
    ratio: float, top: float, threshold: float, nonfinite: bool, first_bad: int | None,
    clip: float | None, count: int,
) -> list[str]:
    if count == 0:
        return [f"No layer's gradient norm exceeded {threshold:g}; nothing to mitigate."]
    recs = []
    if ratio > 0.3:
        recs.append(
            f"{ratio:.0%} of the layers exploded: the cause is global, lower the learning "
            "rate substantially (or lengthen its warm-up) rather than treating layers."
        )
    if clip is not None:
        recs.append(
            f"Clip the global gradient norm at about {clip:.3g}: the largest whole-model "
            f"norm before the first explosion at step {first_bad}."
        )
    else:
        recs.append("Clip the global gradient norm (torch.nn.utils.clip_grad_norm_).")
    if nonfinite:
        recs.append(
            "Gradients reached NaN/Inf: skip non-finite optimiser steps and, with mixed "
            "precision, use dynamic loss scaling."
        )
    if top > 10 * threshold:
        recs.append(
            f"The largest layer norm ({top:.3g}) is {top / threshold:.0f}x the threshold: "
            "check normalisation layers and weight initialisation of the layers listed."
        )
    return recs


_SEVERITY_STYLE = {
    ExplosionSeverity.LOW: "yellow", ExplosionSeverity.MEDIUM: "dark_orange",
    ExplosionSeverity.HIGH: "red", ExplosionSeverity.CRITICAL: "bold red",
}


def render_explosion(report: GradientExplosionAnalysis) -> RenderableType:
    """The explosion analysis as terminal tables (summary, exploding layers, advice).

    Args:
        report: from :func:`build_explosion_analysis`.

    Returns:
        A rich renderable.
    """
    head = Text("gradient explosion analysis of run ", style="bold")
    head.append(show_name(report.run_id))
    head.append(f"  ({report.layers} layers, {report.steps} steps)", style="dim")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    grid.add_row("severity", Text(report.overall_severity.value,
                                  style=_SEVERITY_STYLE[report.overall_severity]))
    grid.add_row("threshold (L2 norm)", num(report.threshold))
    grid.add_row("rules", report.rules)
    grid.add_row("exploding layers", f"{len(report.exploding_layers)} "
                 f"({report.explosion_ratio:.1%} of layers)")
    grid.add_row("layer norms", f"max {num(report.max_gradient_norm)}, mean "
                 f"{num(report.mean_gradient_norm)}, std {num(report.std_gradient_norm)}")
    if report.first_explosion_step is not None:
        grid.add_row("first explosion", f"step {report.first_explosion_step}")
    if report.ignore_layers:
        grid.add_row("excluded", excluded_text(report.ignore_layers, report.layers_excluded))
    layers = table("exploding layers (model order)",
                   ["layer", "severity", "peak norm", "at step", "steps above", "NaN/Inf steps",
                    "first"],
                   [False, False, True, True, True, True, True])
    for x in report.exploding_layers[:ROWS_IN_TABLE]:
        layers.add_row(show_name(x.layer_name),
                       Text(x.severity.value, style=_SEVERITY_STYLE[x.severity]),
                       num(x.gradient_norm), str(x.step), str(x.exploding_steps),
                       str(x.nonfinite_steps), str(x.first_step))
    add_more_row(layers, len(report.exploding_layers), ROWS_IN_TABLE)
    advice = Text()
    for k, rec in enumerate(report.mitigation_recommendations):
        advice.append(("\n" if k else "") + f"• {rec}")
    parts: list[RenderableType] = [head, grid]
    if report.exploding_layers:
        parts.append(layers)
    parts += [Text("Recommendations", style="bold underline"), advice]
    return Group(*parts)


# -- registry entry ------------------------------------------------------------------------


class ExplosionOptions(BaseModel):
    """Options of the explosion analysis (``gradstream analyze --kind explosion``,
    ``/api/analysis/explosion``).

    - ``threshold``: L2-norm threshold (> 0); ``None`` = the run's exploding threshold.
    - ``rules``: ``"gradstream"`` (default) or ``"reference"``: the reference's per-layer
      severity, actions and recommendations (:mod:`analysis.analyses.reference`).
    - ``ignore_layers``: comma-separated layer-name patterns excluded besides the run's
      own ``ignore_layers`` (as ``gradstream report --ignore-layers``;
      :func:`build_explosion_analysis`).
    """

    model_config = ConfigDict(frozen=True)

    threshold: float | None = Field(default=None, gt=0.0)
    rules: Rules = DEFAULT_RULES
    ignore_layers: str = ""


def _build(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    options: ExplosionOptions,
) -> GradientExplosionAnalysis:
    """:func:`build_explosion_analysis` with ``options``; raises what it raises."""
    return build_explosion_analysis(
        con, run_id, from_step, to_step, options.threshold, options.rules,
        split_patterns(options.ignore_layers),
    )


ANALYSIS = Analysis(
    name="explosion",
    help="Layers whose gradient L2 norm went above a threshold or held NaN/Inf, with "
    "severity, a clip-norm suggestion and mitigations.",
    options=ExplosionOptions,
    build=_build,
    render=render_explosion,
)
"""The explosion analysis's entry in :data:`analysis.registry.ANALYSES`."""
