"""The read endpoint of every process that writes a store, and the dashboard on it.

DuckDB lets one process write the store, and while it does no other process can open the
file, not even read-only. So the process that writes is the one that answers reads:
:class:`ReadEndpoint` takes a read cursor on the writer's own database instance as soon
as the store is open (the ``on_open(sink)`` hook of :class:`consumer.loop.ConsumerLoop`,
``DuckDBSink.read_cursor()``), serves the dashboard, ``/api/query`` and the other read
routes from it (:mod:`analysis.dashboard`), and advertises itself in ``<db>.serve.json``
(:mod:`analysis.read.sidecar`) so that ``gradstream query`` and the other readers
find it; the file is removed on stop. Every route requires the endpoint's token
(:attr:`EndpointOptions.token`, random unless chosen), which the sidecar holds and
:attr:`ReadEndpoint.dashboard_url` carries for a browser.

:class:`ServedLoop` is the one helper every writing command uses: it runs any consumer
loop (:class:`consumer.worker.Worker` for ``gradstream consume``, ``serve`` and ``demo``;
:class:`consumer.store_writer.StoreWriter` for ``gradstream store``) on a background thread with a
:class:`ReadEndpoint` attached, or none (``--no-read-endpoint``). :class:`ServedWorker` is
that helper for a worker; :class:`ServedStore` serves a store no process writes,
read-only: a DuckDB file, or a store named by a store URL (an Apache Iceberg table set,
``iceberg+...``), whose current snapshot is loaded and re-read when the writers commit
(:class:`analysis.read.snapshots.SnapshotCursors`, every
:data:`DEFAULT_SNAPSHOT_INTERVAL_S` s at most while it is read); such a store has no
sidecar (its readers open it themselves), so its token is the one printed.

Long queries never hold up ingestion: read requests run on their own threads and cursors
(MVCC snapshots, no lock shared with the writer's transactions), at the lowest CPU
priority (so they use the CPU the writer leaves), and at most ``max_readers`` of them run
at once (:class:`BoundedReadCursors`); the others wait for a slot.
``bench/read_contention.py`` measures the ingest rate with and without concurrent readers.

This joins the consumer and the analysis packages, which do not import each other, so it
lives in ``deploy``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import duckdb

    from analysis.dashboard.server import DashboardServer
    from analysis.read.cursors import ReadCursors
    from analysis.read.snapshots import SnapshotCursors
    from consumer.loop import ConsumerLoop
    from consumer.outputs.duckdb import DuckDBSink
    from consumer.settings import ConsumerSettings
    from consumer.worker import Worker

    OnOpen = Callable[[DuckDBSink], None]

log = logging.getLogger("gradstream.serve")

LoopT = TypeVar("LoopT", bound="ConsumerLoop")
"""The consumer loop a :class:`ServedLoop` runs."""

DEFAULT_PORT = 8765
"""Port of ``gradstream serve`` unless ``--port`` / ``GRADSTREAM_SERVE_PORT`` says otherwise."""

DEFAULT_READ_PORT = 0
"""Port of the read endpoint of ``consume``, ``store`` and ``demo``: 0 = any free port (the
URL is in the sidecar)."""

DEFAULT_MAX_READERS = max(1, (os.cpu_count() or 1) // 2)
"""Read requests a process answers at once (the others wait): half the cores, at least one.
The other half is the writer's (the loop thread and the DuckDB writer thread), and DuckDB
parallelises each query over the instance's threads anyway (the ingest rates under
concurrent readers: ``bench/README.md``, ``read_contention.py``)."""

READER_NICE = 19
"""Nice value of the threads that answer reads in a writing process (Linux): 19, the
lowest CPU priority, so that readers use the CPU the writer leaves and a long query never
holds up ingestion (``bench/read_contention.py``: the ingest rate under 4 readers that
query back to back, with this and at normal priority)."""


DEFAULT_SNAPSHOT_INTERVAL_S = 2.0
"""Least seconds between two checks of a served store URL's current snapshot (``serve
--snapshot-interval``, ``GRADSTREAM_SERVE_SNAPSHOT_INTERVAL_S``). A check is one query to
the catalog (each table's metadata location); the store is loaded again only when a table
changed. The Iceberg output commits at most every 5 s
(``consumer.settings.DEFAULT_ICEBERG_COMMIT_INTERVAL_S``) and a row must be readable
within 10 s of being produced: 2 s keeps the dashboard's share of that small while a page
polling every second costs one catalog query per 2 s."""


class ServeError(Exception):
    """The endpoint or its loop could not start; ``str(exc)`` tells the user what to do."""


def client_url(url: str, host: str) -> str:
    """The URL clients should use: a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", ""):
        return url.replace("://0.0.0.0:", "://127.0.0.1:", 1)
    if host == "::":
        return url.replace("://[::]:", "://[::1]:", 1)
    return url


@dataclass(frozen=True)
class EndpointOptions:
    """Where and how a process answers reads.

    Attributes:
        host: address to listen on (loopback by default).
        port: TCP port; 0 = any free port.
        refresh_s: the dashboard page's polling interval, seconds.
        query_timeout_s: longest ``/api/query``, seconds (then interrupted).
        max_readers: read requests run at once (>= 1); ``None`` = no bound.
        reader_nice: nice value (0-19) set on each thread that answers a read; 0 = normal
            priority. Applied on Linux only (elsewhere a thread id is not a priority target).
        token: the secret every route requires (header, or the cookie set by the URL
            :attr:`ReadEndpoint.dashboard_url`); ``None``: a random one
            (:func:`~analysis.read.sidecar.new_token`). Either way it is written in
            the sidecar (a store file's; a store URL has none).
        snapshot_interval_s: least seconds between two checks of a served store URL's
            snapshot (:class:`~analysis.read.snapshots.SnapshotCursors`); unused for a
            store file.

    Raises:
        ValueError: ``token`` fails :func:`~analysis.read.sidecar.check_token`.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_READ_PORT
    refresh_s: float = 1.0
    query_timeout_s: float = 120.0
    max_readers: int | None = DEFAULT_MAX_READERS
    reader_nice: int = READER_NICE
    token: str | None = None
    snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S

    def __post_init__(self) -> None:
        from analysis.read.sidecar import check_token

        if self.token is not None:
            check_token(self.token)


class BoundedReadCursors:
    """:class:`~analysis.read.cursors.ReadCursors` of which at most ``max_readers``
    cursors are open at once, each used at a lower CPU priority: :meth:`cursor` lowers the
    calling thread's priority to ``nice`` and waits for a free slot.

    Args:
        cursors: the cursors to bound (closed by :meth:`close`).
        max_readers: slots (>= 1); ``None``: no bound.
        nice: nice value (0-19) of the threads that take a cursor (Linux; the server's
            worker threads, which answer reads only). 0: unchanged.

    Raises:
        ValueError: ``max_readers`` < 1 or ``nice`` outside 0-19.
    """

    def __init__(self, cursors: ReadCursors | SnapshotCursors, max_readers: int | None,
                 nice: int = 0) -> None:
        if max_readers is not None and max_readers < 1:
            raise ValueError(f"max_readers must be at least 1, got {max_readers}")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be within 0-19, got {nice}")
        self.inner = cursors
        self.db = cursors.db
        self.writer = cursors.writer
        self.nice = nice if sys.platform.startswith("linux") else 0
        self._slots = threading.BoundedSemaphore(max_readers) if max_readers else None

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only cursor (as ``ReadCursors.cursor``), once a slot is free; the calling
        thread runs at nice :attr:`nice` from then on (a thread cannot raise its priority
        back without privileges: call this from threads that only read).

        Raises:
            analysis.read.cursors.StoreClosedError: the store was closed.
        """
        if self.nice:
            tid = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, tid)
            if current < self.nice:
                os.setpriority(os.PRIO_PROCESS, tid, self.nice)
        slot = self._slots if self._slots is not None else contextlib.nullcontext()
        with slot, self.inner.cursor() as cur:
            yield cur

    def snapshot_key(self, cur: duckdb.DuckDBPyConnection) -> int | None:
        """The inner cursors' ``snapshot_key(cur)``: which loaded snapshot ``cur`` reads."""
        return self.inner.snapshot_key(cur)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the cursors (``ReadCursors.close``): queued requests then get
        ``StoreClosedError``."""
        self.inner.close(timeout_s)


class ReadEndpoint:
    """The loopback read endpoint (dashboard, ``/api/query``...) of one store.

    Args:
        db: the store file, or a store URL (``iceberg+...``, :mod:`analysis.read.store_url`;
            served read-only, without a sidecar).
        options: where and how to serve.
        status: extra JSON for ``/api/status`` (e.g. the loop's counters).
        command: the ``gradstream`` command of this process, written in the sidecar.

    :meth:`attach` is the ``on_open`` hook of a consumer loop; :meth:`open_read_only`
    serves a file or a store URL no process of this machine holds. :attr:`url` is the base
    URL once serving, :attr:`token` its secret, :attr:`dashboard_url` the URL to open in a
    browser.
    """

    def __init__(self, db: str | os.PathLike[str], options: EndpointOptions,
                 status: Callable[[], dict[str, Any]] | None = None,
                 command: str = "serve") -> None:
        self.db: Path | str = _store(db)
        self.options = options
        self.status = status
        self.command = command
        self.cursors: BoundedReadCursors | None = None
        self.server: DashboardServer | None = None
        self.url = ""
        self.token = ""
        self._closing = threading.Lock()  # the loop's thread and the main thread both close

    def attach(self, sink: DuckDBSink) -> None:
        """Serve reads on the writer's database instance (called on the loop's thread
        right after the store is opened, before consuming).

        Raises:
            ServeError: the address cannot be bound.
        """
        from analysis.read.cursors import ReadCursors

        self.serve(ReadCursors.from_connection(sink.read_cursor(), self.db), writer=True)

    def open_read_only(self) -> str:
        """Open the store read-only and serve it: a file as it is, a store URL as its
        current snapshot, re-read when it changes (:class:`~analysis.read.snapshots.
        SnapshotCursors`). Returns the URL.

        Raises:
            ServeError: missing file, store locked by a writer, a store URL that cannot
                be read (the message says why), or address in use.
        """
        import duckdb

        from analysis.read.cursors import ReadCursors

        if isinstance(self.db, str):
            return self._open_snapshots(self.db)
        if not self.db.exists():
            raise ServeError(f"no gradstream store at {str(self.db)!r} (pass --db)")
        try:
            cursors = ReadCursors.open_read_only(self.db)
        except duckdb.Error as exc:
            raise ServeError(f"cannot open {str(self.db)!r} read-only: {exc}."
                             f"{_held_hint(self.db, exc)}") from None
        return self.serve(cursors, writer=False)

    def _open_snapshots(self, url: str) -> str:
        """Serve the store URL ``url`` from its loaded snapshots (``/api/status`` tells
        which one, unless :attr:`status` says something else). Returns the URL.

        Raises:
            ServeError: the store cannot be opened or read, or the address is in use.
        """
        from analysis.read.connect import StoreError
        from analysis.read.snapshots import open_snapshot_cursors

        try:
            cursors = open_snapshot_cursors(url, self.options.snapshot_interval_s)
        except (StoreError, ValueError) as exc:
            raise ServeError(str(exc)) from None
        if self.status is None:
            self.status = cursors.status
        return self.serve(cursors, writer=False)

    def serve(self, cursors: ReadCursors | SnapshotCursors, writer: bool) -> str:
        """Serve ``cursors`` over HTTP and write the sidecar (a store file's). Returns the
        URL.

        Raises:
            ServeError: the address cannot be bound (``cursors`` are then closed).
        """
        from analysis.dashboard.server import Dashboard, DashboardServer
        from analysis.read.sidecar import new_token, write_sidecar

        o = self.options
        self.cursors = BoundedReadCursors(cursors, o.max_readers, o.reader_nice)
        token = o.token or new_token()
        app = Dashboard(self.cursors, token, o.refresh_s, o.query_timeout_s,  # type: ignore[arg-type]
                        self.status)
        try:
            self.server = DashboardServer(app, o.host, o.port)
        except OSError as exc:
            self.close()
            raise ServeError(
                f"cannot listen on {o.host}:{o.port}: {exc.strerror or exc} "
                "(choose another port, or stop the process using it)"
            ) from None
        self.server.start()
        self.url = client_url(self.server.url, o.host)
        self.token = token
        if isinstance(self.db, Path):
            write_sidecar(self.db, self.url, token, writer=writer, command=self.command)
        return self.url

    @property
    def dashboard_url(self) -> str:
        """``<url>/?token=<token>``: opens the dashboard and lets the browser in ("" before
        serving)."""
        from analysis.read.sidecar import dashboard_url

        return dashboard_url(self.url, self.token) if self.url else ""

    def close(self) -> None:
        """Remove the sidecar, stop serving, close the cursors (interrupting the queries
        still running), so that the writer can checkpoint and close the file. Idempotent."""
        from analysis.read.sidecar import remove_sidecar

        with self._closing:
            if isinstance(self.db, Path):
                remove_sidecar(self.db)
            if self.server is not None:
                self.server.stop()
                self.server = None
            if self.cursors is not None:
                self.cursors.close()
                self.cursors = None


class ServedLoop(Generic[LoopT]):
    """A consumer loop on a background thread, answering reads on its store while it
    writes.

    Args:
        make_loop: builds the loop given its ``on_open`` hook, e.g.
            ``functools.partial(Worker, settings)`` or ``functools.partial(StoreWriter,
            settings)`` (both take ``(settings, on_open)``).
        db: the store the loop writes.
        options: the read endpoint's; ``None``: no endpoint (the loop holds the file and
            answers nothing).
        command: the ``gradstream`` command of this process (``consume``, ``store``,
            ``serve``, ``demo``), written in the sidecar.

    Use as a context manager, or :meth:`start` / :meth:`stop`. :attr:`url` is the
    endpoint's base URL ("" without one).
    """

    def __init__(self, make_loop: Callable[[OnOpen | None], LoopT],
                 db: str | os.PathLike[str], options: EndpointOptions | None,
                 command: str = "serve") -> None:
        self.db = str(db)
        self.endpoint = (None if options is None  # a loop writes a file: always a Path
                         else ReadEndpoint(Path(db), options, self._status, command))
        self._opened = threading.Event()
        self.loop = make_loop(self._on_open)
        self.url = ""
        self._thread: threading.Thread | None = None

    def _on_open(self, sink: DuckDBSink) -> None:
        if self.endpoint is not None:
            self.endpoint.attach(sink)
        self._opened.set()

    def start(self, timeout: float = 60.0) -> str:
        """Start the loop; with an endpoint, wait until the store is open and served.
        Returns the endpoint's URL ("" without one).

        Raises:
            ServeError: the loop stopped before the store was served (store locked, Kafka
                unreachable, address in use...) or did not open it within ``timeout`` s.
        """
        self._thread = threading.Thread(target=self._run_loop, name="gradstream-loop",
                                        daemon=True)
        self._thread.start()
        if self.endpoint is None:
            return ""
        deadline = time.monotonic() + timeout
        while not self._opened.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(timeout=5.0)
                raise ServeError(self.failure())
        self.url = self.endpoint.url
        return self.url

    def _run_loop(self) -> None:
        try:
            self.loop.run()
        except Exception as exc:  # kept in loop.error; reported by start() / failure()
            log.error("%s stopped: %s", self.loop.process_name, exc)
        finally:  # a loop that ended by itself answers nothing more
            if self.endpoint is not None:
                self.endpoint.close()

    def _status(self) -> dict[str, Any]:
        counters = asdict(self.loop.counters)  # type: ignore[call-overload]
        counters.pop("dead_letter_reasons", None)
        return {"counters": counters, "worker_alive": self.alive(),
                "group_id": self.loop.settings.group_id, "topic": self.loop.topics()[0]}

    @property
    def dashboard_url(self) -> str:
        """The URL that opens the dashboard with its token ("" without an endpoint or
        before :meth:`start`)."""
        return self.endpoint.dashboard_url if self.endpoint is not None else ""

    def alive(self) -> bool:
        """Whether the loop's thread still runs."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, stop: threading.Event, poll_s: float = 0.5) -> bool:
        """Block until ``stop`` is set or the loop ends by itself, then :meth:`stop`.
        Returns True when the loop ended by itself (see :meth:`failure`)."""
        ended = False
        try:
            while not stop.wait(poll_s):
                if not self.alive():
                    ended = True
                    break
        finally:
            self.stop()
        return ended

    def failure(self) -> str:
        """What to tell the user about the loop's end (:func:`worker_failure`)."""
        return worker_failure(self.loop.error, self.db)

    def stop(self, timeout: float | None = None) -> None:
        """Stop answering reads (sidecar removed, queries interrupted), then stop the loop
        (it writes its last batch and closes the file) and wait for it, at most
        ``timeout`` s (None: until it is done, as a process must before it exits)."""
        if self.endpoint is not None:
            self.endpoint.close()
        self.loop.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ServedLoop[LoopT]:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServedWorker(ServedLoop["Worker"]):
    """A consumer worker (:class:`consumer.worker.Worker`) whose store is served by the
    dashboard of this process (``gradstream serve``, ``demo``).

    Args:
        settings: the worker's settings (``settings.db`` is the store).
        host / port / refresh_s / query_timeout_s / max_readers / token: as
            :class:`EndpointOptions` (``port`` defaults to :data:`DEFAULT_PORT`).
        command: as :class:`ServedLoop`.
    """

    def __init__(
        self, settings: ConsumerSettings, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
        refresh_s: float = 1.0, query_timeout_s: float = 120.0,
        max_readers: int | None = DEFAULT_MAX_READERS, command: str = "serve",
        token: str | None = None,
    ) -> None:
        from consumer.worker import Worker

        super().__init__(functools.partial(Worker, settings), settings.db,
                         EndpointOptions(host, port, refresh_s, query_timeout_s, max_readers,
                                         token=token),
                         command)

    @property
    def worker(self) -> Worker:
        """The :class:`consumer.worker.Worker`."""
        return self.loop


