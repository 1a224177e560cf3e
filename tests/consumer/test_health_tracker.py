"""Run health: the health rule at every threshold boundary, incremental updates,
replacement of rewritten frames, rolling window and restore."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.health_tracker import RunHealthTracker
from schemas.health import classify_health as classify
from schemas.wire import GradientHealth as H


@pytest.mark.parametrize(
    ("van", "exp", "issues", "frames", "nonfinite", "expected"),
    [
        (False, False, 0, 10, False, H.HEALTHY),
        (False, False, 1, 10, False, H.HEALTHY),          # ratio 0.1 is not > 0.1
        (False, False, 11, 100, False, H.MINOR_ISSUES),   # 0.11 > 0.1
        (True, False, 1, 100, False, H.MINOR_ISSUES),     # any vanishing layer
        (True, False, 3, 10, False, H.MINOR_ISSUES),      # 0.3 is not > 0.3
        (True, False, 31, 100, False, H.PROBLEMS_DETECTED),
        (False, True, 1, 100, False, H.PROBLEMS_DETECTED),  # any exploding layer
        (False, True, 5, 10, False, H.PROBLEMS_DETECTED),   # exploding, 0.5 not > 0.5
        (False, True, 51, 100, False, H.CRITICAL),          # exploding and 0.51 > 0.5
        (True, False, 100, 100, False, H.PROBLEMS_DETECTED),  # no exploding: never Critical
        (False, False, 0, 100, True, H.CRITICAL),           # non-finite: Critical at once
        (False, False, 0, 0, False, H.HEALTHY),             # no frames
    ],
)
def test_classify_boundaries(van, exp, issues, frames, nonfinite, expected):
    assert classify(van, exp, issues, frames, nonfinite) is expected


def _update(t: RunHealthTracker, step: int, van=(), exp=(), nonf=(), layers=4):
    idx = np.arange(layers)
    return t.update(step, idx, np.isin(idx, van), np.isin(idx, exp),
                    np.isin(idx, nonf).astype(np.int64))


def test_incremental_counts_and_total_steps():
    t = RunHealthTracker(4)
    for s in range(10):
        _update(t, s, van=(0,) if s == 3 else ())
    assert t.frames == 10 and t.issue_frames == 1 and t.total_steps == 10
    assert t.health is H.MINOR_ISSUES
    assert t.vanishing_frames.tolist() == [1, 0, 0, 0]


def test_rewritten_frame_replaces_its_contribution():
    t = RunHealthTracker(4)
    _update(t, 0, exp=(2,))
    assert t.health is H.CRITICAL  # 1/1 issue frames with an exploding layer
    _update(t, 0)                   # same step rewritten healthy (late shard)
    assert t.frames == 1 and t.issue_frames == 0 and t.health is H.HEALTHY
    assert not t.exploding_frames.any()


def test_nonfinite_frame_is_critical_and_first_step_kept():
    t = RunHealthTracker(4)
    _update(t, 5)
    _update(t, 9, nonf=(1,))
    _update(t, 7, nonf=(3,))
    assert t.health is H.CRITICAL and t.first_nonfinite_step == 7


def test_rolling_window_like_reference_max_frames():
    t = RunHealthTracker(4, max_frames=3)
    _update(t, 0, exp=(1,))
    for s in range(1, 10):
        _update(t, s)
    assert t.frames == 3 and t.health is H.HEALTHY


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7), st.integers(0, 3)),
                min_size=1, max_size=60),
       st.sampled_from([0, 5]))
def test_restore_equals_incremental(events, window):
    """A tracker rebuilt from stored flags equals the one that saw the frames."""
    layers = 3
    t = RunHealthTracker(layers, window)
    stored: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for step, flags, layer in events:
        idx = np.arange(layers)
        van = (idx == layer) & bool(flags & 1)
        exp = (idx == layer) & bool(flags & 2)
        nonf = ((idx == layer) & bool(flags & 4)).astype(np.int64)
        t.update(step, idx, van, exp, nonf)
        stored[step] = (van, exp, nonf > 0)
    steps = np.array(sorted(stored))
    rows = [(s, i, *[f[i] for f in stored[s]]) for s in steps for i in range(layers)
            if any(f[i] for f in stored[s])]
    arr = np.array(rows, dtype=object).reshape(-1, 5)
    r = RunHealthTracker.restored(layers, window, steps, arr[:, 0].astype(np.int64),
                        arr[:, 1].astype(np.int64), arr[:, 2].astype(bool),
                        arr[:, 3].astype(bool), arr[:, 4].astype(bool))
    if window == 0:
        assert (r.frames, r.issue_frames, r.health) == (t.frames, t.issue_frames, t.health)
        assert r.vanishing_frames.tolist() == t.vanishing_frames.tolist()
        assert r.first_nonfinite_step == t.first_nonfinite_step
    else:
        assert r.frames == t.frames == min(window, len(stored))
        assert r.health == t.health


def test_nonfinite_frames_are_issue_frames():
    """A run whose last 39 of 60 frames hold NaN (2 earlier vanishing frames): 41 issue
    frames, not 2; a rebuilt tracker counts the same."""
    t = RunHealthTracker(4)
    for s in range(60):
        _update(t, s, van=(0,) if s in (3, 7) else (), nonf=(2,) if s >= 21 else ())
    assert (t.frames, t.issue_frames) == (60, 41)
    assert t.nonfinite_frames.tolist() == [0, 0, 39, 0] and t.health is H.CRITICAL
    steps = np.arange(60)
    flag_steps = np.array([3, 7, *range(21, 60)])
    layers = np.array([0, 0] + [2] * 39)
    van = layers == 0
    r = RunHealthTracker.restored(4, 0, steps, flag_steps, layers, van, np.zeros(41, bool), ~van)
    assert (r.frames, r.issue_frames, r.health) == (60, 41, H.CRITICAL)


def _frame(t: RunHealthTracker, step: int, nonfinite: list[int], nan: list[int] | None,
           exp: tuple[int, ...] = ()) -> H:
    idx = np.arange(len(nonfinite))
    return t.update(step, idx, np.zeros(len(idx), bool), np.isin(idx, exp),
                    np.asarray(nonfinite, np.int64), None,
                    None if nan is None else np.asarray(nan, np.int64))


def test_nonfinite_rule_reference_counts_inf_as_exploding_and_nan_as_nothing():
    """``nonfinite_rule="reference"``: a NaN-only layer is no issue (Healthy), an Inf makes
    the layer exploding (ProblemsDetected, Critical only by the issue ratio); the default
    rule makes either Critical at once."""
    ref = RunHealthTracker(3, nonfinite_rule="reference")
    default = RunHealthTracker(3)
    for step in range(4):
        assert _frame(ref, step, [2, 0, 0], [2, 0, 0]) is H.HEALTHY  # NaN only
        assert _frame(default, step, [2, 0, 0], [2, 0, 0]) is H.CRITICAL
    assert ref.issue_frames == 0 and ref.nonfinite_frames[0] == 4
    assert ref.first_nonfinite_step == 0
    assert _frame(ref, 4, [0, 1, 0], [0, 0, 0]) is H.PROBLEMS_DETECTED  # one Inf
    assert ref.exploding_frames.tolist() == [0, 1, 0] and ref.issue_frames == 1
    assert _frame(ref, 4, [0, 3, 0], [0, 1, 0]) is H.PROBLEMS_DETECTED  # rewritten: NaN+Inf
    assert ref.issue_frames == 1 and ref.frames == 5
    for step in range(5, 10):  # Inf in 6 of 10 frames: ratio 0.6 > 0.5 with an exploding layer
        _frame(ref, step, [0, 1, 0], [0, 0, 0])
    assert ref.health is H.CRITICAL and ref.critical_frames.sum() == 0
    with pytest.raises(ValueError, match="nonfinite_rule must be one of critical, reference"):
        RunHealthTracker(3, nonfinite_rule="strict")  # type: ignore[arg-type]


def test_nonfinite_rule_reference_keeps_critical_where_the_split_is_unknown():
    """A producer before wire schema 1.7 sends no NaN count: the reference's verdict cannot
    be known, so such a layer keeps gradstream's rule (Critical), never a guess."""
    ref = RunHealthTracker(2, nonfinite_rule="reference")
    assert _frame(ref, 0, [1, 0], None) is H.CRITICAL
    assert _frame(ref, 0, [1, 0], [-1, 0]) is H.CRITICAL  # merged with an unknown shard
    assert _frame(ref, 0, [1, 0], [1, 0]) is H.HEALTHY  # the frame rewritten, split known


def test_restore_with_the_reference_rule_equals_the_live_tracker():
    live = RunHealthTracker(2, nonfinite_rule="reference")
    _frame(live, 0, [1, 0], [1, 0])
    _frame(live, 1, [0, 1], [0, 0])
    _frame(live, 2, [1, 0], None)
    restored = RunHealthTracker.restored(
        2, 0, np.array([0, 1, 2]), np.array([0, 1, 2]), np.array([0, 1, 0]),
        np.zeros(3, bool), np.array([False, True, False]), np.ones(3, bool),
        flag_critical=np.array([False, False, True]), nonfinite_rule="reference")
    assert restored.health is live.health is H.CRITICAL
    assert (restored.issue_frames, restored.frames) == (live.issue_frames, live.frames) == (2, 3)
    np.testing.assert_array_equal(restored.critical_frames, live.critical_frames)
    np.testing.assert_array_equal(restored.exploding_frames, live.exploding_frames)
