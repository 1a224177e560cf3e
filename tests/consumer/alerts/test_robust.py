"""Modified z-scores (Iglewicz & Hoaglin) vectorised over layers, against a per-row
reference written from the formulas, and the rolling window."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from consumer.alerts.robust import MEANAD_NORMAL, Q3_NORMAL, RollingRobustZ, modified_z


def reference(x: float, sample: list[float]) -> float:
    sample = [float(v) for v in sample]
    x = float(x)
    med = statistics.median(sample)
    dev = [abs(v - med) for v in sample]
    mad = statistics.median(dev)
    if x == med:
        return 0.0
    try:
        if mad > 0:
            return 0.6744897501960817 * (x - med) / mad
        mean_ad = sum(dev) / len(dev)
        if mean_ad > 0:
            return (x - med) / (1.2533141373155001 * mean_ad)
    except OverflowError:
        pass
    return math.copysign(math.inf, x - med)


def test_constants_are_the_normal_ones():
    assert pytest.approx(0.6744897501960817, abs=1e-12) == Q3_NORMAL
    assert pytest.approx(1.2533141373155001, abs=1e-12) == 1 / MEANAD_NORMAL


values = st.floats(-1e3, 1e3, allow_nan=False, width=64)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 5).flatmap(lambda k: st.tuples(
    arrays(np.float64, (k, 7), elements=values | st.just(np.nan) | st.just(2.0)),
    arrays(np.float64, k, elements=values | st.just(2.0)),
)))
def test_matches_the_reference_row_by_row(case):
    history, x = case
    history[:, 0] = np.where(np.isnan(history[:, 0]), 1.0, history[:, 0])  # >= 1 sample
    z, med, n = modified_z(x, history)
    for i in range(len(x)):
        sample = [v for v in history[i] if not np.isnan(v)]
        assert n[i] == len(sample)
        assert med[i] == pytest.approx(statistics.median(sample))
        want = reference(float(x[i]), sample)
        if math.isinf(want):
            assert z[i] == want
        else:
            assert z[i] == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_mad_zero_falls_back_to_mean_absolute_deviation():
    history = np.array([[1.0, 1.0, 1.0, 1.0, 5.0]])  # MAD 0, MeanAD 0.8
    z, _, _ = modified_z(np.array([3.0]), history)
    assert z[0] == pytest.approx(2.0 / (1.2533141373155001 * 0.8))


def test_rolling_window_keeps_the_last_w_values_per_layer():
    r = RollingRobustZ(num_layers=3, window=4)
    for v in range(10):
        # layer 2 only reported on even frames
        layers = np.array([0, 1, 2]) if v % 2 == 0 else np.array([0, 1])
        r.push(layers, np.full(len(layers), float(v)))
    z, med, n = r.score(np.array([0, 1, 2]), np.array([7.5, 100.0, 8.0]))
    assert n.tolist() == [4, 4, 2]          # frames 6..9; layer 2 only 6 and 8
    assert med.tolist() == [7.5, 7.5, 7.0]
    assert z[0] == 0.0 and z[1] > 50 and z[2] > 0


def test_no_history_gives_nan():
    r = RollingRobustZ(2, 5)
    z, _, n = r.score(np.array([0, 1]), np.array([1.0, 2.0]))
    assert np.isnan(z).all() and n.tolist() == [0, 0]
    r.push(np.array([0]), np.array([1.0]))
    z, _med, n = r.score(np.array([0, 1]), np.array([1.0, 2.0]))
    assert n.tolist() == [1, 0] and z[0] == 0.0 and np.isnan(z[1])


def test_refreshing_every_k_frames_scores_against_a_recent_window():
    """With refresh_every=4: exact while the window fills, then every score equals the
    exact score against the window of at most 3 frames ago, and sometimes not the
    current one."""
    rng = np.random.default_rng(1)
    cached = RollingRobustZ(5, 20, refresh_every=4)
    layers = np.arange(5)
    windows: list[np.ndarray] = []  # window before each frame's push, newest last
    stale = 0
    for i in range(60):
        x = rng.normal(size=5)
        z, _, _ = cached.score(layers, x)
        if i:
            candidates = [modified_z(x, w)[0] for w in windows[-4:]]
            matches = [np.allclose(z, c) for c in candidates]
            assert any(matches), i
            if i < 20:
                assert matches[-1]  # filling: exact
            stale += not matches[-1]
        cached.push(layers, x)
        windows.append(cached.history[:, : min(i + 1, 20)].copy())
    assert stale >= 20  # most frames after warm-up reuse older statistics


@settings(max_examples=150, deadline=None)
@given(
    arrays(np.float64, st.tuples(st.integers(1, 12), st.integers(1, 15)),
           elements=st.one_of(st.integers(-4, 4).map(float),
                              st.floats(-1e6, 1e6, allow_nan=False),
                              st.just(float("nan")))),
    st.booleans(),
)
def test_window_stats_equals_numpy_medians(history: np.ndarray, with_buffer: bool) -> None:
    """The in-place selections give, row by row, exactly ``np.nanmedian`` / ``np.nanmean``
    (rows with gaps) or ``np.median`` / ``mean`` (whole rows), ties and odd/even widths."""
    import warnings

    from consumer.alerts.robust import window_stats

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        med = np.nanmedian(history, axis=1)
        dev = np.abs(history - med[:, None])
        mad, mean_ad = np.nanmedian(dev, axis=1), np.nanmean(dev, axis=1)
        got = window_stats(history, np.empty(history.size + 3) if with_buffer else None)
    np.testing.assert_array_equal(got.median, med)
    np.testing.assert_array_equal(got.mad, mad)
    np.testing.assert_array_equal(got.mean_ad, mean_ad)
    assert got.samples.tolist() == (~np.isnan(history)).sum(axis=1).tolist()


def test_min_samples_skips_statistics_and_keeps_counts():
    """Below min_samples frames nothing is scored (NaN) but the sample counts are exact
    (gaps included, and after the ring wraps); from then on the scores are those of a
    RollingRobustZ without the minimum."""
    rng = np.random.default_rng(2)
    lazy = RollingRobustZ(4, 6, refresh_every=1, min_samples=3)
    eager = RollingRobustZ(4, 6, refresh_every=1)
    layers = np.arange(4)
    for i in range(15):
        x = rng.normal(size=4)
        if i % 4 == 1:
            x[2] = np.nan  # layer 2 not testable in this frame
        z, med, n = lazy.score(layers, x)
        z_ref, med_ref, n_ref = eager.score(layers, x)
        assert n.tolist() == n_ref.tolist()
        assert n.tolist() == (~np.isnan(eager.history)).sum(axis=1).tolist()
        if i < 3:
            assert np.isnan(z).all() and np.isnan(med).all()
        else:
            np.testing.assert_array_equal(z, z_ref)
            np.testing.assert_array_equal(med, med_ref)
        lazy.push(layers, x)
        eager.push(layers, x)
