"""GradientProducer: sends a rank's RunStarted / StepSummary / RunFinished messages to Kafka.

The training thread only summarises the gradients (NumPy) and appends the result to a
bounded in-memory queue; a daemon sender thread builds the pydantic messages, encodes them
and hands them to kafka-python's ``KafkaProducer``. The Kafka client itself is created on
the sender thread, so an unreachable broker never blocks training: summaries wait in the
queue, and when it is full the oldest pending *step* summary is dropped and counted
(run start/finish messages are never dropped).
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from producer.settings import ProducerSettings
from producer.summary import LayerSummaries, summarize, warmup
from producer.weights import WeightSummaries, summarize_weights
from schemas.health import match_layers
from schemas.wire import (
    RunFinished,
    RunStarted,
    StepSummary,
    encode_message,
    split_step_summary,
)

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
    """

    recorded: int
    skipped: int
    sent: int
    dropped: int
    failed: int
    queued: int
    in_flight: int
    training_thread_s: float


@dataclass(slots=True)
class _Pending:
    kind: str  # "start" | "step" | "finish"
    payload: Any


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
        run_id: the run's id, the same on every rank (also the Kafka key).
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
        self._steps_recorded = 0

        self._queue: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._recorded = 0
        self._skipped = 0
        self._sent = 0
        self._dropped = 0
        self._failed = 0
        self._in_flight = 0
        self._training_s = 0.0
        self._kafka: Any = None
        self._last_error: str | None = None
        self.value_limit: int | None = None
        """Largest record value this producer sends (bytes), set when it connects."""
        self.oversized_dropped = 0
        """Layer ranges of step summaries dropped because one layer alone is too large."""
        self._thread = threading.Thread(
            target=self._sender_loop, name=f"gradstream-sender-{rank}", daemon=True
        )
        self._thread.start()

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
                patterns travel in RunStarted (schema 1.5), are recorded with the run and
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
        selected = [name for name in layer_numel if self._selected(name)]
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
        self._enqueue(_Pending("start", message))
        # Compile (or load from cache) the summary kernels now, not on the first step.
        warmup(histogram=self.settings.exp_histogram)

    def _selected(self, name: str) -> bool:
        s = self.settings
        if s.include and not any(fnmatch.fnmatchcase(name, p) for p in s.include):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in s.exclude)

    def record_step(
        self,
        step: int,
        gradients: Mapping[str, np.ndarray],
        weights: Mapping[str, np.ndarray] | None = None,
        *,
        replicated: bool = False,
        local_gradients: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Summarise this rank's gradients of one optimiser step and queue them for sending.

        Pass the gradient the optimiser applies. Under data parallelism that is the
        all-reduced (averaged) gradient, the same on every rank: say ``replicated=True`` so
        that the consumer counts it once and checks that the ranks agree; the rank's own
        gradient before the reduction can go along as ``local_gradients`` (the per-rank
        local view, stored apart and used to name the rank where NaN/Inf or an explosion
        started). Without ``replicated`` each rank's gradients are a disjoint shard of the
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

        Raises:
            RuntimeError: ``start_run`` was not called, or the producer is closed.
            ValueError: negative step, unknown layer name, empty gradient, weights whose
                names or shapes differ from the gradients'.
            TypeError: a gradient of a non-float dtype.
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
            if own:
                summaries = summaries.with_local(summarize(own))
        extra = self._weight_stats(watched, weights) if self.settings.weight_stats else None
        self._queue_summaries(int(step), summaries, t0, extra)

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

    def record_summaries(self, step: int, summaries: LayerSummaries) -> None:
        """Queue statistics already computed elsewhere (e.g. on a GPU by a framework
        adapter) for one optimiser step; same rules as :meth:`record_step`.

        Args:
            step: optimiser step, >= 0.
            summaries: per-layer statistics whose ``names`` are among those given to
                ``start_run``.

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
            if local.sum_abs is None or local.max_abs is None:
                raise ValueError("the local view needs sum_abs and max_abs (full statistics)")
            for values in (local.sum_abs, local.sum_sq, local.max_abs):
                if not np.all(np.isfinite(values)) or np.any(values < 0):
                    raise ValueError("local statistics must be finite and >= 0")
            unknown = [n for n in local.names if n not in self._known]
            if unknown:
                raise ValueError(f"unknown layer(s) in the local view: {unknown[:5]!r}")
        if not keep.all():
            summaries = summaries.select(keep)
        if self.settings.mode == "norms":
            summaries = summaries.norms_only()
        self._queue_summaries(int(step), summaries, t0, None)

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
            with self._cond:
                self._skipped += 1
            return False
        return True

    def _queue_summaries(
        self, step: int, summaries: LayerSummaries, t0: float,
        extra: WeightSummaries | None,
    ) -> None:
        indices = np.fromiter(
            (self._layer_index[n] for n in summaries.names), dtype=np.int64, count=len(summaries)
        )
        self._enqueue(_Pending("step", (step, time.time(), indices, summaries, extra)))
        self._last_step = max(self._last_step, step)
        self._steps_recorded += 1
        with self._cond:
            self._recorded += 1
            self._training_s += time.perf_counter() - t0

    def finish_run(self, timeout: float | None = None) -> bool:
        """Send this rank's RunFinished and wait for delivery of everything queued.

        Args:
            timeout: seconds to wait (default ``settings.close_timeout_s``).

        Returns:
            True when everything queued was delivered or accounted as dropped/failed.
        """
        with self._cond:
            dropped = self._dropped
        self._enqueue(
            _Pending(
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
        limit = self.settings.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(remaining, 0.1))
        kafka = self._kafka
        if kafka is not None:
            remaining = max(deadline - time.monotonic(), 0.0)
            try:
                kafka.flush(timeout=remaining)
            except Exception as exc:  # kafka-python raises KafkaTimeoutError on timeout
                log.warning("flush did not complete: %s", exc)
                return False
        with self._cond:
            return self._in_flight == 0

    def close(self, timeout: float | None = None) -> ProducerStats:
        """Flush, stop the sender thread, close the Kafka client and log a summary.

        Returns:
            The final :class:`ProducerStats`.
        """
        if not self._closing:
            self.flush(timeout)
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join(timeout=5.0)
            if self._kafka is not None:
                try:
                    self._kafka.close(timeout=timeout or self.settings.close_timeout_s)
                except Exception as exc:  # closing must never raise into training code
                    log.warning("error closing the Kafka producer: %s", exc)
            stats = self.stats()
            log.info(
                "gradstream producer run=%s rank=%d: recorded=%d sent=%d dropped=%d failed=%d "
                "training-thread time=%.3fs",
                self.run_id, self.rank, stats.recorded, stats.sent, stats.dropped,
                stats.failed, stats.training_thread_s,
            )
        return self.stats()

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
        with self._cond:
            self._training_s += seconds

    def stats(self) -> ProducerStats:
        """Current counters (thread-safe snapshot)."""
        with self._cond:
            return ProducerStats(
                recorded=self._recorded,
                skipped=self._skipped,
                sent=self._sent,
                dropped=self._dropped,
                failed=self._failed,
                queued=len(self._queue),
                in_flight=self._in_flight,
                training_thread_s=self._training_s,
            )

    def __enter__(self) -> GradientProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queue ---------------------------------------------------------------------------

    def _enqueue(self, item: _Pending) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("producer is closed")
            if item.kind == "step" and len(self._queue) >= self.settings.queue_size:
                wait = self.settings.enqueue_timeout_s
                if wait > 0:
                    self._cond.wait_for(
                        lambda: len(self._queue) < self.settings.queue_size, timeout=wait
                    )
                if len(self._queue) >= self.settings.queue_size:
                    self._drop_oldest_step()
            self._queue.append(item)
            self._cond.notify_all()

    def _drop_oldest_step(self) -> None:
        for i, pending in enumerate(self._queue):
            if pending.kind == "step":
                del self._queue[i]
                self._dropped += 1
                return

    # -- sender thread -------------------------------------------------------------------

    def _sender_loop(self) -> None:
        backoff = 0.1
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing and not self._queue:
                    return
                if self._kafka is None:
                    self._busy = False
            if self._kafka is None and not self._connect():
                # Back off for the full period: new summaries notify the condition, and
                # waking on each would retry the connection (and take the GIL) every step.
                retry_at = time.monotonic() + backoff
                with self._cond:
                    while not self._closing and time.monotonic() < retry_at:
                        self._cond.wait(retry_at - time.monotonic())
                    if self._closing:
                        return
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            with self._cond:
                if not self._queue:
                    continue
                item = self._queue.popleft()
                self._busy = True
                self._cond.notify_all()  # room in the queue for a waiting record_step
            try:
                self._send(item)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _connect(self) -> bool:
        from kafka import KafkaProducer

        s = self.settings

        def producer(batch_size: int) -> Any:
            return KafkaProducer(
                **s.kafka_kwargs(),
                acks=-1 if s.acks == "all" else int(s.acks),
                enable_idempotence=s.enable_idempotence,
                compression_type=None if s.compression_type == "none" else s.compression_type,
                linger_ms=s.linger_ms,
                batch_size=batch_size,
                max_request_size=s.max_request_size,
                delivery_timeout_ms=s.delivery_timeout_ms,
                request_timeout_ms=s.request_timeout_ms,
                max_block_ms=s.max_block_ms,
            )

        try:
            # Connect first (an unreachable broker fails here, once), then read the limit.
            batch_size = min(s.batch_size, s.message_max_bytes, s.max_request_size)
            kafka = producer(batch_size)
            limit = min(self._cluster_limit(), s.max_request_size)
            if limit < batch_size:
                # A batch larger than the limit is refused as a whole: keep batches below it.
                kafka.close(timeout=0)
                kafka = producer(limit)
            self._kafka = kafka
            self.value_limit = limit - _RECORD_OVERHEAD - len(self.run_id.encode())
            return True
        except Exception as exc:  # broker unreachable: keep queueing, retry with backoff
            if str(exc) != self._last_error:
                log.warning("cannot connect to Kafka at %s yet: %s", s.bootstrap_servers, exc)
                self._last_error = str(exc)
            return False

    def _cluster_limit(self) -> int:
        """The topic's ``max.message.bytes`` (its own or the broker's default), read with
        the admin client; ``settings.message_max_bytes`` when it cannot be read (no
        DescribeConfigs permission, topic not created yet)."""
        s = self.settings
        try:
            from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

            admin = KafkaAdminClient(**s.kafka_kwargs(),
                                     request_timeout_ms=min(s.request_timeout_ms, 10_000))
            try:
                found = admin.describe_configs(
                    [ConfigResource(ConfigResourceType.TOPIC, s.topic, ["max.message.bytes"])],
                    config_filter="all",
                )
            finally:
                admin.close()
            entry = found["topic"][s.topic]["max.message.bytes"]
            value = int(entry["value"] if isinstance(entry, dict) else entry)
            log.debug("topic %s: max.message.bytes = %d", s.topic, value)
            return value
        except Exception as exc:  # any failure: the documented fallback
            log.info("cannot read max.message.bytes of %s (%s); assuming %d bytes", s.topic,
                     exc, s.message_max_bytes)
            return s.message_max_bytes

    def _encode(self, item: _Pending) -> list[bytes]:
        """The record values of one queued item: one, or the parts of a StepSummary too
        large for ``value_limit`` (layer ranges halved until each part fits; a single
        layer that alone does not fit is dropped, counted in ``oversized_dropped`` and in
        ``failed``, and logged)."""
        message = self._build(item)
        value = encode_message(message, self.settings.wire_format)
        limit = self.value_limit
        if limit is None or len(value) <= limit or not isinstance(message, StepSummary):
            return [value]
        n = len(message.layer_indices)
        k = min(n, -(-len(value) // max(int(limit * 0.9), 1)))
        edges = np.linspace(0, n, k + 1).astype(int).tolist()
        bounds = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
        dropped: list[tuple[int, int]] = []
        while True:
            values = [encode_message(part, self.settings.wire_format)
                      for part in split_step_summary(message, bounds)] if bounds else []
            over = {i for i, v in enumerate(values) if len(v) > limit}
            if not over:
                break
            refined: list[tuple[int, int]] = []
            for i, (a, b) in enumerate(bounds):
                if i not in over:
                    refined.append((a, b))
                elif b - a > 1:
                    mid = (a + b) // 2
                    refined.extend([(a, mid), (mid, b)])
                else:
                    dropped.append((a, b))
            bounds = refined
        if dropped:
            layers = [message.layer_indices[a] for a, _b in dropped]
            log.error("gradstream: step %d rank %d: %d layer(s) (layer_index %s) each alone "
                      "exceed the %d-byte message limit; their statistics for this step are "
                      "dropped", message.step, self.rank, len(layers),
                      ", ".join(map(str, layers[:10])) + (", ..." if len(layers) > 10 else ""),
                      limit)
            with self._cond:
                self.oversized_dropped += len(dropped)
                self._failed += len(dropped)
        if len(values) > 1:
            log.debug("step %d rank %d: %d bytes sent as %d parts", message.step, self.rank,
                      len(value), len(values))
        return values

    def _build(self, item: _Pending) -> StepSummary | RunStarted | RunFinished:
        if item.kind != "step":
            return item.payload
        step, wall_time, indices, summaries, extra = item.payload
        assert isinstance(summaries, LayerSummaries)
        optional: dict[str, Any] = {}
        hist = getattr(summaries, "exp_hist", None)
        if hist is not None:
            optional.update(_sparse_histogram("exp_hist", hist))
        if extra is not None:
            optional.update(
                weight_sum_sq=extra.sum_sq.tolist(), weight_sum=extra.sum.tolist(),
                weight_sum_cube=extra.sum_cube.tolist(), weight_sum_quad=extra.sum_quad.tolist(),
                weight_min=extra.min.tolist(), weight_max=extra.max.tolist(),
                weight_nonfinite=extra.nonfinite.tolist(),
                **_sparse_histogram("weight_exp_hist", extra.exp_hist),
            )
            if extra.update_sum_sq is not None:
                optional["update_sum_sq"] = extra.update_sum_sq.tolist()
        nan = getattr(summaries, "nan", None)
        if nan is not None and summaries.nonfinite.any():
            # wire schema 1.7: the NaN among the non-finite elements, sent only when there
            # are some (without it a layer with nonfinite = 0 has no NaN either)
            optional["nan"] = nan.tolist()
        if summaries.shard_index is not None and summaries.shard_count is not None:
            optional.update(shard_index=summaries.shard_index.tolist(),
                            shard_count=summaries.shard_count.tolist())
        local = summaries.local
        if local is not None:
            keep = [i for i, n in enumerate(local.names) if n in self._layer_index]
            if keep:
                sel = np.asarray(keep, np.int64)
                assert local.sum_abs is not None and local.max_abs is not None
                optional.update(
                    local_layer_indices=[self._layer_index[local.names[i]] for i in keep],
                    local_numel=local.numel[sel].tolist(),
                    local_sum_abs=local.sum_abs[sel].tolist(),
                    local_sum_sq=local.sum_sq[sel].tolist(),
                    local_max_abs=local.max_abs[sel].tolist(),
                    local_nonfinite=local.nonfinite[sel].tolist(),
                )
        return StepSummary(
            run_id=self.run_id,
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            wall_time=wall_time,
            layer_indices=indices.tolist(),
            numel=summaries.numel.tolist(),
            sum_abs=None if summaries.sum_abs is None else summaries.sum_abs.tolist(),
            sum_sq=summaries.sum_sq.tolist(),
            max_abs=None if summaries.max_abs is None else summaries.max_abs.tolist(),
            nonfinite=summaries.nonfinite.tolist(),
            **optional,
        )

    def _send(self, item: _Pending) -> None:
        try:
            values = self._encode(item)
        except Exception as exc:
            log.error("could not encode a %s message: %s", item.kind, exc)
            with self._cond:
                self._failed += 1
            return
        for value in values:
            try:
                future = self._kafka.send(self.settings.topic, key=self.run_id.encode(),
                                          value=value)
            except Exception as exc:
                log.error("could not send a %s message: %s", item.kind, exc)
                with self._cond:
                    self._failed += 1
                continue
            with self._cond:
                self._in_flight += 1
            future.add_callback(self._on_sent)
            future.add_errback(self._on_failed)

    def _on_sent(self, _metadata: object) -> None:
        with self._cond:
            self._sent += 1
            self._in_flight -= 1

    def _on_failed(self, exc: BaseException) -> None:
        log.error("Kafka did not accept a gradstream message: %s", exc)
        with self._cond:
            self._failed += 1
            self._in_flight -= 1


_RECORD_OVERHEAD = 512
"""Bytes kept free below the message limit for the record batch and record headers
(61 + about 30 bytes in Kafka's v2 format) besides the key."""


def _sparse_histogram(prefix: str, hist: np.ndarray) -> dict[str, list[int]]:
    """CSR wire form (``<prefix>_offsets/_columns/_counts``) of an int64[k, B] histogram."""
    rows, cols = np.nonzero(hist)
    offsets = np.zeros(hist.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=hist.shape[0]), out=offsets[1:])
    return {
        f"{prefix}_offsets": offsets.tolist(), f"{prefix}_columns": cols.tolist(),
        f"{prefix}_counts": hist[rows, cols].tolist(),
    }
