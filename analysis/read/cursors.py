"""Read-only cursors on the store for the dashboard's request threads.

:class:`ReadCursors` hands each request a fresh DuckDB cursor inside ``BEGIN TRANSACTION
READ ONLY`` (why this is the read-only mechanism available inside the writing process:
:mod:`analysis.read.query`). Built either

- :meth:`ReadCursors.from_connection` on a connection of the writer's own database
  instance (``gradstream serve`` running the consumer worker: ``DuckDBSink.read_cursor()``),
  where every cursor sees the frames committed so far (MVCC snapshot per request); or
- :meth:`ReadCursors.open_read_only` on a file no one writes (``serve --no-consume``).

Either way the instance is hardened on construction (:func:`analysis.read.query.harden`): file
access outside the store is off (``COPY ... TO``, ``EXPORT DATABASE``, ``read_text``,
``ATTACH`` are refused) and the configuration is locked, so a query can neither write
files nor change settings the writer depends on. Every process that serves reads builds
its cursors here, so every one of them is hardened.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import duckdb

from analysis.read.connect import limit_read_memory
from analysis.read.query import harden


class StoreClosedError(Exception):
    """The store's connection is closed (the worker stopped); requests get HTTP 503."""


class ReadCursors:
    """Factory of read-only cursors on one DuckDB database instance.

    Args:
        root: a connection used only to create cursors (never to run queries).
        db: the store's path (for display).
        writer: whether this process also writes the store.
        owns_root: close ``root`` in :meth:`close` (True when this object opened it).

    Raises:
        RuntimeError: the instance's configuration was already locked with file access on.
    """

    def __init__(
        self, root: duckdb.DuckDBPyConnection, db: str | os.PathLike[str], writer: bool,
        owns_root: bool,
    ) -> None:
        self._root = root
        self.db = Path(db)
        self.writer = writer
        self._owns_root = owns_root
        self._lock = threading.Condition()
        self._active: set[duckdb.DuckDBPyConnection] = set()
        self._closed = False
        harden(root)

    @classmethod
    def from_connection(
        cls, root: duckdb.DuckDBPyConnection, db: str | os.PathLike[str]
    ) -> ReadCursors:
        """Cursors on the writer's instance; ``root`` is e.g. ``DuckDBSink.read_cursor()``
        (it is closed by :meth:`close`; the writer's own connection is not)."""
        return cls(root, db, writer=True, owns_root=True)

    @classmethod
    def open_read_only(cls, db: str | os.PathLike[str]) -> ReadCursors:
        """Open ``db`` with ``read_only=True`` (no writer anywhere).

        Its DuckDB buffer pool is bounded as a read-only file reader's
        (:func:`analysis.read.connect.limit_read_memory`).

        Raises:
            duckdb.Error: the file is missing, locked by a writer, or not a DuckDB file.
            analysis.read.connect.StoreError: ``GRADSTREAM_READ_MEMORY_LIMIT`` is not a size.
        """
        root = duckdb.connect(str(db), read_only=True)
        try:
            limit_read_memory(root)
        except BaseException:
            root.close()
            raise
        return cls(root, db, writer=False, owns_root=True)

    @contextlib.contextmanager
    def cursor(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A new cursor inside ``BEGIN TRANSACTION READ ONLY``; rolled back and closed on exit.

        Raises:
            StoreClosedError: the store was closed (the worker stopped, or :meth:`close`).
        """
        with self._lock:
            if self._closed:
                raise StoreClosedError("the store is closed")
            try:
                cur = self._root.cursor()
            except duckdb.Error as exc:
                raise StoreClosedError(f"the store is closed: {exc}") from None
            self._active.add(cur)
        try:
            try:
                cur.execute("BEGIN TRANSACTION READ ONLY")
            except duckdb.Error as exc:
                raise StoreClosedError(f"the store is closed: {exc}") from None
            yield cur
        finally:
            with contextlib.suppress(duckdb.Error):
                cur.execute("ROLLBACK")  # fails harmlessly if the statement was a COMMIT
            cur.close()
            with self._lock:
                self._active.discard(cur)
                self._lock.notify_all()

    def snapshot_key(self, cur: duckdb.DuckDBPyConnection) -> None:
        """None: a cursor here reads the one database, which changes only by transactions
        (so a response cache keyed on its rows sees every change);
        :meth:`analysis.read.snapshots.SnapshotCursors.snapshot_key` tells which loaded
        snapshot a cursor reads."""
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Refuse new cursors, interrupt the queries still running (waiting up to
        ``timeout_s`` for their requests to end), then close the root connection if this
        object owns it, so the writer can checkpoint and close the file."""
        with self._lock:
            self._closed = True
            for cur in self._active:
                with contextlib.suppress(duckdb.Error):
                    cur.interrupt()
            self._lock.wait_for(lambda: not self._active, timeout_s)
            if self._owns_root:
                with contextlib.suppress(duckdb.Error):
                    self._root.close()
