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
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Consume gradient summaries, merge ranks into frames, classify health and store
    everything in DuckDB. Stops cleanly on Ctrl-C / SIGTERM (writes what is final,
    leaves the group). Bad messages go to the dead-letter topic and never stop it.
    """
    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)
    overrides: dict[str, Any] = {
        "bootstrap_servers": bootstrap_servers,
        "db": str(db) if db else None,
        "topic": topic,
        "dlq_topic": dlq_topic,
        "group_id": group_id,
        "shard_timeout_s": shard_timeout,
        "max_frames": max_frames,
        "partitions": partitions,
    }
    settings = ConsumerSettings(**{k: v for k, v in overrides.items() if v is not None})
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


def register(app: typer.Typer) -> None:
    """Add the consumer's subcommands (``consume``) to the root application."""
    app.command(
        "consume",
        help=consume.__doc__,
        short_help="Consume summaries from Kafka: merge ranks, frames, health -> DuckDB.",
    )(consume)
