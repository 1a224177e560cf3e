"""Gradient-flow network analysis (per-layer flow, flow network, regions, dead zones),
computed from the stored history of a run. Semantics follow the reference implementation
(trustformers-debug, module ``gradient_debugger::visualization``).

:func:`build_flow_visualization` loads the run once (:func:`load_history`) and derives
every section with NumPy passes over the ``layers x steps`` arrays, O(layers x steps) in
total. The report models and the formula of every field are in
:mod:`analysis.analyses.flow_models`.

Differences from the reference (with reasons in ``analysis/REFERENCE_DIFFERENCES.md``;
the option ``rules="reference"`` restores those marked R, with the reference's own
cut-offs, from :mod:`analysis.analyses.flow_reference`):

- Placeholders computed from data: ``direction_vector = [norm]`` (left out: needs gradient
  vectors), ``connectivity = number of layers`` (node degree), edges between hash-order
  neighbours (consecutive layers in backpropagation order), ``criticality_score 0.8`` and
  ``optimization_potential 0.6`` (share of gradient lost along the path; share of the
  parameters on it), ``affected_parameters 1000`` (sum of the layers' ``numel``).
- (R) ``FlowDirection``: turning-point test and a t-test on the slope over the temporal
  window, instead of the sign of ``latest - oldest`` over the last three samples.
- (R) ``stability_score``: ``1 / (1 + std / mean)`` over the window instead of ``1 / (1 +
  variance)`` of the last five samples.
- (R) ``NodeType``: position in the backpropagation chain and Tukey fences on the edges'
  per-element log gains, instead of ``bottleneck_score > 0.8`` / ``flow rate > 1`` /
  ``sum of norms < 0.01`` / ``any norm > 10``.
- (R) ``FlowEdge`` and ``EdgeType``: per-element gain between the two layers (geometric
  mean, consistency, zero fraction) and cut-offs Blocked >= 1/2 zero, Intermittent
  consistency < 1/2, Strong gain >= 1, instead of the mean of the two layers' flow rates
  and consistencies with cut-offs 1.0 / 0.8, 0.1 / 0.3, 0.6 and a fall-through to Blocked.
- (R) ``network_connectivity``: share of edges not Blocked instead of ``edges / (n (n -
  1))``.
- Critical paths: stretches of non-Strong edges, product of gains (reference: one
  "main path" of all layers, sum of strengths, constant scores).
- (R) Vanishing and exploding regions, dead zones: the run's own per-step flags (the rule
  of health, report and alerts), at least half of the steps, adjacent layers merged,
  severities in orders of magnitude, instead of one region per layer at mean norm < 1e-5
  (Critical < 1e-7), max norm > 100 (Critical > 1000), norms < 1e-8 in more than half of
  the samples.
- ``flow_consistency``: a zero sample followed by a non-zero one is an infinite change
  (the reference's ``+ 1e-8`` gives 1e8, the same consistency to eight digits).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from analysis.analyses.flow_models import (
    PALETTES,
    ColorScheme,
    CriticalGradientPath,
    EdgeType,
    ExplodingRegion,
    ExplodingSeverity,
    FlowDirection,
    FlowEdge,
    FlowNode,
    GradientDeadZone,
    GradientDirection,
    GradientFlowNetwork,
    GradientFlowVisualization,
    GradientLayerFlow,
    GradientVisualizationConfig,
    NetworkMetrics,
    NodeType,
    RecoveryPotential,
    RegionExtent,
    TemporalGradientFlow,
    VanishingRegion,
    VanishingSeverity,
)
from analysis.analyses.history import (
    FLAG_DEAD,
    FLAG_EXPLODING,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    GradientHistory,
    Packed,
    load_history,
)
from analysis.analyses.reference import DEFAULT_RULES, Rules
from analysis.analyses.regions import adjacent_runs, steps_all, steps_any
from analysis.analyses.render import (
    ROWS_IN_TABLE,
    add_more_row,
    excluded_text,
    num,
    show_name,
    table,
)
from analysis.analyses.stats import DEFAULT_ALPHA, family_alpha, tukey_fences
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Group, RenderableType
from rich.text import Text

from analysis.analyses import flow_reference, series
from analysis.read.connect import StoreError
from analysis.read.exclusion import split_patterns
from analysis.registry import Analysis

if TYPE_CHECKING:
    from collections.abc import Sequence

    import duckdb

__all__ = [
    "ANALYSIS",
    "ColorScheme",
    "FlowOptions",
    "GradientFlowVisualization",
    "GradientVisualizationConfig",
    "build_flow_visualization",
    "flow_from_history",
    "render_flow",
]

_SEVERITY_ORDER = ("Mild", "Moderate", "Severe", "Critical")


def build_flow_visualization(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None = None,
    to_step: int | None = None,
    config: GradientVisualizationConfig | None = None,
    ignore_layers: Sequence[str] = (),
) -> GradientFlowVisualization:
    """The gradient-flow network analysis (``generate_visualization``) over one run's stored
    history.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run.
        from_step, to_step: inclusive step range (``None`` = open).
        config: window, significance level, colour scheme, sections; the reference defaults.
        ignore_layers: patterns excluded besides the run's own ``ignore_layers``: the
            layers of the report's exclusion have no vanishing, exploding or dead flag here
            (:func:`analysis.analyses.history.load_history`).

    Returns:
        The :class:`GradientFlowVisualization`.

    Raises:
        StoreError: unknown run, invalid step range, or no gradient rows in the range.
    """
    history = load_history(con, run_id, from_step, to_step, ignore_layers)
    return flow_from_history(history, config)


def flow_from_history(
    history: GradientHistory, config: GradientVisualizationConfig | None = None
) -> GradientFlowVisualization:
    """Compute the visualisation data from a loaded history (see the module docstring).

    Args:
        history: from :func:`analysis.analyses.history.load_history`.
        config: see :func:`build_flow_visualization`.

    Returns:
        The :class:`GradientFlowVisualization`.

    Raises:
        StoreError: the history has no rows.
    """
    cfg = config or GradientVisualizationConfig()
    if history.num_layers == 0:
        raise StoreError(f"run {history.run_id!r} has no gradient rows in the step range")
    packed = history.packed
    x, n = packed.values, packed.counts
    mom = series.moments(x)
    consistency = series.flow_consistency(x)
    bottleneck = series.bottleneck_score(x, mom.mean)
    flow_rate = series.information_flow_rate(x, n)
    window = packed.window(cfg.temporal_window)
    step_scores = series.step_consistency(x)[:, -window.values.shape[1] :]

    layer_flows = [
        _layer_flow(history, i, window, step_scores[i], consistency, bottleneck, flow_rate)
        for i in range(history.num_layers)
    ]
    reference = cfg.rules == "reference"
    if not cfg.show_temporal_flows:
        temporal = []
    elif reference:
        temporal = _reference_temporal_flows(history, packed)
    else:
        temporal = _temporal_flows(history, window, cfg)
    if reference:
        network = _reference_network(history, x, mom.mean, consistency, bottleneck, flow_rate)
    else:
        network = _network(history, mom.mean, consistency)
    paths = _critical_paths(history, network) if cfg.show_critical_paths else []
    regions = cfg.show_problem_regions
    if regions and reference:
        vanishing, exploding, dead = _reference_regions(history, packed)
    elif regions:
        vanishing = _vanishing_regions(history)
        exploding = _exploding_regions(history)
        dead = _dead_zones(history)
    else:
        vanishing, exploding, dead = [], [], []
    return GradientFlowVisualization(
        run_id=history.run_id,
        from_step=history.from_step,
        to_step=history.to_step,
        steps=history.num_steps,
        layers=history.num_layers,
        layer_flows=layer_flows,
        temporal_flows=temporal,
        flow_network=network,
        critical_paths=paths,
        vanishing_regions=vanishing,
        exploding_regions=exploding,
        dead_zones=dead,
        visualization_config=cfg,
        ignore_layers=history.exclusion.patterns,
        layers_excluded=[n for n, x in zip(history.names, history.excluded.tolist(),
                                           strict=True) if x],
    )


def _layer_flow(
    history: GradientHistory,
    i: int,
    window: Packed,
    scores: np.ndarray,
    consistency: np.ndarray,
    bottleneck: np.ndarray,
    flow_rate: np.ndarray,
) -> GradientLayerFlow:
    keep = ~np.isnan(window.values[i])
    values = window.values[i][keep].tolist()
    steps = window.steps[i][keep].astype(np.int64).tolist()
    cons = scores[keep].tolist()
    return GradientLayerFlow(
        layer_name=history.names[i],
        layer_index=int(history.layer_index[i]),
        samples=int(history.counts[i]),
        gradient_magnitudes=values,
        gradient_directions=[
            GradientDirection(step=s, magnitude=v, consistency_score=c)
            for s, v, c in zip(steps, values, cons, strict=True)
        ],
        flow_consistency=float(consistency[i]),
        bottleneck_score=float(bottleneck[i]),
        information_flow_rate=float(flow_rate[i]),
    )


def _temporal_flows(
    history: GradientHistory, window: Packed, cfg: GradientVisualizationConfig
) -> list[TemporalGradientFlow]:
    values, steps, counts = window.values, window.steps, window.counts
    per_layer = family_alpha(cfg.alpha, history.num_layers)
    turning = series.turning_points(values, counts, per_layer)
    fit = series.trend(values, steps, per_layer)
    mom = series.moments(values)
    stable = series.stability(mom.std, mom.mean)
    out = []
    for i in range(history.num_layers):
        if counts[i] == 0:
            continue  # every row of the layer held NaN/Inf: no magnitude to follow
        if turning.oscillating[i]:
            direction = FlowDirection.OSCILLATING
        elif fit.significant[i] and fit.slope[i] > 0:
            direction = FlowDirection.FORWARD
        elif fit.significant[i] and fit.slope[i] < 0:
            direction = FlowDirection.BACKWARD
        else:
            direction = FlowDirection.STAGNANT
        out.append(
            TemporalGradientFlow(
                step=int(steps[i, -1]),
                layer_name=history.names[i],
                gradient_magnitude=float(values[i, -1]),
                flow_direction=direction,
                stability_score=float(stable[i]),
            )
        )
    return out


def _reference_temporal_flows(
    history: GradientHistory, packed: Packed
) -> list[TemporalGradientFlow]:
    """Temporal flows by the reference's rules: direction from the last three samples,
    stability ``1 / (1 + variance)`` of the last five (:mod:`.flow_reference`)."""
    values, steps, counts = packed.values, packed.steps, packed.counts
    directions = flow_reference.latest_directions(values, counts)
    stable = flow_reference.stability_scores(values, counts)
    return [
        TemporalGradientFlow(
            step=int(steps[i, -1]),
            layer_name=history.names[i],
            gradient_magnitude=float(values[i, -1]),
            flow_direction=directions[i],
            stability_score=float(stable[i]),
        )
        for i in range(history.num_layers)
        if counts[i] > 0
    ]


def _reference_network(
    history: GradientHistory,
    x: np.ndarray,
    strength: np.ndarray,
    consistency: np.ndarray,
    bottleneck: np.ndarray,
    flow_rate: np.ndarray,
) -> GradientFlowNetwork:
    """The flow network by the reference's rules (``build_gradient_flow_network``): node
    types from each layer's own series, edge strength and consistency the means of the two
    layers' ``information_flow_rate`` and ``flow_consistency``, the reference's edge
    cut-offs and ``network_connectivity = edges / (n (n - 1))``. The edges join
    consecutive layers in backpropagation order (the reference's hash-order neighbours are
    a placeholder); ``blocked_fraction`` is measured as with gradstream's rules."""
    count = history.num_layers
    node_types = flow_reference.node_types(x, bottleneck, flow_rate)
    e_strength = (flow_rate[1:] + flow_rate[:-1]) / 2.0
    e_consistency = (consistency[1:] + consistency[:-1]) / 2.0
    types = flow_reference.edge_types(e_strength, e_consistency)
    blocked_fraction = _edge_arrays(history)["blocked_fraction"]
    nodes = [
        FlowNode(
            layer_name=history.names[i],
            layer_index=int(history.layer_index[i]),
            node_type=node_types[i],
            gradient_strength=float(strength[i]),
            connectivity=(1 if i > 0 else 0) + (1 if i < count - 1 else 0),
            influence_score=float(strength[i] * consistency[i]),
        )
        for i in range(count)
    ]
    edges = [
        FlowEdge(
            from_layer=history.names[e + 1],
            to_layer=history.names[e],
            flow_strength=float(e_strength[e]),
            flow_consistency=float(e_consistency[e]),
            edge_type=types[e],
            blocked_fraction=float(blocked_fraction[e]),
        )
        for e in range(count - 2, -1, -1)
    ]
    n_edges = len(edges)
    efficiency = float(e_strength.sum()) / max(n_edges, 1)
    connectivity = n_edges / (max(count, 1) * max(count - 1, 1))
    metrics = NetworkMetrics(
        overall_flow_efficiency=efficiency,
        network_connectivity=connectivity,
        bottleneck_density=(
            sum(n.node_type is NodeType.BOTTLENECK for n in nodes) / count if count else 0.0
        ),
        flow_stability=float(e_consistency.sum()) / max(n_edges, 1),
        information_propagation_speed=efficiency * connectivity,
    )
    return GradientFlowNetwork(nodes=nodes, edges=edges, network_metrics=metrics)


