"""When two replicas of a gradient agree: the tolerance shared by the consumer's replica
check (``consumer.merge.PieceLedger``) and the producer's in-band cross-check
(``producer.adapters.torch_reduce``)."""

from __future__ import annotations

import numpy as np

REPLICA_RTOL = 1e-6
"""Relative tolerance for two replicas' sums (sum |g|, sum g^2, max |g|) to agree.

After an all-reduce the replicas of a gradient are bitwise identical, so their float64 sums
can differ only by the order in which a kernel added the terms. Recursive summation of n
non-negative terms has a relative error of at most gamma_n = n u / (1 - n u), u = 2^-53
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2), which is
below 1e-6 for every n up to 9e9 elements. Element counts (``numel``, ``nonfinite``, and
``nan`` where both replicas sent it) must be equal exactly."""


def replicas_disagree(counted: np.ndarray, checked: np.ndarray) -> np.ndarray:
    """Which rows of two replicas' statistics disagree.

    Args:
        counted, checked: float64[n, 5] rows (numel, nonfinite, sum_abs, sum_sq, max_abs)
            of the same pieces from two replicas; NaN in a sum column means "not sent"
            (norms mode) and compares equal.

    Returns:
        bool[n]: the element counts differ, or a sum differs by more than
        :data:`REPLICA_RTOL` relative to the larger of the two.

    Examples:
        >>> a = np.array([[4, 0, 2.0, 1.0, 1.0]])
        >>> replicas_disagree(a, a + [[0, 0, 1e-9, 0, 0]]).tolist()
        [False]
        >>> replicas_disagree(a, a + [[0, 0, 1e-3, 0, 0]]).tolist()
        [True]
    """
    counts = (counted[:, :2] != checked[:, :2]).any(axis=1)
    a, b = counted[:, 2:], checked[:, 2:]
    with np.errstate(invalid="ignore"):
        far = np.abs(a - b) > REPLICA_RTOL * np.maximum(np.abs(a), np.abs(b))
    return counts | far.any(axis=1)
