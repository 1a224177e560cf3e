"""``gradstream maintain``: housekeeping of a store.

- The Apache Iceberg table set the stores write (:mod:`consumer.iceberg_maintenance`):
  small files compacted, old snapshots expired, the Kafka offsets kept.
- A DuckDB store (``--db``, :mod:`consumer.duckdb_maintenance`): the frame summaries and
  grid rollup the writer keeps beside the rows, given to frames stored without them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from deploy.cli.errors import fail
from deploy.cli.options import given

CatalogOption = Annotated[
    str | None,
    typer.Option("--catalog", "--iceberg-catalog", metavar="URL", show_default=False,
                 help="The Iceberg SQL catalog the stores write (a SQLAlchemy URL: "
                 "sqlite:///path/catalog.db or postgresql+psycopg2://user:password@host/db). "
                 "Default: $GRADSTREAM_ICEBERG_CATALOG. Prefer the variable when the URL "
                 "holds a password: a flag shows in `ps`."),
]
WarehouseOption = Annotated[
    str | None,
    typer.Option("--warehouse", "--iceberg-warehouse", metavar="URL", show_default=False,
                 help="Where the tables' files are: file:///path or s3://bucket/path (S3 "
                 "endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
                 "AWS_SECRET_ACCESS_KEY, AWS_REGION). Default: $GRADSTREAM_ICEBERG_WAREHOUSE."),
]
NamespaceOption = Annotated[
    str | None,
    typer.Option("--namespace", "--iceberg-namespace", metavar="NAME",
                 help="Iceberg namespace of the store's tables. "
                 "Default: $GRADSTREAM_ICEBERG_NAMESPACE or gradstream."),
]
RetainOption = Annotated[
    str | None,
    typer.Option("--retain", metavar="AGE",
                 help="Keep every snapshot that was current within this age (e.g. 7d, 12h, "
                 "30m; s, m, h, d, w) and expire the older ones, deleting the files only "
                 "they use; the offsets stores resume from are kept whatever their age. "
                 "Default: $GRADSTREAM_ICEBERG_RETAIN or 5d (Iceberg's default)."),
]
MinInputFilesOption = Annotated[
    int | None,
    typer.Option("--min-input-files", min=2, metavar="N",
                 help="Compact a partition (a run) holding at least N small data files "
                 "into files of the table's target size. Default: "
                 "$GRADSTREAM_ICEBERG_MIN_INPUT_FILES or 5 (Iceberg's rewrite_data_files)."),
]
QuietPeriodOption = Annotated[
    str | None,
    typer.Option("--quiet-period", metavar="AGE",
                 help="Leave alone the partitions that got a file within this age (runs "
                 "still streaming). Default: $GRADSTREAM_ICEBERG_QUIET_PERIOD or 1h."),
]


def _hidden_password(uri: str) -> str:
    """``uri`` with its password shown as ``***`` (SQLAlchemy's URL rendering)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(uri).render_as_string(hide_password=True)
    except ArgumentError:
        return uri


def _reason(exc: Exception) -> str:
    """The first line of the database driver's message behind a SQLAlchemy error (the
    statement and parameters SQLAlchemy appends are left out)."""
    cause = getattr(exc, "orig", None) or exc
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


DuckDbOption = Annotated[
    Path | None,
    typer.Option("--db", metavar="PATH", show_default=False, exists=True, dir_okay=False,
                 help="Maintain this DuckDB store instead of Iceberg tables: give the frames "
                 "stored before gradstream kept them (or written by another program) their "
                 "report summaries and the grid rollup, so that reports and the heatmap of "
                 "long runs read those instead of every row. Needs the file to itself: stop "
                 "the consumer writing it first."),
]
RunOnlyOption = Annotated[
    str | None,
    typer.Option("--run", show_default=False,
                 help="With --db: only this run (default: every run)."),
]


def maintain(
    db: DuckDbOption = None,
    run: RunOnlyOption = None,
    catalog: CatalogOption = None,
    warehouse: WarehouseOption = None,
    namespace: NamespaceOption = None,
    retain: RetainOption = None,
    min_input_files: MinInputFilesOption = None,
    quiet_period: QuietPeriodOption = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print what would be done; commit and delete nothing.")] = False,
) -> None:
    """Housekeeping of the Iceberg tables the stores write: compact each run's small data
    files, expire the snapshots older than --retain and delete the files only they use,
    without losing a Kafka offset a store resumes from (the newest offset of every
    consumer group and partition is first carried into a new snapshot when an old one
    holds it). Runs while stores write: runs that got a file within --quiet-period are not
    compacted, and a commit that conflicts with a store's is refused, then retried or the
    run left as it is. Run one at a time per namespace, e.g. daily. With --db, a DuckDB
    store instead: the report summaries of its frames and the grid rollup of its runs are
    filled where a store written by an older gradstream lacks them."""
    if db is not None:
        given_iceberg = [flag for flag, value in (
            ("--catalog", catalog), ("--warehouse", warehouse), ("--namespace", namespace),
            ("--retain", retain), ("--min-input-files", min_input_files),
            ("--quiet-period", quiet_period)) if value is not None]
        if given_iceberg:
            fail(f"{', '.join(given_iceberg)} maintain Iceberg tables, --db a DuckDB store: "
                 "give one or the other", 2)
        _maintain_duckdb(db, run, dry_run)
        return
    if run is not None:
        fail("--run goes with --db (a DuckDB store); Iceberg maintenance covers every run", 2)
    from pyiceberg.exceptions import CommitFailedException, NoSuchTableError, ValidationException
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from sqlalchemy.exc import SQLAlchemyError

    from consumer.iceberg_maintenance import (
        MaintenanceError,
        MaintenanceSettings,
        format_age,
        open_catalog,
    )
    from consumer.iceberg_maintenance import maintain as run_maintenance
    from deploy.cli.consume import valid_settings
    from schemas.iceberg_catalog import s3_properties

    settings = valid_settings(MaintenanceSettings, **given(
        iceberg_catalog=catalog, iceberg_warehouse=warehouse, iceberg_namespace=namespace,
        iceberg_retain=retain, iceberg_min_input_files=min_input_files,
        iceberg_quiet_period=quiet_period))
    if not settings.iceberg_catalog or not settings.iceberg_warehouse:
        fail("maintain needs the Iceberg catalog and warehouse the stores write: give "
             "--catalog and --warehouse, or set GRADSTREAM_ICEBERG_CATALOG and "
             "GRADSTREAM_ICEBERG_WAREHOUSE", 2)
    where = (f"catalog {_hidden_password(settings.iceberg_catalog)}, warehouse "
             f"{settings.iceberg_warehouse}, namespace {settings.iceberg_namespace}")
    err = Console(stderr=True, highlight=False)
    err.print(f"{'dry run: ' if dry_run else ''}maintaining {where} (retain "
              f"{format_age(settings.iceberg_retain)}, compact from "
              f"{settings.iceberg_min_input_files} small files, quiet period "
              f"{format_age(settings.iceberg_quiet_period)})", markup=False)
    try:
        iceberg = open_catalog(settings.iceberg_catalog, settings.iceberg_warehouse,
                               s3_properties(os.environ))
    except MaintenanceError as exc:
        fail(str(exc))
    except ModuleNotFoundError as exc:  # the database driver of the catalog's URL
        fail(f"the catalog URL needs the Python module {exc.name}: for PostgreSQL install "
             "gradstream[postgres] (psycopg2)")
    except SQLAlchemyError as exc:
        fail(f"cannot open the catalog {_hidden_password(settings.iceberg_catalog)}: "
             f"{_reason(exc)} (is the database up, and the URL right?)")
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("opening the tables", total=None)

            def progress(what: str, done: int, total: int) -> None:
                bar.update(task, description=what, completed=done, total=total)

            report = run_maintenance(
                iceberg, settings.iceberg_namespace, settings.iceberg_retain,
                settings.iceberg_min_input_files, settings.iceberg_quiet_period, dry_run,
                progress)
    except MaintenanceError as exc:
        fail(str(exc))
    except SQLAlchemyError as exc:
        fail(f"the catalog {_hidden_password(settings.iceberg_catalog)} failed: "
             f"{_reason(exc)} (is the database up?)")
    except (OSError, NoSuchTableError, CommitFailedException, ValidationException) as exc:
        fail(f"maintaining {where} failed: {type(exc).__name__}: {exc} (each commit is "
             "atomic: run maintain again)")
    for item in report.compactions:
        if item.refused is not None:
            err.print(f"left {item.table} partition {item.partition}: {item.refused}",
                      style="yellow", markup=False)
    Console(highlight=False).print(report.summary(), markup=False, soft_wrap=True)


def _maintain_duckdb(path: Path, run: str | None, dry_run: bool) -> None:
    """``maintain --db``: :func:`consumer.duckdb_maintenance.upgrade_store` on ``path``
    with a progress bar; with ``dry_run``, what it would do, from a read-only connection."""
    import duckdb
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from analysis.read.connect import has_column, has_table
    from consumer.duckdb_maintenance import stale_rollup_runs, upgrade_store
    from schemas.grid_rollup import ROLLUP_TABLE

    err = Console(stderr=True, highlight=False)
    try:
        con = duckdb.connect(str(path), read_only=dry_run)
    except duckdb.Error as exc:
        fail(f"cannot open {path} for {'reading' if dry_run else 'writing'}: {exc} (DuckDB "
             "lets one process write a file: stop the consumer or server writing it)")
    try:
        if not (has_table(con, "frames") and has_table(con, "layer_stats")):
            fail(f"{path} is not a gradstream store (no frames or layer_stats table)")
        if run is not None and not con.execute(
                "SELECT count(*) FROM frames WHERE run_id = ?", [run]).fetchone()[0]:  # type: ignore[index]
            fail(f"no frames of run {run!r} in {path}")
        if dry_run:
            summarised = has_column(con, "frames", "vanishing_indices")
            where = "" if run is None else "AND run_id = $run"
            missing = con.execute(
                "SELECT count(*) FROM frames WHERE "
                + ("vanishing_indices IS NULL " if summarised else "true ") + where,
                {} if run is None else {"run": run}).fetchone()[0]  # type: ignore[index]
            stale = (stale_rollup_runs(con, run) if has_table(con, ROLLUP_TABLE) else
                     [r[0] for r in con.execute(
                         "SELECT DISTINCT run_id FROM layer_stats "
                         + ("" if run is None else "WHERE run_id = $run ") + "ORDER BY 1",
                         {} if run is None else {"run": run}).fetchall()])
            Console(highlight=False).print(
                f"dry run: {missing:,} frames to summarise; grid rollup to rebuild for "
                f"{len(stale)} run{'s' if len(stale) != 1 else ''}"
                + (f" ({', '.join(stale[:5])}{', ...' if len(stale) > 5 else ''})"
                   if stale else ""), markup=False, soft_wrap=True)
            return
        con.execute("SET enable_progress_bar = false")  # the bar below says what is done
        err.print(f"maintaining {path}" + (f", run {run}" if run else ""), markup=False)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("opening the store", total=None)

            def progress(what: str, done: int, total: int) -> None:
                bar.update(task, description=what, completed=done, total=total)

            report = upgrade_store(con, run, progress)
    except duckdb.Error as exc:
        fail(f"maintaining {path} failed: {type(exc).__name__}: {exc} (what was done is "
             "kept; run maintain again)")
    finally:
        con.close()
    Console(highlight=False).print(report.summary(), markup=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``maintain`` to the root application."""
    app.command("maintain", help=maintain.__doc__,
                short_help="Store housekeeping: Iceberg compaction and snapshot expiry; "
                "DuckDB summaries and grid rollup (--db).")(maintain)
