"""The reference's classification rules of the gradient-flow network
analysis (trustformers-debug, ``gradient_debugger::visualization``), used by
:mod:`analysis.analyses.flow` with ``rules="reference"``.

Each function reproduces one rule as the reference writes it, vectorised over layers
(model order); the cut-offs are the reference's constants, in gradient-norm units. Inputs
are the right-aligned per-layer series of :class:`analysis.blocks.gradient_arrays.Packed`
(``values`` float64 ``[L, W]``, NaN before a layer's first sample; only rows with a finite
norm). gradstream's own rules, and why they are the default, are in
:mod:`analysis.analyses.flow.models` and ``analysis/REFERENCE_DIFFERENCES.md``.
"""

from __future__ import annotations

import numpy as np

from analysis.analyses.flow.models import (
    EdgeType,
    ExplodingSeverity,
    FlowDirection,
    NodeType,
    RecoveryPotential,
    VanishingSeverity,
)

__all__ = [
    "DEAD_NORM",
    "EXPLODING_CRITICAL_NORM",
    "EXPLODING_NORM",
    "STAGNANT_TREND",
    "VANISHING_CRITICAL_NORM",
    "VANISHING_NORM",
    "dead_zone_classes",
    "edge_types",
    "exploding_classes",
    "latest_directions",
    "node_types",
    "stability_scores",
    "vanishing_classes",
]

STAGNANT_TREND = 1e-6
"""``|latest - oldest| < 1e-6`` over the last three samples: Stagnant."""
VANISHING_NORM = 1e-5
"""A layer whose mean norm is below this is a vanishing region (Critical below 1e-7)."""
VANISHING_CRITICAL_NORM = 1e-7
EXPLODING_NORM = 100.0
"""A layer whose largest norm is above this is an exploding region (Critical above 1000)."""
EXPLODING_CRITICAL_NORM = 1000.0
DEAD_NORM = 1e-8
"""A sample with a norm below this counts as dead (``zero_gradients``)."""


def latest_directions(values: np.ndarray, counts: np.ndarray) -> list[FlowDirection]:
    """``get_latest_flow_direction``: from the last three samples ``a, b, c`` (oldest
    first), ``trend = c - a``: Stagnant if ``|trend| < 1e-6``, Forward if ``trend > 0``;
    when it falls, Oscillating if the two steps ``c - b`` and ``b - a`` have opposite
    signs, else Backward. Fewer than three samples: Forward (as in the reference).

    Args:
        values: float64 ``[L, W]`` right-aligned norms; counts: int64 ``[L]`` samples.

    Returns:
        One :class:`FlowDirection` per layer.
    """
    out = []
    if values.shape[1] < 3:
        return [FlowDirection.FORWARD] * values.shape[0]
    a, b, c = values[:, -3], values[:, -2], values[:, -1]
    trend = c - a
    reversal = (c - b) * (b - a) < 0
    for k in range(values.shape[0]):
        if counts[k] < 3:
            out.append(FlowDirection.FORWARD)
        elif abs(trend[k]) < STAGNANT_TREND:
            out.append(FlowDirection.STAGNANT)
        elif trend[k] > 0:
            out.append(FlowDirection.FORWARD)
        elif reversal[k]:
            out.append(FlowDirection.OSCILLATING)
        else:
            out.append(FlowDirection.BACKWARD)
    return out


