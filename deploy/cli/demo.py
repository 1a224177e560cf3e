"""``gradstream demo``: a real data-parallel training run, end to end
(:mod:`deploy.demo.pipeline`).

Starts (or reuses) a Kafka broker, runs a consumer worker writing a fresh DuckDB file,
trains the six demo scenarios (healthy, vanishing, exploding, bad-rank, loss-spike,
straggler) as N rank processes that each send the averaged gradient they apply (a
replicated layout, counted once) with their own local gradient as the per-rank local view
and their training scalars (loss, learning rate, compute time), then prints each run's
report read back from DuckDB and writes the CSV/JSON exports.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from deploy.cli.options import (
    AlertRoutingOptions,
    ReadEndpointOption,
    TokenOption,
    WebhookOption,
    with_option_groups,
)

DEMO_EVENT_LOGGERS: dict[str, tuple[str, int]] = {
    "gradstream.alerts": ("alert", logging.CRITICAL),
    "gradstream.consumer": ("worker", logging.WARNING),
}
"""Loggers whose records are the demo's own events (alerts firing and resolving, run
health changing): logger name -> (label printed instead of the level name, highest level
so labelled). A critical alert logs at ERROR; printed as "ERROR" it would read as the demo
failing. The worker's records above WARNING keep their level."""


class DemoLogFormatter(logging.Formatter):
    """One line per record: ``"alert: <message>"`` / ``"worker: <message>"`` for the event
    records of :data:`DEMO_EVENT_LOGGERS`, ``"<LEVEL> <logger>: <message>"`` for any other
    (exception text appended as by ``logging.Formatter``)."""

    def format(self, record: logging.LogRecord) -> str:
        """The text of ``record`` with its label."""
        text = super().format(record)
        label, highest = DEMO_EVENT_LOGGERS.get(record.name, ("", logging.NOTSET))
        if label and record.levelno <= highest:
            return f"{label}: {text}"
        return f"{record.levelname} {record.name}: {text}"


def intro(chosen: list[str], ranks: int, db: Path, bootstrap_servers: str | None) -> str:
    """The demo's first lines: what it trains, where the store is, how to read it.

    Args:
        chosen: scenario names, in run order.
        ranks: data-parallel ranks per scenario.
        db: the DuckDB file the worker writes.
        bootstrap_servers: the Kafka cluster given, or None for the local broker.

    Returns:
        Rich markup, three lines.
    """
    from rich.markup import escape

    kafka = f"Kafka at {escape(bootstrap_servers)}" if bootstrap_servers else "a local Kafka broker"
    store = escape(str(db))
    scenarios = f"{len(chosen)} scenario{'s' if len(chosen) > 1 else ''} ({', '.join(chosen)})"
    return (
        f"[bold]gradstream demo[/]: trains an MLP on digits in {scenarios}, "
        f"{ranks} data-parallel rank{'s' if ranks > 1 else ''} each.\n"
        f"Every rank streams per-step gradient summaries to {kafka}; a worker writes frames, "
        f"health and alerts to [bold]{store}[/].\n"
        f"Reports follow; later read it with [bold]gradstream report --db {store} --all[/] "
        f"or [bold]gradstream query \"SELECT * FROM runs\" --db {store}[/]."
    )


@with_option_groups
def demo(
    *,
    ranks: Annotated[int, typer.Option(min=1, max=16, help="Data-parallel ranks (processes).")] = 3,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Optimiser steps per scenario (default: each "
                                 "scenario's own).")
    ] = None,
    scenario: Annotated[
        list[str] | None,
        typer.Option(help="Scenario to run (repeatable): healthy, vanishing, exploding, "
                     "bad-rank. Default: all four."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for the DuckDB file and exports.")] = Path(
        "out"
    ),
    bootstrap_servers: Annotated[
        str | None, typer.Option(help="Use this Kafka cluster instead of a local broker. "
                                 "Default: $KAFKA_BOOTSTRAP_SERVERS.")
    ] = None,
    heatmap: Annotated[bool, typer.Option(help="Print each run's ASCII heatmap too.")] = True,
    webhook: WebhookOption = None,
    serve_port: Annotated[
        int,
        typer.Option("--serve-port", "--read-port", envvar="GRADSTREAM_READ_PORT", min=0,
                     max=65535, metavar="PORT",
                     help="Serve the live dashboard and the read endpoint (the demo's worker "
                     "owns the DuckDB file, so it answers `gradstream query` and the page) on "
                     "127.0.0.1:PORT while training runs; 0 = any free port. Open the printed "
                     "URL (it carries the token)."),
    ] = 0,
    read_endpoint: ReadEndpointOption = True,
    token: TokenOption = None,
    routing: AlertRoutingOptions,
) -> None:
    """Train an MLP on the digits dataset, data-parallel, in six scenarios, and watch
    gradstream catch vanishing and exploding gradients, name the rank whose corrupted
    data turned every rank's update NaN, the step of a loss spike with the layers whose
    gradient spiked, and a straggling rank, end to end (Kafka -> worker -> DuckDB ->
    report). Writes out/demo.duckdb and per-run CSV/JSON exports."""
    from rich.console import Console
    from rich.highlighter import NullHighlighter
    from rich.logging import RichHandler
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from deploy.broker import BrokerError
    from deploy.demo.pipeline import (
        SCENARIO_NAMES,
        kafka_for_demo,
        report_runs,
        train_and_consume,
    )
    from deploy.demo.scenarios import SCENARIOS

    console = Console()
    chosen = scenario or list(SCENARIO_NAMES)
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        console.print(f"[red]unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
        raise typer.Exit(2)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "demo.duckdb"
    given = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip() or None
    console.print(intro(chosen, ranks, db, given), highlight=False)
    handler = RichHandler(console=console, show_time=False, show_level=False, show_path=False,
                          markup=False, highlighter=NullHighlighter())
    handler.setFormatter(DemoLogFormatter())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    logging.getLogger("kafka").setLevel(logging.ERROR)
    for stale in (db, db.with_suffix(".duckdb.wal")):
        stale.unlink(missing_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        with kafka_for_demo(bootstrap_servers) as bootstrap:
            console.print(f"Kafka bootstrap servers: [bold]{bootstrap}[/]")
            run_ids = train_and_consume(
                console, bootstrap, db, chosen, ranks, steps, stamp, webhook,
                serve_port if read_endpoint else None,
                Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                         console=console),
                token=token, alerting=routing.settings(),
            )
    except BrokerError as exc:
        console.print(f"[red]Could not start a Kafka broker:[/] {exc}")
        raise typer.Exit(1) from None
    report_runs(console, db, run_ids, out, heatmap)


def register(app: typer.Typer) -> None:
    """Add ``demo`` to the root application."""
    app.command(
        "demo",
        help=demo.__doc__,
        short_help="Real data-parallel training in six scenarios, end to end.",
    )(demo)
