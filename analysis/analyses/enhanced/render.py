"""Terminal rendering (rich) of the enhanced per-layer analysis."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from analysis.analyses.enhanced.models import (
    EnhancedLayerGradientAnalysis,
    InteractionType,
    LayerHealth,
    OptimizationTarget,
    UrgencyLevel,
)
from analysis.blocks.terminal import (
    ROWS_IN_TABLE,
    add_more_row,
    excluded_text,
    names_text,
    num,
    report_head,
    show_name,
    summary_grid,
    table,
)

LAYER_HEALTH_STYLE: dict[LayerHealth, str] = {
    LayerHealth.HEALTHY: "green", LayerHealth.WARNING: "yellow",
    LayerHealth.CRITICAL: "bold red", LayerHealth.UNKNOWN: "dim",
}
"""Rich style of each :class:`~analysis.analyses.enhanced.models.LayerHealth` (the enhanced
analysis's verdict on a layer or the network; the run's gradient health of the frames has
its own style in :data:`analysis.report.HEALTH_STYLE`)."""
_KIND = {
    OptimizationTarget.INDIVIDUAL_LAYER: "layer", OptimizationTarget.LAYER_GROUP: "group",
    OptimizationTarget.NETWORK_LEVEL: "network",
}
_URGENCY_STYLE = {
    UrgencyLevel.LOW: "green", UrgencyLevel.MEDIUM: "yellow",
    UrgencyLevel.HIGH: "dark_orange", UrgencyLevel.CRITICAL: "bold red",
}


def render_enhanced(report: EnhancedLayerGradientAnalysis) -> RenderableType:
    """Tables of the enhanced analysis for a terminal: network summary, priorities,
    layers (at most ``ROWS_IN_TABLE`` rows each), instability sources, hierarchy and the
    strongest significant interactions.

    Args:
        report: from :func:`analysis.analyses.enhanced.build_enhanced_analysis`.

    Returns:
        A rich renderable.
    """
    net = report.network_level_analysis
    conv = net.convergence_indicators
    dyn = net.training_dynamics
    stab = net.stability_assessment
    head = report_head("enhanced gradient analysis", report.run_id,
                       f"{report.layers} layers, {report.steps} steps, {report.rules} rules, "
                       f"{report.analysis_depth.value} depth")
    summary = summary_grid()
    health = net.overall_gradient_health
    summary.add_row("overall health", Text(health.value, style=LAYER_HEALTH_STYLE[health]))
    if report.ignore_layers:
        summary.add_row("excluded", excluded_text(report.ignore_layers, report.layers_excluded))
    dist = net.gradient_distribution
    summary.add_row("layer norms", f"mean {num(dist.mean_gradient_norm)}, distribution "
                    f"{dist.distribution_type.value}")
    steps_left = conv.estimated_steps_to_convergence
    summary.add_row(
        "convergence",
        f"{conv.convergence_trend.value}, score {num(conv.gradient_convergence_score)}, "
        f"decay {num(conv.decay_rate)}/step, "
        + (f"~{steps_left} steps to floor {num(conv.convergence_floor)}"
           if steps_left is not None else "no floor estimate"),
    )
    if conv.parameter_convergence_score is not None:
        summary.add_row("parameters", f"convergence score {num(conv.parameter_convergence_score)}")
    plateau = dyn.plateau_detection
    summary.add_row(
        "training phase",
        f"{dyn.learning_phase.value}"
        + (f", plateau for {plateau.plateau_duration} steps ({plateau.plateau_severity.value})"
           if plateau.is_plateau else ""),
    )
    summary.add_row(
        "stability",
        f"{num(stab.overall_stability)} "
        f"({'above' if stab.above_stability_threshold else 'not above'} "
        f"{stab.stability_threshold:g}), trend {stab.stability_trend.value}, outlook "
        f"{stab.stability_forecast.short_term_outlook.value} (short) / "
        f"{stab.stability_forecast.long_term_outlook.value} (long)",
    )
    parts: list[RenderableType] = [head, summary]

    prio = table("optimisation priorities", ["target", "kind", "urgency", "score",
                                             "first action"],
                 [False, False, False, True, False])
    for p in report.optimization_priorities[:ROWS_IN_TABLE]:
        actions = p.recommended_actions
        first = actions[0].action_name if actions else "-"
        more = f" (+{len(actions) - 1} more)" if len(actions) > 1 else ""
        prio.add_row(
            show_name(p.target_name), _KIND[p.target_type],
            Text(p.urgency_level.value, style=_URGENCY_STYLE[p.urgency_level]),
            num(p.priority_score), first + more,
        )
    add_more_row(prio, len(report.optimization_priorities), ROWS_IN_TABLE)
    parts.append(prio if report.optimization_priorities
                 else Text("no optimisation priorities: no layer shows a risk", style="green"))

    layers = table(
        "layers (model order): gradient norm statistics",
        ["layer", "health", "mean", "median", "p95", "stability", "risks"],
        [False, False, True, True, True, True, True],
    )
    for d in report.layer_details[:ROWS_IN_TABLE]:
        s, h = d.gradient_statistics, d.health_metrics
        layers.add_row(
            show_name(d.layer_name),
            Text(h.overall_health.value, style=LAYER_HEALTH_STYLE[h.overall_health]),
            num(s.mean, 2), num(s.median, 2), num(s.percentile_95, 2),
            num(h.gradient_stability, 2), str(len(h.risk_factors)),
        )
    add_more_row(layers, len(report.layer_details), ROWS_IN_TABLE)
    parts.append(layers)

    if stab.instability_sources:
        src = table("instability sources", ["kind", "layers", "share of params"],
                    [False, False, True])
        for s in stab.instability_sources:
            src.add_row(s.source_type.value, names_text(s.affected_layers), f"{s.severity:.1%}")
        parts.append(src)

    levels = table("gradient hierarchy (levels by mean norm)",
                   ["level", "group", "layers", "sync", "difficulty", "|g|^2", "params"],
                   [True, False, True, True, False, True, True])
    for level, group in zip(report.gradient_hierarchy.hierarchy_levels,
                            report.gradient_hierarchy.layer_groups, strict=True):
        ch = group.group_characteristics
        levels.add_row(str(level.level_id), group.group_name.removeprefix("mean norm "),
                       str(len(group.layers)), num(ch.gradient_synchronization),
                       ch.optimization_difficulty.value, f"{level.level_importance:.1%}",
                       f"{level.optimization_impact:.1%}")
    parts.append(levels)

    strong = sorted((x for x in net.layer_interactions
                     if x.interaction_type is not InteractionType.NEUTRAL),
                    key=lambda x: -x.impact_score)
    if strong:
        inter = table("strongest layer interactions", ["layer 1", "layer 2", "type", "r",
                                                       "impact"],
                      [False, False, False, True, True])
        for x in strong[:ROWS_IN_TABLE]:
            inter.add_row(show_name(x.layer1), show_name(x.layer2), x.interaction_type.value,
                          num(x.correlation), num(x.impact_score))
        add_more_row(inter, len(strong), ROWS_IN_TABLE)
        parts.append(inter)
    return Group(*parts)
