"""Terminal rendering (rich) of the gradient explosion analysis."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from analysis.analyses.explosion.models import ExplosionSeverity, GradientExplosionAnalysis
from analysis.blocks.terminal import (
    ROWS_IN_TABLE,
    add_more_row,
    excluded_text,
    num,
    report_head,
    show_name,
    summary_grid,
    table,
)

_SEVERITY_STYLE = {
    ExplosionSeverity.LOW: "yellow", ExplosionSeverity.MEDIUM: "dark_orange",
    ExplosionSeverity.HIGH: "red", ExplosionSeverity.CRITICAL: "bold red",
}


def render_explosion(report: GradientExplosionAnalysis) -> RenderableType:
    """The explosion analysis as terminal tables (summary, exploding layers, advice).

    Args:
        report: from :func:`analysis.analyses.explosion.build_explosion_analysis`.

    Returns:
        A rich renderable.
    """
    head = report_head("gradient explosion analysis", report.run_id,
                       f"{report.layers} layers, {report.steps} steps")
    grid = summary_grid()
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
