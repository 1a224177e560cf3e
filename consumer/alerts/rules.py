"""The alert rules, evaluated incrementally on one run's frames (O(layers) per frame).

Each rule turns a frame into a :class:`Finding`: whether its condition is bad now, the
layers and ranks involved, the frame values behind it and a message. The incident state
machine (``consumer.alerts.incident``) turns findings into firing / resolved events.

Conditions (thresholds from ``consumer.alerts.config``; per-layer flags from the seed-001
frame, ``consumer.frames``):

- ``run_health``: the run's health (``consumer.health``) is at least ``level``.
- ``nonfinite``: any layer of the frame holds NaN/Inf elements; the ranks are those whose
  shard of that step counted non-finite elements (from the shards, see
  :meth:`RunRules.note_shard`). When the producers send the per-rank local view
  (``GradientFrame.local``), the message also names where it started: the ranks whose
  *local* gradient held NaN/Inf at the run's earliest such step (:class:`LocalOrigin`;
  under DDP every rank's averaged gradient is NaN, the local view tells whose was first).
- ``exploding`` / ``vanishing``: some layer has been flagged in ``consecutive`` frames in a
  row. A frame in which a layer's gradient is non-finite says nothing from its finite
  part: it continues an exploding streak already under way (Inf/NaN right after
  |g| > threshold is the divergence going on) and otherwise leaves the layer's count as
  it is (a NaN layer has not recovered, and NaN alone is the ``nonfinite`` rule's). The
  exploding message names the ranks whose local gradient first had max |g| above the
  threshold or NaN/Inf, when the local view is sent. A layer with no gradient by
  construction (zero up to floating-point rounding in every frame so far, from its first:
  :attr:`consumer.health.RunHealthTracker.no_gradient`, ``consumer.rounding``) is not
  vanishing for this rule.
- ``grad_norm_spike``: some layer's ``grad_norm`` (``ln`` of it with ``log_scale``) has a
  modified z-score above ``z_threshold`` against that layer's last ``window`` testable
  frames, once it has ``min_samples`` of them (``consumer.alerts.robust``), and is at
  least ``min_ratio`` times that history's median norm. Testable: a finite, positive norm
  and no non-finite element. A frame in which a layer of the last spike is not testable
  neither clears nor extends the incident.
- ``missing_ranks``: ``consecutive`` frames in a row finalised without every rank.
- ``replica_divergence``: replicas of a piece of some layer disagreed in this frame
  (``GradientFrame.replica_divergence``, tolerance ``consumer.merge.REPLICA_RTOL``); names
  the layers and the ranks on both sides.
- ``stalled``: evaluated by :meth:`RunRules.check_stall` (no frame for the threshold of
  ``StalledRuleConfig``), cleared by each new frame.

``Finding.values`` holds ``{"layers": {name: {statistic: value}}}`` for at most
``max_layer_values`` layers (the worst by the rule's statistic) plus rule-specific keys:
``nonfinite_by_rank`` (rank -> layer names), ``local_origin`` (``{"step", "ranks"}`` of
:class:`LocalOrigin`; nonfinite and exploding, when known), ``threshold`` and
``consecutive`` (streaks),
``z_threshold``, ``min_ratio`` and ``window`` (spike), ``health``, ``level``, ``frames``,
``issue_frames``, ``issue_ratio`` (run health), ``missing_ranks``, ``ranks_seen``,
``world_size`` (missing ranks), ``seconds_since_last_frame``, ``threshold_s``,
``median_frame_interval_s`` (stalled). Non-finite numbers are written as null.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from consumer.alerts.config import AlertRulesConfig
from consumer.alerts.robust import RollingRobustZ
from consumer.frames import GradientFrame
from consumer.health import RunHealthTracker
from consumer.runs import RunInfo
from schemas.alert import AlertRule
from schemas.wire import GradientHealth

_NO_LAYERS = np.empty(0, np.int64)


@dataclass(slots=True)
class Finding:
    """A rule's verdict on one observation.

    Attributes:
        bad: the condition holds (True), is clear (False), or cannot be judged from this
            frame (None: neither starts nor clears an incident).
        layers: involved layer names (model order).
        ranks: involved ranks (ascending). values: frame values (module doc).
        message: one line describing the bad state (used when the incident fires).
    """

    bad: bool | None
    layers: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    message: str = ""


def num(x: Any) -> float | int | None:
    """A JSON-safe number: ints stay ints, non-finite floats become None."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    value = float(x)
    return value if math.isfinite(value) else None


