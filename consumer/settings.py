"""Worker configuration (pydantic-settings): flags, else ``GRADSTREAM_*`` / ``KAFKA_*``
environment variables, else these defaults."""

from __future__ import annotations

from pydantic import Field

from schemas.config import KafkaClientSettings
from schemas.topics import DEFAULT_CONSUMER_GROUP, DEFAULT_DLQ_TOPIC, DEFAULT_SUMMARIES_TOPIC


class ConsumerSettings(KafkaClientSettings):
    """Settings of a consumer worker.

    Attributes:
        topic: summaries topic to consume. dlq_topic: where unusable messages go.
        group_id: Kafka consumer group. db: DuckDB file the worker writes.
        shard_timeout_s: seconds to wait for every rank of a step before finalising the
            frame as partial.
        flush_interval_s: longest time finalised frames wait before being written.
        max_batch_rows: write as soon as this many layer rows are waiting.
        max_frames: rolling window of run health in frames (0 = whole run; seed 001).
        poll_timeout_ms / max_poll_records: Kafka poll parameters.
        partitions: partitions of the topics when the worker creates them.
        replication_factor: replication of topics the worker creates.
    """

    topic: str = DEFAULT_SUMMARIES_TOPIC
    dlq_topic: str = DEFAULT_DLQ_TOPIC
    group_id: str = DEFAULT_CONSUMER_GROUP
    db: str = "gradstream.duckdb"
    shard_timeout_s: float = Field(default=30.0, gt=0)
    flush_interval_s: float = Field(default=0.2, gt=0)
    max_batch_rows: int = Field(default=500_000, gt=0)
    max_frames: int = Field(default=0, ge=0)
    poll_timeout_ms: int = Field(default=100, gt=0)
    max_poll_records: int = Field(default=2000, gt=0)
    max_partition_fetch_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    partitions: int = Field(default=4, gt=0)
    replication_factor: int = Field(default=1, gt=0)