def _reference_regions(
    history: GradientHistory, packed: Packed
) -> tuple[list[VanishingRegion], list[ExplodingRegion], list[GradientDeadZone]]:
    """Regions and dead zones by the reference's rules: one per layer, from the layer's
    finite samples (:mod:`.flow_reference`); ``duration_steps`` the layer's samples,
    ``affected_parameters`` its ``numel``."""
    values, counts = packed.values, packed.counts
    vanishing, exploding, dead = [], [], []
    v_classes = flow_reference.vanishing_classes(values, counts)
    e_classes = flow_reference.exploding_classes(values)
    d_classes = flow_reference.dead_zone_classes(values, counts)
    for i in range(history.num_layers):
        samples = int(counts[i])
        if v_classes[i] is not None:
            severity = v_classes[i]
            vanishing.append(VanishingRegion(
                region_id=f"vanishing_{len(vanishing) + 1}",
                affected_layers=[history.names[i]],
                severity_level=severity,
                extent=_extent(history, i, i, samples),
                mitigation_suggestions=_vanishing_advice(history, i, i, severity),
            ))
        if e_classes[i] is not None:
            peak = float(np.nanmax(values[i]))
            exploding.append(ExplodingRegion(
                region_id=f"exploding_{len(exploding) + 1}",
                affected_layers=[history.names[i]],
                severity_level=e_classes[i],
                extent=_extent(history, i, i, samples),
                mitigation_suggestions=_exploding_advice(
                    False, peak, flow_reference.EXPLODING_NORM
                ),
            ))
        if d_classes[i] is not None:
            zeros, potential, intervene = d_classes[i]
            dead.append(GradientDeadZone(
                zone_id=f"dead_zone_{len(dead) + 1}",
                affected_layers=[history.names[i]],
                dead_duration=zeros,
                recovery_potential=potential,
                intervention_required=intervene,
                affected_parameters=int(history.numel[i]),
            ))
    return vanishing, exploding, dead


