"""Opening the gradstream DuckDB store for reading, and naming runs in it.

DuckDB allows one writing process per database file (README.md, "Tables"): while a
``gradstream consume`` worker writes the store, other processes cannot open it, not even
read-only. :func:`open_store` turns that and the other opening failures into a
:class:`StoreError` with a message a user can act on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import duckdb

REQUIRED_TABLES: tuple[str, ...] = ("runs", "layers", "layer_stats", "frames")
"""Tables of ``schemas.tables.SCHEMA_DDL`` that the analysis reads."""

READ_MEMORY_LIMIT_ENV = "GRADSTREAM_READ_MEMORY_LIMIT"
"""Environment variable overriding :data:`DEFAULT_READ_MEMORY_LIMIT`."""

DEFAULT_READ_MEMORY_LIMIT = "1GB"
"""DuckDB ``memory_limit`` of a read-only store connection. DuckDB's buffer pool keeps the
table pages a query read, up to its limit (80 % of RAM by default): reading a 100 M-row
run left about 3.7 GB of pages held after the query, on top of the analysis's own arrays.
The file's pages stay in the operating system's page cache anyway, so a small pool costs
a re-read from memory, not from disk; a query needing more (a sort or window over the whole
run) spills to ``<store>.tmp``. 1 GB keeps a 100 M-row analysis within a few GB
(``bench/history_scale.py``)."""

_MEMORY_LIMIT = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)


class StoreError(Exception):
    """The store cannot answer: missing or locked file, not a gradstream store, unknown or
    ambiguous run, or an invalid query argument. ``str(exc)`` is a one-line message meant
    for the user (the CLI prints it as is)."""


class StoreLockedError(StoreError):
    """Another process (or this one, in the other mode) holds the store's file, so it cannot
    be opened read-only; a reader then looks for that process's endpoint
    (:func:`analysis.read.reader.open_reader`)."""


def open_store(path: str | os.PathLike[str], read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """Open an existing gradstream store.

    Args:
        path: the DuckDB file written by the consumer's sink (e.g. ``./gradstream.duckdb``).
        read_only: open without write access (the default; the analysis never writes).
            A read-write open still refuses to create a missing file.

    Returns:
        A DuckDB connection; the caller closes it.

    A read-only connection's DuckDB buffer pool is limited to :func:`read_memory_limit`.

    Raises:
        StoreLockedError: it is locked by a writing process, or already open in this
            process in the other mode.
        StoreError: the file does not exist; it is not a DuckDB file; it lacks the
            gradstream tables (``schemas.tables.SCHEMA_DDL``); or
            ``GRADSTREAM_READ_MEMORY_LIMIT`` is not a size.
    """
    file = Path(path)
    if not file.exists():
        raise StoreError(
            f"no gradstream store at {str(file)!r}: the file does not exist "
            "(pass --db or set GRADSTREAM_DB)"
        )
    if file.is_dir():
        raise StoreError(f"{str(file)!r} is a directory, not a gradstream store file")
    try:
        con = duckdb.connect(str(file), read_only=read_only)
    except duckdb.IOException as exc:
        text = str(exc)
        if "lock" in text.lower():
            raise StoreLockedError(
                f"the store {str(file)!r} is being written by another process (DuckDB "
                "allows one writing process); stop it, or read through its endpoint"
            ) from None
        raise StoreError(f"cannot open the store {str(file)!r}: {text}") from None
    except duckdb.ConnectionException as exc:
        raise StoreLockedError(
            f"the store {str(file)!r} is already open in this process with a different "
            f"read_only setting: {exc}"
        ) from None
    except duckdb.Error as exc:
        raise StoreError(f"cannot open the store {str(file)!r}: {exc}") from None
    present = {
        row[0]
        for row in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
        ).fetchall()
    }
    missing = [name for name in REQUIRED_TABLES if name not in present]
    if missing:
        con.close()
        raise StoreError(
            f"{str(file)!r} is a DuckDB file but not a gradstream store "
            f"(missing tables: {', '.join(missing)})"
        )
    if read_only:
        try:
            limit_read_memory(con)
        except StoreError:
            con.close()
            raise
    return con


def limit_read_memory(con: duckdb.DuckDBPyConnection) -> None:
    """Bound the DuckDB buffer pool of a read-only connection to :func:`read_memory_limit`.

    A second open of a file in this process shares the first one's DuckDB instance, whose
    configuration a reader locks (``analysis.read.query.harden``): it is left as it is.

    Raises:
        StoreError: ``GRADSTREAM_READ_MEMORY_LIMIT`` is not a size.
    """
    limit = read_memory_limit()
    (locked,) = con.execute("SELECT current_setting('lock_configuration')").fetchall()[0]
    if not locked:
        con.execute(f"SET memory_limit = '{limit}'")


def read_memory_limit() -> str:
    """The DuckDB ``memory_limit`` of a read-only store connection:
    ``GRADSTREAM_READ_MEMORY_LIMIT`` (e.g. ``4GB``, ``512MiB``), else
    :data:`DEFAULT_READ_MEMORY_LIMIT`.

    Raises:
        StoreError: the variable is not a size (a number and a unit: B, KB, MB, GB, TB,
            KiB, MiB, GiB, TiB).
    """
    value = os.environ.get(READ_MEMORY_LIMIT_ENV, "").strip() or DEFAULT_READ_MEMORY_LIMIT
    if not _MEMORY_LIMIT.match(value):
        raise StoreError(f"{READ_MEMORY_LIMIT_ENV} must be a size such as 1GB or 512MiB, "
                         f"got {value!r}")
    return value


def list_runs(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Run ids recorded in the store's ``runs`` table, sorted by id.

    Args:
        con: a connection from :func:`open_store`.

    Returns:
        Every ``runs.run_id``, ascending (code-point order); empty for an empty store.
    """
    return [row[0] for row in con.execute("SELECT run_id FROM runs ORDER BY run_id").fetchall()]


