"""Runs of adjacent layers (model order) sharing a property: the vanishing / exploding
regions and dead zones of the gradient-flow network analysis.

The reference (trustformers-debug's ``gradient_visualization`` module)
reports one region per layer, in hash order. A region here is a maximal run of
layers that are adjacent in model order (consecutive positions of the run's layer list)
and all have the property; a layer in between without it, or with no data in the range,
ends the region.
"""

from __future__ import annotations

import numpy as np


def adjacent_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of ``True`` in a 1-D mask.

    Args:
        mask: bool ``[L]`` (one entry per layer, model order).

    Returns:
        ``[(start, end), ...]`` inclusive positions, ascending; O(L).

    Example:
        ``adjacent_runs([F, T, T, F, T]) == [(1, 2), (4, 4)]``
    """
    m = np.asarray(mask, dtype=np.int8)
    edges = np.diff(np.concatenate(([0], m, [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1) - 1
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def steps_all(flags: np.ndarray, present: np.ndarray, start: int, end: int) -> np.ndarray:
    """Steps at which every layer of ``[start, end]`` that has a row is flagged (and at
    least one has a row).

    Args:
        flags: bool ``[L, T]`` the property per (layer, step).
        present: bool ``[L, T]`` the layer has a row at that step.
        start, end: inclusive layer positions.

    Returns:
        bool ``[T]``.
    """
    block_f = flags[start : end + 1]
    block_p = present[start : end + 1]
    return np.all(block_f | ~block_p, axis=0) & np.any(block_p, axis=0)


def steps_any(flags: np.ndarray, start: int, end: int) -> np.ndarray:
    """Steps at which at least one layer of ``[start, end]`` is flagged.

    Returns:
        bool ``[T]``.
    """
    return np.any(flags[start : end + 1], axis=0)
