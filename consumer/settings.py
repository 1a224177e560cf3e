"""Worker configuration (pydantic-settings): flags, else ``GRADSTREAM_*`` / ``KAFKA_*``
environment variables, else these defaults."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
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

DEFAULT_ICEBERG_NAMESPACE = "gradstream"
"""The Iceberg namespace of the store's tables unless ``GRADSTREAM_ICEBERG_NAMESPACE``
says otherwise (the project's name: one namespace holds one store's table set)."""

DEFAULT_ICEBERG_COMMIT_INTERVAL_S = 5.0
"""Seconds the Iceberg output asks the loop to leave at least between two writes
(``GRADSTREAM_ICEBERG_COMMIT_INTERVAL_S``;
:attr:`consumer.outputs.base.Output.min_write_interval_s`). Every write commits a
snapshot to each table it touches, at a fixed cost that grows with the table's snapshot
count, so writes are spaced; but a row must be readable within 10 s of being produced. A
row waits in the batch at most this interval (or the write in flight, if longer), then its
own write: half of the 10 s here leaves the other half to a write, which takes well under
5 s at ``max_batch_rows`` rows (``bench/lakehouse.py``)."""

ICEBERG_WAREHOUSE_SCHEMES = ("file", "s3")
"""Warehouse URL schemes the Iceberg output writes to (pyiceberg's PyArrow FileIO: local
files and S3 or an S3-compatible endpoint)."""


class LoopSettings(TopicCreationSettings):
    """Settings every consumer loop reads (:class:`consumer.loop.ConsumerLoop`): the
    worker's (:class:`ConsumerSettings`) and the store's
    (:class:`consumer.store_writer_settings.StoreWriterSettings`).

    Attributes:
        dlq_topic: where unusable messages go.
        group_id: Kafka consumer group (the store: the name of its offsets in DuckDB).
        db: DuckDB file the process writes.
        iceberg_catalog: the Apache Iceberg output's SQL catalog (a SQLAlchemy URL:
            ``sqlite:///path/catalog.db``; ``GRADSTREAM_ICEBERG_CATALOG``): when set, a
            worker writes the store's tables to Iceberg instead of ``db``
            (:mod:`consumer.outputs.iceberg`). None = no Iceberg output.
        iceberg_warehouse: where the Iceberg tables' files go (``file:///path`` or
            ``s3://bucket/path``; ``GRADSTREAM_ICEBERG_WAREHOUSE``); S3 endpoint and
            credentials come from the standard ``AWS_ENDPOINT_URL``,
            ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION``.
        iceberg_namespace: the Iceberg namespace of the tables (created if absent).
        iceberg_commit_interval_s: least seconds between two writes of the Iceberg output
            (:data:`DEFAULT_ICEBERG_COMMIT_INTERVAL_S`); the DuckDB output ignores it.
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
    iceberg_catalog: str | None = Field(default=None, min_length=1)
    iceberg_warehouse: str | None = Field(default=None, min_length=1)
    iceberg_namespace: str = Field(default=DEFAULT_ICEBERG_NAMESPACE, min_length=1)
    iceberg_commit_interval_s: float = Field(default=DEFAULT_ICEBERG_COMMIT_INTERVAL_S, ge=0)
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

    @field_validator("iceberg_warehouse")
    @classmethod
    def _iceberg_warehouse(cls, value: str | None) -> str | None:
        """Accept a ``file://`` or ``s3://`` warehouse URL.

        Raises:
            ValueError: another scheme.
        """
        if value is not None and urlsplit(value).scheme not in ICEBERG_WAREHOUSE_SCHEMES:
            raise ValueError(f"iceberg_warehouse must be a file:///path or s3://bucket/path "
                             f"URL, got {value!r}")
        return value

    @property
    def store_output(self) -> str:
        """The store this loop writes when it writes one
        (:data:`consumer.outputs.registry.OUTPUTS`): ``iceberg`` when ``iceberg_catalog``
        is set, else ``duckdb`` (the file ``db``)."""
        return "duckdb" if self.iceberg_catalog is None else "iceberg"


PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"
"""Where alert events are sent to PagerDuty (PagerDuty Events API v2, "Send an Alert
Event"); ``GRADSTREAM_PAGERDUTY_URL`` replaces it (a PagerDuty EU account's
``https://events.eu.pagerduty.com/v2/enqueue``, or a test server)."""

ALERTMANAGER_RESEND_INTERVAL_S = 60.0
"""Default seconds between two re-sends of the firing incidents to Alertmanager: the
default ``--rules.alert.resend-delay`` of Prometheus (1 m), inside the 30 s to 3 min
Alertmanager asks of its clients ("Sending alerts", Alertmanager documentation)."""

ALERTMANAGER_LEASE_RESENDS = 4
"""A firing alert is sent with ``endsAt`` this many re-send intervals ahead unless
``alertmanager_lease_s`` says otherwise: Prometheus's own rule (``endsAt = now + 4 x
resend delay``, "allow for two ... Alertmanager send failures"): re-sends may fail for
a while before Alertmanager resolves an incident that gradstream still has firing."""

PAGERDUTY_ROUTING_KEY_LENGTH = 32
"""Characters of a PagerDuty routing key (an Events API v2 integration key); PagerDuty
refuses any other length ("should be 32 characters")."""


def _http_url(name: str, value: str | None) -> str | None:
    """``value`` without trailing slashes when it is an http(s) URL (None stays None).

    Raises:
        ValueError: another scheme, or no host.
    """
    if value is None:
        return None
    value = value.strip()
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{name} must be an http:// or https:// URL with a host, got {value!r}")
    return value.rstrip("/")


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
        alert_queue_size: events each queued sink (log, webhook, Alertmanager,
            PagerDuty) holds before dropping.
        status_interval_s: at most one routine run-status record per run per interval.
        alertmanager_url: base URL of a Prometheus Alertmanager (``GRADSTREAM_ALERTMANAGER_URL``,
            e.g. ``http://alertmanager:9093``): each incident is POSTed to
            ``<url>/api/v2/alerts`` (Alertmanager API v2) when it fires, re-sent while it
            fires and sent once more when it resolves (``consumer.alerts.alertmanager``);
            None = no Alertmanager.
        alertmanager_resend_interval_s: seconds between two re-sends of the firing
            incidents (``GRADSTREAM_ALERTMANAGER_RESEND_INTERVAL_S``; default
            :data:`ALERTMANAGER_RESEND_INTERVAL_S`).
        alertmanager_lease_s: a firing incident is sent with ``endsAt`` this many seconds
            ahead (``GRADSTREAM_ALERTMANAGER_LEASE_S``): if gradstream stops re-sending it,
            Alertmanager resolves it then. None = :data:`ALERTMANAGER_LEASE_RESENDS`
            re-send intervals; it must exceed the re-send interval.
        pagerduty_routing_key: the integration key of a PagerDuty Events API v2
            integration (``GRADSTREAM_PAGERDUTY_ROUTING_KEY``, 32 characters): each
            incident triggers a PagerDuty alert and resolves it
            (``consumer.alerts.pagerduty``); None = no PagerDuty.
        pagerduty_url: the Events API v2 endpoint (``GRADSTREAM_PAGERDUTY_URL``; default
            :data:`PAGERDUTY_EVENTS_URL`).
        dashboard_url: base URL of gradstream's dashboard as the people paged reach it
            (``GRADSTREAM_DASHBOARD_URL``, e.g. ``http://gradstream.internal:8765``, where
            ``gradstream serve`` answers): Alertmanager's ``generatorURL`` and PagerDuty's
            link point at ``<url>/?run=<run id>``, the dashboard with that run selected
            (no token in it: the dashboard asks for one). None = no link.
        webhook_timeout_s and webhook_retries apply to every HTTP sink (webhook,
        Alertmanager, PagerDuty).
    """

    alert_rules: str | None = None
    alert_set: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_url: str | None = None
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    webhook_retries: int = Field(default=3, ge=0)
    alert_queue_size: int = Field(default=1000, gt=0)
    status_interval_s: float = Field(default=1.0, gt=0)
    alertmanager_url: str | None = None
    alertmanager_resend_interval_s: float = Field(default=ALERTMANAGER_RESEND_INTERVAL_S,
                                                  gt=0)
    alertmanager_lease_s: float | None = Field(default=None, gt=0)
    pagerduty_routing_key: str | None = Field(default=None, repr=False)
    pagerduty_url: str = PAGERDUTY_EVENTS_URL
    dashboard_url: str | None = None

    @field_validator("alert_set", mode="before")
    @classmethod
    def _alert_set(cls, value: object) -> object:
        """Accept a comma-separated string (``GRADSTREAM_ALERT_SET``) as well as a list."""
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("alertmanager_url", "pagerduty_url", "dashboard_url")
    @classmethod
    def _urls(cls, value: str | None, info: Any) -> str | None:
        """An http(s) URL, trailing slashes removed.

        Raises:
            ValueError: another scheme or no host.
        """
        return _http_url(f"GRADSTREAM_{info.field_name.upper()}", value)

    @field_validator("pagerduty_routing_key")
    @classmethod
    def _routing_key(cls, value: str | None) -> str | None:
        """A PagerDuty routing key: :data:`PAGERDUTY_ROUTING_KEY_LENGTH` characters.

        Raises:
            ValueError: another length, or whitespace in it.
        """
        if value is None:
            return None
        value = value.strip()
        if len(value) != PAGERDUTY_ROUTING_KEY_LENGTH or any(c.isspace() for c in value):
            raise ValueError(
                f"GRADSTREAM_PAGERDUTY_ROUTING_KEY must be the {PAGERDUTY_ROUTING_KEY_LENGTH}-"
                f"character Integration Key of a PagerDuty Events API v2 integration (got "
                f"{len(value)} characters); copy it from the integration's page in PagerDuty")
        return value

    @model_validator(mode="after")
    def _lease_exceeds_resend(self) -> AlertingSettings:
        """Check that a firing incident outlives the wait for its next re-send.

        Raises:
            ValueError: ``alertmanager_lease_s`` <= ``alertmanager_resend_interval_s``.
        """
        if self.alertmanager_lease <= self.alertmanager_resend_interval_s:
            raise ValueError(
                f"GRADSTREAM_ALERTMANAGER_LEASE_S ({self.alertmanager_lease:g} s) must exceed "
                f"GRADSTREAM_ALERTMANAGER_RESEND_INTERVAL_S "
                f"({self.alertmanager_resend_interval_s:g} s), or Alertmanager resolves each "
                "firing incident between two re-sends; leave the lease unset for "
                f"{ALERTMANAGER_LEASE_RESENDS} re-send intervals")
        return self

    @property
    def alertmanager_lease(self) -> float:
        """Seconds ahead of now of a firing incident's ``endsAt``: ``alertmanager_lease_s``,
        else :data:`ALERTMANAGER_LEASE_RESENDS` x ``alertmanager_resend_interval_s``."""
        if self.alertmanager_lease_s is not None:
            return self.alertmanager_lease_s
        return ALERTMANAGER_LEASE_RESENDS * self.alertmanager_resend_interval_s


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

    The output (:attr:`output`): the frames topic in scale-out mode, else the Iceberg
    tables when ``iceberg_catalog`` is set, else the DuckDB file ``db``.
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
        ``frames_topic`` when ``frames_topic`` is set (scale-out mode), else ``iceberg``
        when ``iceberg_catalog`` is set, else ``duckdb``."""
        return "frames_topic" if self.frames_topic is not None else self.store_output

    def membership_kwargs(self) -> dict[str, Any]:
        """``group_instance_id`` / ``session_timeout_ms`` for KafkaConsumer, when set."""
        given = {"group_instance_id": self.group_instance_id,
                 "session_timeout_ms": self.session_timeout_ms}
        return {k: v for k, v in given.items() if v is not None}
