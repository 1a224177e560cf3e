"""A rebalance the group leader starts on a metadata change is applied, however long the
revocation takes (consumer.loop, the rebalance listener), against the real broker and a
real DuckDB file.

The leader of a consumer group rebalances by itself when the partitions of its topics
change in its metadata (a fresh group's leader always does once, right after its first
assignment: it joined with an empty metadata snapshot). With kafka-python 3.0.12 such a
rebalance could lose its assignment (ARCHITECTURE.md, "The consumer loop and its commit
protocol"): when the revocation listener outlasted the poll's timeout and the join then
completed before the next poll, that poll no longer saw a rejoin needed and never applied
the join's result, so every partition stayed revoked and nothing was fetched again (the
end-to-end benchmark's partition stuck at the first record of its pending frame until the
stuck-partition watchdog re-created the consumer). This test forces that timing: a
revocation longer than the poll timeout, and a loop thread that, after it, waits longer
than a JoinGroup + SyncGroup round trip to a local broker before polling again. The
rebalance is started the way the leader meets it: a partition added to the topic and the
worker's metadata refreshed. The watchdog is off, so a lost assignment is a stall.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kafka import KafkaAdminClient, KafkaProducer
from kafka.admin import NewPartitions

from consumer.outputs.base import PartitionKey
from consumer.settings import ConsumerSettings
from consumer.topic_admin import ensure_topics
from consumer.worker import Worker
from tests.integration.test_stuck_partition import (
    STEPS,
    assert_stored_once,
    metric,
    running,
    summaries,
    wait_for,
)

POLL_TIMEOUT_MS = 100
REVOCATION_S = 0.5
"""Time a revocation takes (the loop's write before it, here made long): five times the
poll timeout, so the poll that runs the revocation listener returns before the join."""
AFTER_REVOCATION_S = 0.2
"""Time the loop thread spends before its first poll after a revocation: about twenty
JoinGroup + SyncGroup round trips to the local broker (about 10 ms in the logs), so the
join completes before that poll."""
SETTLED_S = 1.5
"""Time without a rebalance after which the group counts as settled: several times the
delay of a fresh leader's own rebalance after its first assignment (the metadata refresh
that follows the assignment, about 0.1-0.3 s in the logs)."""


class SlowRebalanceWorker(Worker):
    """A worker whose revocations outlast the poll timeout and whose loop thread pauses
    once after each; it counts its assignments and revocations (those of partitions)."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.assignments = 0
        self.revocations = 0
        self.revoking = threading.Event()
        self._pause_after_poll = False
        self._settled_since: float | None = None

    def assigned(self, partitions: list[Any]) -> None:
        self.assignments += 1
        super().assigned(partitions)

    def revoked(self, keys: set[PartitionKey]) -> None:
        super().revoked(keys)
        if keys:
            self.revocations += 1
            self.revoking.set()
            time.sleep(REVOCATION_S)
            self._pause_after_poll = True

    def settled(self) -> bool:
        """Whether every revocation was followed by its assignment, and has been for
        ``SETTLED_S`` (a fresh leader's own rebalance starts within that of its first
        assignment)."""
        now = time.monotonic()
        if self.assignments != self.revocations + 1:
            self._settled_since = None
            return False
        if self._settled_since is None:
            self._settled_since = now
        return now - self._settled_since >= SETTLED_S

    def tick(self) -> None:
        super().tick()
        if self._pause_after_poll:
            self._pause_after_poll = False
            time.sleep(AFTER_REVOCATION_S)


def produce_to(kafka: str, topic: str, partition: int, key: str, values: list[bytes]) -> None:
    """Send ``values`` to one partition, in order, and wait for the acks."""
    producer = KafkaProducer(bootstrap_servers=kafka)
    for value in values:
        producer.send(topic, key=key.encode(), value=value, partition=partition)
    producer.flush()
    producer.close()


def test_leader_rebalance_after_a_slow_revocation_is_applied(
        kafka_bootstrap: str, tmp_path: Path, unique_name: str) -> None:
    """Half of a run is read and written; the fresh leader's own rebalance (when it
    comes) and then one for a partition added to the topic revoke slowly; each new
    assignment is applied all the same, the other half (produced while the group
    rebalances) is read, and every record is read once and every frame stored once.
    Before the work-around the first such rebalance left the partitions revoked (the
    group never settled, or nothing more was read)."""
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"rebal-sum-{unique_name}",
        dlq_topic=f"rebal-dlq-{unique_name}", alerts_topic=f"rebal-alerts-{unique_name}",
        group_id=f"rebal-{unique_name}", db=str(tmp_path / "worker.duckdb"), partitions=1,
        poll_timeout_ms=POLL_TIMEOUT_MS, stuck_partition_timeout_s=0)
    ensure_topics(settings, [settings.topic])
    run_id = f"run-{unique_name}"
    values = summaries(run_id)
    half = len(values) // 2
    produce_to(kafka_bootstrap, settings.topic, 0, run_id, values[:half])
    worker = SlowRebalanceWorker(settings)

    def read() -> float:
        return metric(worker, "gradstream_messages_total", topic=settings.topic)

    with running(worker):
        wait_for(lambda: read() >= half and not worker.batch
                 and not worker.checkpoint.unacknowledged, 20,
                 "the first half read and written", worker)
        wait_for(worker.settled, 15, "the group settled (a fresh leader's own rebalance "
                 "applied)", worker)
        assignments = worker.assignments
        worker.revoking.clear()
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.create_partitions({settings.topic: NewPartitions(total_count=2)})
        finally:
            admin.close()
        worker._consumer.topics()  # the leader's metadata refresh (public API)
        assert worker.revoking.wait(10), (
            "no revocation started: the leader's rebalance did not begin, or an earlier "
            f"one never completed ({worker.assignments} assignments, "
            f"{worker.revocations} revocations)")
        produce_to(kafka_bootstrap, settings.topic, 0, run_id, values[half:])
        took = wait_for(lambda: worker.assignments > assignments, 15,
                        "the rebalance's assignment applied", worker)
        wait_for(lambda: read() >= len(values) and worker.counters.frames >= STEPS
                 and not worker.batch and not worker.checkpoint.unacknowledged,
                 15, "every record read and written", worker)
        records_read = read()
    print(f"leader rebalance with a {REVOCATION_S:g} s revocation: assignment applied "
          f"{took:.2f} s after it began; {worker.assignments} assignments, "
          f"{worker.revocations} revocations in all")
    assert worker.error is None
    assert records_read == len(values)  # each record read once
    assert worker.counters.frames == STEPS  # each frame made once
    assert_stored_once(settings.db, run_id)