def preview(names: list[str], limit: int = 3) -> str:
    """``"a, b, c and 4 more"`` for a message."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class LocalOrigin:
    """Where a kind of bad gradient started in a run, from the per-rank local view: the
    earliest step at which some rank's *local* gradient (before the cross-rank reduction)
    was bad, and every rank that was bad at that step.

    Frames may arrive out of order and a late rank's rows come in a rewrite of the frame,
    so an earlier step replaces the origin and the same step adds its ranks. O(1) state;
    :meth:`update` is O(rows of the frame's local view), vectorised.

    Attributes:
        step: the earliest bad step seen, or None. ranks: its bad ranks (ascending).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.ranks: list[int] = []

    def update(self, step: int, bad_ranks: np.ndarray) -> None:
        """Take a frame's bad local rows into account.

        Args:
            step: the frame's optimiser step.
            bad_ranks: int[m] ranks of the local rows that are bad (repeats allowed; empty:
                nothing bad at this step).
        """
        if bad_ranks.size == 0 or (self.step is not None and step > self.step):
            return
        ranks = np.unique(bad_ranks).tolist()
        if self.step is None or step < self.step:
            self.step, self.ranks = step, ranks
        else:
            self.ranks = sorted(set(self.ranks) | set(ranks))

    def values(self) -> dict[str, Any]:
        """``{"local_origin": {"step": s, "ranks": [...]}}``, or ``{}`` when unknown."""
        if self.step is None:
            return {}
        return {"local_origin": {"step": self.step, "ranks": list(self.ranks)}}

    def phrase(self, what: str) -> str:
        """``"; {what} first in rank 2's local gradient at step 20"`` (several ranks: "in
        the local gradients of ranks 0, 1"), or ``""`` when unknown."""
        if self.step is None:
            return ""
        if len(self.ranks) == 1:
            where = f"rank {self.ranks[0]}'s local gradient"
        else:
            where = f"the local gradients of ranks {', '.join(map(str, self.ranks))}"
        return f"; {what} first in {where} at step {self.step}"


class _FrameView:
    """Per-frame helpers shared by the rules: layer index -> row, names, value dicts."""

    def __init__(self, frame: GradientFrame, names: np.ndarray, limit: int) -> None:
        self.frame = frame
        self.names = names
        self.limit = limit
        self.row = np.full(len(names), -1, np.int64)
        self.row[frame.layer_index] = np.arange(len(frame.layer_index))

    def layer_values(
        self, layers: np.ndarray, key: np.ndarray, extra: dict[str, np.ndarray] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Values of at most ``limit`` of ``layers`` (int[k] layer indices), the ones with
        the largest ``key`` (float[k]), in model order; ``extra`` adds aligned columns."""
        if layers.size > self.limit:
            keep = np.sort(np.argsort(-key, kind="stable")[: self.limit])
            layers = layers[keep]
            extra = {k: v[keep] for k, v in (extra or {}).items()}
        f = self.frame
        out: dict[str, dict[str, Any]] = {}
        for i, layer in enumerate(layers.tolist()):
            values: dict[str, Any] = {}
            r = int(self.row[layer])
            if r >= 0:
                values = {
                    "grad_norm": num(f.grad_norm[r]),
                    "max_abs_grad": num(f.max_abs_grad[r]),
                    "mean_abs_grad": num(f.mean_abs_grad[r]),
                    "nonfinite": int(f.nonfinite[r]),
                    "numel": int(f.numel[r]),
                }
            for name, column in (extra or {}).items():
                values[name] = num(column[i])
            out[str(self.names[layer])] = values
        return out


class RunRules:
    """Rule state of one run: per-layer streaks, spike history, stall clock.

    Args:
        run: the run (layer names, thresholds, world size).
        rules: the configuration.
    """

    def __init__(self, run: RunInfo, rules: AlertRulesConfig) -> None:
        self.run = run
        self.rules = rules
        num_layers = run.num_layers
        self.names = np.asarray(run.layer_names, dtype=object)
        self.index = {name: i for i, name in enumerate(run.layer_names)}
        self.exploding_streak = np.zeros(num_layers, np.int64)
        self.vanishing_streak = np.zeros(num_layers, np.int64)
        self.partial_streak = 0
        self.spike = RollingRobustZ(num_layers, rules.grad_norm_spike.window,
                                    rules.grad_norm_spike.refresh_frames)
        self._spiked = _NO_LAYERS
        self.last_step: int | None = None
        self.last_frame_at: float | None = None
        self.intervals: deque[float] = deque(maxlen=rules.stalled.window)
        self._shard_nonfinite: dict[int, dict[int, np.ndarray]] = {}
        self.last_view: _FrameView | None = None
        self.nonfinite_origin = LocalOrigin()
        self.exploding_origin = LocalOrigin()

    def current_values(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """Values of the named layers in the last evaluated frame (for resolved events:
        what the layers look like now), at most ``max_layer_values`` of them."""
        if self.last_view is None or not names:
            return {}
        layers = np.asarray([self.index[n] for n in names if n in self.index], np.int64)
        return self.last_view.layer_values(layers, np.zeros(layers.size))

    def model_order(self, names: set[str] | list[str]) -> list[str]:
        """``names`` sorted by layer index."""
        return sorted(names, key=lambda n: self.index.get(n, len(self.index)))

    # -- shards --------------------------------------------------------------------------

    def note_shard(self, step: int, rank: int, layers: np.ndarray) -> None:
        """Remember that ``rank``'s shard of ``step`` had non-finite elements in ``layers``
        (int[k]). Kept until that step's frame is evaluated; at most ``world_size * 64``
        steps are remembered (older notes are dropped first)."""
        self._shard_nonfinite.setdefault(step, {})[rank] = layers
        if len(self._shard_nonfinite) > 64 * self.run.world_size:
            self._shard_nonfinite.pop(next(iter(self._shard_nonfinite)))

    # -- frame-level rules ---------------------------------------------------------------

    def evaluate(
        self, frame: GradientFrame, tracker: RunHealthTracker
    ) -> dict[AlertRule, Finding]:
        """Evaluate every enabled frame rule on a new frame (updates streaks and history).

        Args:
            frame: the run's next finalised frame.
            tracker: the run's health tracker, already updated with ``frame``.

        Returns:
            rule -> finding, for the enabled rules (``stalled`` included: a frame clears it).
        """
        r = self.rules
        view = _FrameView(frame, self.names, r.max_layer_values)
        self.last_view = view
        self._note_local(frame)
        out: dict[AlertRule, Finding] = {}
        if r.nonfinite.enabled:
            out[AlertRule.NONFINITE] = self._nonfinite(view)
        else:
            self._shard_nonfinite.pop(frame.step, None)
        finite = frame.nonfinite == 0
        if r.exploding.enabled:
            out[AlertRule.EXPLODING] = self._streak(
                view, self.exploding_streak, frame.is_exploding, finite, "exploding",
                r.exploding.consecutive, self.run.exploding_threshold, frame.max_abs_grad,
            )
        if r.vanishing.enabled:
            out[AlertRule.VANISHING] = self._streak(
                view, self.vanishing_streak,
                frame.is_vanishing & ~tracker.no_gradient[frame.layer_index], finite,
                "vanishing", r.vanishing.consecutive, self.run.vanishing_threshold,
                -frame.mean_abs_grad,
            )
        if r.grad_norm_spike.enabled:
            out[AlertRule.GRAD_NORM_SPIKE] = self._spike(view)
        if r.missing_ranks.enabled:
            out[AlertRule.MISSING_RANKS] = self._missing(frame)
        if r.replica_divergence.enabled:
            out[AlertRule.REPLICA_DIVERGENCE] = self._divergence(view)
        if r.run_health.enabled:
            out[AlertRule.RUN_HEALTH] = self._health(view, tracker)
        if r.stalled.enabled:
            out[AlertRule.STALLED] = Finding(False)
        return out

    def _note_local(self, frame: GradientFrame) -> None:
        """Update the local origins from the frame's per-rank local rows (if any): NaN/Inf
        for ``nonfinite``; NaN/Inf or max |g| above the run's exploding threshold for
        ``exploding`` (the report's ``first_bad_local_step`` criterion)."""
        local = frame.local
        if local is None or len(local) == 0:
            return
        nonfinite = local.nonfinite > 0
        self.nonfinite_origin.update(frame.step, local.rank[nonfinite])
        bad = nonfinite | (local.max_abs > self.run.exploding_threshold)
        self.exploding_origin.update(frame.step, local.rank[bad])

    def _nonfinite(self, view: _FrameView) -> Finding:
        f = view.frame
        notes = self._shard_nonfinite.pop(f.step, {})
        rows = np.flatnonzero(f.nonfinite > 0)
        if rows.size == 0:
            return Finding(False)
        layers = f.layer_index[rows].astype(np.int64)
        names = [str(n) for n in self.names[layers]]
        ranks = sorted(notes)
        by_rank = {
            str(rank): [str(n) for n in self.names[np.sort(notes[rank])]] for rank in ranks
        }
        total = int(f.nonfinite[rows].sum())
        on = f"on rank(s) {ranks}" if ranks else "(ranks unknown)"
        return Finding(
            True, names, ranks,
            {
                "layers": view.layer_values(layers, f.nonfinite[rows].astype(np.float64)),
                "nonfinite_by_rank": by_rank,
                "nonfinite_elements": total,
                **self.nonfinite_origin.values(),
            },
            f"non-finite gradients (NaN/Inf) at step {f.step}: {total} element(s) in "
            f"{len(names)} layer(s) {preview(names)} {on}"
            f"{self.nonfinite_origin.phrase('NaN/Inf')}",
        )

    def _streak(
        self, view: _FrameView, streak: np.ndarray, flag: np.ndarray, finite: np.ndarray,
        what: str, k: int, threshold: float, key: np.ndarray,
    ) -> Finding:
        f = view.frame
        idx = f.layer_index
        # finite layers: +1 when flagged, 0 otherwise. Non-finite layers: an exploding
        # streak goes on (Inf/NaN after |g| > threshold is the explosion continuing), any
        # other count is kept as it is.
        current = streak[idx]
        nonfinite_next = current + 1 if what == "exploding" else current
        nonfinite_next = np.where(current > 0, nonfinite_next, current)
        streak[idx] = np.where(finite, np.where(flag, current + 1, 0), nonfinite_next)
        bad_layers = np.flatnonzero(streak >= k)
        if bad_layers.size == 0:
            return Finding(False)
        names = [str(n) for n in self.names[bad_layers]]
        rows = view.row[bad_layers]
        order_key = np.where(rows >= 0, key[np.maximum(rows, 0)], -np.inf)
        stat = "max |g| >" if what == "exploding" else "mean |g| <"
        origin = self.exploding_origin if what == "exploding" else LocalOrigin()
        return Finding(
            True, names, [],
            {
                "layers": view.layer_values(
                    bad_layers, order_key, {"consecutive": streak[bad_layers]}
                ),
                "threshold": threshold,
                "consecutive": k,
                **origin.values(),
            },
            f"{len(names)} layer(s) {what} ({stat} {threshold:g}) for >= {k} consecutive "
            f"steps at step {f.step}: {preview(names)}"
            f"{origin.phrase(f'max |g| > {threshold:g} or NaN/Inf')}",
        )

    def _spike(self, view: _FrameView) -> Finding:
        cfg = self.rules.grad_norm_spike
        f = view.frame
        norm = f.grad_norm
        testable = np.isfinite(norm) & (norm > 0) & (f.nonfinite == 0)
        layers = f.layer_index[testable].astype(np.int64)
        with np.errstate(divide="ignore"):
            x = np.log(norm[testable]) if cfg.log_scale else norm[testable]
        z, med, samples = self.spike.score(layers, x)
        self.spike.push(layers, x)
        with np.errstate(divide="ignore", invalid="ignore"):
            all_ratio = norm[testable] / (np.exp(med) if cfg.log_scale else med)
        hit = (samples >= cfg.min_samples) & (z > cfg.z_threshold) & (all_ratio >= cfg.min_ratio)
        if not hit.any():
            # A layer that spiked and is now non-finite (or absent) has not calmed down:
            # the frame says nothing about it (neither clear nor bad).
            if self._spiked.size and np.isin(self._spiked, layers, invert=True).any():
                return Finding(None)
            self._spiked = _NO_LAYERS
            return Finding(False)
        spiking = layers[hit]
        self._spiked = spiking
        median_norm = np.exp(med[hit]) if cfg.log_scale else med[hit]
        names = [str(n) for n in self.names[spiking]]
        ratio = all_ratio[hit]
        top = int(np.argmax(z[hit]))
        return Finding(
            True, names, [],
            {
                "layers": view.layer_values(
                    spiking, z[hit],
                    {"z": z[hit], "median_grad_norm": median_norm, "ratio": ratio,
                     "samples": samples[hit]},
                ),
                "z_threshold": cfg.z_threshold,
                "min_ratio": cfg.min_ratio,
                "window": cfg.window,
            },
            f"gradient-norm spike at step {f.step} in {len(names)} layer(s) "
            f"{preview(names)}: {names[top]} norm {norm[testable][hit][top]:.4g} is "
            f"{ratio[top]:.3g}x its median {median_norm[top]:.4g} over the last "
            f"{int(samples[hit][top])} steps (robust z {z[hit][top]:.3g} > {cfg.z_threshold:g})",
        )

    def _missing(self, frame: GradientFrame) -> Finding:
        k = self.rules.missing_ranks.consecutive
        self.partial_streak = 0 if frame.complete else self.partial_streak + 1
        if self.partial_streak < k:
            return Finding(False)
        missing = list(frame.missing_ranks)
        return Finding(
            True, [], missing,
            {
                "missing_ranks": missing,
                "ranks_seen": list(frame.ranks_seen),
                "world_size": frame.world_size,
                "consecutive": self.partial_streak,
            },
            f"step {frame.step} finalised without rank(s) {missing} of world size "
            f"{frame.world_size} ({self.partial_streak} partial frame(s) in a row)",
        )

    def _divergence(self, view: _FrameView) -> Finding:
        rows = view.frame.replica_divergence
        if rows.size == 0:
            return Finding(False)
        layers = np.unique(rows[:, 0]).astype(np.int64)
        names = [str(n) for n in self.names[layers]]
        ranks = sorted(set(rows[:, 1].tolist()) | set(rows[:, 2].tolist()))
        pairs = {
            str(n): sorted({(int(a), int(b)) for a, b in rows[rows[:, 0] == i][:, 1:]})
            for i, n in zip(layers.tolist(), names, strict=True)
        }
        first = rows[0]
        return Finding(
            True, names, ranks,
            {
                "layers": view.layer_values(layers, np.zeros(layers.size)),
                "diverged_pairs": {k: [list(p) for p in v] for k, v in pairs.items()},
            },
            f"replicas disagree at step {view.frame.step} in {len(names)} layer(s) "
            f"({preview(names)}): rank {int(first[1])} differs from rank {int(first[2])}",
        )

    def _health(self, view: _FrameView, tracker: RunHealthTracker) -> Finding:
        level: GradientHealth = self.rules.run_health.level
        health = tracker.health
        if health.severity < level.severity:
            return Finding(False, values={"health": health.value})
        flagged = np.flatnonzero(
            (tracker.exploding_frames > 0) | (tracker.nonfinite_frames > 0)
            | (tracker.vanishing_frames > 0)
        )
        names = [str(n) for n in self.names[flagged]]
        ratio = tracker.issue_frames / max(tracker.frames, 1)
        # worst first: most non-finite frames, then exploding, then vanishing frames
        order = np.lexsort((tracker.vanishing_frames[flagged],
                            tracker.exploding_frames[flagged],
                            tracker.nonfinite_frames[flagged]))
        key = np.empty(flagged.size, np.float64)
        key[order] = np.arange(flagged.size)
        return Finding(
            True, names, [],
            {
                "layers": view.layer_values(flagged, key, {
                    "exploding_frames": tracker.exploding_frames[flagged],
                    "vanishing_frames": tracker.vanishing_frames[flagged],
                    "nonfinite_frames": tracker.nonfinite_frames[flagged],
                }),
                "health": health.value,
                "level": level.value,
                "frames": tracker.frames,
                "issue_frames": tracker.issue_frames,
                "issue_ratio": num(ratio),
            },
            f"run health {health.value} at step {view.frame.step} (alert level "
            f"{level.value}): {tracker.issue_frames} of {tracker.frames} frames with "
            f"issues ({ratio:.0%}), {int((tracker.exploding_frames > 0).sum())} layer(s) "
            f"exploding, {int((tracker.nonfinite_frames > 0).sum())} non-finite, "
            f"{int((tracker.vanishing_frames > 0).sum())} vanishing",
        )

    # -- stalls --------------------------------------------------------------------------

    def frame_arrived(self, step: int, now: float) -> None:
        """Record a new frame's arrival (worker monotonic clock, s) for the stall rule."""
        if self.last_frame_at is not None and (self.last_step is None or step > self.last_step):
            self.intervals.append(now - self.last_frame_at)
        self.last_frame_at = now
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    def stall_threshold(self) -> tuple[float, float | None]:
        """(threshold s, median frame interval s or None) of the stall rule."""
        cfg = self.rules.stalled
        median = float(np.median(np.fromiter(self.intervals, float))) if self.intervals \
            else None
        if cfg.after_s is not None:
            return cfg.after_s, median
        if median is None:
            return cfg.min_after_s, None
        return max(cfg.min_after_s, cfg.interval_factor * median), median

    def check_stall(self, now: float) -> Finding:
        """Whether the run has had no frame for longer than the stall threshold."""
        if self.last_frame_at is None or self.last_step is None:
            return Finding(False)
        idle = now - self.last_frame_at
        threshold, median = self.stall_threshold()
        if idle <= threshold:
            return Finding(False)
        return Finding(
            True, [], [],
            {
                "seconds_since_last_frame": num(idle),
                "threshold_s": num(threshold),
                "median_frame_interval_s": None if median is None else num(median),
                "last_step": self.last_step,
            },
            f"no frame for {idle:.0f} s after step {self.last_step} (threshold "
            f"{threshold:.0f} s) although the run has not finished",
        )
