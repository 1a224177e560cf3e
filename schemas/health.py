"""The run-health rule (``classify_health``, extended for non-finite gradients) and the
layer exclusion a run may set (``match_layers``): pure functions, used by the consumer's
incremental tracker (``consumer.health_tracker``) and by the report computed from the store
(``analysis.report``), so that both always agree.

Semantics follow trustformers-debug's ``gradient_flow`` module (``classify_health``): every
layer's flags count. A layer leaves the counts only when the run says so explicitly
(``ignore_layers`` patterns, :func:`match_layers`), and the report names it. How a NaN/Inf
gradient counts is an option, :data:`NonfiniteVerdict` (defined in
:mod:`schemas.nonfinite_verdict`, re-exported here).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

import numpy as np

from schemas.nonfinite_verdict import NONFINITE_VERDICTS as NONFINITE_VERDICTS
from schemas.nonfinite_verdict import NonfiniteVerdict as NonfiniteVerdict
from schemas.nonfinite_verdict import check_nonfinite_verdict as check_nonfinite_verdict
from schemas.wire import GradientHealth


def match_layers(names: Sequence[str], patterns: Iterable[str]) -> np.ndarray:
    """Which layers an ``ignore_layers`` setting excludes.

    Patterns are shell-style, as :func:`fnmatch.fnmatchcase` (case-sensitive, whatever the
    platform): ``*`` matches any run of characters including ``.``, ``?`` one character,
    ``[seq]`` / ``[!seq]`` a character in / not in ``seq``. A pattern is matched against
    the whole layer name: ``"*.attention.self.key.bias"`` excludes every BERT key bias.

    Args:
        names: L layer names (model order).
        patterns: the patterns; empty = no layer.

    Returns:
        bool[L], True where some pattern matches the name. One compiled regular expression
        for all patterns; O(L) matches.
    """
    pats = [p for p in patterns if p]
    out = np.zeros(len(names), bool)
    if not pats:
        return out
    regex = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in pats), re.DOTALL)
    for i, name in enumerate(names):
        out[i] = regex.match(name) is not None
    return out


def classify_health(
    any_vanishing: bool,
    any_exploding: bool,
    issue_frames: int,
    frames: int,
    any_nonfinite: bool,
) -> GradientHealth:
    """Run health from its counters (README.md, "How it works").

    With ``issue_ratio = issue_frames / max(frames, 1)`` (frames == 0 counts as 1, as in
    the reference, trustformers-debug ``gradient_flow``), the first rule that holds wins:

    1. any non-finite gradient (gradstream's rule, :data:`NONFINITE_VERDICTS`; pass
       ``any_nonfinite=False`` for the reference's rule) -> Critical
    2. an exploding layer and ``issue_ratio > 0.5`` -> Critical
    3. an exploding layer or ``issue_ratio > 0.3`` -> ProblemsDetected
    4. a vanishing layer or ``issue_ratio > 0.1`` -> MinorIssues
    5. otherwise Healthy

    The ratio comparisons are done exactly in integers (``10 * issue_frames > frames``
    for 0.1, and so on), so a ratio of exactly 0.1, 0.3 or 0.5 is never "above".

    Note (as in the reference): an issue frame always contains a
    vanishing, an exploding or a non-finite layer, so with counters taken from data rule 4's
    ``issue_ratio > 0.1`` never decides anything (any issue frame already sets a flag); it
    matters only for callers passing independent counts.

    Args:
        any_vanishing: some layer had ``is_vanishing`` in some frame considered (layers
            excluded by the run's ``ignore_layers`` left out, :func:`match_layers`).
        any_exploding: some layer had ``is_exploding`` in some frame considered (the
            same exclusion).
        issue_frames: frames with any vanishing, exploding or non-finite layer
            (0 <= issue_frames).
        frames: frames considered (issue_frames <= frames).
        any_nonfinite: some layer had a NaN/Inf gradient element in some frame.

    Returns:
        The :class:`schemas.wire.GradientHealth` class.

    Raises:
        ValueError: negative counts or ``issue_frames > frames``.
    """
    if issue_frames < 0 or frames < 0:
        raise ValueError(f"counts must be >= 0, got issue_frames={issue_frames}, frames={frames}")
    if issue_frames > frames:
        raise ValueError(f"issue_frames {issue_frames} exceeds frames {frames}")
    denominator = max(frames, 1)
    if any_nonfinite:
        return GradientHealth.CRITICAL
    if any_exploding and 2 * issue_frames > denominator:
        return GradientHealth.CRITICAL
    if any_exploding or 10 * issue_frames > 3 * denominator:
        return GradientHealth.PROBLEMS_DETECTED
    if any_vanishing or 10 * issue_frames > denominator:
        return GradientHealth.MINOR_ISSUES
    return GradientHealth.HEALTHY


HEALTH_COLOR: dict[GradientHealth, str] = {
    GradientHealth.HEALTHY: "green",
    GradientHealth.MINOR_ISSUES: "yellow",
    GradientHealth.PROBLEMS_DETECTED: "dark_orange",
    GradientHealth.CRITICAL: "red",
}
"""Terminal colour (a ``rich`` colour name) of each run health, the one palette of
``gradstream report`` and ``gradstream alerts watch``."""