class ServedStore:
    """The dashboard on a store no process of this machine holds, read-only; no loop.

    Args:
        db: the store file (no process writes it), or a store URL (an Iceberg table set,
            which writers may be writing: its snapshot is re-read, module docstring).
        host / port / refresh_s / query_timeout_s / max_readers / token /
            snapshot_interval_s: as :class:`EndpointOptions`.

    :attr:`db` is the store as shown to users (a store URL without its password once
    started).
    """

    def __init__(self, db: str | os.PathLike[str], host: str = "127.0.0.1",
                 port: int = DEFAULT_PORT, refresh_s: float = 1.0,
                 query_timeout_s: float = 120.0,
                 max_readers: int | None = DEFAULT_MAX_READERS,
                 token: str | None = None,
                 snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S) -> None:
        self.db = os.fspath(db)
        # No writer to leave the CPU to: readers keep their normal priority.
        self.endpoint = ReadEndpoint(db, EndpointOptions(
            host, port, refresh_s, query_timeout_s, max_readers, reader_nice=0, token=token,
            snapshot_interval_s=snapshot_interval_s))
        self.url = ""

    @property
    def dashboard_url(self) -> str:
        """The URL that opens the dashboard with its token ("" before :meth:`start`)."""
        return self.endpoint.dashboard_url

    def start(self) -> str:
        """Open the store read-only and serve it. Returns the URL.

        Raises:
            ServeError: missing file, store locked by a writer, a store URL that cannot be
                read, or address in use.
        """
        self.url = self.endpoint.open_read_only()
        if self.endpoint.cursors is not None:
            self.db = str(self.endpoint.cursors.db)
        return self.url

    def wait(self, stop: threading.Event, poll_s: float = 0.5) -> bool:
        """Block until ``stop`` is set, then :meth:`stop`. Returns False (nothing ends by
        itself)."""
        try:
            while not stop.wait(poll_s):
                pass
        finally:
            self.stop()
        return False

    def failure(self) -> str:
        """Never called (:meth:`wait` returns False)."""
        return ""

    def stop(self) -> None:
        """Stop serving and close the store."""
        self.endpoint.close()


