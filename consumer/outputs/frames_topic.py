"""The frames-topic output (scale-out workers): finished frames onto a Kafka topic.

A scale-out worker's batch goes to the frames topic instead of DuckDB
(:class:`FramesTopicOutput`). :class:`FramePublisher` publishes, per flushed batch and in
this order, the new runs' RunStarted, the flight recorders' LocalSummary messages as they
came (JSON, stored by the store writer in ``local_layer_stats``; before the frames, as the
producers queued them before their step's summary, so that the store writer's alert rules
know where NaN/Inf started when they evaluate the frame), the finished frames
(:class:`schemas.wire.MergedFrame`, key = run id, so a run's messages stay ordered in one
partition) and the RunFinished messages; it waits until Kafka
acknowledged all of them (acks=all, idempotent) before the worker commits its offsets, so
a crash in between only republishes frames, which ``gradstream store`` reconciles by their
rank sets (:mod:`consumer.store_writer`). New runs are then recorded in the compacted runs
topic, which a worker reads when it is assigned partitions (:func:`load_runs_topic`). The
runs topic also keeps each refused rank (:class:`RankRefused`: a RunStarted that
contradicted the run's), so that a restarted worker or a partition's new owner still
dead-letters that rank's summaries.

On the topic a frame travels as its merged sums (:func:`frame_to_message`) rather than its
derived fields, so that the store writer recomputes the frame fields with
:func:`consumer.frames.compute_frame` (identical to what a single-process worker stores)
and merges a late rank's frame into a stored partial one exactly; the record value is the
columnar binary form (:func:`encode_frame`, ``schemas.wire.encode_binary``), which
:func:`schemas.wire.decode_frame_message` reads as it reads JSON.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from consumer.frames import GradientFrame, MergedShards
from consumer.merge import VIOLATION_NUMEL
from consumer.outputs.base import Batch, KnownState, Output, PartitionKey, commit_offsets
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from schemas.stats.csr import csr_from_dense
from schemas.wire import (
    MAX_MESSAGE_BYTES,
    MergedFrame,
    RunStarted,
    WireError,
    WireFormat,
    decode_message,
    encode_message,
    rank_scalar_fields,
)

log = logging.getLogger("gradstream.consumer")


def _csr(hist: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """(offsets, columns, counts) of an int64[n, B] histogram as lists for the wire
    (:func:`schemas.stats.csr.csr_from_dense`)."""
    offsets, columns, counts = csr_from_dense(hist)
    return offsets.tolist(), columns.tolist(), counts.tolist()


def _all_known(values: np.ndarray | None) -> bool:
    return values is not None and not np.isnan(values).any()


def frame_to_message(frame: GradientFrame) -> MergedFrame:
    """The merged sums of ``frame`` as a MergedFrame.

    An optional statistic (sum_abs/max_abs, the NaN count, histogram, weight norms, weight
    distribution) is included only when it is known for every layer of the frame; otherwise
    it is left out for the whole frame (a layer-mixed frame only arises when ranks of one
    run use different producer settings). The frame's per-rank local view rows travel
    along (``local_ranks``). So do the frame's layout violations that its sums
    cannot show (the worker's ledger rows: replicas of another numel, other shard counts;
    the ``numel`` kind the store checks again from the sums), its refused ranks, its
    disagreeing replicas and the ranks whose summaries held NaN/Inf (wire 1.11: the store
    writer's ``replica_divergence`` and ``nonfinite`` alerts name them), and its training
    scalars (wire 1.12).

    Raises:
        pydantic.ValidationError: the frame violates the wire contract (a bug upstream).
    """
    optional: dict[str, object] = {}
    if _all_known(frame.sum_abs) and _all_known(frame.max_abs_grad):
        optional.update(sum_abs=frame.sum_abs.tolist(), max_abs=frame.max_abs_grad.tolist())
    if frame.nan is not None and frame.nonfinite.any() and (frame.nan >= 0).all():
        optional["nan"] = frame.nan.tolist()  # known for every layer
    if frame.exp_hist is not None and (frame.exp_hist[:, 0] >= 0).all():
        off, cols, counts = _csr(frame.exp_hist)
        optional.update(exp_hist_offsets=off, exp_hist_columns=cols, exp_hist_counts=counts)
    if _all_known(frame.weight_sum_sq):
        optional["weight_sum_sq"] = frame.weight_sum_sq.tolist()  # type: ignore[union-attr]
        if _all_known(frame.update_sum_sq):
            optional["update_sum_sq"] = frame.update_sum_sq.tolist()  # type: ignore[union-attr]
        if _all_known(frame.weight_sum) and frame.weight_exp_hist is not None:
            off, cols, counts = _csr(frame.weight_exp_hist)
            optional.update(
                weight_sum=frame.weight_sum.tolist(),  # type: ignore[union-attr]
                weight_sum_cube=frame.weight_sum_cube.tolist(),  # type: ignore[union-attr]
                weight_sum_quad=frame.weight_sum_quad.tolist(),  # type: ignore[union-attr]
                weight_min=frame.weight_min.tolist(),  # type: ignore[union-attr]
                weight_max=frame.weight_max.tolist(),  # type: ignore[union-attr]
                weight_nonfinite=frame.weight_nonfinite.tolist(),  # type: ignore[union-attr]
                weight_exp_hist_offsets=off, weight_exp_hist_columns=cols,
                weight_exp_hist_counts=counts,
            )
    local = frame.local
    if local is not None and len(local):
        optional.update(
            local_ranks=local.rank.tolist(), local_layer_indices=local.layer_index.tolist(),
            local_numel=local.numel.tolist(), local_sum_abs=local.sum_abs.tolist(),
            local_sum_sq=local.sum_sq.tolist(), local_max_abs=local.max_abs.tolist(),
            local_nonfinite=local.nonfinite.tolist(),
        )
    ledger = frame.layout_violations[frame.layout_violations[:, 1] != VIOLATION_NUMEL]
    if len(ledger):
        optional["layout_violations"] = ledger.ravel().tolist()
    if frame.refused_ranks:
        optional["refused_ranks"] = sorted(frame.refused_ranks)
    if len(frame.replica_divergence):  # what only the worker saw (wire 1.11)
        optional["replica_divergence"] = frame.replica_divergence.astype(np.int64).ravel().tolist()
    if len(frame.nonfinite_pieces):
        optional["nonfinite_pieces"] = frame.nonfinite_pieces.ravel().tolist()
    if frame.scalars:
        optional["scalars"] = frame.scalars
    ranks = sorted(frame.ranks_seen)
    rows = frame.rank_scalars
    if rows is not None and len(rows):
        optional.update(rank_scalar_fields(rows, np.asarray(ranks, np.int64)))
    return MergedFrame(
        run_id=frame.run_id, step=frame.step, rank=ranks[0], world_size=frame.world_size,
        wall_time=frame.wall_time, ranks_seen=ranks,
        layer_indices=frame.layer_index.tolist(), numel=frame.numel.tolist(),
        sum_sq=frame.sum_sq.tolist(), nonfinite=frame.nonfinite.tolist(), **optional,
    )


def encode_frame(frame: GradientFrame, wire_format: WireFormat = "binary") -> bytes:
    """The record value of ``frame`` on the frames topic: its MergedFrame
    (:func:`frame_to_message`) in the columnar binary form (default) or as JSON.

    Raises:
        schemas.wire.WireError: the encoded frame exceeds ``MAX_MESSAGE_BYTES``.
        pydantic.ValidationError: as :func:`frame_to_message`.
    """
    return encode_message(frame_to_message(frame), wire_format)


def message_to_merged(message: MergedFrame, num_layers: int) -> MergedShards:
    """The MergedShards of a MergedFrame over a run's ``num_layers`` layers: every
    statistic it carries (:meth:`consumer.frames.MergedShards.from_message`), zero in the
    layers it does not report."""
    return MergedShards.from_message(message, num_layers)


def message_violations(message: MergedFrame) -> np.ndarray:
    """int64[v, 5] layout-violation rows (layer_index, kind, rank, got, expected) a
    MergedFrame carries (none when it carries no ``layout_violations``)."""
    if message.layout_violations is None:
        return np.empty((0, 5), np.int64)
    return np.asarray(message.layout_violations, np.int64).reshape(-1, 5)


REFUSED_KEY = b"\x00refused\x00"
"""Separator of a :class:`RankRefused` record's key on the runs topic: ``run_id``, this,
then the rank in decimal (one record per (run, rank) survives compaction). A RunStarted's
key is its run id alone, and a run id holds no NUL byte in practice."""


class RankRefused(BaseModel):
    """A rank of a run whose RunStarted was refused (it contradicted the run's), kept in the
    compacted runs topic by scale-out workers (JSON). Consumer-internal: producers never
    send it; :func:`load_runs_topic` skips an unusable one with a warning."""

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

    def publish(self, batch: Batch, timeout_s: float = 60.0) -> None:
        """Publish a batch and wait for Kafka's acknowledgement of every message.

        Raises:
            kafka.errors.KafkaError: a message was not acknowledged within ``timeout_s``.
        """
        futures: list[Any] = []
        send = self._producer.send
        for started in batch.runs_started:
            futures.append(send(self.frames_topic, key=started.run_id.encode(),
                                value=encode_message(started)))
        for local in batch.local_summaries:  # before the frames: the store's rules learn
            futures.append(send(self.frames_topic, key=local.run_id.encode(),  # the origin
                                value=encode_message(local)))
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


class FramesTopicOutput(Output):
    """Batches onto the frames topic (:class:`FramePublisher`): every frame acknowledged
    by the frames topic, then the offsets committed to Kafka synchronously: the group's
    committed offsets are the positions.

    Args:
        settings: a worker's ConsumerSettings with ``frames_topic`` set.

    Raises:
        kafka.errors.KafkaError: the cluster cannot be reached.
    """

    name = "frames_topic"
    frame_rules = False
    """The store writer evaluates the alert rules, in step order (a run's steps may be
    spread over the workers: ``ProducerSettings.partition_key="step"``)."""

    def __init__(self, settings: ConsumerSettings) -> None:
        self.settings = settings
        self.publisher = FramePublisher(settings)

    @classmethod
    def from_settings(cls, settings: ConsumerSettings) -> FramesTopicOutput:
        """Create the frames topic and the compacted runs topic if absent, then the
        output.

        Raises:
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        assert settings.frames_topic is not None
        ensure_topics(settings, [settings.frames_topic])
        ensure_topics(settings, [settings.runs_topic], compacted=True)
        return cls(settings)

    def describe(self) -> str:
        """The frames topic."""
        return f"frames topic {self.settings.frames_topic}"

    def assign(self) -> KnownState:
        """The runs and refused ranks kept in the compacted runs topic; the incidents are
        read back from the alerts topic (``incidents`` None).

        Raises:
            TimeoutError: the runs topic could not be read to its end.
        """
        started, refused = load_runs_topic(self.settings)
        return KnownState(runs_started=started,
                          refusals=[(r.run_id, r.rank, r.reason) for r in refused])

    def stored_offsets(self, topics: Iterable[str]) -> None:
        """None: the consumer group's committed offsets are the positions."""
        return None

    def write(self, batch: Batch) -> None:
        """Publish the batch and wait for Kafka's acknowledgement of every message.

        Timed (:meth:`Output.timed_write`) from the first send to the last
        acknowledgement.

        Raises:
            kafka.errors.KafkaError: a message was not acknowledged.
        """
        with self.timed_write():
            self.publisher.publish(batch)

    def settle(self, wait: bool) -> bool:
        """True: :meth:`write` returns once Kafka acknowledged every frame."""
        return True

    def acknowledge(self, consumer: Any, offsets: dict[PartitionKey, int],
                    blocking: bool = True) -> None:
        """Commit the offsets: synchronously, or asynchronously when ``blocking`` is False
        (inside a rebalance callback, which kafka-python 3 runs on its network thread
        where a blocking call is refused; the frames are on the topic already, so a
        commit lost there only makes the next owner republish them).

        Raises:
            kafka.errors.KafkaError: the synchronous commit failed; a replay only
                republishes the frames (the store writer reconciles).
        """
        commit_offsets(consumer, offsets, sync=blocking)

    def close(self) -> None:
        """Deliver what is pending and close the producer."""
        self.publisher.close()
