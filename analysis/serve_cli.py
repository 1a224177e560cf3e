"""``gradstream serve``: the consumer worker and the live dashboard in one process.

DuckDB lets one process write the store, and while it does no other process can read it.
So the process that writes is the one that serves: ``serve`` runs a consumer worker
(``consumer.worker.Worker``, the same as ``gradstream consume``) on a background thread,
takes a read cursor on the worker's database instance as soon as the store is open, and
serves the dashboard and ``/api/query`` from it (:mod:`analysis.dashboard`). It advertises
itself in ``<db>.serve.json`` so that ``gradstream query`` finds it; the file is removed
on exit. With ``--no-consume`` it serves an existing store read-only instead.

:class:`ServedWorker` packages this for other commands (e.g. a demo that wants its worker
to serve the page too).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

if TYPE_CHECKING:
    from analysis.dashboard.cursors import ReadCursors
    from analysis.dashboard.server import DashboardServer
    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker

log = logging.getLogger("gradstream.serve")

DEFAULT_PORT = 8765
"""Port of ``gradstream serve`` unless ``--port`` / ``GRADSTREAM_SERVE_PORT`` says otherwise."""


class ServeError(Exception):
    """The dashboard could not start; ``str(exc)`` tells the user what to do."""


def _client_url(url: str, host: str) -> str:
    """The URL clients should use: a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", ""):
        return url.replace("://0.0.0.0:", "://127.0.0.1:", 1)
    if host == "::":
        return url.replace("://[::]:", "://[::1]:", 1)
    return url


class ServedWorker:
    """A consumer worker whose store is served by the dashboard of this process.

    Args:
        settings: the worker's settings (``settings.db`` is the store).
        host / port: where the dashboard listens (port 0 = any free port).
        refresh_s: the page's polling interval, seconds.
        query_timeout_s: longest ``/api/query``, seconds.

    Use as a context manager, or :meth:`start` / :meth:`stop`. :attr:`url` is the page.
    """

    def __init__(
        self, settings: ConsumerSettings, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
        refresh_s: float = 1.0, query_timeout_s: float = 120.0,
    ) -> None:
        self.settings = settings
        self.host, self.port = host, port
        self.refresh_s, self.query_timeout_s = refresh_s, query_timeout_s
        self.worker: Worker | None = None
        self.cursors: ReadCursors | None = None
        self.server: DashboardServer | None = None
        self.url = ""
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 60.0) -> str:
        """Start the worker, wait until the store is open, start the dashboard, write the
        sidecar. Returns the dashboard's URL.

        Raises:
            ServeError: the worker failed (store locked, Kafka unreachable...) or the
                address cannot be bound.
        """
        from analysis.dashboard.cursors import ReadCursors
        from consumer.worker import Worker

        opened = threading.Event()
        roots: list[Any] = []

        def on_open(sink: Any) -> None:
            roots.append(sink.read_cursor())
            opened.set()

        self.worker = Worker(self.settings, on_open=on_open)
        self._thread = threading.Thread(target=self._run_worker, name="gradstream-worker",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not opened.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._thread.join(5)
                raise ServeError(_worker_failure(self.worker.error, self.settings.db))
        self.cursors = ReadCursors.from_connection(roots[0], self.settings.db)
        self._serve(self.cursors, writer=True)
        return self.url

    def _run_worker(self) -> None:
        assert self.worker is not None
        try:
            self.worker.run()
        except Exception as exc:  # kept in worker.error; reported by start() / alive()
            log.error("consumer worker stopped: %s", exc)

    def _serve(self, cursors: ReadCursors, writer: bool) -> None:
        from analysis.dashboard.server import Dashboard, DashboardServer
        from analysis.dashboard.sidecar import new_token, write_sidecar

        token = new_token()
        app = Dashboard(cursors, token, self.refresh_s, self.query_timeout_s, self._status)
        try:
            self.server = DashboardServer(app, self.host, self.port)
        except OSError as exc:
            self.stop()
            raise ServeError(
                f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc} "
                "(choose another --port, or stop the process using it)"
            ) from None
        self.server.start()
        self.url = _client_url(self.server.url, self.host)
        write_sidecar(cursors.db, self.url, token, writer=writer)

    def _status(self) -> dict[str, Any]:
        if self.worker is None:
            return {}
        counters = asdict(self.worker.counters)
        counters.pop("dead_letter_reasons", None)
        return {"counters": counters, "worker_alive": self.alive(),
                "group_id": self.settings.group_id, "topic": self.settings.topic}

    def alive(self) -> bool:
        """Whether the worker thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Remove the sidecar, stop the dashboard, close the cursors, stop the worker."""
        from analysis.dashboard.sidecar import remove_sidecar

        if self.cursors is not None:
            remove_sidecar(self.cursors.db)
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.cursors is not None:
            self.cursors.close()
        if self.worker is not None:
            self.worker.stop()
        if self._thread is not None:
            self._thread.join(60)

    def __enter__(self) -> ServedWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServedStore(ServedWorker):
    """The dashboard on a store no process writes (opened read-only); no worker.

    Args:
        db: the store file. Other arguments as :class:`ServedWorker`.
    """

    def __init__(self, db: Path, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 refresh_s: float = 1.0, query_timeout_s: float = 120.0) -> None:
        super().__init__(None, host, port, refresh_s, query_timeout_s)  # type: ignore[arg-type]
        self.db = db

    def start(self, timeout: float = 60.0) -> str:
        """Open the store read-only and start the dashboard.

        Raises:
            ServeError: missing file, store locked by a writer, or address in use.
        """
        import duckdb

        from analysis.dashboard.cursors import ReadCursors

        if not self.db.exists():
            raise ServeError(f"no gradstream store at {str(self.db)!r} (pass --db)")
        try:
            self.cursors = ReadCursors.open_read_only(self.db)
        except duckdb.Error as exc:
            hint = (" It is being written by another process: run `gradstream serve` in place "
                    "of that process, or query through its server.") if "lock" in str(
                exc).lower() else ""
            raise ServeError(f"cannot open {str(self.db)!r} read-only: {exc}.{hint}") from None
        self._serve(self.cursors, writer=False)
        return self.url

    def alive(self) -> bool:
        """Always True (no worker)."""
        return True


