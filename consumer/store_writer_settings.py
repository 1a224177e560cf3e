"""Configuration of ``gradstream store`` (pydantic-settings): flags, else ``GRADSTREAM_*`` /
``KAFKA_*`` environment variables, else these defaults."""

from __future__ import annotations

from consumer.settings import LoopSettings
from schemas.topics import DEFAULT_ALERTS_TOPIC, DEFAULT_FRAMES_TOPIC, DEFAULT_STORE_GROUP


class StoreWriterSettings(LoopSettings):
    """Settings of the store writer (scale-out mode), besides those of
    :class:`consumer.settings.LoopSettings` (``db``, ``dlq_topic`` for unusable
    frames-topic messages, batching, ``max_frames``, Kafka polling, ``metrics_port``).

    Attributes:
        frames_topic: topic of finished frames published by the workers.
        alerts_topic: topic of the workers' alert events, stored in the ``alerts`` table
            (None: alerts are not stored).
        group_id: the name under which the store keeps its consumed offsets in DuckDB
            (``kafka_offsets.consumer_group``); the store joins no Kafka consumer group, it
            assigns itself every partition (DuckDB has one writer).
    """

    frames_topic: str = DEFAULT_FRAMES_TOPIC
    alerts_topic: str | None = DEFAULT_ALERTS_TOPIC
    group_id: str = DEFAULT_STORE_GROUP
