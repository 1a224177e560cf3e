"""Incremental run health (the health rule of ``schemas.health``, extended for non-finite
gradients). Semantics follow trustformers-debug's ``gradient_flow`` module.

Over the frames considered (the whole run, or the ``max_frames`` highest steps when a
rolling window is set, as the reference's ``max_frames``):

- ``issue_ratio = issue_frames / max(frames, 1)``, where an issue frame has any vanishing,
  exploding or non-finite layer (a NaN/Inf gradient is an issue: the reference counts an
  infinite gradient as exploding, its max |g| being inf);
- Critical if any non-finite gradient (gradstream's rule), or any exploding layer and
  ``issue_ratio > 0.5``; ProblemsDetected if any exploding layer or ``issue_ratio > 0.3``;
  MinorIssues if any vanishing layer or ``issue_ratio > 0.1``; else Healthy.

The non-finite verdict is an option (``nonfinite_rule``, ``--nonfinite-rule``,
:data:`NONFINITE_VERDICTS`):

- ``"critical"`` (default, gradstream's addition): a layer with NaN/Inf elements makes its
  frame an issue frame and the run Critical.
- ``"reference"``: the reference's own rule, which has none: there a NaN
  makes mean |g| NaN (never below the vanishing threshold) and is ignored by max |g|, so a
  NaN-only layer is no issue at all; an Inf makes max |g| inf, so the layer is exploding.
  The tracker then counts a layer with ``nonfinite - nan > 0`` (an Inf element) as
  exploding and a layer with NaN only as nothing. Where the NaN/Inf split is unknown (a
  producer that sends no ``nan`` count) the reference's verdict
  cannot be known: such a layer keeps gradstream's rule (Critical), never a guess.

By default every layer counts, as in the reference: no layer is left out
because of its magnitude. Layers leave the counts only by an explicit, visible choice:

- ``excluded`` (the run's ``ignore_layers`` patterns, from ``start_run(...,
  ignore_layers=...)`` or ``--ignore-layers``; :func:`schemas.health.match_layers`): their
  vanishing and exploding flags count nowhere (not as a flagged layer, not in
  ``issue_frames``). A NaN/Inf gradient in such a layer still counts: it corrupts the
  weights at the next optimiser step whatever the layer is.
- ``exclude_rounding`` (off by default; ``--exclude-rounding-level``): the vanishing flag of a
  layer with no gradient by construction so far (zero up to floating-point rounding at
  every frame from its first on, ``schemas.rounding``) counts nowhere either.

Whatever the options, the tracker judges each frame's layers as it arrives (per layer:
seen, ever above rounding level) so that those layers can be reported as a finding
(:attr:`RunHealthTracker.no_gradient`).

The tracker keeps counters (per-layer counts of vanishing / exploding / non-finite frames,
issue frames, frames) and, per step, the indices of its flagged layers, so that a new frame
costs O(layers) (O(layers log layers) for a frame with a layer still at rounding level: one
sort) and a rewritten frame (late shard, replay) replaces its old contribution instead of
counting twice. Nothing rescans the history.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from schemas.health import (
    NONFINITE_VERDICTS,
    NonfiniteVerdict,
    check_nonfinite_verdict,
    classify_health,
)
from schemas.rounding import at_rounding_level, unit_roundoff
from schemas.wire import GradientHealth

__all__ = ["NONFINITE_VERDICTS", "NonfiniteVerdict", "RunHealthTracker", "critical_rows",
           "reference_exploding"]

_EMPTY = np.empty(0, dtype=np.int32)


def reference_exploding(is_exploding: np.ndarray, nonfinite: np.ndarray,
                        nan: np.ndarray | None) -> np.ndarray:
    """bool[n]: the reference's ``is_exploding`` of n rows: gradstream's
    flag (finite max |g| above the threshold) or an Inf element (``nonfinite - nan > 0``:
    the reference's max |g| is then inf). Rows whose ``nan`` is unknown (< 0, or ``nan``
    None) keep gradstream's flag.

    Args:
        is_exploding: bool[n]. nonfinite: int[n]. nan: int[n] (-1 where unknown) or None.
    """
    if nan is None or not nonfinite.any():
        return is_exploding
    nan = np.asarray(nan)
    return is_exploding | ((nan >= 0) & (nonfinite > nan))


def critical_rows(nonfinite: np.ndarray, nan: np.ndarray | None,
                  rule: NonfiniteVerdict) -> np.ndarray:
    """bool[n]: the rows the non-finite rule makes Critical (module doc): every row with
    ``nonfinite > 0`` under ``"critical"``; under ``"reference"`` only those whose NaN/Inf
    split is unknown (``nan`` < 0 or None).

    Args:
        nonfinite: int[n]. nan: int[n] (-1 where unknown) or None. rule: the option.
    """
    bad = nonfinite > 0
    if rule == "critical" or not bad.any():
        return bad
    if nan is None:
        return bad
    return bad & (np.asarray(nan) < 0)


@dataclass(frozen=True, slots=True)
class _Contribution:
    vanishing: np.ndarray  # int32 layer indices
    exploding: np.ndarray
    nonfinite: np.ndarray  # layers with NaN/Inf elements
    critical: np.ndarray  # those of them the non-finite rule counts (module doc)

    @property
    def is_issue(self) -> bool:
        return bool(self.vanishing.size or self.exploding.size or self.critical.size)


class RunHealthTracker:
    """Health of one run, updated frame by frame.

    Args:
        num_layers: L, the run's layer count.
        max_frames: rolling window in frames (highest steps kept); 0 = whole run. The
            no-gradient-by-construction state is the whole run's, never windowed.
        roundoff: float64[L] unit roundoff of each layer's gradient dtype
            (:func:`schemas.rounding.unit_roundoff`); None = float32 for every layer.
        excluded: bool[L], layers excluded by the run setting (module doc); None = none.
        exclude_rounding: leave out the vanishing flag of the layers of
            :attr:`no_gradient` (module doc; off by default, as in the reference).
        nonfinite_rule: ``"critical"`` (default: a NaN/Inf gradient makes the run
            Critical) or ``"reference"`` (the reference's rule: an Inf
            counts as exploding, a NaN as nothing; module doc).

    Attributes:
        seen: bool[L], the layer was in some frame. ordinary: bool[L], some frame showed
            it above rounding level (or could not judge it: no magnitude given).
        vanishing_frames, exploding_frames, nonfinite_frames: int64[L] considered frames
            per flag (without the layers left out, :attr:`left_out`).
        critical_frames: int64[L] considered frames in which the non-finite rule counted
            the layer (every non-finite frame under ``"critical"``; under
            ``"reference"`` only those whose NaN/Inf split is unknown).

    Raises:
        ValueError: ``excluded`` or ``roundoff`` does not have L entries, or an unknown
            ``nonfinite_rule``.
    """

    def __init__(
        self, num_layers: int, max_frames: int = 0, roundoff: np.ndarray | None = None,
        *, excluded: np.ndarray | None = None, exclude_rounding: bool = False,
        nonfinite_rule: NonfiniteVerdict = "critical",
    ) -> None:
        self.nonfinite_rule: NonfiniteVerdict = check_nonfinite_verdict(nonfinite_rule)
        self.num_layers = num_layers
        self.max_frames = max_frames
        self.roundoff = (unit_roundoff(None, num_layers) if roundoff is None
                         else np.asarray(roundoff, np.float64))
        self.excluded = (np.zeros(num_layers, bool) if excluded is None
                         else np.asarray(excluded, bool).copy())
        for name, arr in (("roundoff", self.roundoff), ("excluded", self.excluded)):
            if arr.shape != (num_layers,):
                raise ValueError(f"{name} has shape {arr.shape}, expected ({num_layers},)")
        self.exclude_rounding = exclude_rounding
        self.seen = np.zeros(num_layers, bool)
        self.ordinary = np.zeros(num_layers, bool)
        self.vanishing_frames = np.zeros(num_layers, np.int64)
        self.exploding_frames = np.zeros(num_layers, np.int64)
        self.nonfinite_frames = np.zeros(num_layers, np.int64)
        self.critical_frames = np.zeros(num_layers, np.int64)
        self.frames = 0
        self.issue_frames = 0
        self.last_step: int | None = None
        self._nonfinite_steps: set[int] = set()
        self._by_step: dict[int, _Contribution] = {}
        self._heap: list[int] = []

    @property
    def no_gradient(self) -> np.ndarray:
        """bool[L]: layers with no gradient by construction so far (seen, and at rounding
        level in every frame that had them; ``schemas.rounding``)."""
        return self.seen & ~self.ordinary

    @property
    def left_out(self) -> np.ndarray:
        """bool[L]: layers whose vanishing flag counts nowhere now: :attr:`excluded`,
        plus :attr:`no_gradient` with ``exclude_rounding`` (module doc). Their exploding
        flag counts nowhere when :attr:`excluded`."""
        if self.exclude_rounding:
            return self.excluded | self.no_gradient
        return self.excluded

    @property
    def first_nonfinite_step(self) -> int | None:
        """Smallest considered step with a non-finite gradient, or None."""
        return min(self._nonfinite_steps) if self._nonfinite_steps else None

    def _apply(self, c: _Contribution, sign: int) -> None:
        self.vanishing_frames[c.vanishing] += sign
        self.exploding_frames[c.exploding] += sign
        self.nonfinite_frames[c.nonfinite] += sign
        self.critical_frames[c.critical] += sign
        self.frames += sign
        self.issue_frames += sign * int(c.is_issue)

    def update(
        self,
        step: int,
        layer_index: np.ndarray,
        is_vanishing: np.ndarray,
        is_exploding: np.ndarray,
        nonfinite: np.ndarray,
        magnitude: np.ndarray | None = None,
        nan: np.ndarray | None = None,
    ) -> GradientHealth:
        """Add (or replace) the frame of ``step`` and return the run health after it.

        Args:
            step: optimiser step of the frame.
            layer_index: int[n] layer indices of the frame's rows (every row of the frame:
                the rounding test compares the layers of a frame with each other).
            is_vanishing, is_exploding: bool[n]; nonfinite: int[n] counts (aligned).
            magnitude: float64[n] gradient magnitude per row
                (:func:`schemas.rounding.gradient_magnitude`: mean |g|, or the RMS in
                norms mode). None: the rows cannot be judged and count as ordinary layers
                (never in :attr:`no_gradient`).
            nan: int[n] NaN elements among ``nonfinite`` (-1 where unknown), or None
                (unknown for every row); read by the ``"reference"`` non-finite rule.
        """
        idx = layer_index.astype(np.int64)
        if self.nonfinite_rule == "reference":
            is_exploding = reference_exploding(is_exploding, nonfinite, nan)
        pending = ~self.ordinary[idx]
        if magnitude is None:
            self.ordinary[idx] = True
        elif pending.any():
            at_rounding = at_rounding_level(magnitude, self.roundoff[idx], nonfinite)
            self.ordinary[idx[~at_rounding]] = True
        self.seen[idx] = True
        if is_vanishing.any() and (self.excluded.any() or (self.exclude_rounding
                                                           and pending.any())):
            is_vanishing = is_vanishing & ~self.left_out[idx]
        if is_exploding.any() and self.excluded.any():
            is_exploding = is_exploding & ~self.excluded[idx]
        bad = layer_index[nonfinite > 0].astype(np.int32) if nonfinite.any() else _EMPTY
        if self.nonfinite_rule == "critical" or not bad.size:
            critical = bad
        else:
            critical = layer_index[critical_rows(nonfinite, nan, "reference")].astype(np.int32)
        c = _Contribution(
            layer_index[is_vanishing].astype(np.int32) if is_vanishing.any() else _EMPTY,
            layer_index[is_exploding].astype(np.int32) if is_exploding.any() else _EMPTY,
            bad, critical,
        )
        old = self._by_step.get(step)
        if old is not None:
            self._apply(old, -1)
        else:
            heapq.heappush(self._heap, step)
        self._by_step[step] = c
        self._apply(c, +1)
        if c.nonfinite.size:
            self._nonfinite_steps.add(step)
        else:
            self._nonfinite_steps.discard(step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self._trim_window()
        return self.health

    def _trim_window(self) -> None:
        """Drop the oldest frames beyond the rolling window (``max_frames``; 0: none)."""
        if self.max_frames:
            while len(self._by_step) > self.max_frames:
                oldest = heapq.heappop(self._heap)
                self._apply(self._by_step.pop(oldest), -1)
                self._nonfinite_steps.discard(oldest)

    @property
    def health(self) -> GradientHealth:
        """Current health over the considered frames (see module doc)."""
        return classify_health(
            any_vanishing=bool(self.vanishing_frames.any()),
            any_exploding=bool(self.exploding_frames.any()),
            issue_frames=self.issue_frames,
            frames=self.frames,
            any_nonfinite=bool(self.critical_frames.any()),
        )

    @property
    def total_steps(self) -> int:
        """``total_steps`` of the run summary: last step + 1 (0 before any frame)."""
        return 0 if self.last_step is None else self.last_step + 1

    @classmethod
    def restored(
        cls,
        num_layers: int,
        max_frames: int,
        frame_steps: np.ndarray,
        flag_steps: np.ndarray,
        flag_layers: np.ndarray,
        flag_vanishing: np.ndarray,
        flag_exploding: np.ndarray,
        flag_nonfinite: np.ndarray,
        *,
        roundoff: np.ndarray | None = None,
        seen: np.ndarray | None = None,
        ordinary: np.ndarray | None = None,
        excluded: np.ndarray | None = None,
        exclude_rounding: bool = False,
        flag_critical: np.ndarray | None = None,
        nonfinite_rule: NonfiniteVerdict = "critical",
    ) -> RunHealthTracker:
        """A tracker rebuilt from stored frames (worker restart), without replaying frames.

        Args:
            num_layers: L. max_frames: rolling window (0 = whole run).
            frame_steps: int[F], every stored step of the run.
            flag_steps, flag_layers: int[R], the stored layer rows with any flag set.
            flag_vanishing, flag_exploding, flag_nonfinite: bool[R], the flags of those rows
                as stored, except with ``exclude_rounding``: then ``flag_vanishing`` without
                the rows of layers that had no gradient by construction up to that row's step
                (``DuckDBSink.load_flags(run_id, exclude_rounding=True)``).
            roundoff: float64[L] unit roundoff per layer (None = float32).
            seen, ordinary: bool[L], the per-layer rounding state
                (``DuckDBSink.load_gradient_state``). None: every layer counts as ordinary.
            excluded, exclude_rounding: as in :class:`RunHealthTracker`; the vanishing and
                exploding flags of ``excluded`` layers are left out here.
            flag_critical: bool[R], the rows the non-finite rule counts
                (:func:`critical_rows`); None = ``flag_nonfinite`` (the ``"critical"`` rule).
                With ``nonfinite_rule="reference"`` the caller also passes the reference's
                ``flag_exploding`` (:func:`reference_exploding`;
                ``DuckDBSink.load_flags(..., nonfinite_rule="reference")`` gives both).
            nonfinite_rule: as in :class:`RunHealthTracker`.

        Returns:
            A tracker equal to one that saw those frames one by one (in step order).
        """
        tracker = cls(num_layers, max_frames, roundoff, excluded=excluded,
                      exclude_rounding=exclude_rounding, nonfinite_rule=nonfinite_rule)
        if flag_critical is None:
            flag_critical = flag_nonfinite
        if flag_layers.size and tracker.excluded.any():
            kept = ~tracker.excluded[flag_layers]
            flag_vanishing = flag_vanishing & kept
            flag_exploding = flag_exploding & kept
        tracker.ordinary = (np.ones(num_layers, bool) if ordinary is None
                            else np.asarray(ordinary, bool).copy())
        tracker.seen = tracker.ordinary.copy() if seen is None else np.asarray(seen, bool).copy()
        empty = _Contribution(_EMPTY, _EMPTY, _EMPTY, _EMPTY)
        by_step: dict[int, _Contribution] = dict.fromkeys(frame_steps.tolist(), empty)
        if flag_steps.size:
            order = np.argsort(flag_steps, kind="stable")
            steps_sorted = flag_steps[order]
            uniq, starts = np.unique(steps_sorted, return_index=True)
            bounds = [*starts.tolist()[1:], len(order)]
            layers = flag_layers[order].astype(np.int32)
            van, exp, nonf = flag_vanishing[order], flag_exploding[order], flag_nonfinite[order]
            crit = flag_critical[order]
            for step, lo, hi in zip(uniq.tolist(), starts.tolist(), bounds, strict=True):
                sl = slice(lo, hi)
                by_step[step] = _Contribution(
                    layers[sl][van[sl]], layers[sl][exp[sl]], layers[sl][nonf[sl]],
                    layers[sl][crit[sl]],
                )
            np.add.at(tracker.vanishing_frames, flag_layers[flag_vanishing], 1)
            np.add.at(tracker.exploding_frames, flag_layers[flag_exploding], 1)
            np.add.at(tracker.nonfinite_frames, flag_layers[flag_nonfinite], 1)
            np.add.at(tracker.critical_frames, flag_layers[flag_critical], 1)
            tracker._nonfinite_steps = set(np.unique(flag_steps[flag_nonfinite]).tolist())
        tracker._by_step = by_step
        tracker._heap = sorted(by_step)
        tracker.frames = len(by_step)
        tracker.issue_frames = sum(1 for c in by_step.values() if c.is_issue)
        tracker.last_step = max(by_step) if by_step else None
        tracker._trim_window()
        return tracker
