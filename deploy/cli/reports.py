"""``gradstream report``, ``export``, ``plot`` and ``query``: read the store
(:mod:`analysis.report`, :mod:`analysis.export`, :mod:`analysis.plots`,
:mod:`analysis.read.query`).

Every command reads through :func:`analysis.read.reader.open_reader`: the file when it is free,
else the endpoint of the process that writes it; each read runs under one time limit
(``--timeout``, else ``GRADSTREAM_QUERY_TIMEOUT_S``, else 60 s). Errors are printed in red
on stderr, without a traceback, and exit with status 1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from analysis.presentation import EXPORT_FORMATS, LAYER_ORDERS, STYLES
from deploy.cli.errors import fail
from deploy.cli.options import (
    DEFAULT_DB,
    DbOption,
    ExcludeRoundingOption,
    FromStepOption,
    IgnoreLayersOption,
    NonfiniteVerdictOption,
    RunOption,
    ToStepOption,
)
from deploy.cli.options import nonfinite_rule as resolve_nonfinite_rule

if TYPE_CHECKING:
    from analysis.read.reader import StoreReader

def exclusion_patterns(given: list[str] | None) -> list[str]:
    """``--ignore-layers`` as given, else ``$GRADSTREAM_IGNORE_LAYERS`` split on commas (as
    the consumer's settings read it), else none."""
    from analysis.read.exclusion import split_patterns

    if given:
        return list(given)
    return list(split_patterns(os.environ.get("GRADSTREAM_IGNORE_LAYERS", "")))


def exclude_rounding(given: bool | None) -> bool:
    """``--exclude-rounding-level`` as given, else ``$GRADSTREAM_EXCLUDE_ROUNDING_LEVEL``
    (1/true/yes/on, any case), else off."""
    if given is not None:
        return given
    env = os.environ.get("GRADSTREAM_EXCLUDE_ROUNDING_LEVEL", "").strip().lower()
    return env in {"1", "true", "yes", "on"}


TimeoutOption = Annotated[
    float | None,
    typer.Option(
        "--timeout", min=0.001, show_default=False,
        help="Interrupt each read of the store after this many seconds [default: "
        "GRADSTREAM_QUERY_TIMEOUT_S, else 60].",
    ),
]
"""``--timeout``: the time limit of each read (:func:`analysis.read.query.resolve_timeout`);
shared by the commands that read the store (report, export, plot, query, analyze, alerts)."""


@contextmanager
def reading(db: Path | str, timeout: float | None) -> Iterator[StoreReader]:
    """The store's reader (:func:`analysis.read.reader.open_reader`: a DuckDB file's path,
    or a store URL as a ``str``, ``iceberg+...``), closed on exit; a ``StoreError``
    (opening or reading) ends the command with its one-line message."""
    from analysis.read.connect import StoreError
    from analysis.read.reader import open_reader

    try:
        with open_reader(db, timeout) as reader:
            yield reader
    except StoreError as exc:
        fail(str(exc))


class ReportFormat(StrEnum):
    """Output of ``gradstream report``."""

    TABLE = "table"
    JSON = "json"


def _choice_enum(name: str, values: tuple[str, ...], doc: str) -> Any:
    """A command-line choice: the ``StrEnum`` ``name`` with one member per value
    (``NAME = "name"``, in the tuple's order) and docstring ``doc``."""
    choice = StrEnum(name, [(value.upper(), value) for value in values],  # type: ignore[misc]
                     module=__name__)
    choice.__doc__ = doc
    return choice


ExportFormat = _choice_enum("ExportFormat", EXPORT_FORMATS, "File format of ``gradstream "
                            "export`` (:data:`analysis.presentation.EXPORT_FORMATS`).")


class QueryFormat(StrEnum):
    """Output of ``gradstream query``."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"


LayerOrder = _choice_enum("LayerOrder", LAYER_ORDERS, "Layer order within a step (report "
                          "lists, exports; :data:`analysis.presentation.LAYER_ORDERS`).")
Style = _choice_enum("Style", STYLES, "Presentation of the ASCII heatmap and the CSV / JSON "
                     "exports (:data:`analysis.presentation.STYLES`).")


@contextmanager
def _progress_bar(description: str) -> Iterator[Callable[[float | None], None]]:
    """A transient rich progress bar on stderr; yields its ``fraction | None`` callback."""
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
        TimeElapsedColumn(), console=Console(stderr=True), transient=True,
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(fraction: float | None) -> None:
            if fraction is not None:
                bar.update(task, total=1.0, completed=fraction)

        yield update


def report(
    db: DbOption = Path(DEFAULT_DB),
    run: RunOption = None,
    all_runs: Annotated[
        bool, typer.Option("--all", help="Report every run in the store (ignores --run).")
    ] = False,
    from_step: FromStepOption = None,
    to_step: ToStepOption = None,
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
    heatmap_style: Annotated[
        Style,
        typer.Option("--heatmap-style", help="gradstream: model order, at most --max-columns "
                     "columns, NaN/Inf glyph, legend; reference: trustformers-debug's "
                     "drawing exactly (name order, one column per step)."),
    ] = Style.GRADSTREAM,
    output_format: Annotated[
        ReportFormat,
        typer.Option("--format", help="table: for people; json: one object per run."),
    ] = ReportFormat.TABLE,
    ignore_layers: IgnoreLayersOption = None,
    exclude_rounding_level: ExcludeRoundingOption = None,
    nonfinite_rule: NonfiniteVerdictOption = None,
    order: Annotated[
        LayerOrder,
        typer.Option("--order", help="Flagged-layer lists in model order, or by name (the "
                     "order of trustformers-debug)."),
    ] = LayerOrder.MODEL,
    timeout: TimeoutOption = None,
) -> None:
    """Summarise a run's gradient health: flagged layers, health class, findings,
    recommendations. Every layer counts, as in trustformers-debug, except those
    the run's ignore_layers or --ignore-layers exclude; the report names them."""
    from analysis.read.connect import StoreError
    from analysis.report import render_report

    documents: list[dict[str, object]] = []
    rule = resolve_nonfinite_rule(nonfinite_rule)
    with reading(db, timeout) as reader:
        if all_runs:
            run_ids = reader.run_ids()
            if not run_ids:
                raise StoreError("the store holds no runs yet")
        else:
            run_ids = [reader.resolve_run(run)]
        console = Console(highlight=False)
        for run_id in run_ids:
            summary = reader.report(
                run_id, from_step, to_step,
                exclusion_patterns(ignore_layers), exclude_rounding(exclude_rounding_level),
                order.value, rule)
            drawing = (reader.heatmap(run_id, max_columns, from_step, to_step,
                                      heatmap_style.value) if heatmap else None)
            if output_format is ReportFormat.JSON:
                document = summary.model_dump(mode="json")
                if drawing is not None:
                    document["heatmap"] = drawing
                documents.append(document)
            else:
                console.print(render_report(summary))
                if drawing is not None:
                    typer.echo(drawing, nl=False)
    if output_format is ReportFormat.JSON:
        payload: object = documents if all_runs else documents[0]
        typer.echo(json.dumps(payload, indent=2, ensure_ascii=False))


def export(
    db: DbOption = Path(DEFAULT_DB),
    run: RunOption = None,
    output_format: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="csv: one row per (step, layer) with the frame fields; json: an array of "
            "frames, each with its layers; "
            "parquet / jsonl: one row per (step, layer) with every stored column.",
        ),
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
    from_step: FromStepOption = None,
    to_step: ToStepOption = None,
    order: Annotated[
        LayerOrder,
        typer.Option("--order", help="Layers within a step: by name (as trustformers-debug "
                     "exports them) or in model order."),
    ] = LayerOrder.NAME,
    style: Annotated[
        Style,
        typer.Option("--style", help="csv and json. gradstream: CSV names quoted when they "
                     "hold a comma, quote or line break, one compact JSON frame per line; "
                     "reference: trustformers-debug's bytes exactly (name order, "
                     "CSV names raw, JSON pretty-printed as serde_json does)."),
    ] = Style.GRADSTREAM,
    timeout: TimeoutOption = None,
) -> None:
    """Export a run's per-layer gradient statistics: CSV (one row per step and layer: mean
    and max |g|, norm, vanishing / exploding flags) or JSON (an array of frames, one per
    step, with each layer's fields and flow intensity), Parquet or JSON Lines (every
    stored column). Streamed, with a progress bar; while another process writes the store,
    that process reads the rows and this one writes the file."""
    from analysis.export import file_stem

    ext = output_format.value
    with reading(db, timeout) as reader, _progress_bar(f"exporting {ext}") as on_progress:
        run_id = reader.resolve_run(run)
        target = output or Path("out") / f"{file_stem(run_id)}.{ext}"
        count = reader.export(run_id, ext, target, from_step, to_step, order.value, on_progress,
                              style.value)
    unit = "frames" if output_format is ExportFormat.JSON else "rows"
    Console(stderr=True, highlight=False).print(
        f"wrote {count} {unit} of run {run_id!r} to {os.fspath(target)}", markup=False
    )


