"""The commit protocol (consumer.checkpoint.Checkpoint) on its own, with a recording output:
the numbered steps of its docstring."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from consumer.checkpoint import Checkpoint
from consumer.outputs.base import Batch, Output

TopicPartition = namedtuple("TopicPartition", "topic partition")


class RecordingOutput(Output):
    """An output that keeps the order of what it was asked to do."""

    def __init__(self, stored: dict | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.durable = True
        self.stored = stored

    def stored_offsets(self, topics: Any) -> dict | None:
        return self.stored

    def write(self, batch: Batch) -> None:
        self.calls.append(("write", dict(batch.offsets)))

    def settle(self, wait: bool) -> bool:
        if wait:
            self.durable = True
        return self.durable

    def acknowledge(self, consumer: Any, offsets: dict, blocking: bool = True) -> None:
        self.calls.append(("acknowledge", dict(offsets)))

    def close(self) -> None:
        pass


def test_steps_in_order_and_offsets_never_pass_a_pending_frame() -> None:
    """Dead letters are flushed before the write (3), the stored offset stops at the first
    record of a pending frame (1), and the offsets are acknowledged after the write (5)."""
    checkpoint, out = Checkpoint(1.0, 1000), RecordingOutput()
    checkpoint.consumed("t", 0, 9)
    checkpoint.consumed("t", 1, 4)
    written = checkpoint.commit(out, object(), {("t", 0): 7},
                                lambda: out.calls.append(("dead letters", None)))
    assert written is not None and written.offsets == {("t", 0): 7, ("t", 1): 5}
    assert [c for c, _ in out.calls] == ["dead letters", "write", "acknowledge"]
    assert checkpoint.stored == {("t", 0): 7, ("t", 1): 5}
    assert checkpoint.unacknowledged == {} and not checkpoint.batch


def test_nothing_new_writes_nothing() -> None:
    """Step 2: with neither rows nor changed offsets, nothing is written."""
    checkpoint, out = Checkpoint(1.0, 1000), RecordingOutput()
    checkpoint.consumed("t", 0, 3)
    checkpoint.commit(out, object(), {}, lambda: None)
    out.calls.clear()
    assert checkpoint.commit(out, object(), {}, lambda: None) is None
    assert out.calls == []


def test_offsets_wait_until_the_output_says_they_are_durable() -> None:
    """Step 5: a write still in flight acknowledges nothing; a later acknowledge does."""
    checkpoint, out = Checkpoint(1.0, 1000), RecordingOutput()
    out.durable = False
    checkpoint.consumed("t", 0, 0)
    checkpoint.commit(out, object(), {}, lambda: None)
    assert out.calls == [("write", {("t", 0): 1})]
    assert checkpoint.unacknowledged == {("t", 0): 1}
    out.durable = True
    checkpoint.acknowledge(out, object(), blocking=True, wait=False)
    assert out.calls[-1] == ("acknowledge", {("t", 0): 1})
    assert checkpoint.unacknowledged == {}


def test_assignment_seeks_to_the_stored_offsets_and_revocation_forgets() -> None:
    """Step 0: each assigned partition is sought to its stored offset, or the beginning."""

    class Consumer:
        def __init__(self) -> None:
            self.seeks: list[tuple[Any, Any]] = []

        def seek(self, tp: Any, offset: int) -> None:
            self.seeks.append((tp, offset))

        def seek_to_beginning(self, tp: Any) -> None:
            self.seeks.append((tp, "beginning"))

    checkpoint, consumer = Checkpoint(1.0, 1000), Consumer()
    parts = [TopicPartition("t", 0), TopicPartition("t", 1)]
    checkpoint.assign(RecordingOutput({("t", 0): 12}), consumer, parts)
    assert consumer.seeks == [(parts[0], 12), (parts[1], "beginning")]
    assert checkpoint.stored == {("t", 0): 12}
    checkpoint.consumed("t", 0, 12)
    checkpoint.revoke({("t", 0)})
    assert checkpoint.stored == {} and checkpoint.positions == {}
    other = Consumer()
    checkpoint.assign(RecordingOutput(None), other, parts)
    assert other.seeks == []


def test_due_on_rows_or_on_the_interval_once_the_output_is_settled() -> None:
    """A commit is due once ``max_batch_rows`` layer rows wait; otherwise only after
    ``flush_interval_s`` and while the output has no write in flight."""
    out = RecordingOutput()
    checkpoint = Checkpoint(3600.0, 10)
    checkpoint.started(5)
    assert not checkpoint.due(out, 14)
    assert checkpoint.due(out, 15)
    waiting = Checkpoint(0.0, 10)
    out.durable = False
    assert not waiting.due(out, 0)
    out.durable = True
    assert waiting.due(out, 0)


def test_revocation_rewinds_to_the_stored_offset() -> None:
    """A partition being revoked is sought back to the offset the revocation's commit
    stored (the first record of a frame still waiting for ranks): kafka-python keeps the
    position of a partition the same rebalance assigns again, and the frames topic output
    does not seek on assignment, so the forgotten frame's records must be read again."""

    class Consumer:
        def __init__(self) -> None:
            self.seeks: list[tuple[Any, int]] = []

        def seek(self, tp: Any, offset: int) -> None:
            self.seeks.append((tp, offset))

    checkpoint, out, consumer = Checkpoint(1.0, 1000), RecordingOutput(None), Consumer()
    parts = [TopicPartition("t", 0), TopicPartition("t", 1)]
    for offset in range(10):
        checkpoint.consumed("t", 0, offset)
    checkpoint.commit(out, consumer, {("t", 0): 6}, lambda: None, settle=True)
    checkpoint.rewind(consumer, parts)  # ("t", 1): nothing read, nothing to rewind
    assert consumer.seeks == [(parts[0], 6)]
    checkpoint.revoke({("t", 0), ("t", 1)})
    checkpoint.assign(out, consumer, parts)  # no stored offsets: the positions stay
    assert consumer.seeks == [(parts[0], 6)]
