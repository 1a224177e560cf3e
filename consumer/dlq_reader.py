"""Reading the dead-letter topic: the records a worker could not use, decoded.

A dead letter (:mod:`consumer.dlq`) is the original key and value (cut at
``DLQ_VALUE_LIMIT`` bytes, header ``truncated``) with headers ``reason``, ``error`` (error
class: invalid, unknown_run, conflicting_run, refused_rank), ``source_topic``,
``source_partition`` and ``source_offset``. :class:`DeadLetterReader` reads the topic
without a consumer group (every partition assigned, nothing committed), so reading never
disturbs the workers.
:func:`read_topic` reads any gradstream topic the same way for ``gradstream inspect``,
binary messages decoded to JSON (:func:`record_to_json`).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from consumer.dlq import decode_headers
from consumer.topic_admin import TopicMissingError
from schemas.wire import is_binary, to_display

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings

PREVIEW_CHARS = 80
"""Characters of the original value shown in the table (the JSON output has all of it)."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One dead-letter record, decoded.

    Attributes:
        partition, offset: where it sits in the dead-letter topic.
        timestamp: when it was dead-lettered (unix s, the record timestamp).
        key: the original key (run id) as text, or None.
        value: the original value (bytes; the first ``DLQ_VALUE_LIMIT`` bytes if truncated).
        headers: every header as text (``reason``, ``error``, ``source_*``, ``truncated``).
    """

    partition: int
    offset: int
    timestamp: float
    key: str | None
    value: bytes
    headers: dict[str, str]

    @classmethod
    def from_record(cls, record: Any) -> DeadLetter:
        """From a kafka-python ConsumerRecord of the dead-letter topic."""
        key = None if record.key is None else record.key.decode(errors="replace")
        return cls(record.partition, record.offset, record.timestamp / 1000.0, key,
                   record.value or b"", decode_headers(record.headers))

    @property
    def source(self) -> str:
        """``topic[partition]@offset`` of the original message ("?" for a missing header)."""
        h = self.headers
        return (f"{h.get('source_topic', '?')}[{h.get('source_partition', '?')}]"
                f"@{h.get('source_offset', '?')}")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: positions, headers and the value: a binary gradstream message
        decoded for people (``value`` an object, ``value_encoding`` "binary"; cut or
        malformed ones as ``value_base64``), else ``value`` as text when it is UTF-8, else
        ``value_base64``."""
        h = self.headers
        out: dict[str, Any] = {
            "dlq_partition": self.partition, "dlq_offset": self.offset,
            "timestamp": self.timestamp, "key": self.key,
            "error": h.get("error"), "reason": h.get("reason"),
            "source_topic": h.get("source_topic"),
            "source_partition": _int_or_none(h.get("source_partition")),
            "source_offset": _int_or_none(h.get("source_offset")),
            "truncated": h.get("truncated") == "true", "value_bytes": len(self.value),
        }
        if is_binary(self.value):
            shown = to_display(self.value)
            out["value_encoding"] = "binary"
            if isinstance(shown, dict):
                out["value"] = shown
            else:
                out["value_base64"] = base64.b64encode(self.value).decode()
            return out
        try:
            out["value"] = self.value.decode()
        except UnicodeDecodeError:
            out["value_base64"] = base64.b64encode(self.value).decode()
        return out

    def preview(self) -> str:
        """The start of the value as one line of text (a binary message as its JSON)."""
        shown = to_display(self.value) if is_binary(self.value) else None
        if isinstance(shown, dict):
            text = "binary " + json.dumps(shown, separators=(",", ":"))[: PREVIEW_CHARS * 4]
        else:
            text = self.value[: PREVIEW_CHARS * 4].decode(errors="replace")
        text = " ".join(text.split())
        return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 3] + "..."


def _int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


