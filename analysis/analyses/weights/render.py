"""Terminal rendering of the weight analysis (:func:`render_weights`): pooled statistics
and health, per-layer statistics, outliers and the drift, as rich tables."""

from __future__ import annotations

import math

from rich.console import Group, RenderableType
from rich.text import Text

from analysis.analyses.weights.models import DistributionHealthStatus, WeightAnalysisReport
from analysis.blocks.terminal import (
    ROWS_IN_TABLE,
    add_more_row,
    joined_names,
    num,
    report_head,
    show_name,
    summary_grid,
    table,
)

__all__ = ["render_weights"]


def _pct(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.1%}"


_STATUS_STYLE = {
    DistributionHealthStatus.EXCELLENT: "green", DistributionHealthStatus.GOOD: "green",
    DistributionHealthStatus.FAIR: "yellow", DistributionHealthStatus.POOR: "dark_orange",
    DistributionHealthStatus.CRITICAL: "bold red",
}


def render_weights(report: WeightAnalysisReport) -> RenderableType:
    """The weight analysis as terminal tables: pooled statistics and health, per-layer
    statistics, outliers and the drift.

    Args:
        report: from :func:`analysis.analyses.weights.build_weight_analysis`.

    Returns:
        A rich renderable.
    """
    dist = report.distribution
    o = dist.overall_statistics
    head = report_head("weight analysis", report.run_id,
                       f"step {dist.step}, {len(dist.layer_analyses)} layers")
    grid = summary_grid()
    status = dist.distribution_health.status
    grid.add_row("distribution health", Text(f"{status.value} ({dist.distribution_health.score:g})",
                                             style=_STATUS_STYLE[status]))
    grid.add_row("rules", report.rules)
    grid.add_row("all weights", f"mean {num(o.mean)}, std {num(o.std_dev)}, skew "
                 f"{num(o.skewness)}, kurtosis {num(o.kurtosis)}, entropy {num(o.entropy)} bits, "
                 f"range [{num(o.min)}, {num(o.max)}], zeros {_pct(o.zero_fraction)}")
    if report.first_nonfinite_step is not None:
        names = report.first_nonfinite_layers
        grid.add_row("NaN/Inf weights", Text(
            f"first at step {report.first_nonfinite_step} in "
            f"{joined_names(names, 5, lead=' and ')}; {o.nonfinite} at step {dist.step}",
            style="bold red"))
    layers = table("layers (model order)", ["layer", "health", "mean", "std", "skew", "kurt",
                                            "zeros"], [False] + [True] * 6)
    extremes = table("extremes and entropy (model order)", ["layer", "min", "max",
                                                            "entropy (bits)", "issues"],
                     [False, True, True, True, False])
    for x in dist.layer_analyses[:ROWS_IN_TABLE]:
        s = x.statistics
        layers.add_row(show_name(x.layer_name), f"{x.health_score:g}", num(s.mean),
                       num(s.std_dev), num(s.skewness), num(s.kurtosis),
                       _pct(s.zero_fraction))
        extremes.add_row(show_name(x.layer_name), num(s.min), num(s.max), num(s.entropy),
                         "; ".join(x.issues) or "-")
    add_more_row(layers, len(dist.layer_analyses), ROWS_IN_TABLE)
    add_more_row(extremes, len(dist.layer_analyses), ROWS_IN_TABLE)
    parts: list[RenderableType] = [head, grid, layers, extremes]
    if dist.outlier_detection:
        out = table("outliers", ["layer", "side", "value", "z", "severity"],
                    [False, False, True, True, False])
        for w in dist.outlier_detection[:ROWS_IN_TABLE]:
            out.add_row(show_name(w.layer_name), w.side, num(w.value), num(w.z_score),
                        w.severity.value)
        add_more_row(out, len(dist.outlier_detection), ROWS_IN_TABLE)
        parts.append(out)
    if report.drift is not None:
        d = report.drift
        diverged = sum(x.nonfinite for x in d.layer_drifts)
        finite = len(d.layer_drifts) - diverged
        summary = [f"{diverged} layers with NaN/Inf weights"] if diverged else []
        if finite:
            summary.append(f"max {d.max_drift:.3%}, mean {d.mean_drift:.3%}")
        drift = table(f"weight drift, step {d.from_step} -> {d.to_step}: {d.severity.value} "
                      f"({'; '.join(summary)})",
                      ["layer", "norm change", "mean shift", "std ratio", "path",
                       "update/weight per step", "state"],
                      [False, True, True, True, True, True, False])
        for x in d.layer_drifts[:ROWS_IN_TABLE]:
            change, path = x.relative_norm_change, x.relative_path_length
            state = "NaN/Inf" if x.nonfinite else "stalled" if x.stalled else "-"
            drift.add_row(show_name(x.layer_name),
                          "-" if change is None else f"{change:+.3%}",
                          num(x.mean_shift), num(x.std_ratio),
                          "-" if path is None else f"{path:.3%}", num(x.mean_update_ratio),
                          state)
        add_more_row(drift, len(d.layer_drifts), ROWS_IN_TABLE)
        parts.append(drift)
        if d.stalled_layer_names:
            names = d.stalled_layer_names
            parts.append(Text(
                f"stalled (updates below float32 resolution): "
                f"{joined_names(names, 8, lead=' and ')}", style="yellow"))
    return Group(*parts)
