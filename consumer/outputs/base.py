"""The two places a consumer loop writes its batches (:class:`consumer.loop.FrameOutput`).

- :class:`DuckDBOutput`: rows and offsets in one DuckDB transaction, committed on the
  sink's writer thread (write-behind); the offsets in DuckDB are the positions on restart,
  the Kafka commit only mirrors them for lag monitoring, once the transaction committed.
- :class:`FramesTopicOutput` (scale-out workers): every frame acknowledged by the frames
  topic, then the offsets committed to Kafka synchronously: the group's committed
  offsets are the positions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from consumer.frame_publisher import FramePublisher
from consumer.sink import DuckDBSink, SinkBatch

log = logging.getLogger("gradstream.consumer")

PartitionKey = tuple[str, int]


def _commit(consumer: Any, offsets: dict[PartitionKey, int], sync: bool) -> None:
    from kafka import OffsetAndMetadata, TopicPartition

    commit = {
        TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()
    }
    if sync:
        consumer.commit(commit)
    else:
        consumer.commit_async(commit)


class DuckDBOutput:
    """Batches into a DuckDB file (:class:`consumer.sink.DuckDBSink`).

    Args:
        db: the DuckDB file (created if absent).
        group: the name the offsets are kept under (``kafka_offsets.consumer_group``).

    Raises:
        duckdb.IOException: the file is locked by another process.
    """

    def __init__(self, db: str, group: str) -> None:
        self.sink: DuckDBSink | None = DuckDBSink(db)
        self.group = group

    def stored_offsets(self, topics: Iterable[str]) -> dict[PartitionKey, int]:
        """The offsets written with the rows, per (topic, partition)."""
        assert self.sink is not None
        return {(topic, partition): offset for topic in topics
                for partition, offset in self.sink.load_offsets(self.group, topic).items()}

    def write(self, batch: SinkBatch) -> None:
        """Rows and ``batch.offsets`` in one transaction.

        Raises:
            duckdb.Error: the transaction failed (rolled back).
        """
        assert self.sink is not None
        self.sink.write(batch, self.group)

    def settle(self, wait: bool) -> bool:
        """Whether the sink's write in flight (write-behind) has committed; ``wait``: block
        until it has.

        Raises:
            duckdb.Error: that write failed (rolled back).
        """
        assert self.sink is not None
        if wait:
            self.sink.wait()
            return True
        return self.sink.settled()

    def acknowledge(self, consumer: Any, offsets: dict[PartitionKey, int],
                    blocking: bool = True) -> None:
        """Mirror the stored offsets to Kafka (always asynchronously; a failure is only
        logged: DuckDB holds the positions)."""
        try:
            _commit(consumer, offsets, sync=False)
        except Exception as exc:
            log.debug("offset commit to Kafka failed: %s", exc)

    def close(self) -> None:
        """Finish pending writes and close the file."""
        if self.sink is not None:
            self.sink.close()


class FramesTopicOutput:
    """Batches onto the frames topic (:class:`consumer.frame_publisher.FramePublisher`).

    Args:
        settings: a worker's ConsumerSettings with ``frames_topic`` set.

    Raises:
        kafka.errors.KafkaError: the cluster cannot be reached.
    """

    sink: DuckDBSink | None = None

    def __init__(self, settings: Any) -> None:
        self.publisher = FramePublisher(settings)

    def stored_offsets(self, topics: Iterable[str]) -> None:
        """None: the consumer group's committed offsets are the positions."""
        return None

    def write(self, batch: SinkBatch) -> None:
        """Publish the batch and wait for Kafka's acknowledgement of every message.

        Raises:
            kafka.errors.KafkaError: a message was not acknowledged.
        """
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
                republishes the frames (the store reconciles).
        """
        _commit(consumer, offsets, sync=blocking)

    def close(self) -> None:
        """Deliver what is pending and close the producer."""
        self.publisher.close()
