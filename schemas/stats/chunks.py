"""float64 scratch chunks: large arrays scanned piece by piece in one reusable buffer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

CHUNK = 1 << 16
"""Elements per float64 scratch chunk (512 KiB, cache-resident)."""


def float64_chunks(flat: np.ndarray) -> Iterator[np.ndarray] | tuple[np.ndarray, ...]:
    """Consecutive pieces of a 1-D array widened to float64 in one reusable scratch buffer
    (the consumer of a piece may overwrite it); one float64 copy for a small array."""
    if flat.size <= CHUNK:
        return (flat.astype(np.float64),) if flat.size else ()
    return _float64_pieces(flat)


def _float64_pieces(flat: np.ndarray) -> Iterator[np.ndarray]:
    buf = np.empty(CHUNK, np.float64)
    for lo in range(0, flat.size, CHUNK):
        part = flat[lo:lo + CHUNK]
        x = buf[:part.size]
        np.copyto(x, part, casting="unsafe")
        yield x
