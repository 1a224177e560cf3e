"""Scale-out mode: a worker's batch goes to the frames topic instead of DuckDB.

:class:`FramePublisher` publishes, per flushed batch and in this order, the new runs'
RunStarted, the finished frames (:class:`schemas.wire.MergedFrame`, key = run id, so a
run's messages stay ordered in one partition) and the RunFinished messages; it waits until
Kafka acknowledged all of them (acks=all, idempotent) before the worker commits its
offsets, so a crash in between only republishes frames (in the columnar binary form,
:func:`consumer.frame_codec.encode_frame`), which the store reconciles by
their rank sets (``consumer.store``). New runs are then recorded in the compacted runs
topic, which a worker reads when it is assigned partitions (:func:`load_runs_topic`). The
runs topic also keeps each refused rank (:class:`RankRefused`: a RunStarted that
contradicted the run's), so that a restarted worker or a partition's new owner still
dead-letters that rank's summaries.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from consumer.frame_codec import encode_frame
from consumer.settings import ConsumerSettings
from consumer.sink import SinkBatch
from schemas.wire import MAX_MESSAGE_BYTES, RunStarted, WireError, decode_message, encode_message

log = logging.getLogger("gradstream.consumer")


REFUSED_KEY = b"\x00refused\x00"
"""Separator of a :class:`RankRefused` record's key on the runs topic: ``run_id``, this,
then the rank in decimal (one record per (run, rank) survives compaction). A RunStarted's
key is its run id alone, and a run id holds no NUL byte in practice."""


class RankRefused(BaseModel):
    """A rank of a run whose RunStarted was refused (it contradicted the run's), kept in the
    compacted runs topic by scale-out workers (JSON). Consumer-internal: producers never
    send it; a worker of a version before it skips it with a warning."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    type: Literal["rank_refused"] = "rank_refused"
    run_id: str
    rank: int
    reason: str

    def key(self) -> bytes:
        """The record key on the runs topic (:data:`REFUSED_KEY`)."""
        return self.run_id.encode() + REFUSED_KEY + str(self.rank).encode()


class FramePublisher:
    """Kafka producer of a scale-out worker (frames topic + runs topic).

    Args:
        settings: the worker's settings; ``frames_topic`` must be set.

    Raises:
        kafka.errors.KafkaError: the cluster cannot be reached.
    """

    def __init__(self, settings: ConsumerSettings) -> None:
        from kafka import KafkaProducer

        assert settings.frames_topic is not None
        self.settings = settings
        self.frames_topic = settings.frames_topic
        self._producer = KafkaProducer(
            **settings.kafka_kwargs(), acks="all", enable_idempotence=True,
            compression_type="zstd", linger_ms=5, batch_size=1024 * 1024,
            max_request_size=MAX_MESSAGE_BYTES + 65536,
        )
        self.frames_published = 0

    def publish(self, batch: SinkBatch, timeout_s: float = 60.0) -> None:
        """Publish a batch and wait for Kafka's acknowledgement of every message.

        Raises:
            kafka.errors.KafkaError: a message was not acknowledged within ``timeout_s``.
        """
        futures: list[Any] = []
        send = self._producer.send
        for started in batch.runs_started:
            futures.append(send(self.frames_topic, key=started.run_id.encode(),
                                value=encode_message(started)))
        for frame, _health in batch.frames.values():
            futures.append(send(self.frames_topic, key=frame.run_id.encode(),
                                value=encode_frame(frame)))
        for finished in batch.runs_finished:
            futures.append(send(self.frames_topic, key=finished.run_id.encode(),
                                value=encode_message(finished)))
        self._wait(futures, timeout_s)
        self.frames_published += len(batch.frames)
        if batch.runs_started or batch.refusals:
            refused = [RankRefused(run_id=run, rank=rank, reason=why)
                       for run, rank, why in batch.refusals]
            self._wait([
                send(self.settings.runs_topic, key=m.run_id.encode(), value=encode_message(m))
                for m in batch.runs_started
            ] + [
                send(self.settings.runs_topic, key=r.key(), value=r.model_dump_json().encode())
                for r in refused
            ], timeout_s)

    def _wait(self, futures: list[Any], timeout_s: float) -> None:
        if not futures:
            return
        self._producer.flush(timeout=timeout_s)
        for future in futures:
            future.get(timeout=0)  # raises the delivery error, if any

    def close(self) -> None:
        """Deliver what is pending and close the producer."""
        self._producer.close(timeout=10)


def load_runs_topic(
    settings: ConsumerSettings, timeout_s: float = 30.0
) -> tuple[list[RunStarted], list[RankRefused]]:
    """Every RunStarted kept in the compacted runs topic (the latest per run id), and every
    refused rank (:class:`RankRefused`, the latest per (run, rank)).

    Reads each partition from the beginning to its end offset at the time of the call,
    with a consumer outside any group.

    Raises:
        TimeoutError: the end offsets were not reached within ``timeout_s``.
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(**settings.kafka_kwargs(), enable_auto_commit=False,
                             group_id=None)
    try:
        parts = consumer.partitions_for_topic(settings.runs_topic) or set()
        tps = [TopicPartition(settings.runs_topic, p) for p in sorted(parts)]
        if not tps:
            return [], []
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        runs: dict[str, RunStarted] = {}
        refused: dict[tuple[str, int], RankRefused] = {}
        deadline = time.monotonic() + timeout_s
        while any(consumer.position(tp) < end[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {settings.runs_topic} took over {timeout_s} s")
            for records in consumer.poll(timeout_ms=200).values():
                for record in records:
                    if record.key is not None and REFUSED_KEY in record.key:
                        try:
                            refusal = RankRefused.model_validate_json(record.value)
                        except ValidationError as exc:
                            log.warning("skipping unusable refusal in %s: %s",
                                        settings.runs_topic, exc.errors()[0]["msg"])
                            continue
                        refused[(refusal.run_id, refusal.rank)] = refusal
                        continue
                    try:
                        message = decode_message(record.value)
                    except WireError as exc:
                        log.warning("skipping unusable record in %s: %s",
                                    settings.runs_topic, exc.reason)
                        continue
                    if isinstance(message, RunStarted):
                        runs[message.run_id] = message
        return list(runs.values()), list(refused.values())
    finally:
        consumer.close()
