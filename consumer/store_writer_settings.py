"""Configuration of ``gradstream store`` (pydantic-settings): flags, else ``GRADSTREAM_*`` /
``KAFKA_*`` environment variables, else these defaults."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from consumer.settings import LoopSettings
from schemas.topics import DEFAULT_ALERTS_TOPIC, DEFAULT_FRAMES_TOPIC, DEFAULT_STORE_GROUP


class StoreWriterSettings(LoopSettings):
    """Settings of the store writer (scale-out mode), besides those of
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
            (:mod:`consumer.store_writer`); a frame that follows is taken at once.
        alert_rules, alert_set, webhook_url, webhook_timeout_s, webhook_retries,
            alert_queue_size, status_interval_s: the alert rules and sinks, as
            :class:`consumer.settings.ConsumerSettings`' (in scale-out mode the store
            writer evaluates the rules, the workers do not).
    """

    frames_topic: str = DEFAULT_FRAMES_TOPIC
    alerts_topic: str | None = DEFAULT_ALERTS_TOPIC
    group_id: str = DEFAULT_STORE_GROUP
    reorder_delay_s: float = Field(default=2.0, ge=0)
    alert_rules: str | None = None
    alert_set: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_url: str | None = None
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    webhook_retries: int = Field(default=3, ge=0)
    alert_queue_size: int = Field(default=1000, gt=0)
    status_interval_s: float = Field(default=1.0, gt=0)

    @field_validator("alert_set", mode="before")
    @classmethod
    def _alert_set(cls, value: object) -> object:
        """Accept a comma-separated string (``GRADSTREAM_ALERT_SET``) as well as a list."""
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value