def stability_scores(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``compute_stability_score``: ``1 / (1 + var)`` of the last (up to) five samples,
    population variance in squared norm units; 1.0 with fewer than three samples.

    Returns:
        float64 ``[L]`` in (0, 1].
    """
    recent = values[:, -5:]
    ok = ~np.isnan(recent)
    n = np.maximum(ok.sum(axis=1), 1)
    x = np.where(ok, recent, 0.0)
    mean = x.sum(axis=1) / n
    var = (np.where(ok, x - mean[:, None], 0.0) ** 2).sum(axis=1) / n
    return np.where(counts >= 3, 1.0 / (1.0 + var), 1.0)


def node_types(
    values: np.ndarray, bottleneck: np.ndarray, flow_rate: np.ndarray
) -> list[NodeType]:
    """``classify_node_type`` (first match): Bottleneck if ``bottleneck_score > 0.8``,
    Amplifier if ``information_flow_rate > 1``, Sink if the sum of the layer's norms is
    below 0.01, Source if any norm is above 10, Normal otherwise.

    Args:
        values: float64 ``[L, W]`` norms (all samples in the range).
        bottleneck, flow_rate: float64 ``[L]`` the layers' ``bottleneck_score`` and
            ``information_flow_rate``.

    Returns:
        One :class:`NodeType` per layer.
    """
    total = np.nansum(values, axis=1)
    peak = np.nanmax(np.where(np.isnan(values), -np.inf, values), axis=1, initial=-np.inf)
    out = []
    for k in range(values.shape[0]):
        if bottleneck[k] > 0.8:
            out.append(NodeType.BOTTLENECK)
        elif flow_rate[k] > 1.0:
            out.append(NodeType.AMPLIFIER)
        elif total[k] < 0.01:
            out.append(NodeType.SINK)
        elif peak[k] > 10.0:
            out.append(NodeType.SOURCE)
        else:
            out.append(NodeType.NORMAL)
    return out


def edge_types(strength: np.ndarray, consistency: np.ndarray) -> list[EdgeType]:
    """``classify_edge_type`` (first match): Strong if ``strength > 1`` and ``consistency
    > 0.8``; Weak if ``strength < 0.1`` or ``consistency < 0.3``; Intermittent if
    ``consistency < 0.6``; otherwise Blocked (the reference's fall-through, kept as
    written: an edge of moderate strength and good consistency is called Blocked).

    Args:
        strength, consistency: float64 ``[E]``: the mean of the two layers'
            ``information_flow_rate`` and of their ``flow_consistency``.
    """
    out = []
    for s, c in zip(strength.tolist(), consistency.tolist(), strict=True):
        if s > 1.0 and c > 0.8:
            out.append(EdgeType.STRONG)
        elif s < 0.1 or c < 0.3:
            out.append(EdgeType.WEAK)
        elif c < 0.6:
            out.append(EdgeType.INTERMITTENT)
        else:
            out.append(EdgeType.BLOCKED)
    return out


def vanishing_classes(values: np.ndarray, counts: np.ndarray) -> list[VanishingSeverity | None]:
    """``identify_vanishing_regions``: a layer whose mean norm is below 1e-5 is a region,
    Critical below 1e-7, Moderate otherwise; ``None`` for other layers (and for layers
    without a finite sample)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nansum(values, axis=1) / counts
    return [
        None if not (counts[k] > 0 and m < VANISHING_NORM)
        else VanishingSeverity.CRITICAL if m < VANISHING_CRITICAL_NORM
        else VanishingSeverity.MODERATE
        for k, m in enumerate(mean.tolist())
    ]


def exploding_classes(values: np.ndarray) -> list[ExplodingSeverity | None]:
    """``identify_exploding_regions``: a layer whose largest norm is above 100 is a
    region, Critical above 1000, Moderate otherwise; ``None`` for other layers."""
    peak = np.nanmax(np.where(np.isnan(values), 0.0, values), axis=1, initial=0.0)
    return [
        None if not p > EXPLODING_NORM
        else ExplodingSeverity.CRITICAL if p > EXPLODING_CRITICAL_NORM
        else ExplodingSeverity.MODERATE
        for p in peak.tolist()
    ]


def dead_zone_classes(
    values: np.ndarray, counts: np.ndarray
) -> list[tuple[int, RecoveryPotential, bool] | None]:
    """``identify_gradient_dead_zones``: with ``z`` the samples whose norm is below 1e-8
    and ``r = z / samples``, a layer with ``r > 0.5`` is a dead zone: ``(z, Low if r > 0.9
    else Medium, intervention required r > 0.8)``; ``None`` for other layers."""
    dead = np.where(np.isnan(values), False, values < DEAD_NORM).sum(axis=1)
    out: list[tuple[int, RecoveryPotential, bool] | None] = []
    for k in range(values.shape[0]):
        ratio = dead[k] / counts[k] if counts[k] else 0.0
        if ratio > 0.5:
            potential = RecoveryPotential.LOW if ratio > 0.9 else RecoveryPotential.MEDIUM
            out.append((int(dead[k]), potential, bool(ratio > 0.8)))
        else:
            out.append(None)
    return out
