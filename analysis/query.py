"""Read-only SQL over the store, whether or not a writer holds the file (``gradstream query``).

DuckDB lets one process open a database file for writing, and while it does, no other
process can open the file at all (README.md, "Tables"). A query therefore takes one of
two paths, chosen by :func:`run_query`:

1. **The file is free**: open it with ``duckdb.connect(path, read_only=True)``. The whole
   database is attached read-only; DuckDB refuses any write ("attached in read-only mode").
2. **Another process holds it**: that process must be ``gradstream serve`` (the consumer
   worker plus the dashboard), which advertises its address in the sidecar file
   ``<db>.serve.json`` (:mod:`analysis.dashboard.sidecar`). The query is POSTed to it and
   the result comes back as an Arrow IPC stream.

How the serving process gets a read-only connection (tested on DuckDB 2.0.0):

- a second ``duckdb.connect(path, read_only=True)`` in the process that holds the file
  read-write fails ("Can't open a connection to same database file with a different
  configuration");
- ``ATTACH 'path' AS ro (READ_ONLY)``, from the same or a new in-memory instance, fails
  ("Unique file handle conflict: ... already attached");
- ``SET access_mode = 'READ_ONLY'`` fails at run time ("must be set when opening or
  attaching the database");
- ``BEGIN TRANSACTION READ ONLY`` on a cursor of the writer's instance **works**: every
  write to any attached database in that transaction fails with "transaction is launched
  in read-only mode" (INSERT, UPDATE, DELETE, CREATE, DROP, ALTER, COPY FROM, CREATE
  SEQUENCE/VIEW/MACRO, writes into a database ATTACHed inside the transaction), while
  the writer's own transactions go on (MVCC snapshot: readers see committed frames).

So the serving process answers each query on a fresh cursor inside ``BEGIN TRANSACTION
READ ONLY`` (:func:`execute_read_only`, used by :mod:`analysis.dashboard.cursors`), and
adds two guards that the transaction alone does not give:

- exactly one statement per query (counted by DuckDB's own parser,
  ``extract_statements``), because a ``COMMIT`` followed by a write would otherwise end
  the read-only transaction and run the write in auto-commit mode;
- ``SET lock_configuration = true`` on the shared instance, because a ``SET GLOBAL``
  (threads, memory_limit, enable_external_access...) inside the read-only transaction
  would otherwise change the writer's configuration.

Writes are never detected by reading the SQL text: they are refused by DuckDB, and the
refusal is reported as :class:`ReadOnlyViolationError`. Statements that only read the store
but have effects outside it (``COPY ... TO`` a file, ``EXPORT DATABASE``) run with the
querying user's file permissions on both paths, as with ``duckdb -readonly``; the server
accepts queries only with the token from the sidecar (mode 0600) and only on loopback by
default.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from analysis.dashboard.sidecar import ServeInfo, read_sidecar

if TYPE_CHECKING:
    import pyarrow as pa

ARROW_STREAM = "application/vnd.apache.arrow.stream"
"""Media type of the server's query results (Arrow IPC streaming format)."""

_READ_ONLY_ERRORS = ("read-only mode", "read_only mode")
"""Fragments of DuckDB's error messages for a write refused by a read-only connection
("attached in read-only mode") or transaction ("launched in read-only mode")."""


class QueryError(Exception):
    """The query could not run; ``str(exc)`` is a one-line message for the user."""


class ReadOnlyViolationError(QueryError):
    """DuckDB refused the statement because it would write to the store."""


class StoreHeldError(QueryError):
    """Another process holds the store and does not serve queries (no live sidecar)."""


@dataclass(frozen=True)
class QueryResult:
    """Rows of a query and how they were obtained.

    Attributes:
        table: the result as a ``pyarrow.Table`` (column names and types from DuckDB).
        via: ``"read-only connection"`` or ``"gradstream serve at <url>"``.
    """

    table: pa.Table
    via: str


def _classify(exc: duckdb.Error) -> QueryError:
    text = str(exc).strip()
    if any(fragment in text for fragment in _READ_ONLY_ERRORS):
        return ReadOnlyViolationError(
            f"refused: this statement would write to the store, and queries are read-only "
            f"(DuckDB: {text.splitlines()[0]})"
        )
    return QueryError(text.splitlines()[0] if text else type(exc).__name__)