def _edge_arrays(history: GradientHistory) -> dict[str, np.ndarray]:
    """Per edge ``e`` (from layer ``e + 1`` to layer ``e``, model positions) over the
    aligned steps: flow strength, consistency, blocked fraction, mean log gain."""
    norms = history.norms
    count = max(history.num_layers - 1, 0)
    rms = norms / np.sqrt(np.maximum(history.numel, 1).astype(np.float64))[:, None]
    src, dst = rms[1:], rms[:-1]
    both = history.valid[1:] & history.valid[:-1]
    common = both.sum(axis=1)
    blocked = (both & (norms[:-1] == 0)).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = dst / src
        valid = both & (src > 0) & (dst > 0)
        log_gain = np.where(valid, np.log(np.where(valid, gain, 1.0)), np.nan)
        gm = series.moments(np.where(valid, gain, np.nan))
        mean_log = np.nansum(log_gain, axis=1) / gm.n
    strength = np.where(gm.n > 0, np.exp(mean_log), 0.0)
    consistency = np.where(gm.n > 0, series.stability(gm.std, gm.mean), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        blocked_fraction = np.where(common > 0, blocked / common, 0.0)
    assert strength.shape == (count,)
    return {
        "strength": strength,
        "consistency": consistency,
        "blocked_fraction": blocked_fraction,
        "mean_log_gain": np.where(gm.n > 0, mean_log, np.nan),
    }


def _network(
    history: GradientHistory, strength: np.ndarray, consistency: np.ndarray
) -> GradientFlowNetwork:
    count = history.num_layers
    edges_data = _edge_arrays(history)
    blocked = edges_data["blocked_fraction"] >= 0.5
    edge_types: list[EdgeType] = []
    for e in range(count - 1):
        if blocked[e]:
            edge_types.append(EdgeType.BLOCKED)
        elif edges_data["consistency"][e] < 0.5:
            edge_types.append(EdgeType.INTERMITTENT)
        elif edges_data["strength"][e] >= 1.0:
            edge_types.append(EdgeType.STRONG)
        else:
            edge_types.append(EdgeType.WEAK)
    low, high = tukey_fences(edges_data["mean_log_gain"])
    nodes = []
    for i in range(count):
        incoming = i if i < count - 1 else None  # edge from layer i+1 into layer i
        node_type = NodeType.NORMAL
        if incoming is not None:
            gain = edges_data["mean_log_gain"][incoming]
            if edge_types[incoming] is EdgeType.BLOCKED or gain < low:
                node_type = NodeType.BOTTLENECK
            elif gain > high:
                node_type = NodeType.AMPLIFIER
        if node_type is NodeType.NORMAL and count > 1:
            if incoming is None:
                node_type = NodeType.SOURCE
            elif i == 0:
                node_type = NodeType.SINK
        degree = (1 if i > 0 else 0) + (1 if i < count - 1 else 0)
        nodes.append(
            FlowNode(
                layer_name=history.names[i],
                layer_index=int(history.layer_index[i]),
                node_type=node_type,
                gradient_strength=float(strength[i]),
                connectivity=degree,
                influence_score=float(strength[i] * consistency[i]),
            )
        )
    edges = [
        FlowEdge(
            from_layer=history.names[e + 1],
            to_layer=history.names[e],
            flow_strength=float(edges_data["strength"][e]),
            flow_consistency=float(edges_data["consistency"][e]),
            edge_type=edge_types[e],
            blocked_fraction=float(edges_data["blocked_fraction"][e]),
        )
        for e in range(count - 2, -1, -1)
    ]
    n_edges = len(edges)
    efficiency = float(edges_data["strength"].mean()) if n_edges else 0.0
    connectivity = float(1.0 - blocked.mean()) if n_edges else 0.0
    metrics = NetworkMetrics(
        overall_flow_efficiency=efficiency,
        network_connectivity=connectivity,
        bottleneck_density=(
            sum(n.node_type is NodeType.BOTTLENECK for n in nodes) / count if count else 0.0
        ),
        flow_stability=float(edges_data["consistency"].mean()) if n_edges else 0.0,
        information_propagation_speed=efficiency * connectivity,
    )
    return GradientFlowNetwork(nodes=nodes, edges=edges, network_metrics=metrics)


def _critical_paths(
    history: GradientHistory, network: GradientFlowNetwork
) -> list[CriticalGradientPath]:
    edges = network.edges  # backpropagation order
    weak = np.array([e.edge_type is not EdgeType.STRONG for e in edges], dtype=bool)
    node_type = {n.layer_name: n.node_type for n in network.nodes}
    numel_of = dict(zip(history.names, history.numel.tolist(), strict=True))
    total_params = max(int(history.numel.sum()), 1)
    paths = []
    for start, end in adjacent_runs(weak):
        run = edges[start : end + 1]
        layers = [run[0].from_layer] + [e.to_layer for e in run]
        total = math.prod(e.flow_strength for e in run)
        paths.append(
            CriticalGradientPath(
                path_id="",
                layers=layers,
                path_length=len(layers),
                total_flow_strength=total,
                bottleneck_layers=[n for n in layers if node_type[n] is NodeType.BOTTLENECK],
                criticality_score=1.0 - min(total, 1.0),
                optimization_potential=sum(numel_of[n] for n in layers) / total_params,
            )
        )
    paths.sort(key=lambda p: -p.criticality_score)
    return [p.model_copy(update={"path_id": f"path_{k + 1}"}) for k, p in enumerate(paths)]


def _extent(history: GradientHistory, start: int, end: int, duration: int) -> RegionExtent:
    return RegionExtent(
        start_layer=history.names[start],
        end_layer=history.names[end],
        affected_parameters=int(history.numel[start : end + 1].sum()),
        duration_steps=duration,
    )


def _severity(d: float) -> str:
    """Mild / Moderate / Severe / Critical for ``d`` orders of magnitude (d < 1, < 2, < 3,
    >= 3; NaN or inf -> Critical)."""
    if not math.isfinite(d) or d >= 3:
        return "Critical"
    return _SEVERITY_ORDER[max(math.floor(d), 0)]


def _fraction(history: GradientHistory, bits: int) -> np.ndarray:
    """Share of each layer's samples with any of ``bits`` set, float64 ``[L]``."""
    hits = ((history.flags & bits) != 0).sum(axis=1)
    return hits / np.maximum(history.rows, 1)


def _vanishing_regions(history: GradientHistory) -> list[VanishingRegion]:
    flagged = (history.flags & FLAG_VANISHING) != 0
    member = _fraction(history, FLAG_VANISHING) >= 0.5
    thr = history.vanishing_threshold
    # Orders of magnitude below the threshold of each layer's geometric-mean magnitude.
    with np.errstate(divide="ignore", invalid="ignore"):
        below = np.where(
            np.isnan(history.log_magnitude),
            np.inf,
            (math.log(thr) - history.log_magnitude) / math.log(10.0),
        )
    regions = []
    for k, (start, end) in enumerate(adjacent_runs(member)):
        severity = VanishingSeverity(_severity(float(np.median(below[start : end + 1]))))
        duration = int(steps_all(flagged, history.present, start, end).sum())
        regions.append(
            VanishingRegion(
                region_id=f"vanishing_{k + 1}",
                affected_layers=history.names[start : end + 1],
                severity_level=severity,
                extent=_extent(history, start, end, duration),
                mitigation_suggestions=_vanishing_advice(history, start, end, severity),
            )
        )
    return regions


def _vanishing_advice(
    history: GradientHistory, start: int, end: int, severity: VanishingSeverity
) -> list[str]:
    advice = []
    if start == 0:
        advice.append(
            "The region reaches the input end of the model, the farthest from the loss: "
            "add residual (skip) connections or normalisation layers so the gradient has a "
            "short path back to these layers."
        )
    else:
        advice.append(
            "Gradients fade inside the model: check the activations feeding this region "
            "for saturation (sigmoid/tanh) and consider residual connections around it."
        )
    if severity in (VanishingSeverity.SEVERE, VanishingSeverity.CRITICAL):
        advice.append(
            "Gradients here are orders of magnitude below the threshold: re-initialise "
            "with a scheme matched to the activation (He/Kaiming for ReLU-like units, "
            "Xavier/Glorot for tanh or sigmoid)."
        )
    if end - start + 1 > 1:
        advice.append(
            f"{end - start + 1} adjacent layers vanish together: a per-layer (layer-wise "
            "adaptive) optimiser such as Adam or LAMB rescales their updates."
        )
    return advice


def _exploding_regions(history: GradientHistory) -> list[ExplodingRegion]:
    bits = FLAG_EXPLODING | FLAG_NONFINITE
    flagged = (history.flags & bits) != 0
    member = flagged.any(axis=1)
    nonfinite = ((history.flags & FLAG_NONFINITE) != 0).any(axis=1)
    thr = history.exploding_threshold
    regions = []
    for k, (start, end) in enumerate(adjacent_runs(member)):
        peak = float(np.nanmax(history.peak_magnitude[start : end + 1]))
        if nonfinite[start : end + 1].any():
            severity = ExplodingSeverity.CRITICAL
        else:
            severity = ExplodingSeverity(_severity(math.log10(peak / thr) if peak > 0 else 0.0))
        duration = int(steps_any(flagged, start, end).sum())
        regions.append(
            ExplodingRegion(
                region_id=f"exploding_{k + 1}",
                affected_layers=history.names[start : end + 1],
                severity_level=severity,
                extent=_extent(history, start, end, duration),
                mitigation_suggestions=_exploding_advice(
                    bool(nonfinite[start : end + 1].any()), peak, thr
                ),
            )
        )
    return regions


def _exploding_advice(nonfinite: bool, peak: float, threshold: float) -> list[str]:
    advice = [
        "Clip the global gradient norm before each optimiser step "
        "(torch.nn.utils.clip_grad_norm_) so one bad batch cannot blow up the weights.",
        f"The largest gradient element reached {peak:.3g} (threshold {threshold:.3g}): "
        "lower the learning rate or lengthen its warm-up.",
    ]
    if nonfinite:
        advice.append(
            "Gradients overflowed to NaN/Inf: skip optimiser steps with non-finite "
            "gradients and, with mixed precision, use dynamic loss scaling."
        )
    return advice


def _dead_zones(history: GradientHistory) -> list[GradientDeadZone]:
    dead = (history.flags & FLAG_DEAD) != 0
    member = _fraction(history, FLAG_DEAD) >= 0.5
    half = history.num_steps // 2  # steps[half:] is the later half of the range
    zones = []
    for k, (start, end) in enumerate(adjacent_runs(member)):
        present = history.present[start : end + 1]
        alive = (history.valid[start : end + 1] & ~dead[start : end + 1]).any(axis=0)
        reported = np.flatnonzero(present.any(axis=0))
        last = int(reported[-1])
        if alive[last]:
            potential = RecoveryPotential.HIGH
        elif alive[half:].any():
            potential = RecoveryPotential.MEDIUM
        elif alive.any():
            potential = RecoveryPotential.LOW
        else:
            potential = RecoveryPotential.NONE
        zones.append(
            GradientDeadZone(
                zone_id=f"dead_zone_{k + 1}",
                affected_layers=history.names[start : end + 1],
                dead_duration=int(steps_all(dead, history.present, start, end).sum()),
                recovery_potential=potential,
                intervention_required=potential is not RecoveryPotential.HIGH,
                affected_parameters=int(history.numel[start : end + 1].sum()),
            )
        )
    return zones


# -- terminal rendering -------------------------------------------------------------------


def render_flow(report: GradientFlowVisualization) -> RenderableType:
    """Tables of the visualisation data for a terminal: network metrics, nodes and edges
    (at most ``ROWS_IN_TABLE`` each), critical paths, problem regions and latest flow
    directions, coloured with the report's colour scheme.

    Args:
        report: from :func:`build_flow_visualization`.

    Returns:
        A rich renderable.
    """
    cfg = report.visualization_config
    palette = PALETTES[cfg.color_scheme]
    parts: list[RenderableType] = []
    head = Text("gradient flow of run ", style="bold")
    head.append(show_name(report.run_id))
    head.append(f"  ({report.layers} layers, {report.steps} steps, {cfg.rules} rules)",
                style="dim")
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


# -- registry entry ------------------------------------------------------------------------


class FlowOptions(BaseModel):
    """Options of the flow analysis (``gradstream analyze --kind flow``, ``/api/analysis/flow``).

    - ``window``: samples per layer behind the flow directions and stability scores
      (``temporal_window`` of :class:`GradientVisualizationConfig`), >= 1.
    - ``alpha``: significance level of the direction tests, in (0, 1).
    - ``color_scheme``: colours of the tables and of the report's palette.
    - ``rules``: ``"gradstream"`` (default) or ``"reference"``: the reference's flow
      directions, stability scores, node and edge types, connectivity, regions and dead
      zones (see the module docstring).
    - ``ignore_layers``: comma-separated layer-name patterns excluded besides the run's
      own ``ignore_layers`` (as ``gradstream report --ignore-layers``: the matched layers'
      vanishing, exploding and dead flags count nowhere, NaN/Inf still does;
      :func:`analysis.read.exclusion.run_exclusion`).
    """

    model_config = ConfigDict(frozen=True)

    window: int = Field(default=GradientVisualizationConfig().temporal_window, ge=1)
    alpha: float = Field(default=DEFAULT_ALPHA, gt=0.0, lt=1.0)
    color_scheme: ColorScheme = ColorScheme.DEFAULT
    rules: Rules = DEFAULT_RULES
    ignore_layers: str = ""


def _build(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    from_step: int | None,
    to_step: int | None,
    options: FlowOptions,
) -> GradientFlowVisualization:
    """:func:`build_flow_visualization` with the config made from ``options`` (other
    config fields at their defaults). Raises what that function raises."""
    config = GradientVisualizationConfig(
        temporal_window=options.window, alpha=options.alpha, color_scheme=options.color_scheme,
        rules=options.rules,
    )
    return build_flow_visualization(con, run_id, from_step, to_step, config,
                                    split_patterns(options.ignore_layers))


ANALYSIS = Analysis(
    name="flow",
    help="Gradient flow network, vanishing and exploding regions, dead zones and critical "
    "paths.",
    options=FlowOptions,
    build=_build,
    render=render_flow,
)
"""The flow analysis's entry in :data:`analysis.registry.ANALYSES`."""
