"""The consumer loop's commit protocol around rebalances (consumer.loop), with a recording
output: which commit a revocation makes."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from consumer.loop import ConsumerLoop
from consumer.outputs.base import Output
from consumer.store_writer_settings import StoreWriterSettings

TopicPartition = namedtuple("TopicPartition", "topic partition")


class SeekingConsumer:
    """The one consumer call the loop makes itself on revocation: ``seek``, recorded."""

    def __init__(self) -> None:
        self.seeks: list[tuple[Any, int]] = []

    def seek(self, tp: Any, offset: int) -> None:
        self.seeks.append((tp, offset))
Record = namedtuple("Record", "topic partition offset value key")


class RecordingOutput(Output):
    """An output that keeps what it was asked to do."""

    def __init__(self) -> None:
        self.writes: list[dict] = []
        self.acks: list[tuple[dict, bool]] = []
        self.durable = True  # False: the last write is still in flight (write-behind)
        self.waits = 0

    def stored_offsets(self, topics: Any) -> None:
        return None

    def write(self, batch: Any) -> None:
        self.writes.append(dict(batch.offsets))

    def settle(self, wait: bool) -> bool:
        if wait:
            self.waits += 1
            self.durable = True
        return self.durable

    def acknowledge(self, consumer: Any, offsets: dict, blocking: bool = True) -> None:
        self.acks.append((dict(offsets), blocking))

    def close(self) -> None:
        pass


class CountingLoop(ConsumerLoop):
    """Every record is simply consumed (no rows)."""

    def open_output(self) -> RecordingOutput:
        return RecordingOutput()

    def topics(self) -> list[str]:
        return ["t"]

    def handle(self, record: Any, message: Any = None) -> None:
        return None


def test_revocation_writes_then_commits_without_blocking() -> None:
    """kafka-python 3 runs rebalance callbacks on its network thread and refuses blocking
    calls there (a synchronous commit in ``on_partitions_revoked`` stopped a scale-out
    worker): the flush on revocation writes first, then commits asynchronously; a flush
    from the poll loop commits synchronously."""
    loop = CountingLoop(StoreWriterSettings())
    loop.open()
    loop._consumer = consumer = SeekingConsumer()  # acknowledge only passes it on
    loop.consume(Record("t", 0, 41, b"", b"k"))
    loop.flush()
    loop.consume(Record("t", 0, 42, b"", b"k"))
    loop.on_revoked([TopicPartition("t", 0)])
    out = loop.output
    assert out.writes == [{("t", 0): 42}, {("t", 0): 43}]
    assert out.acks == [({("t", 0): 42}, True), ({("t", 0): 43}, False)]
    assert consumer.seeks == [(TopicPartition("t", 0), 43)]  # rewound to the stored offset


def test_offsets_are_acknowledged_only_once_their_write_is_durable() -> None:
    """With write-behind the output returns before its transaction commits: the loop
    acknowledges nothing to Kafka until the output says every batch handed to it is
    durable, then the latest offsets of all of them at once; a revocation waits for the
    write in flight and acknowledges at once."""
    loop = CountingLoop(StoreWriterSettings())
    loop.open()
    loop._consumer = SeekingConsumer()
    out = loop.output
    out.durable = False
    loop.consume(Record("t", 0, 10, b"", b"k"))
    loop.flush()
    loop.consume(Record("t", 0, 11, b"", b"k"))
    loop.flush()
    assert out.writes == [{("t", 0): 11}, {("t", 0): 12}]
    assert out.acks == []  # nothing durable yet: nothing acknowledged
    loop.flush()  # nothing new to write, still in flight
    assert out.acks == [] and len(out.writes) == 2
    out.durable = True
    loop.flush()  # the poll cycle's check: now durable
    assert out.acks == [({("t", 0): 12}, True)]
    out.durable = False
    loop.consume(Record("t", 0, 12, b"", b"k"))
    loop.on_revoked([TopicPartition("t", 0)])
    assert out.waits == 1
    assert out.acks[-1] == ({("t", 0): 13}, False)
    assert loop.checkpoint.unacknowledged == {}
