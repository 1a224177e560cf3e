"""The bounded queue between the training thread and Kafka, and the sender thread that
empties it.

The training thread appends; a daemon thread connects (retrying with backoff while the
broker is unreachable), builds and encodes each message and hands it to kafka-python.
When the queue is full the oldest pending *step* or local summary is dropped and counted;
run start and finish messages are never dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from producer.settings import ProducerSettings
from producer.transport.encoding import LocalRecord, StepRecord, encode_within
from producer.transport.kafka import connect, longest_key, record_key
from schemas.wire import LocalSummary, RunFinished, RunStarted, StepSummary

log = logging.getLogger("gradstream.producer")


@dataclass(slots=True)
class Pending:
    """One queued message: a run start or finish (built), or a step or a local-view entry
    (``"local"``, a flight recorder's; both built on the sender thread)."""

    kind: Literal["start", "step", "finish", "local"]
    payload: RunStarted | StepRecord | RunFinished | LocalRecord


_DROPPABLE = frozenset({"step", "local"})
"""Kinds of queued items a full queue may drop (oldest first)."""


class DeliveryCounts(NamedTuple):
    """The sender's counters (messages, not bytes); see ``producer.client.ProducerStats``."""

    sent: int
    dropped: int
    failed: int
    queued: int
    in_flight: int


class Sender:
    """A bounded message queue and the daemon thread that sends it to Kafka.

    Args:
        settings: the producer's settings (``queue_size``, ``enqueue_timeout_s``,
            ``topic``, ``wire_format``, the Kafka client settings).
        run_id: the run's id; each record's key is
            :func:`producer.transport.kafka.record_key` of it (``settings.partition_key``:
            the run id, or ``run_id/step`` for a StepSummary).
        build_step: turns a :class:`StepRecord` into its ``StepSummary`` and a
            :class:`LocalRecord` into its ``LocalSummary`` (called on the sender thread).
        name: the thread's name.

    Attributes:
        value_limit: largest record value sent (bytes), set when it connects; None before.
        oversized_dropped: layer ranges of steps dropped because one layer alone exceeds
            ``value_limit``.
    """

    def __init__(
        self, settings: ProducerSettings, run_id: str,
        build_step: Callable[[StepRecord | LocalRecord], StepSummary | LocalSummary],
        name: str,
    ) -> None:
        self.settings = settings
        self.run_id = run_id
        self.key = record_key(run_id, settings.partition_key)
        """The key of messages keyed by run (all of them with ``partition_key="run"``)."""
        self.build_step = build_step
        self.value_limit: int | None = None
        self.oversized_dropped = 0
        self._queue: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._sent = 0
        self._dropped = 0
        self._failed = 0
        self._in_flight = 0
        self._kafka: Any = None
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` began."""
        return self._closing

    def counts(self) -> DeliveryCounts:
        """The counters now (thread-safe snapshot)."""
        with self._cond:
            return DeliveryCounts(self._sent, self._dropped, self._failed, len(self._queue),
                                  self._in_flight)

    def put(self, item: Pending) -> None:
        """Queue ``item``. A step or local entry finding the queue full waits at most
        ``settings.enqueue_timeout_s`` for room, then the oldest queued step or local entry
        is dropped and counted.

        Raises:
            RuntimeError: the sender is closed.
        """
        queue_size = self.settings.queue_size
        with self._cond:
            if self._closing:
                raise RuntimeError("producer is closed")
            if item.kind in _DROPPABLE and len(self._queue) >= queue_size:
                wait = self.settings.enqueue_timeout_s
                if wait > 0:
                    self._cond.wait_for(lambda: len(self._queue) < queue_size, timeout=wait)
                if len(self._queue) >= queue_size:
                    self._drop_oldest_step()
            self._queue.append(item)
            self._cond.notify_all()

    def _drop_oldest_step(self) -> None:
        for i, pending in enumerate(self._queue):
            if pending.kind in _DROPPABLE:
                del self._queue[i]
                self._dropped += 1
                return

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty and Kafka acknowledged every message handed to it.

        Args:
            timeout: seconds.

        Returns:
            True if everything was delivered (or failed/dropped and counted) in time.
        """
        deadline = time.monotonic() + timeout
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

    def close(self, timeout: float) -> None:
        """Stop the thread (what is still queued stays unsent) and close the Kafka client;
        never raises.

        Args:
            timeout: seconds the Kafka client may take to close.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        if self._kafka is not None:
            try:
                self._kafka.close(timeout=timeout)
            except Exception as exc:  # closing must never raise into training code
                log.warning("error closing the Kafka producer: %s", exc)

    def encode(self, item: Pending) -> list[bytes]:
        """The record values of one queued item (:func:`encode_within`); a layer that alone
        exceeds ``value_limit`` is left out, counted in ``oversized_dropped`` and in the
        failed messages, and logged."""
        payload = item.payload
        message = (self.build_step(payload) if isinstance(payload, StepRecord | LocalRecord)
                   else payload)
        values, oversized = encode_within(message, self.settings.wire_format,
                                          self.value_limit)
        if oversized:
            assert isinstance(message, StepSummary | LocalSummary)
            log.error("gradstream: %s of step %d rank %d: %d layer(s) (layer_index %s) each "
                      "alone exceed the %d-byte message limit; their statistics for this step "
                      "are dropped", message.type, message.step, message.rank, len(oversized),
                      ", ".join(map(str, oversized[:10]))
                      + (", ..." if len(oversized) > 10 else ""), self.value_limit)
            with self._cond:
                self.oversized_dropped += len(oversized)
                self._failed += len(oversized)
        if len(values) > 1:
            assert isinstance(message, StepSummary | LocalSummary)
            log.debug("step %d rank %d: sent as %d parts", message.step, message.rank,
                      len(values))
        return values

    # -- sender thread -------------------------------------------------------------------

    def _run(self) -> None:
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
                self._cond.notify_all()  # room in the queue for a waiting put
            try:
                self._send(item)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _connect(self) -> bool:
        try:
            self._kafka, self.value_limit = connect(
                self.settings, longest_key(self.run_id, self.settings.partition_key))
            return True
        except Exception as exc:  # broker unreachable: keep queueing, retry with backoff
            if str(exc) != self._last_error:
                log.warning("cannot connect to Kafka at %s yet: %s",
                            self.settings.bootstrap_servers, exc)
                self._last_error = str(exc)
            return False

    def _send(self, item: Pending) -> None:
        try:
            values = self.encode(item)
        except Exception as exc:
            log.error("could not encode a %s message: %s", item.kind, exc)
            with self._cond:
                self._failed += 1
            return
        payload = item.payload
        key = (record_key(self.run_id, self.settings.partition_key, payload.step)
               if isinstance(payload, StepRecord) else self.key)
        for value in values:
            try:
                future = self._kafka.send(self.settings.topic, key=key, value=value)
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
