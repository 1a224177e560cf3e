"""Reading a store kept as an Apache Iceberg table set, with the DuckDB store's reads.

A store written by the Iceberg output (``gradstream consume`` / ``store`` with
``--iceberg-catalog``; the same tables and columns as the DuckDB store) is named by a store
URL (:mod:`analysis.read.store_url`)::

    iceberg+<catalog>[?warehouse=<warehouse>][&namespace=<namespace>]

``<catalog>`` is the SQLAlchemy URL of pyiceberg's SQL catalog, as the writer was given it
(``sqlite:////abs/catalog.db``: four slashes for an absolute path;
``postgresql+psycopg2://user:pw@host/db``); ``warehouse`` the writer's warehouse
(``file:///abs/wh`` or ``s3://bucket/path``; optional for reading: the catalog records
where every table's files are); ``namespace`` the tables' namespace (default
:data:`schemas.iceberg_catalog.DEFAULT_NAMESPACE`). Other query parameters stay on the
catalog URL. S3 endpoint and credentials come from the AWS environment variables
(:data:`schemas.iceberg_catalog.S3_ENVIRONMENT`). Percent-encode a ``&`` or ``#`` inside a
value (RFC 3986).

:class:`IcebergReader` is a :class:`analysis.read.reader.FileReader` on an in-memory DuckDB
database that holds the table set's current snapshot (:func:`load_table_set`):

- each table of the namespace that the DuckDB store has is created from
  :data:`schemas.tables.SCHEMA_DDL` (so every column has the DuckDB store's type: Iceberg
  has no 16-bit integer or JSON type) and filled from pyiceberg's scan of its current
  snapshot (``Table.scan().to_arrow()``, Iceberg table spec v2, "Scan Planning"); a table
  the namespace lacks is left out, as in a DuckDB store written before it existed;
- then the database is hardened as a file reader's is (:func:`analysis.read.query.harden`:
  no file access, configuration locked), and every read runs on a new cursor inside
  ``BEGIN TRANSACTION READ ONLY`` (DuckDB refuses writes: "transaction is launched in
  read-only mode", as on a serving process's cursors, :mod:`analysis.read.cursors`), one
  statement, under one time limit. The same builders (report, heatmap, analyses, grid,
  export) run on it, so the answers are the DuckDB store's.

Reads never block a writer and need no writer's endpoint: an Iceberg reader reads
immutable snapshots. Iceberg has no transaction over several tables, so the tables are
pinned in the reverse of the writer's commit order
(:data:`schemas.iceberg_catalog.COMMITTED_LAST` first): every row a ``frames`` row claims
stored is in the ``layer_stats`` snapshot read after it. A run read while it streams
shows the steps committed before the reader was opened.

Memory and time: the whole table set is loaded when the reader is opened (a
``analysis.Store`` opens one per call unless used as ``with store:``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import duckdb

from analysis.read.connect import REQUIRED_TABLES, StoreError
from analysis.read.query import harden, resolve_timeout
from analysis.read.reader import FileReader
from schemas.iceberg_catalog import (
    CATALOG_NAME,
    COMMITTED_LAST,
    DEFAULT_NAMESPACE,
    S3_ENVIRONMENT,
    s3_properties,
)
from schemas.tables import SCHEMA_DDL

if TYPE_CHECKING:
    import pyarrow as pa

URL_KIND = "iceberg"
"""The store kind of an Iceberg store URL (``iceberg+...``,
:data:`analysis.read.store_url.STORE_URL_SCHEMES`)."""

INSTALL_HINT = "pip install 'gradstream[iceberg]'"
"""What installs pyiceberg with its SQL catalog (the ``iceberg`` extra)."""

_ROWS = "gs_iceberg_rows"
"""Name under which a scanned Arrow table is registered while it is inserted."""


def _redacted(url: str) -> str:
    """``url`` with any password replaced by ``***``."""
    password = urlsplit(url).password
    return url if password is None else url.replace(f":{password}@", ":***@", 1)


@dataclass(frozen=True)
class IcebergLocation:
    """Where a store's Iceberg table set is (module docstring, the URL).

    Attributes:
        catalog: the SQL catalog's SQLAlchemy URL.
        warehouse: the writer's warehouse URL, or None (reads do not need it).
        namespace: the tables' namespace.
    """

    catalog: str
    warehouse: str | None
    namespace: str

    @classmethod
    def parse(cls, url: str) -> IcebergLocation:
        """The location named by the store URL ``url`` (``iceberg+<catalog>?warehouse=...``).

        Raises:
            StoreError: not an ``iceberg+`` URL, no catalog URL, an empty namespace.
        """
        kind, plus, rest = url.partition("+")
        if kind.lower() != URL_KIND or not plus or "://" not in rest:
            raise StoreError(
                f"not an Iceberg store URL: {_redacted(url)!r}; write "
                "iceberg+sqlite:////abs/catalog.db?warehouse=file:///abs/warehouse")
        base, _, query = rest.partition("?")
        own: dict[str, str] = {}
        other: list[tuple[str, str]] = []
        for key, value in parse_qsl(query, keep_blank_values=True):
            if key in ("warehouse", "namespace"):
                own[key] = value
            else:
                other.append((key, value))
        namespace = own.get("namespace", DEFAULT_NAMESPACE)
        if not namespace.strip():
            raise StoreError("the Iceberg store URL's namespace= is empty; leave it out for "
                             f"{DEFAULT_NAMESPACE!r} or name the writer's namespace")
        catalog = base + (f"?{urlencode(other)}" if other else "")
        return cls(catalog, own.get("warehouse") or None, namespace)

    def url(self) -> str:
        """The store URL of this location, password hidden (for messages)."""
        query = {"warehouse": self.warehouse} if self.warehouse else {}
        if self.namespace != DEFAULT_NAMESPACE:
            query["namespace"] = self.namespace
        sep = "&" if "?" in self.catalog else "?"
        tail = "".join(f"{'&' if i else sep}{k}={v}" for i, (k, v) in enumerate(query.items()))
        return f"{URL_KIND}+{_redacted(self.catalog)}{tail}"


def _check_sqlite_catalog(catalog: str) -> None:
    """Refuse a SQLite catalog whose file does not exist (SQLite would create an empty
    one) or that is in memory (it holds no store).

    Raises:
        StoreError: the URL is malformed, in memory, or names a missing file.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(catalog)
    except ArgumentError as exc:
        raise StoreError(f"the Iceberg catalog URL {_redacted(catalog)!r} is not a "
                         f"SQLAlchemy URL: {exc}") from None
    if parsed.get_backend_name() != "sqlite" or parsed.query.get("uri"):
        return
    database = parsed.database or ""
    if database in ("", ":memory:"):
        raise StoreError("an in-memory SQLite catalog holds no store: give the catalog file "
                         "the writer uses, e.g. iceberg+sqlite:////abs/catalog.db")
    if not Path(database).is_file():
        raise StoreError(
            f"no Iceberg catalog at {database!r}: the file does not exist. Give the catalog "
            "the store's writer was given (--iceberg-catalog / GRADSTREAM_ICEBERG_CATALOG) "
            "after 'iceberg+'; an absolute path takes four slashes: "
            "iceberg+sqlite:////abs/catalog.db")


