"""The commit protocol of a consumer loop: a batch and its offsets made durable together.

A :class:`Checkpoint` holds what a :class:`consumer.loop.ConsumerLoop` has read since its
last commit: the batch being filled, the next offset to consume per partition read, the
offsets stored with the rows and those written but not yet acknowledged to Kafka. It never
asks which output it writes to (:class:`consumer.outputs.base.Output`).

The loop runs :meth:`Checkpoint.commit` when the checkpoint is :meth:`due
<Checkpoint.due>` (``max_batch_rows`` layer rows wait, or ``flush_interval_s`` has passed,
or the output's own longer ``min_write_interval_s``, and the output has no write in
flight), before partitions are revoked and at stop:

1. For every partition read, the offset to store is the next one to consume, but never
   past the first record of a frame still waiting for ranks (``pending``): a crash then
   rebuilds that frame from Kafka.
2. If neither rows nor changed offsets wait, nothing is written.
3. Dead letters sent so far are flushed to Kafka first, so stored offsets never pass a
   record that is neither stored nor dead-lettered.
4. The output makes the batch durable with those offsets in one step
   (:meth:`Output.write <consumer.outputs.base.Output.write>`): one DuckDB transaction
   (rows and ``kafka_offsets`` together), or every frame acknowledged by the frames topic.
   An output that writes behind (DuckDB) returns while its transaction runs and the loop
   goes on decoding and merging the next batch: ``write`` first waits for the previous
   transaction, so at most one is in flight, and a failed one stops the loop at the next
   write with nothing of it acknowledged.
5. Only once the output says every batch handed to it is durable
   (:meth:`Output.settle <consumer.outputs.base.Output.settle>`) are the offsets
   acknowledged to Kafka (:meth:`acknowledge`: a commit, informational when DuckDB holds
   them, the group's positions themselves when the frames topic is the output). With
   write-behind this happens after the commit, at the first poll cycle that finds the
   transaction committed, or at once when the commit settles (before partitions are
   revoked and at stop, where it waits for the transaction).
6. The stored offsets are remembered (the next batch stores only what changed) and a new
   batch begins.

On assignment (:meth:`assign`, step 0 of the next cycle) each partition is sought to the
offset the output stored, so rows are written exactly once whatever crashes; an output
that stores none (the frames topic) leaves the consumer at the group's committed offsets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from consumer.outputs.base import Batch, Output, PartitionKey


class Checkpoint:
    """The batch being filled and the offsets it covers, committed in the numbered steps
    of the module docstring.

    Args:
        flush_interval_s: seconds between commits when the output has no write in flight.
        max_batch_rows: layer rows put into the batch that make a commit due at once.

    Attributes:
        batch: the batch the loop fills (written and replaced by :meth:`commit`).
        positions: (topic, partition) -> the next offset to consume (after the last
            record handed to the loop).
        stored: (topic, partition) -> the offset stored with the rows (step 6).
        unacknowledged: offsets written but not acknowledged to Kafka yet (step 5).
    """

    def __init__(self, flush_interval_s: float, max_batch_rows: int) -> None:
        self.flush_interval_s = flush_interval_s
        self.max_batch_rows = max_batch_rows
        self.batch = Batch()
        self.positions: dict[PartitionKey, int] = {}
        self.stored: dict[PartitionKey, int] = {}
        self.unacknowledged: dict[PartitionKey, int] = {}
        self._last_commit = time.monotonic()
        self._rows_at_commit = 0  # the loop's layer-row count at the last commit

    def due(self, output: Output | None, layer_rows: int) -> bool:
        """Whether to commit now (checked after every record, so cheap):
        ``max_batch_rows`` layer rows were put into the batch since the last commit
        (``layer_rows``: the loop's running count, an upper bound), or
        ``flush_interval_s`` (or ``output.min_write_interval_s``, when longer:
        :attr:`consumer.outputs.base.Output.min_write_interval_s`) has passed and
        ``output`` has no write in flight. While a
        write-behind transaction runs, the batch keeps growing instead of the loop
        blocking on it, so under load transactions grow to cover the time one takes (a
        DuckDB transaction smaller than a row group costs more per row to commit).

        Raises:
            duckdb.Error: the write in flight failed.
        """
        if layer_rows - self._rows_at_commit >= self.max_batch_rows:
            return True
        interval = self.flush_interval_s
        if output is not None and output.min_write_interval_s > interval:
            interval = output.min_write_interval_s
        if time.monotonic() - self._last_commit < interval:
            return False
        return output is None or output.settle(wait=False)

    def started(self, layer_rows: int) -> None:
        """A commit starts now, with the loop's layer-row count at ``layer_rows``: the
        interval and the row limit of :meth:`due` count from here."""
        self._last_commit = time.monotonic()
        self._rows_at_commit = layer_rows

    def consumed(self, topic: str, partition: int, offset: int) -> None:
        """The record at ``offset`` of (``topic``, ``partition``) was handed to the loop."""
        self.positions[(topic, partition)] = offset + 1

    def commit(self, output: Output, consumer: Any, pending: dict[PartitionKey, int],
               flush_dead_letters: Callable[[], None], blocking: bool = True,
               settle: bool = False) -> Batch | None:
        """Write the batch with its offsets (steps 1-6).

        Args:
            output: where the batch goes.
            consumer: the Kafka consumer the offsets are acknowledged to (None: not yet
                connected, nothing is acknowledged).
            pending: first offset per partition of a frame still waiting for ranks.
            flush_dead_letters: sends the dead letters of the batch to Kafka (step 3).
            blocking: acknowledge synchronously; False inside a rebalance callback
                (kafka-python 3 runs it on its network thread and refuses blocking calls
                there), where the commit is sent asynchronously.
            settle: wait until the output has made every batch durable and acknowledge the
                offsets now (before a revocation and at stop); False: acknowledge them
                once the output says so, here or at a later :meth:`acknowledge`.

        Returns:
            The batch written, or None when nothing was (step 2).

        Raises:
            duckdb.Error / kafka.errors.KafkaError: the write failed (this one, or with
                write-behind the one before); its offsets were not stored, so the
                records are read again after a restart.
        """
        offsets = {}                                                               # 1
        for key, position in self.positions.items():
            target = min(position, pending.get(key, position))
            if self.stored.get(key) != target:
                offsets[key] = target
        batch, batch.offsets = self.batch, offsets
        written = None
        if batch:                                                                  # 2
            flush_dead_letters()                                                   # 3
            output.write(batch)                                                    # 4
            self.unacknowledged.update(offsets)
            self.stored.update(offsets)                                            # 6
            self.batch = Batch()
            written = batch
        if self.unacknowledged or settle:
            self.acknowledge(output, consumer, blocking, wait=settle)              # 5
        return written

    def acknowledge(self, output: Output, consumer: Any, blocking: bool,
                    wait: bool) -> None:
        """Step 5: commit the written offsets to Kafka once the output says every batch
        handed to it is durable (``wait``: block until it is).

        Raises:
            duckdb.Error / kafka.errors.KafkaError: a write failed (nothing acknowledged),
                or a blocking commit to the frames topic's group failed.
        """
        if not output.settle(wait):
            return
        offsets, self.unacknowledged = self.unacknowledged, {}
        if offsets and consumer is not None:
            output.acknowledge(consumer, offsets, blocking)

    def assign(self, output: Output, consumer: Any, partitions: list[Any]) -> None:
        """Step 0: seek every newly assigned partition (kafka ``TopicPartition``) to the
        offset ``output`` stored, or to the beginning; with an output that stores none,
        keep the group's positions."""
        stored = output.stored_offsets({tp.topic for tp in partitions})
        if stored is None:
            return
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in stored:
                consumer.seek(tp, stored[key])
                self.stored[key] = stored[key]
            else:
                consumer.seek_to_beginning(tp)

    def rewind(self, consumer: Any, partitions: list[Any]) -> None:
        """Seek each partition being revoked (kafka ``TopicPartition``, still assigned) back
        to the offset stored for it by the commit that precedes a revocation: the first
        record of its earliest frame still waiting for ranks, a frame the loop then
        forgets. kafka-python keeps the position of a partition that the same rebalance
        assigns again, and an output that stores no offsets (the frames topic) does not
        seek on assignment, so without this the records of the forgotten frames would not
        be read again and those frames would end partial.

        Raises:
            ValueError: a partition is no longer assigned to ``consumer``.
        """
        if consumer is None:
            return
        for tp in partitions:
            offset = self.stored.get((tp.topic, tp.partition))
            if offset is not None:
                consumer.seek(tp, offset)

    def revoke(self, keys: set[PartitionKey]) -> None:
        """Forget the positions and stored offsets of revoked partitions."""
        for key in keys:
            self.positions.pop(key, None)
            self.stored.pop(key, None)
