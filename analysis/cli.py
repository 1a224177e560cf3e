"""The ``report`` and ``export`` subcommands (added to the root app by ``register``).

DuckDB and the analysis modules are imported inside the commands, so building the
``gradstream`` command (and ``--help``) stays fast. Errors are printed in red on stderr,
without a traceback, and exit with status 1.
"""

from __future__ import annotations

import json
import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

DEFAULT_DB = "gradstream.duckdb"
"""Store file used when neither ``--db`` nor ``GRADSTREAM_DB`` is given."""


class ReportFormat(StrEnum):
    """Output of ``gradstream report``."""

    TABLE = "table"
    JSON = "json"


class ExportFormat(StrEnum):
    """File format of ``gradstream export``."""

    CSV = "csv"
    JSON = "json"


class LayerOrder(StrEnum):
    """Layer order within a step in exports."""

    NAME = "name"
    MODEL = "model"


DbOption = Annotated[
    Path,
    typer.Option(
        "--db",
        envvar="GRADSTREAM_DB",
        help="DuckDB store written by `gradstream consume` (env GRADSTREAM_DB).",
        show_default=True,
    ),
]
RunOption = Annotated[
    str | None,
    typer.Option(
        "--run",
        help="Run id. Optional when the store holds exactly one run.",
        show_default=False,
    ),
]
FromOption = Annotated[
    int | None,
    typer.Option("--from-step", min=0, help="First optimiser step included (inclusive)."),
]
ToOption = Annotated[
    int | None,
    typer.Option("--to-step", min=0, help="Last optimiser step included (inclusive)."),
]


def _fail(message: str) -> NoReturn:
    Console(stderr=True, highlight=False).print(f"error: {message}", style="bold red", markup=False)
    raise typer.Exit(code=1)


def _safe_filename(run_id: str) -> str:
    """``run_id`` reduced to a portable file-name stem (other characters become ``_``)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._")
    return stem or "run"


def report(
    db: DbOption = Path(DEFAULT_DB),
    run: RunOption = None,
    all_runs: Annotated[
        bool, typer.Option("--all", help="Report every run in the store (ignores --run).")
    ] = False,
    from_step: FromOption = None,
    to_step: ToOption = None,
    heatmap: Annotated[
        bool,
        typer.Option(
            "--heatmap/--no-heatmap",
            help="Also draw the ASCII flow-intensity heatmap (layers x steps).",
        ),
    ] = False,
    max_columns: Annotated[
        int,
        typer.Option("--max-columns", min=1, help="Widest heatmap, in step columns."),
    ] = 100,
    output_format: Annotated[
        ReportFormat,
        typer.Option("--format", help="table: for people; json: one object per run."),
    ] = ReportFormat.TABLE,
) -> None:
    """Summarise a run's gradient health: flagged layers, health class, recommendations."""
    import duckdb

    from analysis.heatmap import ascii_heatmap
    from analysis.report import build_report, render_report
    from analysis.store import StoreError, list_runs, open_store, resolve_run

    try:
        con = open_store(db)
        try:
            if all_runs:
                run_ids = list_runs(con)
                if not run_ids:
                    raise StoreError("the store holds no runs yet")
            else:
                run_ids = [resolve_run(con, run)]
            documents: list[dict[str, object]] = []
            console = Console(highlight=False)
            for run_id in run_ids:
                summary = build_report(con, run_id, from_step, to_step)
                drawing = (
                    ascii_heatmap(con, run_id, max_columns, from_step=from_step, to_step=to_step)
                    if heatmap
                    else None
                )
                if output_format is ReportFormat.JSON:
                    document = summary.model_dump(mode="json")
                    if drawing is not None:
                        document["heatmap"] = drawing
                    documents.append(document)
                else:
                    console.print(render_report(summary))
                    if drawing is not None:
                        typer.echo(drawing, nl=False)
        finally:
            con.close()
    except (StoreError, ValueError, duckdb.Error) as exc:
        _fail(str(exc))
    if output_format is ReportFormat.JSON:
        payload: object = documents if all_runs else documents[0]
        typer.echo(json.dumps(payload, indent=2, ensure_ascii=False))


def export(
    db: DbOption = Path(DEFAULT_DB),
    run: RunOption = None,
    output_format: Annotated[
        ExportFormat,
        typer.Option("--format", help="csv: one row per (step, layer); json: array of frames."),
    ] = ExportFormat.CSV,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Output file (parent directories are created). Default: out/<run>.<format>.",
            show_default=False,
        ),
    ] = None,
    from_step: FromOption = None,
    to_step: ToOption = None,
    order: Annotated[
        LayerOrder,
        typer.Option("--order", help="Layers within a step: by name (seed) or model order."),
    ] = LayerOrder.NAME,
) -> None:
    """Export a run's per-layer gradient statistics to CSV or JSON (seed 001 formats)."""
    import duckdb

    from analysis.export import export_csv, export_json
    from analysis.store import StoreError, open_store, resolve_run

    try:
        con = open_store(db)
        try:
            run_id = resolve_run(con, run)
            ext = output_format.value
            target = output or Path("out") / f"{_safe_filename(run_id)}.{ext}"
            writer = export_csv if output_format is ExportFormat.CSV else export_json
            count = writer(con, run_id, target, from_step, to_step, order.value)
        finally:
            con.close()
    except (StoreError, ValueError, duckdb.Error) as exc:
        _fail(str(exc))
    unit = "rows" if output_format is ExportFormat.CSV else "frames"
    Console(stderr=True, highlight=False).print(
        f"wrote {count} {unit} of run {run_id!r} to {os.fspath(target)}", markup=False
    )


def register(app: typer.Typer) -> None:
    """Add the ``report`` and ``export`` commands to ``app`` (the ``gradstream`` root).

    Args:
        app: the Typer application to extend; nothing else is modified.
    """
    app.command(name="report")(report)
    app.command(name="export")(export)