def plot(
    db: DbOption = Path(DEFAULT_DB),
    run: RunOption = None,
    out: Annotated[
        Path,
        typer.Option("--out", help="Directory for the pictures (created)."),
    ] = Path("out"),
    from_step: FromStepOption = None,
    to_step: ToStepOption = None,
    max_steps: Annotated[
        int,
        typer.Option("--max-steps", min=1,
                     help="Most step columns in the PNGs; more steps are binned (max over "
                     "each bin) and the picture says so."),
    ] = 1200,
    max_layers: Annotated[
        int,
        typer.Option("--max-layers", min=1,
                     help="Most layer rows; more layers are binned (max over each bin)."),
    ] = 200,
    max_frames: Annotated[
        int,
        typer.Option("--max-frames", min=1,
                     help="Most frames of the HTML animation (each covers a bin of steps)."),
    ] = 500,
    width: Annotated[int, typer.Option("--width", min=400, help="PNG width in pixels.")] = 1600,
    timeout: TimeoutOption = None,
) -> None:
    """Draw a run: PNG heatmap of log10 gradient norm (layers in model order x steps,
    vanishing/exploding cells marked; the run's loss above it on the same steps when it
    sent one), PNG of per-layer norms over time, and the gradient-flow animation as one
    offline HTML file (step slider, play button)."""
    from analysis.export import file_stem
    from analysis.plots.files import write_pictures

    with reading(db, timeout) as reader:
        run_id = reader.resolve_run(run)
        with Console(stderr=True).status(f"drawing run {run_id}"):
            files = write_pictures(reader, run_id, out, file_stem(run_id),
                                   max_steps=max_steps, max_layers=max_layers,
                                   max_frames=max_frames, width_px=width, from_step=from_step,
                                   to_step=to_step)
    console = Console(stderr=True, highlight=False)
    console.print(f"run {run_id!r}: {files.heatmap_caption}", markup=False, soft_wrap=True)
    if files.loss_caption is not None:
        console.print(files.loss_caption, markup=False, soft_wrap=True)
    for path in (files.heatmap, files.series, files.animation):
        console.print(f"wrote {os.fspath(path)}", markup=False, soft_wrap=True)


