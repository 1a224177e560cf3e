"""classify_health: the health rule's thresholds, gradstream's non-finite rule, monotonicity."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.health import classify_health
from schemas.wire import GradientHealth

H = GradientHealth


def float_classify(
    vanishing: bool, exploding: bool, issue_frames: int, frames: int, nonfinite: bool
) -> GradientHealth:
    """The reference's (trustformers-debug, ``gradient_flow``) ``classify_health``
    transcribed with floats, plus the non-finite rule."""
    ratio = issue_frames / max(frames, 1)
    if nonfinite:
        return H.CRITICAL
    if exploding and ratio > 0.5:
        return H.CRITICAL
    if exploding or ratio > 0.3:
        return H.PROBLEMS_DETECTED
    if vanishing or ratio > 0.1:
        return H.MINOR_ISSUES
    return H.HEALTHY


@pytest.mark.parametrize(
    ("vanishing", "exploding", "issue", "frames", "expected"),
    [
        # 0.1: exactly is not above; just above is MinorIssues
        (False, False, 1, 10, H.HEALTHY),
        (False, False, 10, 100, H.HEALTHY),
        (False, False, 11, 100, H.MINOR_ISSUES),
        (False, False, 101, 1000, H.MINOR_ISSUES),
        # 0.3
        (False, False, 3, 10, H.MINOR_ISSUES),
        (False, False, 30, 100, H.MINOR_ISSUES),
        (False, False, 31, 100, H.PROBLEMS_DETECTED),
        (True, False, 30, 100, H.MINOR_ISSUES),
        (True, False, 301, 1000, H.PROBLEMS_DETECTED),
        # 0.5 counts only with an exploding layer
        (False, True, 5, 10, H.PROBLEMS_DETECTED),
        (False, True, 50, 100, H.PROBLEMS_DETECTED),
        (False, True, 51, 100, H.CRITICAL),
        (False, False, 100, 100, H.PROBLEMS_DETECTED),
        (True, False, 100, 100, H.PROBLEMS_DETECTED),
        # flags alone
        (True, False, 0, 100, H.MINOR_ISSUES),
        (False, True, 0, 100, H.PROBLEMS_DETECTED),
        (True, True, 1, 100, H.PROBLEMS_DETECTED),
        (False, False, 0, 100, H.HEALTHY),
        # no frames: denominator 1, like the reference
        (False, False, 0, 0, H.HEALTHY),
        (True, False, 0, 0, H.MINOR_ISSUES),
        (False, True, 0, 0, H.PROBLEMS_DETECTED),
    ],
)
def test_thresholds(
    vanishing: bool, exploding: bool, issue: int, frames: int, expected: GradientHealth
) -> None:
    assert classify_health(vanishing, exploding, issue, frames, False) is expected
    assert classify_health(vanishing, exploding, issue, frames, True) is H.CRITICAL


def test_invalid_counts() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        classify_health(False, False, 3, 2, False)
    with pytest.raises(ValueError, match=">= 0"):
        classify_health(False, False, -1, 2, False)


counts = st.integers(min_value=0, max_value=10**6).flatmap(
    lambda frames: st.tuples(st.integers(min_value=0, max_value=frames), st.just(frames))
)
flags = st.tuples(st.booleans(), st.booleans(), st.booleans())


@given(counts, flags)
def test_matches_float_rules(c: tuple[int, int], f: tuple[bool, bool, bool]) -> None:
    issue, frames = c
    assert classify_health(f[0], f[1], issue, frames, f[2]) is float_classify(
        f[0], f[1], issue, frames, f[2]
    )


@given(counts, flags)
def test_monotone_in_issue_frames(c: tuple[int, int], f: tuple[bool, bool, bool]) -> None:
    issue, frames = c
    if issue < frames:
        before = classify_health(f[0], f[1], issue, frames, f[2])
        after = classify_health(f[0], f[1], issue + 1, frames, f[2])
        assert after.severity >= before.severity


@given(counts, flags, st.integers(min_value=0, max_value=2))
def test_monotone_in_each_flag(c: tuple[int, int], f: tuple[bool, bool, bool], i: int) -> None:
    issue, frames = c
    off = list(f)
    off[i] = False
    on = list(f)
    on[i] = True
    low = classify_health(off[0], off[1], issue, frames, off[2])
    high = classify_health(on[0], on[1], issue, frames, on[2])
    assert high.severity >= low.severity


@given(counts)
def test_more_clean_frames_never_worsen(c: tuple[int, int]) -> None:
    """Diluting the same issue frames with clean frames cannot raise severity."""
    issue, frames = c
    for van, exp in ((False, False), (True, False), (False, True), (True, True)):
        a = classify_health(van, exp, issue, frames, False)
        b = classify_health(van, exp, issue, frames + 1, False)
        assert b.severity <= a.severity


@given(counts, flags)
def test_exact_ratio_rules(c: tuple[int, int], f: tuple[bool, bool, bool]) -> None:
    issue, frames = c
    ratio = Fraction(issue, max(frames, 1))
    got = classify_health(f[0], f[1], issue, frames, f[2])
    if f[2] or (f[1] and ratio > Fraction(1, 2)):
        assert got is H.CRITICAL
    elif f[1] or ratio > Fraction(3, 10):
        assert got is H.PROBLEMS_DETECTED
    elif f[0] or ratio > Fraction(1, 10):
        assert got is H.MINOR_ISSUES
    else:
        assert got is H.HEALTHY
