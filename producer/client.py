"""GradientProducer: the run API of one rank (start a run, record steps, finish, close).

The training thread only summarises the gradients (:mod:`producer.summary`,
:mod:`producer.weights`) and queues the result; the transport
(:mod:`producer.transport`) builds, encodes and sends the messages on a daemon thread, so
an unreachable broker never blocks training: summaries wait in a bounded queue, and when
it is full the oldest pending *step* summary is dropped and counted (run start/finish
messages are never dropped).
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.flight_recorder import FlightRecorder, LocalEntry
from producer.selection import select_names
from producer.settings import ProducerSettings
from producer.summary import LayerSummaries, summarize, warmup
from producer.transport.encoding import LocalRecord, StepRecord, local_summary, step_summary
from producer.transport.sender import Pending, Sender
from producer.weights import WeightSummaries, summarize_weights
from schemas.health import match_layers
from schemas.scalars import STEP_TIME, RankScalars, split_scalars
from schemas.wire import LocalSummary, RunFinished, RunStarted, StepSummary

log = logging.getLogger("gradstream.producer")


@dataclass(frozen=True, slots=True)
class ProducerStats:
    """Counters of one producer (messages, not bytes).

    Attributes:
        recorded: step summaries accepted by ``record_step`` / ``record_summaries``.
        skipped: steps not sent because of ``every_n_steps``.
        sent: messages acknowledged by Kafka.
        dropped: step summaries dropped because the queue was full.
        failed: messages Kafka rejected or that could not be delivered in time.
        queued: messages waiting for the sender thread now.
        in_flight: messages handed to Kafka and not yet acknowledged.
        training_thread_s: total seconds the training thread spent on telemetry: inside
            ``record_step`` / ``record_summaries`` (summary + enqueue) plus the time an
            adapter reports with ``add_training_time`` (e.g. ``GradientTap``'s reductions
            and device->host copies).
        local_summaries: ``LocalSummary`` messages queued (the flight recorder's dumps,
            or every step's local view given to ``record_local`` in ``every_step`` mode).
    """

    recorded: int
    skipped: int
    sent: int
    dropped: int
    failed: int
    queued: int
    in_flight: int
    training_thread_s: float
    local_summaries: int = 0


class GradientProducer:
    """Per-rank telemetry producer.

    Typical use::

        with GradientProducer("run-42", rank=r, world_size=w) as gp:
            gp.start_run({name: p.size for name, p in params.items()})
            for step in range(steps):
                ...
                gp.record_step(step, grads)      # returns at once
            gp.finish_run()

    Args:
        run_id: the run's id, the same on every rank (also the Kafka key, with
            ``run_id/step`` for step summaries under ``partition_key="step"``).
        rank: this process's rank, 0 <= rank < world_size.
        world_size: number of ranks that each send a summary per step.
        settings: a ProducerSettings; by default read from the environment.
        **overrides: individual ProducerSettings fields (e.g. ``bootstrap_servers=``,
            ``topic=``) applied over ``settings``.

    Raises:
        ValueError: empty run id, or rank outside [0, world_size).
    """

    def __init__(
        self,
        run_id: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        settings: ProducerSettings | None = None,
        **overrides: Any,
    ) -> None:
        if not run_id:
            raise ValueError("run_id must be a non-empty string")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must satisfy 0 <= rank < world_size ({world_size})")
        base = settings or ProducerSettings()
        self.settings = base.model_copy(update=overrides) if overrides else base
        self.run_id = run_id
        self.rank = rank
        self.world_size = world_size
        self._layer_index: dict[str, int] = {}
        self._known: set[str] = set()
        self._previous_weights: dict[str, np.ndarray] | None = None
        self._last_step = -1
        self._step_clock: tuple[int, float] | None = None  # (step, perf_counter) last timed
        self._steps_recorded = 0
        self._recorder: FlightRecorder | None = None
        self._local_sent = 0

        self._lock = threading.Lock()
        self._recorded = 0
        self._skipped = 0
        self._training_s = 0.0
        self._before_finish: list[Callable[[], object]] = []
        self._sender = Sender(self.settings, run_id, self._step_message,
                              name=f"gradstream-sender-{rank}")

    @property
    def value_limit(self) -> int | None:
        """Largest record value this producer sends (bytes), set when it connects."""
        return self._sender.value_limit

    @property
    def oversized_dropped(self) -> int:
        """Layer ranges of step summaries dropped because one layer alone is too large."""
        return self._sender.oversized_dropped

    # -- training-thread API -------------------------------------------------------------

    def start_run(
        self,
        layer_numel: Mapping[str, int],
        *,
        vanishing_threshold: float = 1e-7,
        exploding_threshold: float = 1e3,
        config: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
        ignore_layers: Sequence[str] = (),
    ) -> None:
        """Announce the run: its layers in model order and their full-tensor sizes.

        Only the layers selected by ``settings.include`` / ``settings.exclude`` are
        announced and sent; the others are ignored by ``record_step``.

        Args:
            layer_numel: layer name -> number of elements of the full parameter, in model
                order (the order defines ``layer_index`` everywhere downstream).
            vanishing_threshold: mean |g| below which a layer is vanishing.
            exploding_threshold: max |g| above which a layer is exploding.
            config: free-form JSON-serialisable run configuration.
            dtypes: layer name -> gradient dtype name (``"float32"``, ``"bfloat16"``, ...)
                for every layer, or None (unknown). The consumer uses it to tell a gradient
                that is zero up to the dtype's rounding from a merely small one.
            ignore_layers: shell-style layer-name patterns
                (:func:`schemas.health.match_layers`) whose vanishing and exploding flags
                the run's health, issue frames and alerts leave out, explicitly: the
                patterns travel in RunStarted, are recorded with the run and
                named in its report. Unlike ``settings.exclude``, the layers are still
                sent, stored and analysed; a NaN/Inf gradient in them still counts. Use it
                for parameters whose gradient is zero by construction (e.g. the key bias of
                softmax attention). A pattern that matches no announced layer is logged as
                a warning.

        Raises:
            pydantic.ValidationError: invalid layer list or thresholds (names the field).
            ValueError: the include/exclude patterns select no layer; ``dtypes`` misses
                a layer.
            RuntimeError: the run was already started or the producer is closed.
        """
        if self._layer_index:
            raise RuntimeError("start_run() was already called for this producer")
        selected = select_names(layer_numel, self.settings.include or None,
                                self.settings.exclude)
        if not selected:
            raise ValueError(
                f"include={self.settings.include} / exclude={self.settings.exclude} select "
                f"none of the {len(layer_numel)} layers"
            )
        run_config = dict(config or {})
        run_config.setdefault("gradstream", {
            "every_n_steps": self.settings.every_n_steps,
            "include": self.settings.include,
            "exclude": self.settings.exclude,
            "layers_total": len(layer_numel),
        })
        if dtypes is not None:
            missing = [name for name in selected if name not in dtypes]
            if missing:
                raise ValueError(f"dtypes has no entry for layer(s) {missing[:5]!r}")
        message = RunStarted(
            run_id=self.run_id,
            rank=self.rank,
            world_size=self.world_size,
            layer_names=selected,
            numel=[int(layer_numel[name]) for name in selected],
            dtypes=None if dtypes is None else [str(dtypes[name]) for name in selected],
            vanishing_threshold=vanishing_threshold,
            exploding_threshold=exploding_threshold,
            host=socket.gethostname(),
            start_time=time.time(),
            config=run_config,
            ignore_layers=list(dict.fromkeys(ignore_layers)),
        )
        for pattern in message.ignore_layers:
            if not match_layers(selected, [pattern]).any():
                log.warning("ignore_layers pattern %r matches none of the run's %d layers",
                               pattern, len(selected))
        self._layer_index = {name: i for i, name in enumerate(message.layer_names)}
        self._known = set(layer_numel)
        s = self.settings
        self._recorder = FlightRecorder(
            s.local_view_steps, s.local_view_max_bytes, exploding_threshold=exploding_threshold,
            spike_factor=s.spike_factor, sample_every=s.local_view_sample_every,
        )
        self._sender.put(Pending("start", message))
        # Compile (or load from cache) the summary kernels now, not on the first step.
        warmup(histogram=self.settings.exp_histogram)

    def record_step(
        self,
        step: int,
        gradients: Mapping[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        *,
        replicated: bool = False,
        local_gradients: Mapping[str, np.ndarray] | None = None,
        scalars: Mapping[str, object] | None = None,
    ) -> None:
        """Summarise this rank's gradients of one optimiser step and queue them for sending.

        Pass the gradient the optimiser applies. Under data parallelism that is the
        all-reduced (averaged) gradient, the same on every rank: say ``replicated=True`` so
        that the consumer counts it once and checks that the ranks agree; the rank's own
        gradient before the reduction can go along as ``local_gradients`` (the per-rank
        local view, stored apart and used to name the rank where NaN/Inf or an explosion
        started; with ``settings.local_view="recorder"``, the default, it goes to the
        rank's flight recorder, :meth:`record_local`, and leaves the rank only when a
        local trigger fires; with ``"every_step"`` it goes inside the StepSummary).
        Without ``replicated`` each rank's gradients are a disjoint shard of the
        parameters (ZeRO/FSDP-style), and the consumer adds the ranks up.

        Never waits for Kafka: when the queue is full it waits at most
        ``settings.enqueue_timeout_s`` (default 0) and then drops the oldest pending step
        summary (counted in ``stats().dropped``). Steps not divisible by
        ``settings.every_n_steps`` return at once (counted in ``stats().skipped``).

        Args:
            step: optimiser step, >= 0.
            gradients: layer name -> gradient array (any shape; float16/32/64); names must
                be among those given to ``start_run``; a subset is allowed; layers left out
                by include/exclude are ignored.
            weights: with ``settings.weight_stats``, the layers' current weights (same
                names and shapes as ``gradients``); ignored otherwise.
            replicated: every rank passes the same (all-reduced) gradient of every layer.
            local_gradients: layer name -> this rank's gradient before the reduction
                (any subset of the watched layers), or None.
            scalars: the step's training scalars, name -> real number (a Python or NumPy
                number or a 0-d tensor; NaN/Inf allowed): ``loss`` (this rank's),
                ``lr`` (``lr/1``, ... for further parameter groups), ``loss_scale``,
                ``tokens`` / ``samples`` (this rank's), ``compute_time_s``, any other
                name (``schemas.scalars``). ``step_time_s`` is measured here when not
                given (:meth:`_rank_scalars`).

        Raises:
            RuntimeError: ``start_run`` was not called, or the producer is closed.
            ValueError: negative step, unknown layer name, empty gradient, weights whose
                names or shapes differ from the gradients', an invalid scalar name.
            TypeError: a gradient of a non-float dtype, a scalar that is not a number.
        """
        t0 = time.perf_counter()
        if not self._check_step(step, gradients):
            return
        watched = {n: g for n, g in gradients.items() if n in self._layer_index}
        if not watched:
            return
        summaries = summarize(watched, histogram=self.settings.exp_histogram,
                              norms_only=self.settings.mode == "norms")
        if replicated:
            summaries = summaries.with_layout(0, 1)
        if local_gradients is not None:
            own = {n: g for n, g in local_gradients.items() if n in self._layer_index}
            unknown = [n for n in local_gradients if n not in self._known]
            if unknown:
                raise ValueError(f"unknown layer(s) in local_gradients: {unknown[:5]!r}")
            if own and self.settings.local_view == "every_step":
                summaries = summaries.with_local(summarize(own))
            elif own:  # the recorder's dump goes before the step's summary
                self._feed_recorder(int(step), summarize(own))
        extra = self._weight_stats(watched, weights) if self.settings.weight_stats else None
        self._queue_summaries(int(step), summaries, t0, extra, *self._scalars(int(step), scalars))

    def _weight_stats(
        self, watched: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray] | None
    ) -> WeightSummaries | None:
        """Weight statistics of the watched layers (:mod:`producer.weights`), updating the
        kept float32 copy of the previous weights; None without ``weights``."""
        if weights is None:
            return None
        missing = [n for n in watched if n not in weights]
        if missing:
            raise ValueError(f"weights missing for layer(s) {missing[:5]!r}")
        current = {n: np.asarray(weights[n]) for n in watched}
        for name, w in current.items():
            if w.shape != np.shape(watched[name]):
                raise ValueError(
                    f"weights of {name!r} have shape {w.shape}, gradient {np.shape(watched[name])}"
                )
        # One pass: statistics, update norm against the kept copy, and the copy refreshed
        # in place (producer.weights.summarize_weights(refresh=True)).
        stats = summarize_weights(current, self._previous_weights, refresh=True)
        if stats.update is None:  # first step, or the layers changed: nothing was refreshed
            self._previous_weights = {n: np.array(w, dtype=np.float32, order="C")
                                      for n, w in current.items()}
        return stats

    def record_summaries(
        self, step: int, summaries: LayerSummaries, *,
        scalars: Mapping[str, object] | None = None, rank_scalars: RankScalars | None = None,
    ) -> None:
        """Queue statistics already computed elsewhere (e.g. on a GPU by a framework
        adapter) for one optimiser step; same rules as :meth:`record_step`.

        A local view in ``summaries.local`` goes to the flight recorder
        (:meth:`record_local`) in ``local_view="recorder"`` mode, into the StepSummary in
        ``"every_step"`` mode.

        Args:
            step: optimiser step, >= 0.
            summaries: per-layer statistics whose ``names`` are among those given to
                ``start_run``.
            scalars: the step's training scalars, as :meth:`record_step`'s.
            rank_scalars: the per-rank scalars of every rank ``summaries`` reports for,
                gathered by the adapter (a summary reduced in-band); replaces this rank's
                own per-rank values from ``scalars`` and the measured step time.

        Raises:
            RuntimeError / ValueError: as :meth:`record_step`; ValueError also for
                statistics that are negative or not finite.
        """
        t0 = time.perf_counter()
        if not self._check_step(step, dict.fromkeys(summaries.names)):
            return
        keep = np.fromiter((n in self._layer_index for n in summaries.names), bool,
                           count=len(summaries))
        if not keep.any():
            return
        if (summaries.sum_abs is None) != (summaries.max_abs is None):
            raise ValueError("sum_abs and max_abs go together: give both or neither")
        for field_name in ("sum_abs", "sum_sq", "max_abs"):
            values = getattr(summaries, field_name)
            if values is None:
                continue
            if not np.all(np.isfinite(values)) or np.any(values < 0):
                raise ValueError(f"{field_name} must be finite and >= 0 for every layer")
        local = summaries.local
        if local is not None:
            self._check_local(local)
            if self.settings.local_view == "recorder":
                summaries = dataclasses.replace(summaries, local=None)
                self._feed_recorder(int(step), local)
        if not keep.all():
            summaries = summaries.select(keep)
        if self.settings.mode == "norms":
            summaries = summaries.norms_only()
        step_values, ranks = self._scalars(int(step), scalars)
        if rank_scalars is not None:
            rank_scalars.check()
            ranks = rank_scalars
        self._queue_summaries(int(step), summaries, t0, None, step_values, ranks)

    def record_local(self, step: int, local: LayerSummaries) -> None:
        """Give this rank's local view of one optimiser step (the statistics of its own
        gradient before the cross-rank reduction) to the producer alone, whether or not
        this rank sends a StepSummary for the step.

        With ``settings.local_view="recorder"`` (default) it goes to the rank's flight
        recorder (:class:`producer.flight_recorder.FlightRecorder`): kept among the last
        ``local_view_steps`` entries, and when a local trigger fires on it (NaN/Inf, a max
        |g| above the run's exploding threshold, a norm spike, the sampled baseline) the
        entries not sent before are queued as ``LocalSummary`` messages. With
        ``"every_step"`` it is queued at once as a ``LocalSummary`` (trigger
        ``"every_step"``). Layers not watched are left out; steps skipped by
        ``every_n_steps`` are ignored. Never waits for Kafka (as :meth:`record_step`).

        Args:
            step: optimiser step, >= 0.
            local: full statistics (``sum_abs`` and ``max_abs`` given) whose ``names`` are
                among those given to ``start_run``.

        Raises:
            RuntimeError: ``start_run`` was not called, or the producer is closed.
            ValueError: negative step, unknown layer name, statistics without ``sum_abs``
                / ``max_abs``, negative or not finite.
        """
        t0 = time.perf_counter()
        if not self._layer_index:
            raise RuntimeError("call start_run(layer_numel) before record_local()")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        self._check_local(local)
        if int(step) % self.settings.every_n_steps:
            return
        if self.settings.local_view == "every_step":
            entry = LocalEntry.from_summaries(int(step), time.time(), local, self._layer_index)
            if entry is not None:
                self._queue_local([LocalRecord(entry, "every_step", int(step))])
        else:
            self._feed_recorder(int(step), local)
        with self._lock:
            self._training_s += time.perf_counter() - t0

    def _check_local(self, local: LayerSummaries) -> None:
        """Validate a local view (full statistics, finite and >= 0, known layer names).

        Raises:
            ValueError: as :meth:`record_local`.
        """
        if local.sum_abs is None or local.max_abs is None:
            raise ValueError("the local view needs sum_abs and max_abs (full statistics)")
        for values in (local.sum_abs, local.sum_sq, local.max_abs):
            if not np.all(np.isfinite(values)) or np.any(values < 0):
                raise ValueError("local statistics must be finite and >= 0")
        unknown = [n for n in local.names if n not in self._known]
        if unknown:
            raise ValueError(f"unknown layer(s) in the local view: {unknown[:5]!r}")

    def _feed_recorder(self, step: int, local: LayerSummaries) -> None:
        """Record ``local`` in the flight recorder and queue what its triggers hand out."""
        assert self._recorder is not None
        entry = LocalEntry.from_summaries(step, time.time(), local, self._layer_index)
        if entry is None:
            return
        self._recorder.update(entry)
        records = [LocalRecord(e, dump.trigger, dump.trigger_step)
                   for dump in self._recorder.get() for e in dump.entries]
        if records:
            self._queue_local(records)

    def _queue_local(self, records: list[LocalRecord]) -> None:
        """Queue local-view entries as LocalSummary messages (built on the sender thread)."""
        for record in records:
            self._sender.put(Pending("local", record))
        with self._lock:
            self._local_sent += len(records)

    def _check_step(self, step: object, names: Mapping[str, object]) -> bool:
        """Validate a step and its layer names; False when every_n_steps skips it."""
        if not self._layer_index:
            raise RuntimeError("call start_run(layer_numel) before record_step()")
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        unknown = [name for name in names if name not in self._known]
        if unknown:
            raise ValueError(
                f"unknown layer(s) {unknown[:5]!r}: not in the layer list given to start_run()"
            )
        if int(step) % self.settings.every_n_steps:
            with self._lock:
                self._skipped += 1
            return False
        return True

    def _scalars(self, step: int, scalars: Mapping[str, object] | None
                 ) -> tuple[dict[str, float], RankScalars | None]:
        """This rank's training scalars of a recorded ``step``: (step scalars, this rank's
        per-rank values or None).

        ``step_time_s``, when not given, is measured: the wall time since the previous
        recorded step divided by the steps between them (so that ``every_n_steps`` still
        gives seconds per optimiser step); the first recorded step has none.

        Raises:
            ValueError: an invalid scalar name. TypeError: a value that is not a number.
        """
        now = time.perf_counter()
        previous, self._step_clock = self._step_clock, (step, now)
        step_values, own = split_scalars(scalars or {})
        if STEP_TIME not in own and previous is not None and step > previous[0]:
            own[STEP_TIME] = (now - previous[1]) / (step - previous[0])
        return step_values, RankScalars.of_rank(self.rank, own) if own else None

    def _queue_summaries(
        self, step: int, summaries: LayerSummaries, t0: float,
        extra: WeightSummaries | None, scalars: dict[str, float] | None = None,
        rank_scalars: RankScalars | None = None,
    ) -> None:
        indices = np.fromiter(
            (self._layer_index[n] for n in summaries.names), dtype=np.int64, count=len(summaries)
        )
        self._sender.put(Pending("step", StepRecord(step, time.time(), indices, summaries, extra,
                                                    scalars or None, rank_scalars)))
        self._last_step = max(self._last_step, step)
        self._steps_recorded += 1
        with self._lock:
            self._recorded += 1
            self._training_s += time.perf_counter() - t0

    def finish_run(self, timeout: float | None = None) -> bool:
        """Send this rank's RunFinished and wait for delivery of everything queued.

        Args:
            timeout: seconds to wait (default ``settings.close_timeout_s``).

        Returns:
            True when everything queued was delivered or accounted as dropped/failed.
        """
        for hook in self._before_finish:
            hook()
        dropped = self._sender.counts().dropped
        self._sender.put(
            Pending(
                "finish",
                RunFinished(
                    run_id=self.run_id,
                    rank=self.rank,
                    world_size=self.world_size,
                    last_step=self._last_step,
                    steps_recorded=self._steps_recorded,
                    dropped=dropped,
                    end_time=time.time(),
                ),
            )
        )
        return self.flush(timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the queue is empty and Kafka acknowledged every message handed to it.

        Returns:
            True if everything was delivered (or failed/dropped and counted) in time.
        """
        return self._sender.flush(self.settings.close_timeout_s if timeout is None else timeout)

    def close(self, timeout: float | None = None) -> ProducerStats:
        """Flush, stop the sender thread, close the Kafka client and log a summary.

        Returns:
            The final :class:`ProducerStats`.
        """
        if not self._sender.closed:
            self.flush(timeout)
            self._sender.close(timeout or self.settings.close_timeout_s)
            stats = self.stats()
            log.info(
                "gradstream producer run=%s rank=%d: recorded=%d sent=%d dropped=%d failed=%d "
                "training-thread time=%.3fs",
                self.run_id, self.rank, stats.recorded, stats.sent, stats.dropped,
                stats.failed, stats.training_thread_s,
            )
        return self.stats()

    def before_finish(self, hook: Callable[[], object]) -> None:
        """Call ``hook()`` at the start of :meth:`finish_run`, before the RunFinished is
        queued (an adapter hands over statistics it still holds, e.g. the torch tap's
        in-band reduction of the last step). Hooks run in the order they were added."""
        self._before_finish.append(hook)

    def add_training_time(self, seconds: float) -> None:
        """Count training-thread seconds spent outside this producer on its behalf (an
        adapter's gradient reductions and copies before ``record_summaries``) in
        ``stats().training_thread_s``.

        Args:
            seconds: wall-clock seconds (``time.perf_counter`` differences), >= 0.

        Raises:
            ValueError: ``seconds`` is negative or not finite.
        """
        seconds = float(seconds)
        if not 0.0 <= seconds < float("inf"):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        with self._lock:
            self._training_s += seconds

    def stats(self) -> ProducerStats:
        """Current counters. Thread-safe; the delivery counters (from the sender) and the
        recording counters are each read consistently, at two instants microseconds
        apart."""
        delivery = self._sender.counts()
        with self._lock:
            return ProducerStats(recorded=self._recorded, skipped=self._skipped,
                                 training_thread_s=self._training_s,
                                 local_summaries=self._local_sent, **delivery._asdict())

    def __enter__(self) -> GradientProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _step_message(self, record: StepRecord | LocalRecord) -> StepSummary | LocalSummary:
        """The StepSummary of a recorded step, or the LocalSummary of a local-view entry
        (called on the sender thread)."""
        if isinstance(record, LocalRecord):
            return local_summary(record, run_id=self.run_id, rank=self.rank,
                                 world_size=self.world_size)
        return step_summary(record, run_id=self.run_id, rank=self.rank,
                            world_size=self.world_size, layer_index=self._layer_index)
