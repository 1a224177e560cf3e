"""Reading a dead-letter topic back in integration tests (real broker)."""

from __future__ import annotations

import time

from kafka import KafkaConsumer

from consumer.dlq import decode_headers


def read_dead_letters(bootstrap: str, topic: str, expected: int) -> list[dict[str, str]]:
    """Headers of the dead-letter topic's records: reads until ``expected`` arrived (at
    most 60 s), then 1 s more to catch any surplus.

    Args:
        bootstrap: the broker's bootstrap servers (``host:port``).
        topic: the dead-letter topic.
        expected: how many records to wait for.

    Returns:
        One dict of decoded headers (``error``, ``reason``, source offset ...) per record,
        in topic order; fewer than ``expected`` when they did not arrive in time.
    """
    dlq = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                        fetch_max_bytes=64 * 1024 * 1024)
    letters: list[dict[str, str]] = []
    try:
        deadline = time.monotonic() + 60
        while len(letters) < expected and time.monotonic() < deadline:
            for batch in dlq.poll(timeout_ms=500).values():
                letters += [decode_headers(m.headers) for m in batch]
        for batch in dlq.poll(timeout_ms=1000).values():
            letters += [decode_headers(m.headers) for m in batch]
    finally:
        dlq.close()
    return letters