def open_catalog(location: IcebergLocation, environ: Mapping[str, str] | None = None) -> Any:
    """pyiceberg's SQL catalog of ``location``, opened without creating anything (no
    catalog tables, no SQLite file), its FileIO given the S3 settings of ``environ``
    (default ``os.environ``, :func:`schemas.iceberg_catalog.s3_properties`).

    Returns:
        A ``pyiceberg.catalog.sql.SqlCatalog``; the caller disposes of ``catalog.engine``.

    Raises:
        StoreError: pyiceberg is not installed (with the command that installs it), the
            catalog file is missing, or the catalog's database cannot be opened.
    """
    try:
        from pyiceberg.catalog.sql import SqlCatalog
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError as exc:
        raise StoreError(f"reading an Iceberg store needs pyiceberg and SQLAlchemy ({exc}): "
                         f"{INSTALL_HINT}") from None
    _check_sqlite_catalog(location.catalog)
    properties = {"uri": location.catalog, "init_catalog_tables": "false",
                  **s3_properties(os.environ if environ is None else environ)}
    if location.warehouse:
        properties["warehouse"] = location.warehouse
    where = f"cannot open the Iceberg catalog {_redacted(location.catalog)!r}"
    try:
        return SqlCatalog(CATALOG_NAME, **properties)
    except ImportError as exc:  # the SQLAlchemy driver the URL names
        raise StoreError(f"{where}: {_first_line(exc)}; install the SQLAlchemy driver of "
                         "its database (e.g. psycopg2-binary for postgresql+psycopg2://)"
                         ) from None
    except SQLAlchemyError as exc:
        raise StoreError(f"{where}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _table_names(catalog: Any, location: IcebergLocation) -> set[str]:
    """The table names of ``location``'s namespace.

    Raises:
        StoreError: the namespace does not exist (the message lists the catalog's), or the
            database is not a pyiceberg SQL catalog.
    """
    from pyiceberg.exceptions import NoSuchNamespaceError
    from sqlalchemy.exc import SQLAlchemyError

    where = f"the Iceberg catalog {_redacted(location.catalog)!r}"
    try:
        try:
            return {ident[-1] for ident in catalog.list_tables(location.namespace)}
        except NoSuchNamespaceError:
            present = [".".join(n) for n in catalog.list_namespaces()]
    except SQLAlchemyError as exc:
        raise StoreError(f"{where} cannot be read as pyiceberg's SQL catalog (is it the "
                         f"catalog a gradstream store writes?): {_first_line(exc)}") from None
    listed = ", ".join(repr(n) for n in present) if present else "none"
    raise StoreError(
        f"{where} has no namespace {location.namespace!r} (catalog {CATALOG_NAME!r}; its "
        f"namespaces: {listed}): name the writer's namespace with &namespace=..., or start "
        "the writer (`gradstream consume --iceberg-catalog ... --iceberg-warehouse ...`) "
        "first")


def _pin(catalog: Any, location: IcebergLocation, name: str) -> Any:
    """The pinned ``pyiceberg`` table ``name`` (its current snapshot at this call).

    Raises:
        StoreError: the table's metadata cannot be read.
    """
    try:
        return catalog.load_table((*location.namespace.split("."), name))
    except Exception as exc:  # pyiceberg and FileIO errors have no common base
        raise StoreError(_unreadable(location, name, exc)) from None


def _unreadable(location: IcebergLocation, name: str, exc: BaseException) -> str:
    """The message for a table whose metadata or files cannot be read."""
    return (f"cannot read the Iceberg table {location.namespace}.{name}: {_first_line(exc)}. "
            "Check that the warehouse's files are reachable (for s3://: "
            f"{', '.join(S3_ENVIRONMENT)})")


def _insert(con: duckdb.DuckDBPyConnection, name: str, rows: pa.Table) -> None:
    """Insert ``rows`` into the DuckDB table ``name``, by column name, each value cast to
    the table's type; Iceberg columns the table lacks (a newer writer's) are left out.

    The rows go in sorted by their columns left to right (``ORDER BY ALL``): every table
    of :data:`schemas.tables.SCHEMA_DDL` begins with its key columns (``run_id, step,
    layer_index`` ...), so a run's rows are in step order, as a DuckDB store written step
    by step holds them, whatever the order of the data files. Floating-point sums then add
    in the same order, and a report or an analysis gives the DuckDB store's digits.

    Raises:
        StoreError: a required column is missing or a value does not fit its type.
    """
    if rows.num_rows == 0:
        return
    columns = [c for (c,) in con.execute(
        "SELECT column_name FROM duckdb_columns() WHERE database_name = current_database() "
        "AND table_name = $t ORDER BY column_index", {"t": name}).fetchall()]
    shared = [c for c in columns if c in set(rows.column_names)]
    quoted = ", ".join(f'"{c}"' for c in shared)
    con.register(_ROWS, rows)
    try:
        con.execute(f'INSERT INTO "{name}" ({quoted}) SELECT {quoted} FROM {_ROWS} '
                    "ORDER BY ALL")
    except duckdb.Error as exc:
        raise StoreError(f"the Iceberg table {name} does not fit the store's table "
                         f"{name} (schemas.tables): {_first_line(exc)}") from None
    finally:
        con.unregister(_ROWS)


def load_table_set(location: IcebergLocation,
                   environ: Mapping[str, str] | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB database holding the current snapshot of every table of the
    store's Iceberg table set (module docstring), not yet hardened.

    Args:
        location: the table set.
        environ: the environment the S3 settings come from (default ``os.environ``).

    Returns:
        The connection; the caller hardens and closes it.

    Raises:
        StoreError: pyiceberg missing, catalog or namespace missing, not a gradstream table
            set (a required table missing), a table or data file unreadable.
    """
    catalog = open_catalog(location, environ)
    con = duckdb.connect(":memory:")
    try:
        present = _table_names(catalog, location)
        for ddl in SCHEMA_DDL:
            con.execute(ddl)
        store_tables = [t for (t,) in con.execute(
            "SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
        missing = [t for t in REQUIRED_TABLES if t not in present]
        if missing:
            raise StoreError(
                f"the Iceberg namespace {location.namespace!r} of "
                f"{_redacted(location.catalog)!r} is not a gradstream table set (missing "
                f"tables: {', '.join(missing)})")
        for name in store_tables:
            if name not in present:
                con.execute(f'DROP TABLE "{name}"')
        # pin the tables a write commits last first (module docstring)
        order = [*reversed(COMMITTED_LAST),
                 *(t for t in store_tables if t not in COMMITTED_LAST)]
        pinned = {name: _pin(catalog, location, name) for name in order if name in present}
        for name, table in pinned.items():
            try:
                rows = table.scan().to_arrow()
            except Exception as exc:  # FileIO (OSError), pyarrow and pyiceberg errors
                raise StoreError(_unreadable(location, name, exc)) from None
            _insert(con, name, rows)
    except BaseException:
        con.close()
        raise
    finally:
        catalog.engine.dispose()
    return con


class IcebergReader(FileReader):
    """Reads on the current snapshot of a store's Iceberg table set (module docstring),
    the same way as a :class:`~analysis.read.reader.FileReader` on a DuckDB file.

    Args:
        url: the store URL (``iceberg+sqlite:////abs/catalog.db?warehouse=...``).
        timeout_s: time limit of each read (``None``:
            :func:`~analysis.read.query.resolve_timeout`); the loading is not limited.
        environ: where the S3 settings come from (default ``os.environ``).

    Attributes:
        location: the table set.

    Raises:
        StoreError: see :func:`load_table_set`; QueryError: invalid time limit.
    """

    def __init__(self, url: str, timeout_s: float | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.location = IcebergLocation.parse(url)
        self.db = self.location.url()
        self.timeout_s = resolve_timeout(timeout_s)
        self.via = (f"Iceberg snapshot of namespace {self.location.namespace} in "
                    f"{_redacted(self.location.catalog)}")
        self._con = load_table_set(self.location, environ)
        harden(self._con)

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        """A new cursor inside ``BEGIN TRANSACTION READ ONLY`` (closing it ends the
        transaction).

        Raises:
            StoreError: the reader is closed.
        """
        cur = super()._cursor()
        cur.execute("BEGIN TRANSACTION READ ONLY")
        return cur
