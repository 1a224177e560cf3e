"""``gradstream demo``: a real data-parallel training run, end to end
(:mod:`deploy.demo.pipeline`).

Starts (or reuses) a Kafka broker, runs a consumer worker writing a fresh DuckDB file,
trains the four demo scenarios (healthy, vanishing, exploding, bad-rank) as N rank
processes that each send the averaged gradient they apply (a replicated layout, counted
once) with their own local gradient as the per-rank local view, then prints each run's
report read back from DuckDB and writes the CSV/JSON exports.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from deploy.cli.options import WebhookOption


def demo(
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
        int | None,
        typer.Option(metavar="PORT", help="Serve the live dashboard (the demo's worker owns "
                     "the DuckDB file, so it serves the page) on 127.0.0.1:PORT while training "
                     "runs; 0 = any free port. Default: off."),
    ] = None,
) -> None:
    """Train an MLP on the digits dataset, data-parallel, in four scenarios, and watch
    gradstream catch vanishing and exploding gradients, and name the rank whose corrupted
    data turned every rank's update NaN, end to end (Kafka -> worker -> DuckDB -> report).
    Writes out/demo.duckdb and per-run CSV/JSON exports."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from deploy.broker import BrokerError
    from deploy.demo.pipeline import (
        SCENARIO_NAMES,
        kafka_for_demo,
        report_runs,
        train_and_consume,
    )
    from deploy.demo.training import SCENARIOS

    console = Console()
    chosen = scenario or list(SCENARIO_NAMES)
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        console.print(f"[red]unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
        raise typer.Exit(2)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    out.mkdir(parents=True, exist_ok=True)
    db = out / "demo.duckdb"
    for stale in (db, db.with_suffix(".duckdb.wal")):
        stale.unlink(missing_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        with kafka_for_demo(bootstrap_servers) as bootstrap:
            console.print(f"Kafka bootstrap servers: [bold]{bootstrap}[/]")
            run_ids = train_and_consume(
                console, bootstrap, db, chosen, ranks, steps, stamp, webhook, serve_port,
                Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                         console=console),
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
        short_help="Real data-parallel training in four scenarios, end to end.",
    )(demo)
