"""The runs a consumer process knows: the frame -> health -> run-state step written once.

Both consumers of frames, the summaries worker (:mod:`consumer.worker`) and the scale-out
store writer (:mod:`consumer.store_writer`), keep the same book: each run's static description
(:class:`consumer.runs.RunInfo`), its incremental health (:class:`RunHealthTracker`) and the
ranks that said they are done. :meth:`RunBook.record` is the one place where a finalised
frame becomes a row of the next write (with the frame's health) and the run's counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from consumer.health_tracker import RunHealthTracker, critical_rows
from consumer.outputs.base import Batch, RunState, StoredFrames
from consumer.runs import RunInfo
from schemas.health import NonfiniteVerdict, check_nonfinite_verdict
from schemas.rounding import gradient_magnitude
from schemas.wire import GradientHealth, RunFinished, RunStarted

if TYPE_CHECKING:
    from consumer.frames import GradientFrame
    from consumer.outputs.duckdb import DuckDBSink


class RunBook:
    """Runs, their health trackers and finished ranks.

    Args:
        max_frames: rolling window of run health in frames (0 = the whole run), as in
            :class:`consumer.health_tracker.RunHealthTracker`.
        ignore_layers: the process's own ``--ignore-layers`` patterns, excluded in every
            run besides the run's own ``ignore_layers`` (``schemas.health.match_layers``).
        exclude_rounding: the tracker's ``exclude_rounding`` (``--exclude-rounding-level``;
            off by default: every layer counts, as in the reference).
        nonfinite_rule: the tracker's ``nonfinite_rule`` (``--nonfinite-rule``;
            ``"critical"`` by default, ``schemas.health.NONFINITE_VERDICTS``).

    Attributes:
        runs: run id -> RunInfo. trackers: run id -> RunHealthTracker.
        finished: run id -> ranks whose RunFinished was seen.
        health: run id -> the run's health after its last recorded frame (Healthy before
            any), kept as a plain value for :meth:`health_counts`.
    """

    def __init__(self, max_frames: int, ignore_layers: tuple[str, ...] = (),
                 exclude_rounding: bool = False,
                 nonfinite_rule: NonfiniteVerdict = "critical") -> None:
        self.max_frames = max_frames
        self.nonfinite_rule: NonfiniteVerdict = check_nonfinite_verdict(nonfinite_rule)
        self.ignore_layers = tuple(ignore_layers)
        self.exclude_rounding = exclude_rounding
        self.runs: dict[str, RunInfo] = {}
        self.trackers: dict[str, RunHealthTracker] = {}
        self.finished: dict[str, set[int]] = {}
        self.health: dict[str, GradientHealth] = {}

    def start(self, msg: RunStarted) -> RunInfo:
        """Register the run of ``msg`` (replacing nothing: call once per run id)."""
        run = RunInfo.from_message(msg)
        self.runs[run.run_id] = run
        self.trackers[run.run_id] = RunHealthTracker(
            run.num_layers, self.max_frames, run.roundoff,
            excluded=run.excluded(self.ignore_layers), exclude_rounding=self.exclude_rounding,
            nonfinite_rule=self.nonfinite_rule)
        self.health[run.run_id] = self.trackers[run.run_id].health
        return run

    def finish(self, msg: RunFinished) -> bool:
        """Record that ``msg.rank`` is done; True when every rank of the run is."""
        self.finished.setdefault(msg.run_id, set()).add(msg.rank)
        return self.is_finished(msg.run_id)

    def is_finished(self, run_id: str) -> bool:
        """Every rank of a known run sent RunFinished."""
        run = self.runs.get(run_id)
        return run is not None and len(self.finished.get(run_id, ())) >= run.world_size

    def health_counts(self) -> dict[tuple[str, bool], int]:
        """Number of runs per (health value, every rank finished), for the
        ``gradstream_runs`` gauge (``consumer.metrics``).

        Called on the metrics server's thread while the loop's thread records frames: the
        health map is copied in one step (``tuple`` of a dict's items: C code under the
        GIL, no Python code runs in between), so a run started meanwhile is counted at the
        next scrape, never raises.
        """
        counts: dict[tuple[str, bool], int] = {}
        for run_id, health in tuple(self.health.items()):
            key = (health.value, self.is_finished(run_id))
            counts[key] = counts.get(key, 0) + 1
        return counts

    def restore(self, sink: DuckDBSink) -> dict[str, StoredFrames]:
        """Load every stored run, the ranks that finished it, and rebuild its health
        tracker from the stored flags.

        Returns:
            run id -> the run's stored frames (steps, complete, ranks seen), for the
            caller's own state (pending frames, rank sets).

        Raises:
            duckdb.Error: the store cannot be read.
        """
        stored: dict[str, StoredFrames] = {}
        for run in sink.load_runs():
            self.runs[run.run_id] = run
            steps, complete, ranks = sink.load_frames(run.run_id)
            stored[run.run_id] = (steps, complete, ranks)
            flags = sink.load_flags(run.run_id, self.exclude_rounding, self.nonfinite_rule)
            seen, ordinary = sink.load_gradient_state(run.run_id, run.num_layers)
            self.trackers[run.run_id] = RunHealthTracker.restored(
                run.num_layers, self.max_frames, steps, flags["step"],
                flags["layer_index"], flags["is_vanishing"].astype(bool),
                flags["is_exploding"].astype(bool), flags["nonfinite"].astype(bool),
                roundoff=run.roundoff, seen=seen, ordinary=ordinary,
                excluded=run.excluded(self.ignore_layers),
                exclude_rounding=self.exclude_rounding,
                flag_critical=flags["critical"].astype(bool),
                nonfinite_rule=self.nonfinite_rule,
            )
            self.health[run.run_id] = self.trackers[run.run_id].health
        for run_id, rank in sink.con.execute("SELECT run_id, rank FROM run_ranks").fetchall():
            self.finished.setdefault(run_id, set()).add(rank)
        return stored

    def record(self, frame: GradientFrame, batch: Batch) -> GradientHealth:
        """Update the run's health with ``frame`` and put the frame, its health and the
        run's counters into ``batch`` (a later frame of the same (run, step) replaces it).

        Returns:
            The run's health before this frame (compare with ``trackers[run].health``).
        """
        tracker = self.trackers[frame.run_id]
        before = tracker.health
        health = tracker.update(
            frame.step, frame.layer_index, frame.is_vanishing, frame.is_exploding,
            frame.nonfinite,
            gradient_magnitude(frame.mean_abs_grad, frame.sum_sq, frame.numel),
            frame.nan,
        )
        critical = frame.has_nonfinite and bool(
            critical_rows(frame.nonfinite, frame.nan, self.nonfinite_rule).any())
        frame_health = GradientHealth.CRITICAL if critical else health
        self.health[frame.run_id] = health
        batch.frames[(frame.run_id, frame.step)] = (frame, frame_health.value)
        batch.run_states[frame.run_id] = RunState(
            health.value, tracker.frames, tracker.issue_frames, tracker.last_step,
            tracker.first_nonfinite_step,
        )
        return before
