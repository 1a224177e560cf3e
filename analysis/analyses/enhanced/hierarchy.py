"""Gradient hierarchy of the enhanced analysis: layers grouped by the decade of their mean
gradient norm, one level per group, and the interactions between levels (formulas in
:mod:`analysis.analyses.enhanced.models`). O(layers x steps) plus O(levels^2 x steps)
for the cross-level pairs (a handful of decades). Semantics follow trustformers-debug's
``enhanced_analysis`` module, except the grouping: decades of the mean norm instead of
the reference's bands > 1, [0.1, 1], < 0.1 (those with ``rules="reference"``), and
characteristics computed from the members instead of constants (differences listed in
``analysis/REFERENCE_DIFFERENCES.md``)."""

from __future__ import annotations

import math

import numpy as np

from analysis.analyses.enhanced.layer_facts import LayerFacts
from analysis.analyses.enhanced.models import (
    CrossLevelInteraction,
    GradientHierarchy,
    GroupCharacteristics,
    HierarchyLevel,
    InteractionDirection,
    LayerGroup,
    LayerHealth,
    OptimizationDifficulty,
)
from analysis.blocks import series
from analysis.blocks.gradient_arrays import GradientHistory
from analysis.blocks.significance import family_alpha, pearson_significant, z_critical

ZERO_GROUP = "zero gradient"

_BELOW_ONE = float(np.nextafter(1.0, 0.0))  # largest |r| with a finite Fisher transform