def _describe(runs: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(r) for r in runs[:limit])
    more = f", ... and {len(runs) - limit} more" if len(runs) > limit else ""
    return shown + more


def pick_run(runs: list[str], run_id: str | None) -> str:
    """Choose a run among ``runs`` (the store's run ids) from an optional ``--run`` argument.

    Args:
        runs: every run id of the store.
        run_id: an exact run id, a prefix matching exactly one run id, or ``None`` to mean
            "the only run in the store".

    Returns:
        The run id chosen.

    Raises:
        StoreError: no run matches (the message lists the runs present), the prefix matches
            several runs (they are listed), the store holds no run, or ``run_id`` is
            ``None`` while several runs exist.
    """
    if run_id is not None:
        if run_id in runs:
            return run_id
        matches = [r for r in runs if r.startswith(run_id)] if run_id else []
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise StoreError(
                f"run {run_id!r} is ambiguous: it begins {len(matches)} run ids: "
                f"{_describe(matches)}"
            )
        where = f"runs in the store: {_describe(runs)}" if runs else "the store holds no runs"
        raise StoreError(f"unknown run {run_id!r}; {where}")
    if not runs:
        raise StoreError("the store holds no runs yet")
    if len(runs) > 1:
        raise StoreError(
            f"the store holds {len(runs)} runs, choose one with --run (or --all): {_describe(runs)}"
        )
    return runs[0]


def resolve_run(con: duckdb.DuckDBPyConnection, run_id: str | None) -> str:
    """Turn an optional ``--run`` argument into a run id present in the store
    (:func:`pick_run` over :func:`list_runs`).

    Raises:
        StoreError: see :func:`pick_run`.
    """
    return pick_run(list_runs(con), run_id)


def require_run(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """Check that ``run_id`` is exactly a run id of the store (no prefix matching: the
    builders take resolved ids).

    Raises:
        StoreError: the run is unknown (the message lists the runs present).
    """
    rows = con.execute("SELECT count(*) FROM runs WHERE run_id = $run_id",
                       {"run_id": run_id}).fetchall()  # fetchall: leaves no pending result
    if not rows or not rows[0][0]:
        runs = list_runs(con)
        where = f"runs in the store: {_describe(runs)}" if runs else "the store holds no runs"
        raise StoreError(f"unknown run {run_id!r}; {where}")


def check_step_range(from_step: int | None, to_step: int | None) -> None:
    """Validate an inclusive optimiser-step range ``[from_step, to_step]``.

    Args:
        from_step: first step kept (inclusive), or ``None`` for no lower bound.
        to_step: last step kept (inclusive), or ``None`` for no upper bound.

    Raises:
        StoreError: a bound is negative or ``from_step > to_step``.
    """
    for label, value in (("from_step", from_step), ("to_step", to_step)):
        if value is not None and value < 0:
            raise StoreError(f"{label} must be >= 0, got {value}")
    if from_step is not None and to_step is not None and from_step > to_step:
        raise StoreError(f"from_step {from_step} is after to_step {to_step}")


TABLE_EXISTS_SQL = (
    "SELECT count(*) AS n FROM duckdb_tables() WHERE database_name = current_database() "
    "AND table_name = $table"
)
"""One row, ``n`` = 1 when the store has the table ``$table`` (else 0): the check behind
:func:`has_table` and :meth:`analysis.read.reader.StoreReader.has_table`."""


def has_table(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Whether the store has ``table``. A store written before a table was added and never
    opened by a newer writer lacks it (e.g. ``step_scalars`` / ``rank_scalars``, the
    training scalars): its readers take a missing optional table as empty."""
    rows = con.execute(TABLE_EXISTS_SQL, {"table": table}).fetchall()  # no pending result
    return bool(rows and rows[0][0])


def has_column(con: duckdb.DuckDBPyConnection, table: str, column: str) -> bool:
    """Whether the store's ``table`` has ``column`` (a store written by an earlier schema
    version lacks the columns added since, e.g. ``layers.dtype`` or ``runs.ignore_layers``)."""
    row = con.execute(
        "SELECT count(*) FROM duckdb_columns() WHERE database_name = current_database() "
        "AND table_name = $table AND column_name = $column",
        {"table": table, "column": column},
    ).fetchone()
    return bool(row and row[0])
