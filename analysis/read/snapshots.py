"""Read cursors on a store that is re-read as a whole, not written in place: the dashboard
of an Apache Iceberg table set (``gradstream serve --no-consume --db 'iceberg+...'``).

A store named by a store URL (:mod:`analysis.read.store_url`) is read from its current
snapshot, loaded into an in-memory DuckDB database (:func:`analysis.read.iceberg.
load_table_set`). A served store must follow the writers, so :class:`SnapshotCursors` keeps
the newest loaded snapshot and re-reads the store when it changed:

- **When.** A read that arrives when the store was last checked ``interval_s`` or more
  ago starts a check on a background thread (one at a time) and is answered at once from
  the snapshot already loaded (stale while revalidating, as HTTP caches do, RFC 5861). So
  no request waits for a load, and a store nobody reads is never re-read; the dashboard
  page polls every ``--refresh`` s, so while it is open a run that streams shows up within
  about ``interval_s`` plus one load plus one poll.
- **What.** A check asks the source for its version (:meth:`SnapshotSource.version`; for
  Iceberg: each table's current metadata file, one query to the SQL catalog, no data
  read) and loads the store only when that version changed since the loaded snapshot's,
  which was taken *before* that snapshot was loaded (so a commit landing during a load is
  seen by the next check, never missed).
- **Swap.** The new snapshot's database is hardened and becomes the current one; requests
  already running keep their cursors on the old one, which is closed when the last of
  them ends. No lock is shared with any writer: Iceberg snapshots are immutable, and the
  catalog is only read.
- **Caches.** :meth:`SnapshotCursors.snapshot_key` tells which loaded snapshot a cursor
  reads; the dashboard's response cache keys its entries on it
  (:meth:`analysis.dashboard.server.Dashboard.cached`), so nothing computed on one
  snapshot is served for another.

A check that fails (catalog unreachable, a data file missing) is logged and reported by
:meth:`SnapshotCursors.status` (``/api/status``); the last snapshot stays served and the
next read after ``interval_s`` tries again.

Sources are registered by store kind in :data:`SNAPSHOT_SOURCES`, one line per kind, as
readers are in :data:`analysis.read.store_url.STORE_URL_SCHEMES`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import duckdb

from analysis.read.connect import StoreError
from analysis.read.cursors import ReadCursors, StoreClosedError
from analysis.read.store_url import store_url_scheme

log = logging.getLogger("gradstream.snapshots")


class SnapshotSource(Protocol):
    """A store read as a whole: its version, and a database holding its current snapshot.

    Attributes:
        name: the store as shown to users (no password).
    """

    name: str

    def version(self) -> Hashable:
        """What identifies the store's current snapshot; equal versions mean equal data.

        Raises:
            StoreError: the store cannot be reached.
        """
        ...

    def load(self) -> duckdb.DuckDBPyConnection:
        """A new in-memory database holding the current snapshot (not hardened).

        Raises:
            StoreError: the store cannot be read.
        """
        ...

    def close(self) -> None:
        """Release what :meth:`version` keeps open."""
        ...


class IcebergSnapshots:
    """The snapshots of a store kept as an Iceberg table set (:mod:`analysis.read.iceberg`).

    :meth:`version` is the sorted ``(table name, metadata_location)`` pairs of the
    namespace's tables, read in one query from the SQL catalog's ``iceberg_tables`` table
    (the Iceberg JDBC catalog's schema, which pyiceberg's ``SqlCatalog`` keeps): every
    commit to a table writes a new metadata file and points the table's row at it (Iceberg
    table spec, "Commit Conflict Resolution and Retry"), so the pairs change exactly when a
    table gets a new snapshot, its schema changes, or a table appears or goes.
    :meth:`load` is :func:`analysis.read.iceberg.load_table_set`.

    Args:
        url: the store URL (``iceberg+sqlite:////abs/catalog.db?warehouse=...``).
        environ: where the S3 settings come from (default ``os.environ``).

    Raises:
        StoreError: not an Iceberg store URL, pyiceberg missing, the catalog missing.
    """

    def __init__(self, url: str, environ: Mapping[str, str] | None = None) -> None:
        from analysis.read.iceberg import IcebergLocation, open_catalog

        self.location = IcebergLocation.parse(url)
        self.name = self.location.url()
        self._environ = environ
        self._catalog = open_catalog(self.location, environ)

    def version(self) -> tuple[tuple[str, str | None], ...]:
        """The namespace's ``(table, metadata_location)`` pairs, sorted.

        Raises:
            StoreError: the catalog's database cannot be queried.
        """
        from pyiceberg.catalog import Catalog
        from pyiceberg.catalog.sql import IcebergTables
        from sqlalchemy import select
        from sqlalchemy.exc import SQLAlchemyError
        from sqlalchemy.orm import Session

        namespace = Catalog.namespace_to_string(tuple(self.location.namespace.split(".")))
        query = select(IcebergTables.table_name, IcebergTables.metadata_location).where(
            IcebergTables.catalog_name == self._catalog.name,
            IcebergTables.table_namespace == namespace)
        try:
            with Session(self._catalog.engine) as session:
                rows = session.execute(query).all()
        except SQLAlchemyError as exc:
            text = str(exc).strip().splitlines()
            raise StoreError(f"cannot read the Iceberg catalog of {self.name}: "
                             f"{text[0] if text else type(exc).__name__}") from None
        return tuple(sorted((str(name), location) for name, location in rows))

    def load(self) -> duckdb.DuckDBPyConnection:
        """:func:`analysis.read.iceberg.load_table_set` of the location.

        Raises:
            StoreError: see there.
        """
        from analysis.read.iceberg import load_table_set

        return load_table_set(self.location, self._environ)

    def close(self) -> None:
        """Dispose of the catalog's database connections."""
        self._catalog.engine.dispose()


SNAPSHOT_SOURCES: dict[str, Callable[[str], SnapshotSource]] = {
    "iceberg": IcebergSnapshots,
}
"""Store kind (:func:`analysis.read.store_url.store_url_scheme`) -> the source of its
snapshots, given the store URL. Add a line to serve another kind of store."""


def open_snapshot_cursors(url: str, interval_s: float) -> SnapshotCursors:
    """:class:`SnapshotCursors` on the store URL ``url``, its first snapshot loaded.

    Raises:
        StoreError: not a store URL of a kind of :data:`SNAPSHOT_SOURCES`, or the store
            cannot be opened or read (the message says what to do).
        ValueError: ``interval_s`` is not positive.
    """
    kind = store_url_scheme(url)
    if kind is None or kind not in SNAPSHOT_SOURCES:
        raise StoreError(f"{url!r} is not a store URL that can be served "
                         f"({', '.join(f'{k}+...' for k in SNAPSHOT_SOURCES)})")
    return SnapshotCursors(SNAPSHOT_SOURCES[kind](url), interval_s)


@dataclass
class _Loaded:
    """One loaded snapshot: its number (1, 2, ...), the source's version it was loaded at,
    its cursors, and how many requests hold one of them."""

    number: int
    version: Hashable
    cursors: ReadCursors
    in_use: int = 0
    retired: bool = False


class SnapshotCursors:
    """Read-only cursors on the newest loaded snapshot of ``source``, re-read when it
    changed (module docstring), with the interface of
    :class:`~analysis.read.cursors.ReadCursors` (:meth:`cursor`, :meth:`close`,
    :attr:`db`, :attr:`writer`).

    Args:
        source: the store; closed by :meth:`close` (and here if the first load fails).
        interval_s: least seconds between two checks of the store (> 0).
        clock: monotonic seconds (tests may pass their own).

    Raises:
        ValueError: ``interval_s`` is not positive.
        StoreError: the first snapshot cannot be loaded.
    """

    writer = False
    """No process writes through these cursors' database (the writers write the store)."""

    def __init__(self, source: SnapshotSource, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            source.close()
            raise ValueError(f"the snapshot interval must be positive, got {interval_s}")
        self.source = source
        self.db = source.name
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._closed = False
        self._checker: threading.Thread | None = None
        self._reading: dict[int, int] = {}  # id(cursor) -> number of its snapshot
        self._retired: list[_Loaded] = []  # replaced, still read
        try:
            version = source.version()
            self._current = _Loaded(1, version, self._cursors(source.load()))
        except BaseException:
            source.close()
            raise
        self._checked_at = clock()
        self.loaded_at = time.time()
        self.error: str | None = None

    def _cursors(self, con: duckdb.DuckDBPyConnection) -> ReadCursors:
        """Hardened read cursors owning ``con`` (closed if hardening fails)."""
        try:
            return ReadCursors(con, self.db, writer=False, owns_root=True)
        except BaseException:
            con.close()
            raise

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A new cursor on the current snapshot inside ``BEGIN TRANSACTION READ ONLY``
        (``ReadCursors.cursor``); starts a check of the store when one is due.

        Raises:
            StoreClosedError: :meth:`close` was called.
        """
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            loaded = self._current
            loaded.in_use += 1
            self._check_when_due()
        try:
            with loaded.cursors.cursor() as cur:
                key = id(cur)
                with self._lock:
                    self._reading[key] = loaded.number
                try:
                    yield cur
                finally:
                    with self._lock:
                        self._reading.pop(key, None)
        finally:
            self._release(loaded)

    def snapshot_key(self, cur: duckdb.DuckDBPyConnection) -> int | None:
        """The number of the snapshot ``cur`` (a cursor of :meth:`cursor`, still open)
        reads; None for another cursor."""
        with self._lock:
            return self._reading.get(id(cur))

    def status(self) -> dict[str, Any]:
        """``{"snapshot": {number, loaded_at (unix s), interval_s, error}}`` for
        ``/api/status``: the snapshot served, when it was loaded, and the last check's
        error (None when it succeeded)."""
        with self._lock:
            number = self._current.number
        return {"snapshot": {"number": number, "loaded_at": self.loaded_at,
                             "interval_s": self.interval_s, "error": self.error}}

    def _release(self, loaded: _Loaded) -> None:
        """A request is done with ``loaded``: close it when it was replaced and this was
        its last reader."""
        with self._lock:
            loaded.in_use -= 1
            last = loaded.retired and loaded.in_use == 0
            if last:
                self._retired.remove(loaded)
        if last:
            loaded.cursors.close()

    def _check_when_due(self) -> None:
        """Start :meth:`check` on a thread when none runs and the last check is
        ``interval_s`` old (call with the lock held)."""
        if self._checker is None and self._clock() - self._checked_at >= self.interval_s:
            self._checker = threading.Thread(target=self.check, name="gradstream-snapshot",
                                             daemon=True)
            self._checker.start()

    def check(self) -> bool:
        """Load the store's snapshot and make it current if its version changed since the
        current one's. Errors are logged and kept in :attr:`error` (the current snapshot
        stays). Returns whether a new snapshot was swapped in."""
        swapped = False
        try:
            version = self.source.version()
            with self._lock:
                changed = version != self._current.version and not self._closed
            if changed:
                swapped = self._swap(version, self._cursors(self.source.load()))
            self.error = None
        except Exception as exc:  # StoreError, or a bug: serve the last snapshot anyway
            self.error = str(exc) or type(exc).__name__
            log.warning("cannot re-read %s (still serving the snapshot loaded at %s): %s",
                        self.db, time.strftime("%H:%M:%S", time.localtime(self.loaded_at)),
                        self.error)
        finally:
            with self._lock:
                self._checked_at = self._clock()
                if self._checker is threading.current_thread():
                    self._checker = None
        return swapped

    def _swap(self, version: Hashable, cursors: ReadCursors) -> bool:
        """Make ``cursors`` (loaded at ``version``) current; the replaced snapshot is
        closed now if no request reads it, else by its last reader. Returns False (and
        closes ``cursors``) when this object was closed meanwhile."""
        with self._lock:
            if self._closed:
                stale: ReadCursors | None = cursors
                swapped = False
            else:
                old = self._current
                self._current = _Loaded(old.number + 1, version, cursors)
                self.loaded_at = time.time()
                old.retired = True
                if old.in_use:
                    self._retired.append(old)
                    stale = None
                else:
                    stale = old.cursors
                swapped = True
        if stale is not None:
            stale.close()
        return swapped

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new cursors, interrupt the reads still running on every loaded snapshot
        (``ReadCursors.close``), close them and the source. A check in progress is waited
        for at most ``timeout_s``; what it loads afterwards is closed. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loaded = [self._current, *self._retired]
            self._retired = []
            checker = self._checker
        for snapshot in loaded:
            snapshot.cursors.close(timeout_s)
        if checker is not None and checker is not threading.current_thread():
            checker.join(timeout_s)
        self.source.close()
