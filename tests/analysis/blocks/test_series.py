"""analysis.blocks.series.order_statistics picks, without sorting, the entries a row-wise
np.sort puts at the given ranks: bit for bit, NaN last, +-inf, ties, -0.0 and per-row
ranks included."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.blocks.series import nearest_rank_percentiles, order_statistics

VALUES = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, 1e-300, np.inf, -np.inf, np.nan, 3.0])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rows=st.integers(1, 6), width=st.integers(1, 9))
def test_order_statistics_are_the_sorted_entries(data: st.DataObject, rows: int,
                                                 width: int) -> None:
    x = np.array(data.draw(st.lists(st.lists(VALUES, min_size=width, max_size=width),
                                    min_size=rows, max_size=rows)), dtype=np.float64)
    shared = data.draw(st.booleans())
    k = data.draw(st.integers(1, 4))
    if shared:
        ranks = np.tile(np.array(data.draw(st.lists(st.integers(0, width - 1), min_size=k,
                                                    max_size=k))), (rows, 1))
    else:
        ranks = np.array(data.draw(st.lists(st.lists(st.integers(0, width - 1), min_size=k,
                                                     max_size=k),
                                            min_size=rows, max_size=rows)))
    got = order_statistics(x, ranks)
    want = np.sort(x, axis=1)[np.arange(rows)[:, None], ranks]
    assert got.tobytes() == want.tobytes()  # same bits: NaN, inf and the sign of zero


def test_percentiles_of_a_row_with_fewer_samples() -> None:
    x = np.array([[3.0, 1.0, 2.0, np.nan], [4.0, 1.0, 3.0, 2.0]])
    median, p5, p95 = nearest_rank_percentiles(x, np.array([3, 4]))
    assert median.tolist() == [2.0, 2.5] and p5.tolist() == [1.0, 1.0]
    assert p95.tolist() == [3.0, 4.0]


def test_percentiles_of_layers_without_samples() -> None:
    """A range whose only rows are non-finite leaves arrays of width 0: every percentile
    is absent (NaN), not an index error."""
    median, p5, p95 = nearest_rank_percentiles(np.empty((2, 0)), np.array([0, 0]))
    assert np.isnan(median).all() and np.isnan(p5).all() and np.isnan(p95).all()
    assert order_statistics(np.empty((1, 0)), np.zeros((1, 2), dtype=np.int64)).shape == (1, 2)
