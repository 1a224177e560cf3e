"""Gradient explosion analysis over any step range of a stored run.

As the reference (trustformers-debug, ``utilities::weight_analysis``,
``WeightAnalyzer::detect_gradient_explosion``) defines it, except that the reference looks
at one set of gradient tensors; here each layer contributes its largest L2 norm
(``grad_norm``) in the range, from two SQL aggregates over ``layer_stats`` (per layer, per
step; :mod:`.load`). Report models: :mod:`.models`; gradstream's severities and advice:
:mod:`.compute`; the reference's: :mod:`.reference`; terminal tables: :mod:`.render`.

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

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from analysis.analyses.explosion.compute import (
    classify_severity,
    layer_action,
    overall_severity,
    recommendations,
)
from analysis.analyses.explosion.load import layer_peaks, run_totals
from analysis.analyses.explosion.models import (
    ExplodingLayer,
    ExplosionSeverity,
    GradientExplosionAnalysis,
)
from analysis.analyses.explosion.reference import (
    classify_severity_reference,
    reference_action,
    reference_recommendations,
)
from analysis.analyses.explosion.render import render_explosion
from analysis.blocks.rules import DEFAULT_RULES, Rules
from analysis.blocks.run_range import open_run_range
from analysis.read.connect import StoreError
from analysis.read.exclusion import split_patterns
from analysis.registry import Analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb


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
    run_range = open_run_range(con, run_id, from_step, to_step, ignore_layers)
    if threshold is None:
        rows = con.execute(
            "SELECT exploding_threshold FROM runs WHERE run_id = $run_id", {"run_id": run_id}
        ).fetchall()
        threshold = float(rows[0][0])
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    params = {**run_range.params, "threshold": threshold,
              "excluded": run_range.exclusion.layer_index}
    layers = layer_peaks(con, params)
    if not layers:
        raise StoreError(f"run {run_id!r} has no gradient rows in the step range")
    top, mean, std, steps, first_bad, clip, counted_top = run_totals(con, params)
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
            action = (layer_action(severity, True) if n_nonfinite > 0
                      else reference_action(peak))
        else:
            severity = classify_severity(peak / threshold, n_nonfinite > 0)
            action = layer_action(severity, n_nonfinite > 0)
        exploding.append(
            ExplodingLayer(
                layer_index=index, layer_name=name, gradient_norm=peak, step=peak_step,
                exploding_steps=n_exp, nonfinite_steps=n_nonfinite, first_step=first,
                severity=severity, recommended_action=action,
            )
        )
    ratio = len(exploding) / len(layers)
    overall = overall_severity(ratio, counted_top, threshold, any_nonfinite)
    return GradientExplosionAnalysis(
        **run_range.report_header(),
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
            reference_recommendations(ratio, counted_top) if rules == "reference"
            else recommendations(
                ratio, counted_top, threshold, any_nonfinite, first_bad, clip,
                len(exploding)
            )
        ),
        rules=rules,
    )


class ExplosionOptions(BaseModel):
    """Options of the explosion analysis (``gradstream analyze --kind explosion``,
    ``/api/analysis/explosion``).

    - ``threshold``: L2-norm threshold (> 0); ``None`` = the run's exploding threshold.
    - ``rules``: ``"gradstream"`` (default) or ``"reference"``: the reference's per-layer
      severity, actions and recommendations (:mod:`analysis.blocks.rules`).
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
