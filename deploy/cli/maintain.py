"""``gradstream maintain``: housekeeping of the Apache Iceberg table set the stores write
(:mod:`consumer.iceberg_maintenance`): small files compacted, old snapshots expired, the
Kafka offsets kept."""

from __future__ import annotations

import os
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


def maintain(
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
    run left as it is. Run one at a time per namespace, e.g. daily."""
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


def register(app: typer.Typer) -> None:
    """Add ``maintain`` to the root application."""
    app.command("maintain", help=maintain.__doc__,
                short_help="Iceberg housekeeping: compact small files, expire old snapshots, "
                "keep the offsets.")(maintain)
