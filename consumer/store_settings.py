"""Configuration of ``gradstream store`` (pydantic-settings): flags, else ``GRADSTREAM_*`` /
``KAFKA_*`` environment variables, else these defaults."""

from __future__ import annotations

from pydantic import Field

from schemas.config import TopicCreationSettings
from schemas.topics import (
    DEFAULT_ALERTS_TOPIC,
    DEFAULT_DLQ_TOPIC,
    DEFAULT_FRAMES_TOPIC,
    DEFAULT_STORE_GROUP,
)


class StoreSettings(TopicCreationSettings):
    """Settings of the store process (scale-out mode).

    Attributes:
        frames_topic: topic of finished frames published by the workers.
        alerts_topic: topic of the workers' alert events, stored in the ``alerts`` table
            (None: alerts are not stored).
        dlq_topic: where unusable frames-topic messages go.
        group_id: the name under which the store keeps its consumed offsets in DuckDB
            (``kafka_offsets.consumer_group``); the store joins no Kafka consumer group, it
            assigns itself every partition (DuckDB has one writer).
        db: DuckDB file the store writes.
        flush_interval_s: longest time frames wait before being written.
        max_batch_rows: write as soon as this many layer rows are waiting.
        max_frames: rolling window of run health in frames (0 = whole run; seed 001).
        poll_timeout_ms / max_poll_records: Kafka poll parameters.
        metrics_port: Prometheus endpoint port (None = off).
    """

    frames_topic: str = DEFAULT_FRAMES_TOPIC
    alerts_topic: str | None = DEFAULT_ALERTS_TOPIC
    dlq_topic: str = DEFAULT_DLQ_TOPIC
    group_id: str = DEFAULT_STORE_GROUP
    db: str = "gradstream.duckdb"
    flush_interval_s: float = Field(default=0.2, gt=0)
    max_batch_rows: int = Field(default=500_000, gt=0)
    max_frames: int = Field(default=0, ge=0)
    poll_timeout_ms: int = Field(default=100, gt=0)
    max_poll_records: int = Field(default=2000, gt=0)
    max_partition_fetch_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
