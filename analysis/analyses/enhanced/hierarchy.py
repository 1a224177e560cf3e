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
from analysis.blocks.gradient_arrays import GradientHistory, layer_chunks
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


def synchronization(changes: np.ndarray, rows: np.ndarray | None = None) -> float | None:
    """Mean pairwise Pearson correlation of the rows of ``changes`` (NaN = missing), from
    ``(sum_t S_t^2 / T - m) / (m (m - 1))`` with ``S_t`` the sum of the standardised rows;
    rows with fewer than 3 values or no variance are left out.

    Args:
        changes: float64 ``[L, T]``.
        rows: int64 positions of the rows of ``changes`` to use (``None`` = every row), in
            the order they are summed.

    Returns:
        In [-1, 1], or ``None`` for fewer than 2 usable rows.

    The rows are read a chunk at a time (:func:`analysis.blocks.gradient_arrays.layer_chunks`):
    the moments are row-wise and ``S_t`` is added row after row in the order NumPy sums a
    C-contiguous block over axis 0, so the bits are those of one pass over every row while
    the temporaries stay within one chunk.
    """
    width = changes.shape[1]
    positions = (np.arange(changes.shape[0]) if rows is None
                 else np.asarray(rows, dtype=np.int64))
    chunks = layer_chunks(positions.size, width)
    mom = (series.concat_rows([series.moments(changes[positions[c]]) for c in chunks])
           if chunks else series.moments(changes[positions]))
    usable = (mom.n >= 3) & (mom.std > 0)
    m = int(usable.sum())
    if m < 2:
        return None
    used, mean, std = positions[usable], mom.mean[usable], mom.std[usable]
    covered = np.zeros(width, dtype=bool)
    total = _RowSum(width)
    for c in layer_chunks(used.size, width):
        part = changes[used[c]]
        covered |= (~np.isnan(part)).any(axis=0)
        z = (part - mean[c, None]) / std[c, None]
        z[np.isnan(z)] = 0.0  # np.nansum's NaN -> 0
        total.add(z)
    columns = int(covered.sum())
    value = (float(np.sum(total.value * total.value)) / columns - m) / (m * (m - 1))
    return float(min(max(value, -1.0), 1.0))


class _RowSum:
    """The sum over axis 0 of rows given a block at a time, with the bits of ``np.sum(a,
    axis=0)`` over all of them at once: NumPy reduces a C-contiguous ``[K, T]`` block over
    axis 0 by copying its first row and adding the others one after the other, in order
    (no pairwise summation across rows), which is what :meth:`add` does across blocks.

    Args:
        width: ``T``, the length of a row.
    """

    def __init__(self, width: int) -> None:
        self._width = width
        self._acc: np.ndarray | None = None

    def add(self, block: np.ndarray) -> None:
        """Add the rows of ``block`` (float64 ``[K, T]``), in order."""
        for row in block:
            if self._acc is None:
                self._acc = row.astype(np.float64, copy=True)
            else:
                self._acc += row

    @property
    def value(self) -> np.ndarray:
        """float64 ``[T]`` the sum so far (zeros before any row, as ``np.sum`` of none)."""
        return self._acc if self._acc is not None else np.zeros(self._width)


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
    # Row-wise, a chunk of layers at a time: the squares stay within one chunk.
    norms = history.norms
    energy = np.empty(history.num_layers)
    for rows in layer_chunks(history.num_layers, history.num_steps):
        energy[rows] = np.nansum(np.square(norms[rows]), axis=1)
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
                    gradient_synchronization=synchronization(facts.log_changes,
                                                             members),
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
        level_series.append(_level_changes(facts.log_changes, members))
    return GradientHierarchy(
        layer_groups=layer_groups,
        hierarchy_levels=levels,
        cross_level_interactions=cross_level(np.array(level_series), alpha),
    )


def _level_changes(changes: np.ndarray, members: np.ndarray) -> np.ndarray:
    """float64 ``[T]`` the mean over ``members`` (positions) of the rows of ``changes``
    that have a value at each step (NaN where none has), the members read a chunk at a
    time (:class:`_RowSum`: the bits of one pass over ``changes[members]``)."""
    width = changes.shape[1]
    total = _RowSum(width)
    counts = np.zeros(width, dtype=np.int64)
    for c in layer_chunks(members.size, width):
        rows = changes[members[c]]
        valid = ~np.isnan(rows)
        counts += valid.sum(axis=0)
        rows[~valid] = 0.0
        total.add(rows)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total.value / counts


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
