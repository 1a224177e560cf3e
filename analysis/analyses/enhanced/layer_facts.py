"""Per-layer facts behind the enhanced analysis (``analysis.analyses.enhanced``), computed once for
all layers.

Every array is indexed by layer position (model order) and computed in a constant number
of vectorised passes over the ``layers x steps`` history; the report builders in
:mod:`analysis.analyses.enhanced`, :mod:`analysis.analyses.enhanced.network` and
:mod:`analysis.analyses.enhanced.hierarchy` only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.analyses.enhanced.models import LayerHealth
from analysis.blocks import series
from analysis.blocks.gradient_arrays import (
    FLAG_DEAD,
    FLAG_EXPLODING,
    FLAG_ISSUE,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    GradientHistory,
    layer_chunks,
)
from analysis.blocks.significance import family_alpha

RISK_VANISHING = "vanishing"
RISK_DEAD = "dead"
RISK_EXPLODING = "exploding"
RISK_NONFINITE = "nonfinite"
RISK_UNSTABLE = "unstable"
RISK_OSCILLATING = "oscillating"


@dataclass(frozen=True)
class LayerFacts:
    """Per-layer arrays (length L, model order).

    Attributes:
        moments: population moments of the norms (:class:`series.Moments`).
        median, p5, p95: nearest-rank percentiles of the norms
            (:func:`series.nearest_rank_percentiles`).
        consistency, smoothness, stability, flow_rate: see
            :class:`analysis.analyses.enhanced.models.FlowCharacteristics`.
        fit: least-squares trend of the norms against the step (all samples).
        turning: turning-point statistics of the norms (all samples).
        convergence: ``1 - exp(b span)`` of the ``ln n`` fit over the last W non-zero
            samples for ``b < 0``, 0 for ``b >= 0``, NaN with fewer than 3 such samples.
        vanishing_fraction, dead_fraction, issue_fraction: share of samples with the
            vanishing flag, the zero flag, any flag.
        exploding_steps, nonfinite_steps: int64 sample counts.
        last_flags: uint8 flags of each layer's last row in the range.
        log_changes: float64 ``[L, T]`` ``ln n_t - ln n_prev`` of each layer placed at the
            step of its later sample on the history's step grid (NaN elsewhere).
        risks: per layer, the risk keys (``RISK_*``) in a fixed order.
        health: per layer, the :class:`LayerHealth`.
    """

    moments: series.Moments
    median: np.ndarray
    p5: np.ndarray
    p95: np.ndarray
    consistency: np.ndarray
    smoothness: np.ndarray
    stability: np.ndarray
    flow_rate: np.ndarray
    fit: series.Trend
    turning: series.TurningPoints
    convergence: np.ndarray
    vanishing_fraction: np.ndarray
    dead_fraction: np.ndarray
    issue_fraction: np.ndarray
    exploding_steps: np.ndarray
    nonfinite_steps: np.ndarray
    last_flags: np.ndarray
    log_changes: np.ndarray
    risks: list[list[str]]
    health: list[LayerHealth]


def convergence_score(slope: np.ndarray, span: np.ndarray) -> np.ndarray:
    """``1 - exp(slope x span)`` where ``slope < 0``, 0 where ``slope >= 0``, NaN where
    the slope is undefined: the share by which a fitted exponential decay shrinks over
    ``span`` steps.

    Args:
        slope: float64 fitted slopes of ``ln y`` per step.
        span: float64 steps covered by each fit.

    Returns:
        float64 in [0, 1) (NaN where undefined).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.where(slope < 0, -np.expm1(slope * span), 0.0)
    return np.where(np.isnan(slope), np.nan, out)


