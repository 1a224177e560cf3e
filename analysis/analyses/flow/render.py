"""Terminal rendering (rich) of the gradient-flow network analysis."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from analysis.analyses.flow.models import (
    PALETTES,
    ExplodingRegion,
    GradientFlowVisualization,
    VanishingRegion,
)
from analysis.blocks.terminal import (
    ROWS_IN_TABLE,
    add_more_row,
    excluded_text,
    num,
    report_head,
    show_name,
    table,
)


def render_flow(report: GradientFlowVisualization) -> RenderableType:
    """Tables of the visualisation data for a terminal: network metrics, nodes and edges
    (at most ``ROWS_IN_TABLE`` each), critical paths, problem regions and latest flow
    directions, coloured with the report's colour scheme.

    Args:
        report: from :func:`analysis.analyses.flow.build_flow_visualization`.

    Returns:
        A rich renderable.
    """
    cfg = report.visualization_config
    palette = PALETTES[cfg.color_scheme]
    parts: list[RenderableType] = []
    head = report_head("gradient flow", report.run_id,
                       f"{report.layers} layers, {report.steps} steps, {cfg.rules} rules")
    parts.append(head)
    if report.ignore_layers:
        excluded = Text("excluded ", style="bold")
        excluded.append_text(excluded_text(report.ignore_layers, report.layers_excluded))
        parts.append(excluded)
    m = report.flow_network.network_metrics
    metrics = table("network", ["metric", "value"], [False, True])
    for name, value in m.model_dump().items():
        metrics.add_row(name, num(value))
    parts.append(metrics)

    strongest = max((n.gradient_strength for n in report.flow_network.nodes), default=0.0)
    flows = {f.layer_name: f for f in report.layer_flows}
    latest = {t.layer_name: t for t in report.temporal_flows}
    nodes = table(
        "layers (model order)",
        ["layer", "node", "mean norm", "consist.", "bneck", "direction", "stab."],
        [False, False, True, True, True, False, True],
    )
    for node in report.flow_network.nodes[:ROWS_IN_TABLE]:
        dim = strongest > 0 and node.gradient_strength < cfg.flow_threshold * strongest
        flow = flows[node.layer_name]
        temporal = latest.get(node.layer_name)
        nodes.add_row(
            Text(show_name(node.layer_name), style="dim" if dim else ""),
            Text(node.node_type.value, style=palette[node.node_type.value]),
            num(node.gradient_strength),
            num(flow.flow_consistency),
            num(flow.bottleneck_score),
            temporal.flow_direction.value if temporal else "-",
            num(temporal.stability_score) if temporal else "-",
        )
    add_more_row(nodes, len(report.flow_network.nodes), ROWS_IN_TABLE)
    parts.append(nodes)

    edges = table(
        "edges (backpropagation order)",
        ["from", "to", "type", "gain", "consist.", "blocked"],
        [False, False, False, True, True, True],
    )
    for edge in report.flow_network.edges[:ROWS_IN_TABLE]:
        edges.add_row(
            show_name(edge.from_layer), show_name(edge.to_layer),
            Text(edge.edge_type.value, style=palette[edge.edge_type.value]),
            num(edge.flow_strength), num(edge.flow_consistency),
            f"{edge.blocked_fraction:.0%}",
        )
    add_more_row(edges, len(report.flow_network.edges), ROWS_IN_TABLE)
    if report.flow_network.edges:
        parts.append(edges)

    if report.critical_paths:
        paths = table(
            "critical paths (stretches of non-Strong edges, backpropagation order)",
            ["path", "from", "to", "layers", "gain", "lost", "params", "bneck"],
            [False, False, False, True, True, True, True, True],
        )
        for path in report.critical_paths[:ROWS_IN_TABLE]:
            paths.add_row(
                path.path_id, show_name(path.layers[0]), show_name(path.layers[-1]),
                str(path.path_length), num(path.total_flow_strength, 2),
                f"{path.criticality_score:.0%}", f"{path.optimization_potential:.0%}",
                str(len(path.bottleneck_layers)),
            )
        add_more_row(paths, len(report.critical_paths), ROWS_IN_TABLE)
        parts.append(paths)

    problems = table(
        "problem regions (adjacent layers, model order)",
        ["region", "severity", "first layer", "last layer", "layers", "params", "steps"],
        [False, False, False, False, True, True, True],
    )
    advice = Text()
    regions: list[VanishingRegion | ExplodingRegion] = [
        *report.vanishing_regions, *report.exploding_regions
    ]
    for region in regions:
        severity = region.severity_level.value
        layers = region.affected_layers
        problems.add_row(
            region.region_id, Text(severity, style=palette[severity]),
            show_name(layers[0]), show_name(layers[-1]), str(len(layers)),
            str(region.extent.affected_parameters), str(region.extent.duration_steps),
        )
        for line in region.mitigation_suggestions:
            advice.append(("\n" if advice.plain else "") + f"• {region.region_id}: {line}")
    for zone in report.dead_zones:
        layers = zone.affected_layers
        problems.add_row(
            zone.zone_id, f"recovery {zone.recovery_potential.value}",
            show_name(layers[0]), show_name(layers[-1]), str(len(layers)),
            str(zone.affected_parameters), str(zone.dead_duration),
        )
        if zone.intervention_required:
            advice.append(("\n" if advice.plain else "")
                          + f"• {zone.zone_id}: no gradient reaches these layers; check that "
                          "they are connected to the loss and that their units are not dead.")
    if regions or report.dead_zones:
        parts += [problems, advice]
    else:
        parts.append(Text("no vanishing or exploding regions, no dead zones", style="green"))
    return Group(*parts)