def decade_groups(means: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Layer positions grouped by ``floor(log10(mean norm))``, largest decade first, the
    all-zero layers last.

    Args:
        means: float64 ``[L]`` mean norms (>= 0).

    Returns:
        ``[(group_name, positions int64[m]), ...]``; names like ``"mean norm [1e-2, 1e-1)"``.
    """
    groups = []
    positive = means > 0
    with np.errstate(divide="ignore"):
        decade = np.where(positive, np.floor(np.log10(np.where(positive, means, 1.0))), 0)
    for k in sorted({int(d) for d in decade[positive]}, reverse=True):
        members = np.flatnonzero(positive & (decade == k))
        groups.append((f"mean norm [1e{k}, 1e{k + 1})", members))
    zero = np.flatnonzero(~positive)
    if zero.size:
        groups.append((ZERO_GROUP, zero))
    return groups


def synchronization(changes: np.ndarray) -> float | None:
    """Mean pairwise Pearson correlation of the rows of ``changes`` (NaN = missing), from
    ``(sum_t S_t^2 / T - m) / (m (m - 1))`` with ``S_t`` the sum of the standardised rows;
    rows with fewer than 3 values or no variance are left out.

    Returns:
        In [-1, 1], or ``None`` for fewer than 2 usable rows.
    """
    mom = series.moments(changes)
    usable = (mom.n >= 3) & (mom.std > 0)
    m = int(usable.sum())
    if m < 2:
        return None
    rows = changes[usable]
    z = (rows - mom.mean[usable, None]) / mom.std[usable, None]
    columns = int((~np.isnan(rows)).any(axis=0).sum())
    total = np.nansum(z, axis=0)
    value = (float(np.sum(total * total)) / columns - m) / (m * (m - 1))
    return float(min(max(value, -1.0), 1.0))


def _difficulty(health: list[LayerHealth]) -> OptimizationDifficulty:
    judged = len(health)
    q = sum(h in (LayerHealth.WARNING, LayerHealth.CRITICAL) for h in health) / max(judged, 1)
    if q == 0:
        return OptimizationDifficulty.EASY
    if q <= 1 / 3:
        return OptimizationDifficulty.MODERATE
    if q <= 2 / 3:
        return OptimizationDifficulty.DIFFICULT
    return OptimizationDifficulty.VERY_DIFFICULT


def build_hierarchy(
    history: GradientHistory,
    facts: LayerFacts,
    alpha: float,
    groups: list[tuple[str, np.ndarray]] | None = None,
) -> GradientHierarchy:
    """Groups, levels and cross-level interactions of one history.

    Args:
        history: the loaded run history.
        facts: its :class:`LayerFacts`.
        alpha: significance level of the cross-level tests.
        groups: ``[(name, positions)]`` largest gradients first; ``None`` =
            :func:`decade_groups` of the layers' mean norms (the reference's three bands
            are :func:`analysis.analyses.enhanced.reference.reference_bands`).

    Returns:
        The :class:`GradientHierarchy`.
    """
    means = facts.moments.mean
    if groups is None:
        groups = decade_groups(means)
    energy = np.nansum(np.square(history.norms), axis=1)
    total_energy = float(energy.sum())
    total_params = max(float(history.numel.sum()), 1.0)
    layer_groups: list[LayerGroup] = []
    levels: list[HierarchyLevel] = []
    level_series = []
    for level_id, (name, members) in enumerate(groups):
        ratio = history.update_to_weight[members]
        ratio = ratio[np.isfinite(ratio)]
        positive = means[members][means[members] > 0]
        if name == ZERO_GROUP or positive.size == 0:
            coherence = 1.0
        else:
            coherence = 1.0 - 2.0 * float(np.std(np.log10(positive)))
        layer_groups.append(
            LayerGroup(
                group_name=name,
                layers=[history.names[i] for i in members],
                group_characteristics=GroupCharacteristics(
                    average_gradient_norm=float(means[members].mean()),
                    gradient_synchronization=synchronization(facts.log_changes[members]),
                    learning_rate_sensitivity=float(ratio.mean()) if ratio.size else None,
                    optimization_difficulty=_difficulty([facts.health[i] for i in members]),
                ),
                internal_coherence=min(max(coherence, 0.0), 1.0),
            )
        )
        levels.append(
            HierarchyLevel(
                level_id=level_id,
                level_name=f"level {level_id}: {name}",
                layer_groups=[name],
                level_importance=(
                    float(energy[members].sum()) / total_energy if total_energy > 0 else 0.0
                ),
                optimization_impact=float(history.numel[members].sum()) / total_params,
            )
        )
        rows = facts.log_changes[members]
        valid = ~np.isnan(rows)
        with np.errstate(invalid="ignore", divide="ignore"):
            level_series.append(
                np.where(valid, rows, 0.0).sum(axis=0) / valid.sum(axis=0)
            )
    return GradientHierarchy(
        layer_groups=layer_groups,
        hierarchy_levels=levels,
        cross_level_interactions=cross_level(np.array(level_series), alpha),
    )


def cross_level(level_changes: np.ndarray, alpha: float) -> list[CrossLevelInteraction]:
    """Significant interactions between every pair of levels (see
    :class:`CrossLevelInteraction`).

    Args:
        level_changes: float64 ``[K, T]`` each level's mean log-norm change per step
            (NaN where no member has one).
        alpha: significance level.
    """
    count = level_changes.shape[0] if level_changes.ndim == 2 else 0
    if count < 2 or level_changes.shape[1] < 4:
        return []
    pairs = [(a, b) for a in range(count) for b in range(a + 1, count)]
    first = level_changes[[a for a, _ in pairs]]
    second = level_changes[[b for _, b in pairs]]
    r0, n0 = series.row_pearson(first, second)
    r_ab, n_ab = series.row_pearson(first[:, :-1], second[:, 1:])  # a leads b
    r_ba, n_ba = series.row_pearson(second[:, :-1], first[:, 1:])  # b leads a
    per_test = family_alpha(alpha, 3 * len(pairs))
    sig0 = pearson_significant(r0, n0, per_test)
    sig_ab = pearson_significant(r_ab, n_ab, per_test)
    sig_ba = pearson_significant(r_ba, n_ba, per_test)
    zc = z_critical(family_alpha(alpha, len(pairs)))
    out = []
    for k, (a, b) in enumerate(pairs):
        if not (sig0[k] or sig_ab[k] or sig_ba[k]):
            continue
        lead_a = math.atanh(min(abs(float(np.nan_to_num(r_ab[k]))), _BELOW_ONE))
        lead_b = math.atanh(min(abs(float(np.nan_to_num(r_ba[k]))), _BELOW_ONE))
        se = math.sqrt(1.0 / max(n_ab[k] - 3, 1) + 1.0 / max(n_ba[k] - 3, 1))
        z = (lead_a - lead_b) / se
        direction = (
            InteractionDirection.TOP_DOWN if z > zc
            else InteractionDirection.BOTTOM_UP if z < -zc
            else InteractionDirection.BIDIRECTIONAL
        )
        strength = max(abs(float(np.nan_to_num(v[k]))) for v in (r0, r_ab, r_ba))
        out.append(
            CrossLevelInteraction(
                from_level=a, to_level=b, interaction_strength=strength,
                interaction_direction=direction,
            )
        )
    return out