def _store(db: str | os.PathLike[str]) -> Path | str:
    """``db`` as the ``str`` of a store URL of a registered kind (a ``Path`` would fold its
    ``//``; :func:`analysis.read.store_url.store_url_scheme`), else as a store file's
    ``Path``, as every process that writes a file has always taken it (the CLI refuses a
    store URL of an unknown kind before)."""
    from analysis.read.connect import StoreError
    from analysis.read.store_url import store_url_scheme

    try:
        return os.fspath(db) if store_url_scheme(db) is not None else Path(db)
    except StoreError:
        return Path(db)


def _held_hint(db: Path, exc: Exception) -> str:
    """Where to read a store another process holds (``exc``: the error opening it)."""
    from analysis.read.sidecar import read_sidecar

    if "lock" not in str(exc).lower():
        return ""
    info = read_sidecar(db)
    if info is None:
        return (" Another process writes it without a read endpoint (--no-read-endpoint): "
                "stop it, or restart it without that flag.")
    return (f" `gradstream {info.command}` (pid {info.pid}) writes it and serves its "
            f"dashboard at {info.dashboard_url}")


def worker_failure(error: BaseException | None, db: str) -> str:
    """What to tell the user when the loop writing ``db`` stopped with ``error`` (None:
    it never opened the store): the lock held by another process, else the error."""
    if error is None:
        return f"the store {db} was not opened in time"
    text = str(error)
    if not isinstance(error, ServeError) and "lock" in text.lower():
        return (f"the store {db} is held by another process (a `gradstream consume`, "
                "`store` or `serve`?). Stop it, or use --db for another file.")
    return text or type(error).__name__
