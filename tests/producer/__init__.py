"""Helpers shared by the producer tests."""

from __future__ import annotations

import time

import numpy as np
from kafka import KafkaConsumer

from schemas.wire import decode_message

UNREACHABLE = "127.0.0.1:9"  # discard port: nothing listens, connections are refused


def grads(n_layers: int = 3, size: int = 8) -> dict[str, np.ndarray]:
    return {f"layer{i}.weight": np.full(size, i + 1.0, np.float32) for i in range(n_layers)}


def numel(g: dict[str, np.ndarray]) -> dict[str, int]:
    return {k: v.size for k, v in g.items()}


def read_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=2000)
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        out.extend(decode_message(m.value) for m in consumer)
    consumer.close()
    return out
