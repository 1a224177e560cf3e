"""``gradstream consume``: run a consumer worker in this process."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

_ENV = "Environment: KAFKA_BOOTSTRAP_SERVERS and GRADSTREAM_<SETTING> (e.g. GRADSTREAM_DB)."


def consume(
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(help="Kafka bootstrap servers host:port[,host:port]. "
                     "Default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092."),
    ] = None,
    db: Annotated[
        Path | None,
        typer.Option(help="DuckDB file to write (created if absent). "
                     "Default: $GRADSTREAM_DB or ./gradstream.duckdb."),
    ] = None,
    topic: Annotated[str | None, typer.Option(help="Summaries topic to consume.")] = None,
    dlq_topic: Annotated[
        str | None, typer.Option(help="Dead-letter topic for unusable messages.")
    ] = None,
    group_id: Annotated[str | None, typer.Option("--group", help="Kafka consumer group.")] = None,
    shard_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds to wait for every rank of a step before storing the "
                     "frame as partial (a late rank rewrites it)."),
    ] = None,
    max_frames: Annotated[
        int | None,
        typer.Option(help="Rolling window of run health in frames; 0 = whole run."),
    ] = None,
    partitions: Annotated[
        int | None, typer.Option(help="Partitions of topics this worker creates.")
    ] = None,
    alerts_topic: Annotated[
        str | None, typer.Option(help="Topic for alert events and run statuses.")
    ] = None,
    alert_rules: Annotated[
        Path | None,
        typer.Option("--alert-rules", metavar="FILE",
                     help="Alert rules and thresholds, a .toml or .yaml file (see `gradstream "
                     "alert-rules --help`). Default: $GRADSTREAM_ALERT_RULES or built-in."),
    ] = None,
    alert_set: Annotated[
        list[str] | None,
        typer.Option("--alert-set", metavar="RULE.FIELD=VALUE",
                     help="Override one rule setting, e.g. exploding.consecutive=5 "
                     "(repeatable; applied over --alert-rules)."),
    ] = None,
    webhook: Annotated[
        str | None,
        typer.Option("--webhook", metavar="URL",
                     help="POST every alert event as Slack-compatible JSON to this URL "
                     "(e.g. a Slack incoming webhook). Default: $GRADSTREAM_WEBHOOK_URL."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, metavar="PORT",
                     help="Serve Prometheus metrics on http://0.0.0.0:PORT/metrics; 0 = off. "
                     "Default: $GRADSTREAM_METRICS_PORT or off."),
    ] = None,
    frames_topic: Annotated[
        str | None,
        typer.Option(metavar="TOPIC",
                     help="Scale-out mode: publish finished frames to this topic (read by "
                     "`gradstream store`) instead of writing DuckDB; run as many workers as "
                     "the summaries topic has partitions, on any hosts. "
                     "Default: $GRADSTREAM_FRAMES_TOPIC or off."),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(min=1, help="Start this many worker processes on this host (scale-out "
                     "mode: needs --frames-topic; metrics ports are PORT, PORT+1, ...). A "
                     "worker that dies is restarted."),
    ] = 1,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
    log_format: Annotated[
        str,
        typer.Option(envvar="GRADSTREAM_LOG_FORMAT",
                     help="'text' (human-readable) or 'json' (one JSON object per line, for "
                     "log collectors)."),
    ] = "text",
) -> None:
    """Consume gradient summaries, merge ranks into frames, classify health and store
    everything in DuckDB. Stops cleanly on Ctrl-C / SIGTERM (writes what is final,
    leaves the group). Bad messages go to the dead-letter topic and never stop it.
    """
    from consumer.logging_setup import setup_logging
    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker

    try:
        setup_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    overrides: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers,
        "db": str(db) if db else None,
        "topic": topic,
        "dlq_topic": dlq_topic,
        "group_id": group_id,
        "shard_timeout_s": shard_timeout,
        "max_frames": max_frames,
        "partitions": partitions,
        "alerts_topic": alerts_topic,
        "alert_rules": str(alert_rules) if alert_rules else None,
        "alert_set": alert_set or None,
        "webhook_url": webhook,
        "metrics_port": metrics_port,
        "frames_topic": frames_topic,
    }
    settings = ConsumerSettings(**{k: v for k, v in overrides.items() if v is not None})
    if workers > 1:
        if settings.frames_topic is None:
            raise typer.BadParameter(
                "--workers N > 1 needs --frames-topic (scale-out mode): one DuckDB file has "
                "one writing process; run `gradstream store --db FILE` to store the frames.",
                param_hint="--workers",
            )
        from consumer.supervisor import run_workers

        raise typer.Exit(run_workers(settings, workers, log_level, log_format))
    from consumer.alerts.config import AlertConfigError, load_alert_rules

    try:  # refuse a bad rule file before joining the group
        load_alert_rules(settings.alert_rules, settings.alert_set)
    except AlertConfigError as exc:
        typer.secho(f"invalid alert rules:\n{exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    worker = Worker(settings)

    def _stop(signum: int, _frame: object) -> None:
        logging.getLogger("gradstream.consumer").info(
            "received %s: finishing the batch", signal.Signals(signum).name
        )
        worker.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        worker.run()
    except Exception as exc:
        typer.secho(f"gradstream consume failed: {exc}", fg="red", err=True)
        if "lock" in str(exc).lower():
            typer.secho(
                f"The DuckDB file {settings.db} is held by another process "
                "(another `gradstream consume`?). Stop it or use --db.", err=True,
            )
        raise typer.Exit(1) from None


consume.__doc__ = f"{consume.__doc__}\n\n{_ENV}"


def store(
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(help="Kafka bootstrap servers host:port[,host:port]. "
                     "Default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092."),
    ] = None,
    db: Annotated[
        Path | None,
        typer.Option(help="DuckDB file to write (created if absent). "
                     "Default: $GRADSTREAM_DB or ./gradstream.duckdb."),
    ] = None,
    frames_topic: Annotated[
        str | None, typer.Option(metavar="TOPIC", help="Frames topic the workers publish to.")
    ] = None,
    group_id: Annotated[
        str | None, typer.Option(
            "--group", help="Name under which the store keeps its consumed offsets in "
            "DuckDB (it joins no Kafka consumer group: it reads every partition itself).")
    ] = None,
    alerts_topic: Annotated[
        str | None,
        typer.Option(metavar="TOPIC", help="Alerts topic of the workers, whose alert events "
                     "go into the alerts table. Default: $GRADSTREAM_ALERTS_TOPIC or "
                     "gradstream.alerts."),
    ] = None,
    max_frames: Annotated[
        int | None,
        typer.Option(help="Rolling window of run health in frames; 0 = whole run."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(min=0, max=65535, metavar="PORT",
                     help="Serve Prometheus metrics on this port; 0 = off."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
    log_format: Annotated[
        str, typer.Option(envvar="GRADSTREAM_LOG_FORMAT", help="'text' or 'json'."),
    ] = "text",
) -> None:
    """Store the frames published by scale-out workers (`consume --frames-topic`) in
    DuckDB: rows and consumed offsets in one transaction, each frame exactly once; a late
    rank's frame is merged into the stored partial frame; the workers' alert events go
    into the alerts table. Run exactly one per DuckDB file. Stops cleanly on Ctrl-C /
    SIGTERM.
    """
    from consumer.logging_setup import setup_logging
    from consumer.store import Store
    from consumer.store_settings import StoreSettings

    try:
        setup_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    overrides: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers, "db": str(db) if db else None,
        "frames_topic": frames_topic, "group_id": group_id, "max_frames": max_frames,
        "alerts_topic": alerts_topic,
        "metrics_port": metrics_port,
    }
    settings = StoreSettings(**{k: v for k, v in overrides.items() if v is not None})
    process = Store(settings)

    def _stop(signum: int, _frame: object) -> None:
        logging.getLogger("gradstream.store").info(
            "received %s: writing the batch", signal.Signals(signum).name
        )
        process.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    try:
        process.run()
    except Exception as exc:
        typer.secho(f"gradstream store failed: {exc}", fg="red", err=True)
        if "lock" in str(exc).lower():
            typer.secho(f"The DuckDB file {settings.db} is held by another process.", err=True)
        raise typer.Exit(1) from None


store.__doc__ = f"{store.__doc__}\n\n{_ENV}"


def register(app: typer.Typer) -> None:
    """Add the consumer's subcommands (``consume``, ``store``) to the root application."""
    app.command(
        "consume",
        help=consume.__doc__,
        short_help="Consume summaries from Kafka: merge ranks, frames, health -> DuckDB.",
    )(consume)
    app.command(
        "store",
        help=store.__doc__,
        short_help="Scale-out mode: store the workers' frames topic in DuckDB (one process).",
    )(store)
