"""The gradient-flow network analysis computed from a loaded gradient history (see
:mod:`analysis.analyses.flow` for the sections and the differences from the reference).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from analysis.analyses.flow import reference as flow_reference
from analysis.analyses.flow.models import (
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
from analysis.analyses.flow.regions import adjacent_runs, steps_all, steps_any
from analysis.blocks import series
from analysis.blocks.gradient_arrays import (
    FLAG_DEAD,
    FLAG_EXPLODING,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    GradientHistory,
    Packed,
    layer_chunks,
)
from analysis.blocks.significance import family_alpha, tukey_fences
from analysis.read.connect import StoreError

_SEVERITY_ORDER = ("Mild", "Moderate", "Severe", "Critical")


def flow_from_history(
    history: GradientHistory, config: GradientVisualizationConfig | None = None
) -> GradientFlowVisualization:
    """Compute the visualisation data from a loaded history (see :mod:`analysis.analyses.flow`).

    Args:
        history: from :func:`analysis.blocks.gradient_arrays.load_history`.
        config: see :func:`analysis.analyses.flow.build_flow_visualization`.

    Returns:
        The :class:`GradientFlowVisualization`.

    Raises:
        StoreError: the history has no rows.
    """
    cfg = config or GradientVisualizationConfig()
    if history.num_layers == 0:
        raise StoreError(f"run {history.run_id!r} has no gradient rows in the step range")
    packed = history.packed
    x = packed.values
    window = packed.window(cfg.temporal_window)
    mean, consistency, bottleneck, flow_rate, step_scores = _layer_series(
        packed, window.values.shape[1]
    )

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
        network = _reference_network(history, x, mean, consistency, bottleneck, flow_rate)
    else:
        network = _network(history, mean, consistency)
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
        **history.report_header(),
        layer_flows=layer_flows,
        temporal_flows=temporal,
        flow_network=network,
        critical_paths=paths,
        vanishing_regions=vanishing,
        exploding_regions=exploding,
        dead_zones=dead,
        visualization_config=cfg,
    )


def _layer_series(
    packed: Packed, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per layer of the packed series: mean, flow consistency, bottleneck score,
    information flow rate (float64 ``[L]`` each) and the step consistency of the last
    ``width`` columns (float64 ``[L, width]``), computed a chunk of layers at a time
    (:func:`analysis.blocks.gradient_arrays.layer_chunks`: each is a row-wise statistic, so
    the bits are those of one pass over the whole array, and the temporaries stay within
    one chunk)."""
    x, n = packed.values, packed.counts
    layers = x.shape[0]
    mean, consistency, bottleneck, flow_rate = (np.empty(layers) for _ in range(4))
    step_scores = np.empty((layers, width))
    for rows in layer_chunks(layers, x.shape[1]):
        part = x[rows]
        mean[rows] = series.moments(part).mean
        consistency[rows] = series.flow_consistency(part)
        bottleneck[rows] = series.bottleneck_score(part, mean[rows])
        flow_rate[rows] = series.information_flow_rate(part, n[rows])
        step_scores[rows] = series.step_consistency(part)[:, part.shape[1] - width :]
    return mean, consistency, bottleneck, flow_rate, step_scores


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
    stability ``1 / (1 + variance)`` of the last five (:mod:`.reference`)."""
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
    finite samples (:mod:`.reference`); ``duration_steps`` the layer's samples,
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
                **_region_place(history, "vanishing", len(vanishing) + 1, i, i, samples),
                severity_level=severity,
                mitigation_suggestions=_vanishing_advice(history, i, i, severity),
            ))
        if e_classes[i] is not None:
            peak = float(np.nanmax(values[i]))
            exploding.append(ExplodingRegion(
                **_region_place(history, "exploding", len(exploding) + 1, i, i, samples),
                severity_level=e_classes[i],
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
    count = max(history.num_layers - 1, 0)
    out = {key: np.empty(count) for key in
           ("strength", "consistency", "blocked_fraction", "mean_log_gain")}
    # Every quantity is per edge (row-wise over the two layers' aligned steps): done a
    # chunk of edges at a time, the [edges, T] temporaries stay within one chunk.
    for edges in layer_chunks(count, history.num_steps):
        for key, value in _edge_chunk(history, edges.start, edges.stop).items():
            out[key][edges] = value
    return out


def _edge_chunk(history: GradientHistory, start: int, stop: int) -> dict[str, np.ndarray]:
    """:func:`_edge_arrays` for the edges ``start:stop`` (layers ``start:stop + 1``)."""
    norms = history.norms[start : stop + 1]
    rms = norms / np.sqrt(
        np.maximum(history.numel[start : stop + 1], 1).astype(np.float64)
    )[:, None]
    src, dst = rms[1:], rms[:-1]
    present = history.valid[start : stop + 1]
    both = present[1:] & present[:-1]
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


def _region_place(
    history: GradientHistory, kind: str, number: int, start: int, end: int, duration: int
) -> dict[str, Any]:
    """The fields every vanishing or exploding region has, as model keyword arguments:
    ``region_id`` (``<kind>_<number>``), ``affected_layers`` (layers ``start..end``,
    model order) and ``extent`` (``duration`` steps)."""
    return {
        "region_id": f"{kind}_{number}",
        "affected_layers": history.names[start : end + 1],
        "extent": RegionExtent(
            start_layer=history.names[start],
            end_layer=history.names[end],
            affected_parameters=int(history.numel[start : end + 1].sum()),
            duration_steps=duration,
        ),
    }


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
                **_region_place(history, "vanishing", k + 1, start, end, duration),
                severity_level=severity,
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
                **_region_place(history, "exploding", k + 1, start, end, duration),
                severity_level=severity,
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

