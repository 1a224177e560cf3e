"""Configuration of ``gradstream store`` (pydantic-settings): flags, else ``GRADSTREAM_*`` /
``KAFKA_*`` environment variables, else these defaults."""

from __future__ import annotations

from pydantic import Field

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
        group_id: the name under which the store keeps its consumed offsets in DuckDB
            (``kafka_offsets.consumer_group``); the store joins no Kafka consumer group, it
            assigns itself every partition (DuckDB has one writer).
        reorder_delay_s: how long a frame that does not follow its run's last evaluated
            step waits for the steps before it (the steps of one run come from several
            workers, each with its own lag) before the run's ordered work takes it anyway
            (:mod:`consumer.store_writer`); a frame that follows is taken at once. In
            scale-out mode the store writer evaluates the alert rules, the workers do not.
    """

    frames_topic: str = DEFAULT_FRAMES_TOPIC
    alerts_topic: str | None = DEFAULT_ALERTS_TOPIC
    group_id: str = DEFAULT_STORE_GROUP
    reorder_delay_s: float = Field(default=2.0, ge=0)