class DeadLetterReader:
    """Reads every partition of a dead-letter topic without a consumer group.

    Args:
        settings: connection settings (bootstrap servers, security).
        topic: the dead-letter topic.
        last: start at the last ``last`` records of each partition (0 = from the
            beginning), which holds the newest ``last`` records of the topic overall.

    Raises:
        TopicMissingError: the topic does not exist.
        kafka.errors.KafkaError: the cluster cannot be reached.
    """

    def __init__(self, settings: ConsumerSettings, topic: str, last: int = 0) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.topic = topic
        self._consumer = KafkaConsumer(
            **settings.kafka_kwargs(), group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_max_bytes=64 * 1024 * 1024,
        )
        try:
            parts = self._consumer.partitions_for_topic(topic)
            if not parts:
                raise TopicMissingError(
                    f"the dead-letter topic {topic!r} does not exist on "
                    f"{settings.bootstrap_servers}: no worker has created it yet (start "
                    "`gradstream consume`), or pass --topic"
                )
            self.partitions = [TopicPartition(topic, p) for p in sorted(parts)]
            self._consumer.assign(self.partitions)
            begin = self._consumer.beginning_offsets(self.partitions)
            self.end = self._consumer.end_offsets(self.partitions)
            self._carry: list[DeadLetter] = []  # read past ``end`` by read_to_end
            for tp in self.partitions:
                start = begin[tp] if last <= 0 else max(begin[tp], self.end[tp] - last)
                self._consumer.seek(tp, start)
        except BaseException:
            self._consumer.close()
            raise

    def poll(self, timeout_ms: int = 200) -> list[DeadLetter]:
        """Records that arrived since the last call, partition by partition."""
        carried, self._carry = self._carry, []
        batches = self._consumer.poll(timeout_ms=timeout_ms)
        return carried + [DeadLetter.from_record(r) for b in batches.values() for r in b]

    def read_to_end(self, timeout_s: float = 60.0) -> list[DeadLetter]:
        """Every record from the start position to the end offsets taken at construction,
        ordered by (timestamp, partition, offset).

        Raises:
            TimeoutError: the end was not reached within ``timeout_s``.
        """
        out: list[DeadLetter] = []
        deadline = time.monotonic() + timeout_s
        while any(self._consumer.position(tp) < self.end[tp] for tp in self.partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading the dead-letter topic {self.topic!r} took over "
                                   f"{timeout_s:.0f} s")
            out.extend(self.poll(200))
        end = {tp.partition: off for tp, off in self.end.items()}
        self._carry = [d for d in out if d.offset >= end[d.partition]]
        out = [d for d in out if d.offset < end[d.partition]]
        return sorted(out, key=lambda d: (d.timestamp, d.partition, d.offset))

    def close(self) -> None:
        """Close the Kafka consumer."""
        self._consumer.close()


def record_to_json(record: Any) -> dict[str, Any]:
    """A record of any gradstream topic as a JSON-ready dict for people: its position,
    key, headers and value, a binary message decoded (``encoding`` "binary", the arrays
    as lists), JSON parsed (``encoding`` "json"), other UTF-8 text as a string
    (``encoding`` "text") and other bytes as ``value_base64`` (``encoding`` "bytes").
    Nothing is validated: an invalid message is shown as it is.

    Args:
        record: a kafka-python ConsumerRecord.
    """
    raw = record.value
    out: dict[str, Any] = {
        "topic": record.topic, "partition": record.partition, "offset": record.offset,
        "timestamp": record.timestamp / 1000.0,
        "key": None if record.key is None else record.key.decode(errors="replace"),
    }
    headers = decode_headers(record.headers)
    if headers:
        out["headers"] = headers
    shown = to_display(raw)
    if raw is None:
        out["encoding"], out["value"] = "none", None
    elif is_binary(raw):
        out["encoding"] = "binary"
        if isinstance(shown, dict):
            out["value"] = shown
        else:
            out["value_base64"] = base64.b64encode(raw).decode()
    elif shown is None:
        out["encoding"], out["value_base64"] = "bytes", base64.b64encode(raw).decode()
    else:
        out["encoding"] = "text" if isinstance(shown, str) else "json"
        out["value"] = shown
    return out


def read_topic(
    settings: ConsumerSettings, topic: str, *, from_beginning: bool = False,
    max_records: int = 0, duration_s: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Records of ``topic`` as :func:`record_to_json` dicts, read without a consumer group
    (every partition assigned, nothing committed).

    Args:
        settings: connection settings. topic: any topic.
        from_beginning: start at the first record of each partition (else at the end:
            only records arriving from now on).
        max_records: stop after this many records (0: no limit).
        duration_s: stop after this many seconds (None: no limit).

    Raises:
        TopicMissingError: the topic does not exist.
        kafka.errors.KafkaError: the cluster cannot be reached.
    """
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(**settings.kafka_kwargs(), group_id=None,
                             enable_auto_commit=False, fetch_max_bytes=64 * 1024 * 1024)
    try:
        parts = consumer.partitions_for_topic(topic)
        if not parts:
            raise TopicMissingError(f"topic {topic!r} does not exist on "
                                    f"{settings.bootstrap_servers}")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        if from_beginning:
            consumer.seek_to_beginning(*tps)
        else:
            consumer.seek_to_end(*tps)
        deadline = None if duration_s is None else time.monotonic() + duration_s
        count = 0
        while deadline is None or time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=200).values():
                for record in batch:
                    yield record_to_json(record)
                    count += 1
                    if max_records and count >= max_records:
                        return
    finally:
        consumer.close()
