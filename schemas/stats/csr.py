"""Compressed sparse row (CSR) form of per-layer histograms, as the wire and the store
carry them.

A k-row histogram in CSR form is three int64 arrays: ``offsets[k + 1]`` (row i holds the
entries ``offsets[i]:offsets[i + 1]``, ``offsets[0] = 0``, ``offsets[k] = nnz``),
``columns[nnz]`` and ``counts[nnz]``. Every conversion between the dense ``[k, B]`` array and
this form, in either direction, is one of the functions below.

Examples:
    >>> dense = np.array([[0, 2, 0, 1], [0, 0, 0, 0], [5, 0, 0, 0]])
    >>> off, cols, counts = csr_from_dense(dense)
    >>> off.tolist(), cols.tolist(), counts.tolist()
    ([0, 2, 2, 3], [1, 3, 0], [2, 1, 5])
    >>> bool((dense_from_csr(off, cols, counts, 4) == dense).all())
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "checked_csr",
    "csr_from_dense",
    "csr_from_lists",
    "dense_from_csr",
    "offsets_from_lengths",
]


def offsets_from_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """CSR row offsets of rows of the given lengths.

    Args:
        lengths: int[k] entries per row.

    Returns:
        int64[k + 1]: ``0`` then the running total of ``lengths``.

    >>> offsets_from_lengths([2, 0, 1]).tolist()
    [0, 2, 2, 3]
    """
    counts = np.asarray(lengths, np.int64)
    offsets = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def csr_from_dense(
    dense: np.ndarray, keep: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CSR form of a dense histogram: its non-zero entries, columns ascending per row.

    Args:
        dense: [k, B] counts (int64, or float64 for a per-copy reading).
        keep: bool[k] rows to encode; the other rows come out empty (e.g. rows that hold
            a -1 placeholder for "no histogram"). None: every row.

    Returns:
        (offsets int64[k + 1], columns int64[nnz], counts[nnz] of ``dense``'s dtype).
    """
    nonzero = dense != 0 if keep is None else (dense != 0) & np.asarray(keep, bool)[:, None]
    rows, cols = np.nonzero(nonzero)
    offsets = offsets_from_lengths(np.bincount(rows, minlength=dense.shape[0]))
    return offsets, cols.astype(np.int64), dense[rows, cols]


def checked_csr(
    offsets: Sequence[int] | np.ndarray, columns: Sequence[int] | np.ndarray,
    counts: Sequence[int] | np.ndarray, width: int, rows: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets, columns, counts) of a CSR histogram as int64 arrays, checked: offsets run
    from 0 to the number of entries (``rows + 1`` of them when given), columns lie in
    ``[0, width)``.

    Raises:
        ValueError: a check failed.
    """
    off, cols = np.array(offsets, np.int64), np.array(columns, np.int64)
    vals = np.array(counts, np.int64)
    if len(off) < 1 or off[0] != 0 or off[-1] != len(cols) or len(vals) != len(cols) or (
        rows is not None and len(off) != rows + 1
    ):
        raise ValueError("histogram offsets must run from 0 to the number of entries, "
                         "one row per layer")
    if cols.size and (cols.min() < 0 or cols.max() >= width):
        raise ValueError(f"histogram columns must be in [0, {width})")
    return off, cols, vals


def dense_from_csr(
    offsets: Sequence[int] | np.ndarray, columns: Sequence[int] | np.ndarray,
    counts: Sequence[int] | np.ndarray, width: int,
) -> np.ndarray:
    """The dense histogram of a CSR one (checked with :func:`checked_csr`); an entry
    repeated within a row adds up.

    Returns:
        int64[k, width].

    Raises:
        ValueError: malformed CSR.
    """
    off, cols, vals = checked_csr(offsets, columns, counts, width)
    k = len(off) - 1
    dense = np.zeros((k, width), np.int64)
    keys = np.repeat(np.arange(k) * width, np.diff(off)) + cols
    flat = dense.reshape(-1)
    if keys.size < 2 or bool(np.all(keys[1:] > keys[:-1])):
        flat[keys] = vals  # distinct entries (the wire's ascending columns): one scatter
    else:
        np.add.at(flat, keys, vals)
    return dense


def csr_from_lists(
    rows: Sequence[Sequence[int] | None],
) -> tuple[np.ndarray, np.ndarray]:
    """CSR form of per-layer lists (e.g. stored histogram list columns fetched as Python
    lists); a None row counts as empty.

    Args:
        rows: k lists of ints, or None.

    Returns:
        (offsets int64[k + 1], values int64[nnz]).

    >>> off, vals = csr_from_lists([[1, 2], None, [5]])
    >>> off.tolist(), vals.tolist()
    ([0, 2, 2, 3], [1, 2, 5])
    """
    offsets = offsets_from_lengths(
        np.fromiter((0 if r is None else len(r) for r in rows), np.int64, len(rows)))
    flat = [v for r in rows if r is not None for v in r]
    return offsets, np.asarray(flat, np.int64)
