"""Dead-letter records: a message a worker cannot use, with the reason in its headers."""

from __future__ import annotations

from typing import Any

DLQ_RECORD_LIMIT = 1024 * 1024
"""Largest dead-letter record (value + key + headers) sent (bytes): Kafka's default
``message.max.bytes`` (1 MiB + 12 bytes) less the batch overhead. A record the broker
refused as too large would break the (idempotent) dead-letter producer for good."""

DEAD_LETTER_ERRORS: tuple[str, ...] = ("invalid", "unknown_run", "conflicting_run",
                                       "refused_rank")
"""The error classes of dead letters (the ``error`` header, :func:`dead_letter_headers`):
the ``reason`` label values of ``gradstream_dead_letters_total`` (``consumer.metrics``)."""

DLQ_VALUE_LIMIT = DLQ_RECORD_LIMIT - 16 * 1024
"""Largest original value copied into a dead-letter record (bytes); longer ones are cut
(less when the key and headers are long) and marked with the ``truncated`` header."""


def dead_letter_headers(
    reason: str, topic: str, partition: int, offset: int, error: str
) -> list[tuple[str, bytes]]:
    """Kafka headers of a dead-letter record.

    Args:
        reason: why the message was refused (one line, names the field).
        topic, partition, offset: where the original message was read.
        error: short error class: ``invalid`` (unusable, or does not fit the run's
            parameters), ``unknown_run``, ``conflicting_run`` (a RunStarted contradicting
            the run's: its rank is refused) or ``refused_rank`` (a summary of a refused
            rank).
    """
    return [
        ("reason", reason.encode()),
        ("error", error.encode()),
        ("source_topic", topic.encode()),
        ("source_partition", str(partition).encode()),
        ("source_offset", str(offset).encode()),
    ]


def dead_letter_value(value: bytes | None, limit: int = DLQ_VALUE_LIMIT) -> tuple[bytes, bool]:
    """(value to store, truncated?) for an original record value cut at ``limit`` bytes."""
    raw = value or b""
    if len(raw) > limit:
        return raw[:limit], True
    return raw, False


def decode_headers(headers: Any) -> dict[str, str]:
    """Kafka record headers [(key, bytes)] as a str dict (undecodable bytes replaced)."""
    return {k: (v or b"").decode(errors="replace") for k, v in (headers or [])}


class DeadLetterQueue:
    """Sends unusable records to the dead-letter topic, with the reason in the headers.

    Args:
        topic: the dead-letter topic.
        producer: a kafka-python ``KafkaProducer``; None keeps the letters in the counters
            and the log only (a loop fed records directly, without Kafka).

    Attributes:
        sent: dead letters so far. reasons: the first 100 reasons (for tests and logs).
    """

    def __init__(self, topic: str, producer: Any | None) -> None:
        self.topic = topic
        self.producer = producer
        self.sent = 0
        self.reasons: list[str] = []

    @classmethod
    def connect(cls, settings: Any) -> DeadLetterQueue:
        """A queue with its own producer (acks=all, no linger; values up to 2 MiB).

        Raises:
            kafka.errors.KafkaError: the cluster cannot be reached.
        """
        from kafka import KafkaProducer

        producer = KafkaProducer(**settings.kafka_kwargs(), acks=-1, linger_ms=0,
                                 max_request_size=2 * 1024 * 1024 + 65536)
        return cls(settings.dlq_topic, producer)

    def send(self, record: Any, reason: str, error: str) -> None:
        """Send ``record`` (a kafka-python ConsumerRecord) with ``reason`` and the error
        class ``error``; a value over ``DLQ_VALUE_LIMIT`` is cut and marked truncated."""
        self.sent += 1
        if len(self.reasons) < 100:
            self.reasons.append(reason)
        if self.producer is None:
            return
        headers = dead_letter_headers(reason[:4096], record.topic, record.partition,
                                      record.offset, error)
        room = DLQ_RECORD_LIMIT - 1024 - len(record.key or b"") - sum(
            len(k) + len(v) for k, v in headers)
        value, truncated = dead_letter_value(record.value, min(DLQ_VALUE_LIMIT, room))
        if truncated:
            headers.append(("truncated", b"true"))
        self.producer.send(self.topic, key=record.key, value=value, headers=headers)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every letter sent so far is acknowledged (before the offsets that
        pass them are stored)."""
        if self.producer is not None and self.sent:
            self.producer.flush(timeout=timeout_s)

    def close(self) -> None:
        """Deliver what is pending (at most 10 s) and close the producer."""
        if self.producer is not None:
            self.producer.close(timeout=10)
