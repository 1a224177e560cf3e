"""The consumer loop's commit protocol around rebalances (consumer.loop), with a recording
output: which commit a revocation makes."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from consumer.loop import ConsumerLoop
from consumer.store_settings import StoreSettings

TopicPartition = namedtuple("TopicPartition", "topic partition")
Record = namedtuple("Record", "topic partition offset value key")


class RecordingOutput:
    """A FrameOutput that keeps what it was asked to do."""

    sink = None

    def __init__(self) -> None:
        self.writes: list[dict] = []
        self.acks: list[tuple[dict, bool]] = []

    def stored_offsets(self, topics: Any) -> None:
        return None

    def write(self, batch: Any) -> None:
        self.writes.append(dict(batch.offsets))

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

    def handle(self, record: Any) -> None:
        return None


def test_revocation_writes_then_commits_without_blocking() -> None:
    """kafka-python 3 runs rebalance callbacks on its network thread and refuses blocking
    calls there (a synchronous commit in ``on_partitions_revoked`` stopped a scale-out
    worker): the flush on revocation writes first, then commits asynchronously; a flush
    from the poll loop commits synchronously."""
    loop = CountingLoop(StoreSettings())
    loop.open()
    loop._consumer = object()  # acknowledge only passes it on
    loop.consume(Record("t", 0, 41, b"", b"k"))
    loop.flush()
    loop.consume(Record("t", 0, 42, b"", b"k"))
    loop.on_revoked([TopicPartition("t", 0)])
    out = loop.output
    assert out.writes == [{("t", 0): 42}, {("t", 0): 43}]
    assert out.acks == [({("t", 0): 42}, True), ({("t", 0): 43}, False)]
