"""The CSR form of histograms (schemas.stats.csr): round trips, masked rows, checks."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.stats.csr import checked_csr, csr_from_dense, csr_from_lists, dense_from_csr


def test_dense_round_trip_and_masked_rows() -> None:
    rng = np.random.default_rng(3)
    dense = rng.integers(0, 3, (5, 7)) * (rng.random((5, 7)) < 0.4)
    off, cols, counts = csr_from_dense(dense)
    np.testing.assert_array_equal(dense_from_csr(off, cols, counts, 7), dense)
    with_placeholder = dense.copy()
    with_placeholder[2] = -1  # a row without a histogram
    keep = with_placeholder[:, 0] >= 0
    off, cols, counts = csr_from_dense(with_placeholder, keep=keep)
    assert off[3] == off[2] and (counts > 0).all()
    expected = dense.copy()
    expected[2] = 0
    np.testing.assert_array_equal(dense_from_csr(off, cols, counts, 7), expected)


def test_lists_and_checks() -> None:
    off, cols = csr_from_lists([[0, 3], None, [6]])
    _, counts = csr_from_lists([[2, 1], None, [4]])
    assert dense_from_csr(off, cols, counts, 7).sum(axis=1).tolist() == [3, 0, 4]
    with pytest.raises(ValueError, match="offsets"):
        checked_csr([0, 3], [1], [1], 7)
    with pytest.raises(ValueError, match="offsets"):
        checked_csr([0, 1], [1], [1], 7, rows=2)
    with pytest.raises(ValueError, match=r"columns must be in \[0, 7\)"):
        checked_csr([0, 1], [7], [1], 7)