def compute_layer_facts(
    history: GradientHistory, window: int, alpha: float
) -> LayerFacts:
    """All per-layer facts of the enhanced analysis.

    Args:
        history: the loaded run history.
        window: convergence window W (samples, >= 3 useful).
        alpha: family-wise significance level of the per-layer tests (each layer is tested
            at ``alpha / L``, Bonferroni).

    Returns:
        :class:`LayerFacts`.
    """
    packed = history.packed
    x, n = packed.values, packed.counts
    per_layer = family_alpha(alpha, history.num_layers)
    # Every statistic below is row-wise: computed a chunk of layers at a time, its
    # [L, T] temporaries (sorted copy, centred values, differences) stay within one chunk.
    chunks = layer_chunks(history.num_layers, x.shape[1]) or [slice(0, 0)]
    (mom, median, p5, p95, turning, fit, consistency, smooth, flow_rate) = series.concat_rows(
        [_row_statistics(x[rows], packed.steps[rows], n[rows], per_layer) for rows in chunks]
    )

    recent = packed.window(window)
    with np.errstate(divide="ignore"):
        log_recent = np.log(recent.values)
    log_fit = series.trend(log_recent, recent.steps, per_layer)
    convergence = convergence_score(log_fit.slope, log_fit.span)
    convergence = np.where(log_fit.n >= 3, convergence, np.nan)

    counts = np.maximum(history.rows, 1)
    flags = history.flags
    # Counts per layer, a chunk of layers at a time (exact integers, the [L, T] masks
    # stay within one chunk).
    bits = (FLAG_VANISHING, FLAG_DEAD, FLAG_ISSUE, FLAG_EXPLODING, FLAG_NONFINITE)
    hits = np.empty((len(bits), history.num_layers), dtype=np.int64)
    for rows in layer_chunks(history.num_layers, history.num_steps):
        for k, bit in enumerate(bits):
            hits[k, rows] = ((flags[rows] & bit) != 0).sum(axis=1)
    vanishing = hits[0] / counts
    dead = hits[1] / counts
    issue = hits[2] / counts
    exploding = hits[3]
    nonfinite = hits[4]
    last_column = history.num_steps - 1 - np.argmax(history.present[:, ::-1], axis=1)
    last_flags = flags[np.arange(history.num_layers), last_column]
    stability = series.stability(mom.std, mom.mean)

    risks: list[list[str]] = []
    health: list[LayerHealth] = []
    for i in range(history.num_layers):
        found = []
        if vanishing[i] >= 0.5:
            found.append(RISK_VANISHING)
        if dead[i] >= 0.5:
            found.append(RISK_DEAD)
        if exploding[i] > 0:
            found.append(RISK_EXPLODING)
        if nonfinite[i] > 0:
            found.append(RISK_NONFINITE)
        if stability[i] < 0.5:
            found.append(RISK_UNSTABLE)
        if turning.oscillating[i]:
            found.append(RISK_OSCILLATING)
        risks.append(found)
        if RISK_EXPLODING in found or RISK_NONFINITE in found or len(found) > 2:
            health.append(LayerHealth.CRITICAL)
        elif n[i] < 3:
            health.append(LayerHealth.UNKNOWN)
        elif found:
            health.append(LayerHealth.WARNING)
        else:
            health.append(LayerHealth.HEALTHY)

    return LayerFacts(
        moments=mom,
        median=median,
        p5=p5,
        p95=p95,
        consistency=consistency,
        smoothness=smooth,
        stability=stability,
        flow_rate=flow_rate,
        fit=fit,
        turning=turning,
        convergence=convergence,
        vanishing_fraction=vanishing,
        dead_fraction=dead,
        issue_fraction=issue,
        exploding_steps=exploding,
        nonfinite_steps=nonfinite,
        last_flags=last_flags,
        log_changes=grid_log_changes(history),
        risks=risks,
        health=health,
    )


def _row_statistics(
    x: np.ndarray, steps: np.ndarray, n: np.ndarray, alpha: float
) -> tuple[series.Moments, np.ndarray, np.ndarray, np.ndarray, series.TurningPoints,
           series.Trend, np.ndarray, np.ndarray, np.ndarray]:
    """The row-wise statistics of :func:`compute_layer_facts` over some layers' packed
    series ``x`` (float64 ``[K, W]``), their ``steps`` and sample counts ``n``: moments,
    median, p5, p95, turning points, trend (tests at ``alpha``), flow consistency,
    smoothness and information flow rate."""
    mom = series.moments(x)
    median, p5, p95 = series.nearest_rank_percentiles(x, n)
    return (
        mom, median, p5, p95,
        series.turning_points(x, n, alpha),
        series.trend(x, steps, alpha),
        series.flow_consistency(x),
        series.smoothness(x, mom.mean),
        series.information_flow_rate(x, n),
    )


def grid_log_changes(history: GradientHistory) -> np.ndarray:
    """``ln n_t - ln n_prev`` of each layer between consecutive samples, placed at the step
    of the later sample on the history's step grid, so that layers can be compared step
    by step. NaN where the layer has no sample, no previous sample, or a zero norm.

    Returns:
        float64 ``[L, T]``.
    """
    norms = history.norms
    out = np.full(norms.shape, np.nan)
    if norms.shape[1] < 2:
        return out
    # Element-wise per layer: a chunk of layers at a time, the logarithms and differences
    # stay within one chunk besides the result.
    if history.valid.all():
        for rows in layer_chunks(history.num_layers, history.num_steps):
            out[rows, 1:] = series.log_changes(norms[rows])
        return out
    packed = history.packed
    for chunk in layer_chunks(history.num_layers, packed.values.shape[1]):
        changes = series.log_changes(packed.values[chunk])
        later = packed.steps[chunk, 1:]
        ok = ~np.isnan(changes) & ~np.isnan(later)
        rows = np.nonzero(ok)[0] + chunk.start
        cols = np.searchsorted(history.steps, later[ok].astype(np.int64))
        out[rows, cols] = changes[ok]
    return out


def finite_or(value: float, default: float) -> float:
    """``value`` if finite, else ``default`` (JSON has no NaN)."""
    return value if math.isfinite(value) else default