def single_statement(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """The text of the one statement in ``sql``, split by DuckDB's parser.

    Raises:
        QueryError: a syntax error, no statement, or more than one statement.
    """
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise _classify(exc) from None
    if not statements:
        raise QueryError("no SQL statement given")
    if len(statements) > 1:
        raise QueryError(
            f"give one SQL statement per query ({len(statements)} found); run them one by one"
        )
    return statements[0].query


def execute_read_only(
    cur: duckdb.DuckDBPyConnection, sql: str, timeout_s: float | None = None
) -> pa.Table:
    """Run one statement on ``cur`` and return its rows as an Arrow table.

    ``cur`` must already be unable to write: a connection opened with ``read_only=True``,
    or a cursor inside ``BEGIN TRANSACTION READ ONLY`` (see the module docstring). The
    result is materialised while ``cur`` is open, so errors surface here.

    Args:
        cur: the read-only connection or cursor.
        sql: one SQL statement.
        timeout_s: interrupt the query after this many seconds (``None``: no limit).

    Returns:
        The result (no columns for statements without a result set).

    Raises:
        ReadOnlyViolationError: DuckDB refused a write.
        QueryError: invalid SQL, several statements, a failing query, or the timeout.
    """
    statement = single_statement(cur, sql)
    timer = None
    if timeout_s is not None:
        timer = threading.Timer(timeout_s, cur.interrupt)
        timer.daemon = True
        timer.start()
    try:
        relation = cur.sql(statement)
        table = relation.to_arrow_table() if relation is not None else None
    except duckdb.InterruptException:
        if timeout_s is not None and timer is not None and timer.finished.is_set():
            raise QueryError(
                f"the query ran longer than {timeout_s:g} s and was interrupted"
            ) from None
        raise QueryError("the query was interrupted (the server is stopping)") from None
    except duckdb.Error as exc:
        raise _classify(exc) from None
    finally:
        if timer is not None:
            timer.cancel()
    if table is None:
        import pyarrow as pa

        table = pa.table({})
    return table


def _held_by_other(exc: duckdb.Error) -> bool:
    if isinstance(exc, duckdb.ConnectionException):
        return True  # this process holds it read-write (e.g. serve and query in one process)
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


def run_query(db: str | os.PathLike[str], sql: str, timeout_s: float | None = None) -> QueryResult:
    """Run one read-only SQL statement against the store at ``db``, by whichever path works.

    Args:
        db: the DuckDB file.
        sql: one SQL statement.
        timeout_s: interrupt the query after this many seconds (``None``: no limit).

    Returns:
        The :class:`QueryResult`.

    Raises:
        ReadOnlyViolationError: the statement would write.
        StoreHeldError: another process holds the file and serves no queries.
        QueryError: missing file, invalid SQL, failing query, unreachable server.
    """
    file = Path(db)
    if not file.exists():
        raise QueryError(
            f"no gradstream store at {str(file)!r}: the file does not exist "
            "(pass --db or set GRADSTREAM_DB)"
        )
    try:
        con = duckdb.connect(str(file), read_only=True)
    except duckdb.Error as exc:
        if not _held_by_other(exc):
            raise QueryError(f"cannot open the store {str(file)!r}: {exc}") from None
        info = read_sidecar(file)
        if info is None:
            raise StoreHeldError(
                f"the store {str(file)!r} is held by another process that does not serve "
                "queries (a `gradstream consume`?). Run the worker as `gradstream serve` "
                "instead (it answers queries while it writes), or stop it and query again."
            ) from None
        return query_server(info, sql, timeout_s)
    try:
        return QueryResult(execute_read_only(con, sql, timeout_s), "read-only connection")
    finally:
        con.close()


def query_server(info: ServeInfo, sql: str, timeout_s: float | None = None) -> QueryResult:
    """POST one statement to a ``gradstream serve`` process and read its Arrow result.

    Args:
        info: the server's sidecar (URL and token).
        sql: one SQL statement.
        timeout_s: server-side time limit (the client waits 30 s longer).

    Raises:
        ReadOnlyViolationError / QueryError: as reported by the server, or the server is
            unreachable.
    """
    import pyarrow as pa

    body = json.dumps({"sql": sql, "timeout_s": timeout_s}).encode()
    request = urllib.request.Request(
        f"{info.url}/api/query",
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "Accept": ARROW_STREAM,
            "Authorization": f"Bearer {info.token}",
        },
    )
    wait = None if timeout_s is None else timeout_s + 30.0
    try:
        with urllib.request.urlopen(request, timeout=wait) as response:
            table = pa.ipc.open_stream(response).read_all()
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read().decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            detail = {"error": f"HTTP {exc.code} {exc.reason}", "kind": "error"}
        message = str(detail.get("error", f"HTTP {exc.code}"))
        if detail.get("kind") == "read_only":
            raise ReadOnlyViolationError(message) from None
        raise QueryError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise QueryError(
            f"`gradstream serve` (pid {info.pid}) holds the store but does not answer at "
            f"{info.url}: {reason}"
        ) from None
    return QueryResult(table, f"gradstream serve at {info.url}")
