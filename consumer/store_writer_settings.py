"""Configuration of ``gradstream store`` (pydantic-settings): flags, else ``GRADSTREAM_*`` /
``KAFKA_*`` environment variables, else these defaults."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from consumer.settings import AlertingSettings
from schemas.topics import DEFAULT_ALERTS_TOPIC, DEFAULT_FRAMES_TOPIC, DEFAULT_STORE_GROUP


class StoreWriterSettings(AlertingSettings):
    """Settings of the store writer (scale-out mode), besides those of
    :class:`consumer.settings.AlertingSettings` (the alert rules and sinks) and
    :class:`consumer.settings.LoopSettings` (``db``, ``dlq_topic`` for unusable
    frames-topic messages, batching, ``max_frames``, Kafka polling, ``metrics_port``).

    Attributes:
        frames_topic: topic of finished frames published by the workers.
        alerts_topic: the alerts topic: the store writer publishes the events of the
            alert rules it evaluates there, and stores every alert event read from it in
            the ``alerts`` table (None: events are stored, not published).
        group_id: the name under which the store keeps its consumed offsets in its output
            (``kafka_offsets.consumer_group``; the Iceberg output also in its snapshots'
            properties); the store joins no Kafka consumer group, it assigns itself every
            partition (DuckDB has one writer) or those of ``assigned_partitions`` (several
            store processes writing one Iceberg table set).
        reorder_delay_s: how long a frame that does not follow its run's last evaluated
            step waits for the steps before it (the steps of one run come from several
            workers, each with its own lag) before the run's ordered work takes it anyway
            (:mod:`consumer.store_writer`); a frame that follows is taken at once. In
            scale-out mode the store writer evaluates the alert rules, the workers do not.
        assigned_partitions: the partition numbers this store process reads of each topic
            it consumes (``GRADSTREAM_ASSIGNED_PARTITIONS``, comma-separated; None: every
            partition). Several store processes writing one Iceberg table set
            (``iceberg_catalog``) each take some partitions; the workers key frames and
            alert events by run id, so a run's frames and alert events sit in partitions
            of the same number and one store process takes all of a run's ordered work.
            A DuckDB file has one writer: leave it None there.
    """

    frames_topic: str = DEFAULT_FRAMES_TOPIC
    alerts_topic: str | None = DEFAULT_ALERTS_TOPIC
    group_id: str = DEFAULT_STORE_GROUP
    reorder_delay_s: float = Field(default=2.0, ge=0)
    assigned_partitions: Annotated[list[int] | None, NoDecode] = Field(default=None,
                                                                        min_length=1)

    @field_validator("assigned_partitions", mode="before")
    @classmethod
    def _assigned_partitions(cls, value: object) -> object:
        """Accept ``"0,2"`` (an environment variable or flag) as well as a list."""
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @model_validator(mode="after")
    def _partitions_need_iceberg(self) -> StoreWriterSettings:
        """Refuse a partition subset for a DuckDB store (one writer reads them all).

        Raises:
            ValueError: ``assigned_partitions`` without ``iceberg_catalog``.
        """
        if self.assigned_partitions is not None and self.iceberg_catalog is None:
            raise ValueError("assigned_partitions splits the topics between store processes "
                             "writing one Iceberg table set: set iceberg_catalog too (a "
                             "DuckDB file has one writer, which reads every partition)")
        return self
