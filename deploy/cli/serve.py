"""``gradstream serve``: a consumer worker and the live dashboard in one process
(:mod:`deploy.serve`). It takes every option of the worker (:class:`WorkerOptions`, as
``consume`` does) plus where and how to serve. With ``--no-consume`` it serves a store
read-only: a DuckDB file, or an Apache Iceberg table set named by a store URL
(``--db 'iceberg+...'``), whose snapshot it re-reads while writers commit."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from deploy.cli.consume import ENVIRONMENT, LoggingOptions, WorkerOptions, run_served
from deploy.cli.errors import fail
from deploy.cli.options import (
    DEFAULT_DB,
    AlertRoutingOptions,
    MaxReadersOption,
    TokenOption,
    store_location,
    with_option_groups,
)
from deploy.serve import (
    DEFAULT_MAX_READERS,
    DEFAULT_PORT,
    DEFAULT_SNAPSHOT_INTERVAL_S,
    ServedStore,
    ServedWorker,
)

ServeDbOption = Annotated[
    Path | None,
    typer.Option("--db", metavar="PATH|URL", parser=store_location, show_default=False,
                 help="DuckDB file to write (created if absent). "
                 f"Default: $GRADSTREAM_DB or ./{DEFAULT_DB}. With --no-consume, the store "
                 "to serve: that file, or an Apache Iceberg table set's store URL "
                 "iceberg+<catalog>?warehouse=<warehouse>[&namespace=<ns>] as the read "
                 "commands take it (e.g. iceberg+sqlite:////abs/catalog.db?warehouse="
                 "file:///abs/wh), re-read while writers commit (--snapshot-interval)."),
]
"""``serve``'s ``--db``: the worker's ``WriteDbOption`` (a path), except that a store URL
stays the ``str`` given (:func:`deploy.cli.options.store_location`), for ``--no-consume``."""


@dataclasses.dataclass(frozen=True)
class ServeWorkerOptions(WorkerOptions):
    """The worker's options as ``serve`` takes them: ``--db`` may also be a store URL
    (:data:`ServeDbOption`), which only ``--no-consume`` serves; ``consume`` keeps
    :class:`WorkerOptions`, whose ``--db`` is a DuckDB file's path."""

    db: ServeDbOption = None


CONSUME_URL_MESSAGE = (
    "serve's worker writes a DuckDB file at --db, not a store URL: add --no-consume to serve "
    "the Iceberg table set read-only, and write Iceberg with `gradstream consume "
    "--iceberg-catalog URL --iceberg-warehouse URL` (or `gradstream store`)")
"""Why ``serve`` without ``--no-consume`` refuses a store URL (exit status 2)."""


@with_option_groups
def serve(
    *,
    host: Annotated[
        str,
        typer.Option(envvar="GRADSTREAM_SERVE_HOST",
                     help="Address to listen on. Loopback by default; another address "
                     "exposes your gradient history to that network."),
    ] = "127.0.0.1",
    port: Annotated[
        int,
        typer.Option(envvar="GRADSTREAM_SERVE_PORT", min=0, max=65535,
                     help="TCP port (0 = any free port; the URL is printed)."),
    ] = DEFAULT_PORT,
    consume: Annotated[
        bool,
        typer.Option("--consume/--no-consume",
                     help="Run the consumer worker (write the store from Kafka), or only "
                     "serve an existing store read-only (then of the worker's options only "
                     "--db applies)."),
    ] = True,
    refresh: Annotated[
        float,
        typer.Option(min=0.1, help="Seconds between two refreshes of the page."),
    ] = 1.0,
    query_timeout: Annotated[
        float,
        typer.Option(min=0.1, help="Longest SQL query answered for `gradstream query`, s."),
    ] = 120.0,
    max_readers: MaxReadersOption = DEFAULT_MAX_READERS,
    token: TokenOption = None,
    snapshot_interval: Annotated[
        float,
        typer.Option(envvar="GRADSTREAM_SERVE_SNAPSHOT_INTERVAL_S", min=0.1,
                     help="With --no-consume on a store URL (Iceberg): least seconds between "
                     "two checks of the tables' current snapshot. A read arriving later "
                     "starts a check in the background (one catalog query) and the tables "
                     "are loaded again when a writer committed; reads meanwhile get the "
                     "snapshot already loaded."),
    ] = DEFAULT_SNAPSHOT_INTERVAL_S,
    worker: ServeWorkerOptions,
    routing: AlertRoutingOptions,
    logs: LoggingOptions,
) -> None:
    """Consume gradient summaries into the store AND serve the live dashboard from the same
    process: runs with health badges, a heatmap that grows while a run streams, the alerts
    feed, drill-down into a layer, export downloads. Every page and read requires the token:
    open the printed URL (http://127.0.0.1:PORT/?token=...), which lets the browser in;
    scripts send the header (the token is in <db>.serve.json). `gradstream query` goes
    through this process while it holds the store. Stops on Ctrl-C / SIGTERM. The worker is
    the one of `gradstream consume` and takes the same options. With --no-consume it
    serves a store read-only: a DuckDB file no process writes, or an Iceberg table set
    (--db 'iceberg+...'), whose new snapshots show up as writers commit them."""
    logs.setup()
    console = Console(stderr=True, highlight=False)
    served: ServedWorker | ServedStore
    if consume:
        settings = worker.settings(**routing.settings())
        if isinstance(store_location(settings.db), str):  # --db or $GRADSTREAM_DB
            fail(CONSUME_URL_MESSAGE, 2)
        if settings.frames_topic is not None:
            fail("serve writes the store in this process: unset GRADSTREAM_FRAMES_TOPIC "
                 "(scale-out workers publish their frames and have no store to serve)", 2)
        served = ServedWorker(settings, host, port, refresh, query_timeout, max_readers,
                              token=token)
    else:
        from consumer.settings import ConsumerSettings

        db = store_location(worker.db or ConsumerSettings().db)
        served = ServedStore(db, host, port, refresh, query_timeout, max_readers, token,
                             snapshot_interval)
    mode = "consuming into" if consume else "serving read-only"
    run_served(served, "serve", "gradstream.serve", "stopping",
               lambda _url: console.print(
                   f"gradstream dashboard: {served.dashboard_url}  ({mode} {served.db})",
                   markup=False, soft_wrap=True))  # one line: the URL stays whole


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the root application."""
    app.command(
        "serve", help=f"{inspect.cleandoc(serve.__doc__ or '')}\n\n{ENVIRONMENT}",
        short_help="Consume into DuckDB and serve the live dashboard (and SQL) from it.",
    )(serve)
