"""A consumer worker and the live dashboard in one process (what ``gradstream serve`` runs).

DuckDB lets one process write the store, and while it does no other process can read it.
So the process that writes is the one that serves: :class:`ServedWorker` runs a consumer
worker (:class:`consumer.worker.Worker`, the same as ``gradstream consume``) on a background
thread, takes a read cursor on the worker's database instance as soon as the store is open,
and serves the dashboard and ``/api/query`` from it (:mod:`analysis.dashboard`). It
advertises itself in ``<db>.serve.json`` so that ``gradstream query`` finds it; the file is
removed on stop. :class:`ServedStore` serves a store no process writes, read-only.

This joins the consumer and the analysis packages, which do not import each other, so it
lives in ``deploy``; the demo uses it too, to serve the page while it trains.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def client_url(url: str, host: str) -> str:
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
                raise ServeError(worker_failure(self.worker.error, self.settings.db))
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
        self.url = client_url(self.server.url, self.host)
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


def worker_failure(error: BaseException | None, db: str) -> str:
    """What to tell the user when the worker serving ``db`` stopped with ``error`` (None:
    it never opened the store)."""
    if error is None:
        return "the consumer worker did not open the store in time"
    text = str(error)
    if "lock" in text.lower():
        return (f"the store {db} is held by another process (a `gradstream consume` or "
                "`serve`?). Stop it, or use --db for another file.")
    return f"the consumer worker failed: {text}"
