"""Dead-letter records: a message a worker cannot use, with the reason in its headers."""

from __future__ import annotations

from typing import Any

DLQ_VALUE_LIMIT = 1024 * 1024
"""Largest original value copied into a dead-letter record (bytes); longer ones are cut
and marked with the ``truncated`` header."""


def dead_letter_headers(
    reason: str, topic: str, partition: int, offset: int, error: str
) -> list[tuple[str, bytes]]:
    """Kafka headers of a dead-letter record.

    Args:
        reason: why the message was refused (one line, names the field).
        topic, partition, offset: where the original message was read.
        error: short error class, e.g. ``invalid`` or ``unknown_run``.
    """
    return [
        ("reason", reason.encode()),
        ("error", error.encode()),
        ("source_topic", topic.encode()),
        ("source_partition", str(partition).encode()),
        ("source_offset", str(offset).encode()),
    ]


def dead_letter_value(value: bytes | None) -> tuple[bytes, bool]:
    """(value to store, truncated?) for an original record value."""
    raw = value or b""
    if len(raw) > DLQ_VALUE_LIMIT:
        return raw[:DLQ_VALUE_LIMIT], True
    return raw, False


def decode_headers(headers: Any) -> dict[str, str]:
    """Kafka record headers [(key, bytes)] as a str dict (undecodable bytes replaced)."""
    return {k: (v or b"").decode(errors="replace") for k, v in (headers or [])}