def query(
    sql: Annotated[str, typer.Argument(help="One SQL statement, e.g. \"SELECT * FROM runs\".")],
    db: DbOption = Path(DEFAULT_DB),
    output_format: Annotated[
        QueryFormat,
        typer.Option("--format", help="table (for people), csv or json (array of objects)."),
    ] = QueryFormat.TABLE,
    timeout: TimeoutOption = None,
) -> None:
    """Run one read-only SQL statement on the store, also while a worker writes it (through
    that process's endpoint). A statement that would write, or touch files outside the
    store, is refused. Tables: runs, layers, layer_stats, frames, alerts, run_ranks,
    kafka_offsets."""
    from analysis.read.query_output import to_csv, to_json, to_rich_table

    with reading(db, timeout) as reader:
        table = reader.sql(sql)
        via = reader.via
    if output_format is QueryFormat.CSV:
        typer.echo(to_csv(table), nl=False)
    elif output_format is QueryFormat.JSON:
        typer.echo(to_json(table), nl=False)
    else:
        Console(highlight=False).print(to_rich_table(table))
        Console(stderr=True, highlight=False).print(
            f"{table.num_rows} rows (via {via})", style="dim", markup=False
        )


def register(app: typer.Typer) -> None:
    """Add ``report``, ``export``, ``plot`` and ``query`` to the root application."""
    app.command(name="report")(report)
    app.command(name="export", short_help="Export a run (or steps of it) as CSV, JSON, "
                "Parquet or JSON Lines.")(export)
    app.command(name="plot", short_help="Draw a run: PNG heatmap, PNG norm series, offline "
                "HTML animation.")(plot)
    app.command(name="query", short_help="Read-only SQL over the store, also while a worker "
                "writes it.")(query)
