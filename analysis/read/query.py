"""One read-only SQL statement, hardened, with a time limit: the rules every read path obeys.

Every connection or cursor that answers reads of the store (a ``read_only=True`` file
connection in :class:`analysis.read.reader.FileReader`, the cursors of a serving process in
:class:`analysis.read.cursors.ReadCursors`) goes through this module:

- :func:`harden` turns file access off on the database instance (``SET
  enable_external_access = false``) and then locks the configuration (``SET
  lock_configuration = true``). Afterwards ``COPY ... TO``, ``EXPORT DATABASE``,
  ``ATTACH``, ``read_text`` / ``read_csv`` / ``read_parquet`` of outside files and ``LOAD``
  raise ``duckdb.PermissionException`` ("file system operations are disabled by
  configuration", DuckDB 2.0.0), and no statement can turn it back on. A writer on the
  same instance still inserts from registered Arrow tables and checkpoints its own file.
- :func:`single_statement`: exactly one statement, counted by DuckDB's own parser
  (``extract_statements``), because a ``COMMIT`` followed by a write would otherwise end a
  read-only transaction and run the write in auto-commit mode.
- :func:`time_limit`: one time limit, enforced by ``interrupt()`` on a timer; the default
  is :data:`DEFAULT_TIMEOUT_S`, or ``GRADSTREAM_QUERY_TIMEOUT_S`` (:func:`resolve_timeout`).
- Writes are never detected by reading the SQL text: DuckDB refuses them (a
  ``read_only=True`` connection: "attached in read-only mode"; a cursor of the writer's
  instance inside ``BEGIN TRANSACTION READ ONLY``: "launched in read-only mode"), and
  :func:`classify` turns DuckDB's refusals into one-line errors
  (:class:`ReadOnlyViolationError`, :class:`ReadRefusedError`).

Why a serving process reads through ``BEGIN TRANSACTION READ ONLY`` cursors of the
writer's instance (tested on DuckDB 2.0.0): a second ``duckdb.connect(path,
read_only=True)`` in the process that holds the file fails ("Can't open a connection to
same database file with a different configuration"), ``ATTACH ... (READ_ONLY)`` fails
("Unique file handle conflict"), ``SET access_mode`` fails at run time; a read-only
transaction on a cursor works and sees the writer's committed rows (MVCC snapshot).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import duckdb

from analysis.read.connect import StoreError

if TYPE_CHECKING:
    import pyarrow as pa

DEFAULT_TIMEOUT_S = 60.0
"""Longest read, seconds, when neither ``--timeout`` nor ``GRADSTREAM_QUERY_TIMEOUT_S`` says
otherwise (a report or an analysis of a long run takes a few seconds; a runaway cross join
would run for hours)."""

TIMEOUT_ENV = "GRADSTREAM_QUERY_TIMEOUT_S"
"""Environment variable overriding :data:`DEFAULT_TIMEOUT_S` (seconds, > 0)."""

Params = dict[str, object] | list[object]
"""Parameters of a statement: by name (``$name``) or by position (``?``); JSON values."""

ARROW_STREAM = "application/vnd.apache.arrow.stream"
"""Media type of Arrow IPC streaming-format bodies (query results, grids)."""

_READ_ONLY_ERRORS = ("read-only mode", "read_only mode")
"""Fragments of DuckDB's error messages for a write refused by a read-only connection
("attached in read-only mode") or transaction ("launched in read-only mode")."""


class QueryError(StoreError):
    """The read could not run; ``str(exc)`` is a one-line message for the user."""


class ReadOnlyViolationError(QueryError):
    """DuckDB refused the statement because it would write to the store."""


class ReadRefusedError(QueryError):
    """DuckDB refused the statement because it would touch files outside the store
    (``COPY ... TO``, ``EXPORT DATABASE``, ``read_text``, ``ATTACH``...)."""


class QueryTimeoutError(QueryError):
    """The read ran longer than its time limit and was interrupted."""


class StoreHeldError(QueryError):
    """Another process holds the store and serves no reads (no live sidecar)."""


def resolve_timeout(timeout_s: float | None) -> float:
    """The time limit of a read, seconds.

    Args:
        timeout_s: an explicit limit (``--timeout``), or ``None`` for the environment's
            ``GRADSTREAM_QUERY_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`.

    Returns:
        A finite limit > 0.

    Raises:
        QueryError: the explicit value or the environment variable is not a finite number > 0.
    """
    source = "--timeout"
    value: object = timeout_s
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        source = TIMEOUT_ENV
        try:
            value = float(raw)
        except ValueError:
            raise QueryError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise QueryError(f"{source} must be a number of seconds > 0, got {value!r}")
    return float(value)


def harden(con: duckdb.DuckDBPyConnection) -> None:
    """Turn file access off on ``con``'s database instance and lock its configuration.

    Idempotent: an instance already hardened is left as it is. Applies to every connection
    and cursor of the instance (``enable_external_access`` and ``lock_configuration`` are
    global settings), so call it once on a writer's instance before serving reads from it.

    Raises:
        RuntimeError: the configuration was locked earlier with file access still on (the
            instance cannot be hardened any more).
    """
    external, locked = con.execute(
        "SELECT current_setting('enable_external_access'), current_setting('lock_configuration')"
    ).fetchall()[0]  # fetchall: leaves no pending result on ``con``
    if not external and locked:
        return
    if locked:
        raise RuntimeError(
            "the DuckDB configuration is locked with external access on; reads cannot be "
            "hardened"
        )
    if external:
        con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def classify(exc: duckdb.Error) -> QueryError:
    """DuckDB's error as a one-line :class:`QueryError` (subclass by cause)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, duckdb.PermissionException):
        return ReadRefusedError(
            f"refused: reads may not touch files outside the store (DuckDB: {first})"
        )
    if any(fragment in text for fragment in _READ_ONLY_ERRORS):
        return ReadOnlyViolationError(
            f"refused: this statement would write to the store, and queries are read-only "
            f"(DuckDB: {first})"
        )
    return QueryError(first)


def single_statement(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """The text of the one statement in ``sql``, split by DuckDB's parser.

    Raises:
        QueryError: a syntax error, no statement, or more than one statement.
    """
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise classify(exc) from None
    if not statements:
        raise QueryError("no SQL statement given")
    if len(statements) > 1:
        raise QueryError(
            f"give one SQL statement per query ({len(statements)} found); run them one by one"
        )
    return statements[0].query


@contextlib.contextmanager
def time_limit(con: duckdb.DuckDBPyConnection, timeout_s: float) -> Iterator[None]:
    """Interrupt ``con`` if the block runs longer than ``timeout_s`` seconds.

    DuckDB errors raised in the block are re-raised as :func:`classify` errors, so every
    read reports a refusal the same way.

    Raises:
        QueryTimeoutError: the limit was reached (the running statement was interrupted).
        QueryError: any other DuckDB error in the block (a ``StoreError`` raised by the
            block itself passes through).
    """
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        with contextlib.suppress(duckdb.Error):
            con.interrupt()

    timer = threading.Timer(timeout_s, interrupt)
    timer.daemon = True
    timer.start()
    try:
        yield
    except duckdb.InterruptException:
        if fired.is_set():
            raise QueryTimeoutError(
                f"the read ran longer than {timeout_s:g} s and was interrupted (raise the "
                f"limit with --timeout or {TIMEOUT_ENV})"
            ) from None
        raise QueryError("the read was interrupted (the store is closing)") from None
    except duckdb.Error as exc:
        raise classify(exc) from None
    finally:
        timer.cancel()


def execute_read_only(
    cur: duckdb.DuckDBPyConnection, sql: str, timeout_s: float | None = None,
    params: Params | None = None,
) -> pa.Table:
    """Run one statement on ``cur`` and return its rows as an Arrow table.

    ``cur`` must already be unable to write and hardened: a :func:`harden`-ed connection
    opened with ``read_only=True``, or a cursor of :class:`~analysis.read.cursors.
    ReadCursors` (inside ``BEGIN TRANSACTION READ ONLY``). The result is materialised while
    ``cur`` is open, so errors surface here.

    Args:
        cur: the read-only connection or cursor.
        sql: one SQL statement.
        timeout_s: time limit, seconds (``None``: :func:`resolve_timeout`'s default).
        params: the statement's parameters (:data:`Params`).

    Returns:
        The result (no columns for statements without a result set).

    Raises:
        ReadOnlyViolationError: DuckDB refused a write.
        ReadRefusedError: DuckDB refused a file access outside the store.
        QueryTimeoutError: the limit was reached.
        QueryError: invalid SQL, several statements, or a failing query.
    """
    import pyarrow as pa

    statement = single_statement(cur, sql)
    with time_limit(cur, resolve_timeout(timeout_s)):
        relation = cur.sql(statement, params=params) if params else cur.sql(statement)
        table = relation.to_arrow_table() if relation is not None else None
    return table if table is not None else pa.table({})
