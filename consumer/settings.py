"""Worker configuration (pydantic-settings): flags, else ``GRADSTREAM_*`` / ``KAFKA_*``
environment variables, else these defaults."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from consumer.defaults import DEFAULT_DB
from schemas.health import NonfiniteVerdict
from schemas.kafka_settings import TopicCreationSettings
from schemas.topics import (
    DEFAULT_ALERTS_TOPIC,
    DEFAULT_CONSUMER_GROUP,
    DEFAULT_DLQ_TOPIC,
    DEFAULT_RUNS_TOPIC,
    DEFAULT_SUMMARIES_TOPIC,
)


class LoopSettings(TopicCreationSettings):
    """Settings every consumer loop reads (:class:`consumer.loop.ConsumerLoop`): the
    worker's (:class:`ConsumerSettings`) and the store's
    (:class:`consumer.store_writer_settings.StoreWriterSettings`).

    Attributes:
        dlq_topic: where unusable messages go.
        group_id: Kafka consumer group (the store: the name of its offsets in DuckDB).
        db: DuckDB file the process writes.
        flush_interval_s: longest time finalised frames wait before being written.
        max_batch_rows: write as soon as this many layer rows are waiting.
        max_frames: rolling window of run health in frames (0 = whole run).
        poll_timeout_ms / max_poll_records / max_partition_fetch_bytes: Kafka poll
            parameters.
        metrics_port: serve Prometheus metrics (``consumer.metrics``) on this TCP port
            (``GRADSTREAM_METRICS_PORT``); None or 0 = no endpoint.
        stuck_partition_timeout_s: seconds an assigned partition with records to read may
            keep the same position before the loop calls it stuck and recovers it
            (:mod:`consumer.stuck_partition`; ``GRADSTREAM_STUCK_PARTITION_TIMEOUT_S``);
            0 = no watchdog. The default, 30 s, is 300 poll timeouts and 150 flush
            intervals: no healthy loop holds a partition's position that long while records
            wait, and a stuck partition is still acted on within 37.5 s.
        ignore_layers: layer-name patterns (``schemas.health.match_layers``) excluded
            from every run's health, issue frames and vanishing / exploding alerts, besides
            each run's own ``ignore_layers`` (``GRADSTREAM_IGNORE_LAYERS``:
            comma-separated), and recorded with each run the process stores
            (``runs.ignore_layers``), so that its report applies them too. In scale-out
            mode give the workers (alerts) and the store (health, record) the same ones.
            Empty = every layer counts.
        exclude_rounding_level: also leave out the vanishing flag of layers with no
            gradient by construction (``schemas.rounding``; ``consumer.health_tracker``). Off by
            default: every layer counts, as in the reference.
        nonfinite_rule: how a NaN/Inf gradient counts in the live health
            (``GRADSTREAM_NONFINITE_RULE``; ``schemas.health.NONFINITE_VERDICTS``):
            ``"critical"`` (default, gradstream's rule: the run is Critical) or
            ``"reference"`` (the reference's: an Inf element makes the layer exploding, a
            NaN-only layer is no issue; a layer whose NaN/Inf split is unknown, from a
            producer that sends no ``nan`` count, keeps the Critical rule).
    """

    dlq_topic: str = DEFAULT_DLQ_TOPIC
    group_id: str = DEFAULT_CONSUMER_GROUP
    db: str = DEFAULT_DB
    flush_interval_s: float = Field(default=0.2, gt=0)
    max_batch_rows: int = Field(default=500_000, gt=0)
    max_frames: int = Field(default=0, ge=0)
    poll_timeout_ms: int = Field(default=100, gt=0)
    max_poll_records: int = Field(default=2000, gt=0)
    max_partition_fetch_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    stuck_partition_timeout_s: float = Field(default=30.0, ge=0)
    ignore_layers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    exclude_rounding_level: bool = False
    nonfinite_rule: NonfiniteVerdict = "critical"

    @field_validator("ignore_layers", mode="before")
    @classmethod
    def _ignore_layers(cls, value: object) -> object:
        """Accept a comma-separated string (``GRADSTREAM_IGNORE_LAYERS``) as well as a
        list."""
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value


class AlertingSettings(LoopSettings):
    """The alert rules and sinks of a loop that evaluates them (:mod:`consumer.alerts`): the
    worker (:class:`ConsumerSettings`) and, in scale-out mode, the store writer
    (:class:`consumer.store_writer_settings.StoreWriterSettings`).

    Attributes:
        alert_rules: TOML/YAML rule file (``consumer.alerts.config``); None = defaults.
        alert_set: ``RULE.FIELD=VALUE`` overrides applied over the rule file
            (``GRADSTREAM_ALERT_SET``: comma-separated).
        webhook_url: POST each alert event (Slack-compatible JSON) here; None = no webhook.
        webhook_timeout_s / webhook_retries: per attempt timeout (s) and extra attempts.
        alert_queue_size: events each queued sink (log, webhook) holds before dropping.
        status_interval_s: at most one routine run-status record per run per interval.
    """

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


class ConsumerSettings(AlertingSettings):
    """Settings of a consumer worker (besides those of :class:`AlertingSettings`).

    Attributes:
        topic: summaries topic to consume.
        shard_timeout_s: seconds to wait for every rank of a step before finalising the
            frame as partial.
        partitions: partitions of the topics when the worker creates them.
        replication_factor: replication of topics the worker creates.
        group_instance_id: static group membership (Kafka KIP-345,
            ``GRADSTREAM_GROUP_INSTANCE_ID``): a worker restarted with the same id takes its
            partitions back at once instead of waiting ``session_timeout_ms`` for the
            coordinator to drop its crashed predecessor. Unique per worker; None = dynamic.
        session_timeout_ms: how long the coordinator waits for a silent worker before
            reassigning its partitions (broker bounds: group.min/max.session.timeout.ms);
            None = kafka-python's default (45 s).
        frames_topic: scale-out mode when set (``GRADSTREAM_FRAMES_TOPIC``): the worker
            writes no DuckDB file; it publishes each finished frame's merged sums to this
            topic, where ``gradstream store`` reads them; ``db`` is unused.
        runs_topic: compacted topic where scale-out workers keep every run's RunStarted,
            so a worker that takes over a partition knows the runs on it.
        alerts_topic: where alert events and run statuses are published (key = run id).
    """

    topic: str = DEFAULT_SUMMARIES_TOPIC
    shard_timeout_s: float = Field(default=30.0, gt=0)
    group_instance_id: str | None = Field(default=None, min_length=1)
    session_timeout_ms: int | None = Field(default=None, gt=0)
    # Scale-out mode (consumer.worker): publish merged frames instead of writing DuckDB.
    frames_topic: str | None = None
    runs_topic: str = DEFAULT_RUNS_TOPIC
    # Alerting (consumer.alerts): the alerts topic; the rules and sinks in AlertingSettings.
    alerts_topic: str = DEFAULT_ALERTS_TOPIC

    @property
    def output(self) -> str:
        """The output the worker writes to (:data:`consumer.outputs.registry.OUTPUTS`):
        ``frames_topic`` when ``frames_topic`` is set (scale-out mode), else ``duckdb``."""
        return "duckdb" if self.frames_topic is None else "frames_topic"

    def membership_kwargs(self) -> dict[str, Any]:
        """``group_instance_id`` / ``session_timeout_ms`` for KafkaConsumer, when set."""
        given = {"group_instance_id": self.group_instance_id,
                 "session_timeout_ms": self.session_timeout_ms}
        return {k: v for k, v in given.items() if v is not None}
