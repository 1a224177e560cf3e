"""Reading the alerts topic without a consumer group (``gradstream alerts --follow``,
``gradstream watch``): every partition assigned, started at a point in time.

No group means no committed offsets and no rebalances: any number of terminals can tail
the topic while workers run, and none of them affects the others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from consumer.topic_admin import TopicMissingError
from schemas.alert import Alert, RunStatus, decode_alert_record
from schemas.kafka_settings import KafkaClientSettings
from schemas.wire import WireError

log = logging.getLogger("gradstream.alerts")


class AlertFeed:
    """Alert and run-status records from every partition of the alerts topic.

    Args:
        settings: connection settings. topic: the alerts topic.
        since: unix time (s) of the first record wanted; None = only records published
            from now on; 0 = from the beginning of the topic.
        wait_s: how long to wait for the topic to appear (s); 0 = fail at once.
        on_wait: called once if the topic is not there yet (e.g. to print a notice).

    The consumer fetches with ``fetch_max_wait_ms=100`` (kafka-python's default is 500),
    which shortens the time to see an alert (``bench/README.md``, ``alert_latency.py``).

    Raises:
        TopicMissingError: the topic did not appear within ``wait_s``.
        kafka.errors.KafkaError: the cluster cannot be reached.
    """

    def __init__(
        self, settings: KafkaClientSettings, topic: str, *, since: float | None = None,
        wait_s: float = 0.0, on_wait: Callable[[], None] | None = None,
    ) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.topic = topic
        self.invalid = 0
        self._consumer = KafkaConsumer(**settings.kafka_kwargs(), group_id=None,
                                       enable_auto_commit=False, auto_offset_reset="latest",
                                       fetch_max_wait_ms=100)
        try:
            deadline = time.monotonic() + wait_s
            waited = False
            while True:
                parts = self._consumer.partitions_for_topic(topic)
                if parts:
                    break
                if time.monotonic() >= deadline:
                    raise TopicMissingError(
                        f"the alerts topic {topic!r} does not exist on "
                        f"{settings.bootstrap_servers}: start a worker (`gradstream consume`) "
                        "or pass --alerts-topic"
                    )
                if not waited and on_wait is not None:
                    on_wait()
                waited = True
                time.sleep(0.5)  # partitions_for_topic fetches fresh metadata when unknown
            self.partitions = [TopicPartition(topic, p) for p in sorted(parts)]
            self._consumer.assign(self.partitions)
            self._seek(since)
        except BaseException:
            self._consumer.close()
            raise

    def _seek(self, since: float | None) -> None:
        if since is None:
            self._consumer.seek_to_end(*self.partitions)
            for tp in self.partitions:  # resolve the position now, not at the first poll
                self._consumer.position(tp)
            return
        if since <= 0:
            self._consumer.seek_to_beginning(*self.partitions)
            return
        found = self._consumer.offsets_for_times({tp: int(since * 1000) for tp in self.partitions})
        for tp in self.partitions:
            hit = found.get(tp)
            if hit is None:
                self._consumer.seek_to_end(tp)
            else:
                self._consumer.seek(tp, hit.offset)

    def poll(self, timeout_ms: int = 200) -> list[Alert | RunStatus]:
        """Records that arrived, in partition order; undecodable ones are skipped and
        counted in ``invalid``."""
        batches = self._consumer.poll(timeout_ms=timeout_ms)
        return [r for batch in batches.values() for r in self._decode(batch)]

    def _decode(self, records: list[Any]) -> list[Alert | RunStatus]:
        out = []
        for record in records:
            try:
                out.append(decode_alert_record(record.value))
            except WireError as exc:
                self.invalid += 1
                log.debug("skipping alerts-topic record %s@%d: %s", record.partition,
                          record.offset, exc.reason)
        return out

    def read_to_end(self, timeout_s: float = 30.0) -> list[Alert | RunStatus]:
        """Everything from the start position up to the end offsets as of now.

        Raises:
            TimeoutError: the end was not reached within ``timeout_s``.
        """
        end = self._consumer.end_offsets(self.partitions)
        out: list[Alert | RunStatus] = []
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < end[tp] for tp in self.partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading the alerts topic {self.topic!r} took over "
                                   f"{timeout_s:.0f} s")
            out.extend(self.poll(200))
        return out

    def close(self) -> None:
        """Close the Kafka consumer."""
        self._consumer.close()