def _worker_failure(error: BaseException | None, db: str) -> str:
    if error is None:
        return "the consumer worker did not open the store in time"
    text = str(error)
    if "lock" in text.lower():
        return (f"the store {db} is held by another process (a `gradstream consume` or "
                "`serve`?). Stop it, or use --db for another file.")
    return f"the consumer worker failed: {text}"


def serve(
    db: Annotated[
        Path | None,
        typer.Option(help="DuckDB store to write and serve (created if absent). "
                     "Default: $GRADSTREAM_DB or ./gradstream.duckdb."),
    ] = None,
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
                     help="Run the consumer worker (write the store from Kafka) or only "
                     "serve an existing store read-only."),
    ] = True,
    bootstrap_servers: Annotated[
        str | None,
        typer.Option(help="Kafka bootstrap servers host:port[,host:port]. "
                     "Default: $KAFKA_BOOTSTRAP_SERVERS or 127.0.0.1:9092."),
    ] = None,
    topic: Annotated[str | None, typer.Option(help="Summaries topic to consume.")] = None,
    dlq_topic: Annotated[
        str | None, typer.Option(help="Dead-letter topic for unusable messages.")
    ] = None,
    alerts_topic: Annotated[
        str | None, typer.Option(help="Topic for alert events and run statuses.")
    ] = None,
    group_id: Annotated[str | None, typer.Option("--group", help="Kafka consumer group.")] = None,
    shard_timeout: Annotated[
        float | None,
        typer.Option(help="Seconds to wait for every rank of a step before storing the "
                     "frame as partial."),
    ] = None,
    alert_rules: Annotated[
        Path | None,
        typer.Option("--alert-rules", metavar="FILE", help="Alert rules file (.toml/.yaml)."),
    ] = None,
    refresh: Annotated[
        float,
        typer.Option(min=0.1, help="Seconds between two refreshes of the page."),
    ] = 1.0,
    query_timeout: Annotated[
        float,
        typer.Option(min=0.1, help="Longest SQL query answered for `gradstream query`, s."),
    ] = 120.0,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING or ERROR.")] = "INFO",
) -> None:
    """Consume gradient summaries into the store AND serve the live dashboard from the same
    process: runs with health badges, a heatmap that grows while a run streams, the alerts
    feed, drill-down into a layer, export downloads. `gradstream query` goes through this
    process while it holds the store. Stops on Ctrl-C / SIGTERM.

    Other worker settings: GRADSTREAM_<SETTING> environment variables, as for `consume`."""
    from consumer.settings import ConsumerSettings

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)
    console = Console(stderr=True, highlight=False)
    served: ServedWorker
    if consume:
        overrides: dict[str, Any] = {
            "bootstrap_servers": bootstrap_servers, "db": str(db) if db else None,
            "topic": topic, "dlq_topic": dlq_topic, "alerts_topic": alerts_topic,
            "group_id": group_id, "shard_timeout_s": shard_timeout,
            "alert_rules": str(alert_rules) if alert_rules else None,
        }
        settings = ConsumerSettings(**{k: v for k, v in overrides.items() if v is not None})
        served = ServedWorker(settings, host, port, refresh, query_timeout)
        store = settings.db
    else:
        store = str(db or Path(ConsumerSettings().db))
        served = ServedStore(Path(store), host, port, refresh, query_timeout)

    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        url = served.start()
    except ServeError as exc:
        console.print(f"error: {exc}", style="bold red", markup=False)
        raise typer.Exit(1) from None
    mode = "consuming into" if consume else "serving read-only"
    console.print(f"gradstream dashboard: {url}/  ({mode} {store})", markup=False)
    failed = False
    try:
        while not stop.wait(0.5):
            if not served.alive():
                failed = True
                break
    finally:
        served.stop()
    if failed:
        error = served.worker.error if served.worker is not None else None
        console.print(f"error: {_worker_failure(error, store)}", style="bold red", markup=False)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the root application."""
    app.command(
        "serve", help=serve.__doc__,
        short_help="Consume into DuckDB and serve the live dashboard (and SQL) from it.",
    )(serve)
