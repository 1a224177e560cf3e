"""``gradstream consume`` and ``gradstream store``: the pipeline's processes.

:class:`WorkerOptions` is every option of a consumer worker; ``consume`` and ``serve``
(which runs the same worker beside the dashboard) both take it, so they cannot drift apart.
:class:`LoggingOptions` is taken by every long-running process. :class:`ReadOptions` is the
read endpoint of a process that writes a store (:mod:`deploy.serve`), and
:func:`run_served` runs such a process until Ctrl-C / SIGTERM: ``consume``, ``store`` and
``serve`` all answer reads while they write, through the same helper.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from deploy.cli.errors import fail
from deploy.cli.options import (
    AlertRoutingOptions,
    AlertRulesOption,
    AlertSetOption,
    AlertsTopicOption,
    BootstrapServersOption,
    DlqTopicOption,
    ExcludeRoundingOption,
    FramesTopicOption,
    GroupInstanceIdOption,
    GroupOption,
    IcebergOptions,
    IgnoreLayersOption,
    LogFormatOption,
    LogLevelOption,
    MaxFramesOption,
    MaxReadersOption,
    MetricsPortOption,
    NonfiniteVerdictOption,
    OptionGroup,
    PartitionsOption,
    ReadEndpointOption,
    ReadPortOption,
    RunsTopicOption,
    ShardTimeoutOption,
    StuckPartitionTimeoutOption,
    SummariesTopicOption,
    TokenOption,
    WebhookOption,
    WriteDbOption,
    given,
    with_option_groups,
)
from deploy.serve import DEFAULT_MAX_READERS, DEFAULT_READ_PORT, EndpointOptions

if TYPE_CHECKING:
    from consumer.settings import ConsumerSettings
    from deploy.serve import ServedLoop, ServedStore

ENVIRONMENT = "Environment: KAFKA_BOOTSTRAP_SERVERS and GRADSTREAM_<SETTING> (e.g. GRADSTREAM_DB)."
"""The last paragraph of the help of the commands that start a worker or the store."""


SettingsT = TypeVar("SettingsT")


def valid_settings(settings_type: Callable[..., SettingsT], **fields: Any) -> SettingsT:
    """``settings_type(**fields)`` (a pydantic-settings class, which also reads the
    environment); exits with status 2 (:func:`deploy.cli.errors.fail`), before anything
    connects, when a value is invalid, printing each field's error without its value (a
    PagerDuty routing key is a secret)."""
    from pydantic import ValidationError

    try:
        return settings_type(**fields)
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                 for e in exc.errors(include_url=False)]
        fail("invalid settings:\n" + "\n".join(lines), 2)


@dataclasses.dataclass(frozen=True)
class LoggingOptions(OptionGroup):
    """``--log-level`` and ``--log-format`` of a long-running process."""

    log_level: LogLevelOption = "INFO"
    log_format: LogFormatOption = "text"

    def setup(self) -> None:
        """Configure logging on stderr (:func:`consumer.logging_setup.setup_logging`).

        Raises:
            typer.BadParameter: unknown level or format.
        """
        from consumer.logging_setup import setup_logging

        try:
            setup_logging(self.log_level, self.log_format)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class ReadOptions(OptionGroup):
    """``--read-endpoint/--no-read-endpoint``, ``--read-port``, ``--max-readers`` and
    ``--token`` of a process that writes a store."""

    read_endpoint: ReadEndpointOption = True
    read_port: ReadPortOption = DEFAULT_READ_PORT
    max_readers: MaxReadersOption = DEFAULT_MAX_READERS
    token: TokenOption = None

    def options(self) -> EndpointOptions | None:
        """The endpoint on 127.0.0.1 (:class:`deploy.serve.EndpointOptions`), or None when
        turned off."""
        if not self.read_endpoint:
            return None
        return EndpointOptions(port=self.read_port, max_readers=self.max_readers,
                               token=self.token)


@dataclasses.dataclass(frozen=True)
class WorkerOptions(OptionGroup):
    """The options of a consumer worker (:class:`consumer.settings.ConsumerSettings`)."""

    bootstrap_servers: BootstrapServersOption = None
    db: WriteDbOption = None
    topic: SummariesTopicOption = None
    dlq_topic: DlqTopicOption = None
    group_id: GroupOption = None
    group_instance_id: GroupInstanceIdOption = None
    shard_timeout: ShardTimeoutOption = None
    max_frames: MaxFramesOption = None
    ignore_layers: IgnoreLayersOption = None
    exclude_rounding_level: ExcludeRoundingOption = None
    nonfinite_rule: NonfiniteVerdictOption = None
    partitions: PartitionsOption = None
    alerts_topic: AlertsTopicOption = None
    alert_rules: AlertRulesOption = None
    alert_set: AlertSetOption = None
    webhook: WebhookOption = None
    metrics_port: MetricsPortOption = None
    stuck_partition_timeout: StuckPartitionTimeoutOption = None

    def settings(self, **more: Any) -> ConsumerSettings:
        """The worker's settings: the options given here and in ``more`` (settings fields),
        then the environment, then the defaults. Exits with status 2, before anything
        connects, when the alert rules are invalid."""
        from consumer.alerts.config import AlertConfigError, load_alert_rules
        from consumer.settings import ConsumerSettings

        settings = valid_settings(ConsumerSettings, **given(
            bootstrap_servers=self.bootstrap_servers, db=self.db, topic=self.topic,
            dlq_topic=self.dlq_topic, group_id=self.group_id,
            group_instance_id=self.group_instance_id, shard_timeout_s=self.shard_timeout,
            max_frames=self.max_frames, ignore_layers=self.ignore_layers or None,
            exclude_rounding_level=self.exclude_rounding_level,
            nonfinite_rule=None if self.nonfinite_rule is None else self.nonfinite_rule.value,
            partitions=self.partitions, alerts_topic=self.alerts_topic,
            alert_rules=self.alert_rules, alert_set=self.alert_set or None,
            webhook_url=self.webhook, metrics_port=self.metrics_port,
            stuck_partition_timeout_s=self.stuck_partition_timeout, **more,
        ))
        try:
            load_alert_rules(settings.alert_rules, settings.alert_set)
        except AlertConfigError as exc:
            fail(f"invalid alert rules:\n{exc}", 2)
        return settings


WorkersOption = Annotated[
    int,
    typer.Option("--workers", min=1,
                 help="Start this many worker processes on this host (scale-out mode: needs "
                 "--frames-topic; metrics ports are PORT, PORT+1, ...). A worker that dies "
                 "is restarted."),
]


@with_option_groups
def consume(
    *,
    worker: WorkerOptions,
    frames_topic: FramesTopicOption = None,
    runs_topic: RunsTopicOption = None,
    workers: WorkersOption = 1,
    iceberg: IcebergOptions,
    routing: AlertRoutingOptions,
    read: ReadOptions,
    logs: LoggingOptions,
) -> None:
    """Consume gradient summaries, merge ranks into frames, classify health and store
    everything in DuckDB. While it writes, it answers reads (`gradstream query`, `report`,
    `export`, notebooks) on a loopback endpoint advertised in <db>.serve.json. Stops
    cleanly on Ctrl-C / SIGTERM (writes what is final, leaves the group). Bad messages go
    to the dead-letter topic and never stop it."""
    logs.setup()
    settings = worker.settings(**given(frames_topic=frames_topic, runs_topic=runs_topic),
                               **iceberg.settings(), **routing.settings())
    if workers > 1:
        if settings.frames_topic is None:
            raise typer.BadParameter(
                "--workers N > 1 needs --frames-topic (scale-out mode): one DuckDB file has "
                "one writing process; run `gradstream store --db FILE` to store the frames.",
                param_hint="--workers",
            )
        from consumer.supervisor import run_workers

        raise typer.Exit(run_workers(settings, workers, logs.log_level, logs.log_format))
    from consumer.worker import Worker
    from deploy.serve import ServedLoop

    # A scale-out worker publishes its frames and writes no store, and an Iceberg table
    # set is read from its catalog by any process: nothing to serve.
    options = read.options() if settings.output == "duckdb" else None
    served = ServedLoop(functools.partial(Worker, settings), settings.db, options, "consume")
    run_served(served, "consume", "gradstream.consumer", "finishing the batch")


StoreGroupOption = Annotated[
    str | None,
    typer.Option("--group", help="Name under which the store keeps its consumed offsets in "
                 "its output (DuckDB's kafka_offsets table, or the Iceberg snapshots' "
                 "properties). It joins no Kafka consumer group: it assigns itself every "
                 "partition, or those of --assign-partitions."),
]


AssignPartitionsOption = Annotated[
    str | None,
    typer.Option("--assign-partitions", help="Read only these partition numbers of the "
                 "frames and alerts topics (comma-separated, e.g. 0,2): several store "
                 "processes writing one Iceberg table set (--iceberg-catalog) each take "
                 "some. Default: $GRADSTREAM_ASSIGNED_PARTITIONS, else every partition."),
]


@with_option_groups
def store(
    *,
    bootstrap_servers: BootstrapServersOption = None,
    db: WriteDbOption = None,
    frames_topic: FramesTopicOption = None,
    group_id: StoreGroupOption = None,
    alerts_topic: AlertsTopicOption = None,
    alert_rules: AlertRulesOption = None,
    alert_set: AlertSetOption = None,
    webhook: WebhookOption = None,
    max_frames: MaxFramesOption = None,
    ignore_layers: IgnoreLayersOption = None,
    exclude_rounding_level: ExcludeRoundingOption = None,
    nonfinite_rule: NonfiniteVerdictOption = None,
    metrics_port: MetricsPortOption = None,
    stuck_partition_timeout: StuckPartitionTimeoutOption = None,
    assign_partitions: AssignPartitionsOption = None,
    iceberg: IcebergOptions,
    routing: AlertRoutingOptions,
    read: ReadOptions,
    logs: LoggingOptions,
) -> None:
    """Store the frames published by scale-out workers (`consume --frames-topic`) in
    DuckDB: rows and consumed offsets in one transaction, each frame exactly once; a late
    rank's frame is merged into the stored partial frame. A run's frames (its steps may
    come from several workers) are taken in step order for the run health and the alert
    rules, which the store evaluates and publishes to the alerts topic; the alert events
    go into the alerts table. Run exactly one per DuckDB file. While it writes, it answers
    reads on a loopback endpoint advertised in <db>.serve.json. Stops cleanly on Ctrl-C /
    SIGTERM."""
    from consumer.alerts.config import AlertConfigError, load_alert_rules
    from consumer.store_writer import StoreWriter
    from consumer.store_writer_settings import StoreWriterSettings
    from deploy.serve import ServedLoop

    logs.setup()
    settings = valid_settings(StoreWriterSettings, **given(
        bootstrap_servers=bootstrap_servers, db=db, frames_topic=frames_topic,
        group_id=group_id, alerts_topic=alerts_topic, alert_rules=alert_rules,
        alert_set=alert_set or None, webhook_url=webhook, max_frames=max_frames,
        ignore_layers=ignore_layers or None, exclude_rounding_level=exclude_rounding_level,
        nonfinite_rule=None if nonfinite_rule is None else nonfinite_rule.value,
        metrics_port=metrics_port, stuck_partition_timeout_s=stuck_partition_timeout,
        assigned_partitions=assign_partitions,
    ), **iceberg.settings(), **routing.settings())
    try:
        load_alert_rules(settings.alert_rules, settings.alert_set)
    except AlertConfigError as exc:
        fail(f"invalid alert rules:\n{exc}", 2)
    # An Iceberg table set is read from its catalog by any process: nothing to serve.
    options = read.options() if settings.store_output == "duckdb" else None
    served = ServedLoop(functools.partial(StoreWriter, settings), settings.db, options,
                        "store")
    run_served(served, "store", "gradstream.store", "writing the batch")


def run_served(served: ServedLoop | ServedStore, command: str, logger: str, doing: str,
               announce: Callable[[str], None] | None = None) -> None:
    """Run ``served`` until Ctrl-C / SIGTERM (logging what the process does meanwhile,
    ``doing``), then stop it: sidecar removed, last batch written, file closed.
    ``announce`` receives the endpoint's URL once serving (default: logged at INFO).

    Exits with status 1 (:func:`deploy.cli.errors.fail`) when it cannot start, or when its
    loop ends by itself (store locked, Kafka unreachable...).
    """
    from deploy.serve import ServeError

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger(logger).info("received %s: %s", signal.Signals(signum).name, doing)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        url = served.start()
    except ServeError as exc:
        fail(f"gradstream {command} failed: {exc}")
    if url:
        (announce or _log_endpoint(logger, served.db))(url)
    if served.wait(stop):
        fail(f"gradstream {command} failed: {served.failure()}")


def _log_endpoint(logger: str, db: str) -> Callable[[str], None]:
    """Log the read endpoint's URL (the token is only in the sidecar)."""
    from analysis.read.sidecar import sidecar_path

    def announce(url: str) -> None:
        logging.getLogger(logger).info("answering reads of %s at %s (token in %s)", db, url,
                                       sidecar_path(db))

    return announce


def register(app: typer.Typer) -> None:
    """Add ``consume`` and ``store`` to the root application."""
    app.command(
        "consume", help=f"{inspect.cleandoc(consume.__doc__ or '')}\n\n{ENVIRONMENT}",
        short_help="Consume summaries from Kafka: merge ranks, frames, health -> DuckDB.",
    )(consume)
    app.command(
        "store", help=f"{inspect.cleandoc(store.__doc__ or '')}\n\n{ENVIRONMENT}",
        short_help="Scale-out mode: store the workers' frames topic in DuckDB (one process).",
    )(store)
