"""``gradstream analyze``: the seed 002/003/004 analyses of a stored run, as terminal tables
or JSON.

Kinds: ``flow`` (gradient flow visualisation data, :mod:`analysis.flow`), ``enhanced``
(enhanced analysis, :mod:`analysis.enhanced`), ``explosion`` (:mod:`analysis.explosion`),
``weights`` (weight distribution and drift, :mod:`analysis.weights`). DuckDB and the
analysis modules are imported inside the command so that ``gradstream --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console, RenderableType

if TYPE_CHECKING:
    import duckdb
    from pydantic import BaseModel

DEFAULT_DB = "gradstream.duckdb"
"""Store file used when neither ``--db`` nor ``GRADSTREAM_DB`` is given."""


class AnalysisKind(StrEnum):
    """Which analysis ``gradstream analyze`` runs."""

    FLOW = "flow"
    ENHANCED = "enhanced"
    EXPLOSION = "explosion"
    WEIGHTS = "weights"


class OutputFormat(StrEnum):
    """Output of ``gradstream analyze``."""

    TABLE = "table"
    JSON = "json"


class Scheme(StrEnum):
    """Colour schemes of the flow tables (seed 002 ``ColorScheme``)."""

    DEFAULT = "Default"
    HIGH_CONTRAST = "HighContrast"
    COLOR_BLIND = "ColorBlind"
    MONOCHROME = "Monochrome"


def _fail(message: str) -> NoReturn:
    Console(stderr=True, highlight=False).print(f"error: {message}", style="bold red", markup=False)
    raise typer.Exit(code=1)


def analyze(
    kind: Annotated[
        AnalysisKind,
        typer.Option("--kind", "-k", help="flow: gradient flow network, regions and dead zones "
                     "(seed 002); enhanced: per-layer statistics, convergence, stability, "
                     "hierarchy and priorities (seed 003); explosion: layers above a norm "
                     "threshold (seed 004); weights: weight distribution and drift (seed 004, "
                     "needs weight statistics from the producer)."),
    ],
    db: Annotated[
        Path,
        typer.Option("--db", envvar="GRADSTREAM_DB",
                     help="DuckDB store written by `gradstream consume` (env GRADSTREAM_DB)."),
    ] = Path(DEFAULT_DB),
    run: Annotated[
        str | None,
        typer.Option("--run", help="Run id. Optional when the store holds exactly one run.",
                     show_default=False),
    ] = None,
    from_step: Annotated[
        int | None,
        typer.Option("--from-step", min=0, help="First optimiser step included (inclusive). "
                     "weights: the drift starts at the first step with weight statistics "
                     "from here."),
    ] = None,
    to_step: Annotated[
        int | None,
        typer.Option("--to-step", min=0, help="Last optimiser step included (inclusive). "
                     "weights: the distribution is taken at the last step with weight "
                     "statistics up to here."),
    ] = None,
    output_format: Annotated[
        OutputFormat,
        typer.Option("--format", help="table: for people; json: the full report."),
    ] = OutputFormat.TABLE,
    window: Annotated[
        int | None,
        typer.Option("--window", min=1, help="flow: samples per layer behind the flow "
                     "directions (default 50); enhanced: convergence window (default 100, "
                     "at least 3)."),
    ] = None,
    alpha: Annotated[
        float,
        typer.Option("--alpha", min=1e-12, max=0.5, help="Significance level of the statistical "
                     "tests (family-wise over layers)."),
    ] = 0.01,
    threshold: Annotated[
        float | None,
        typer.Option("--threshold", help="explosion: L2-norm threshold (default: the run's "
                     "exploding threshold)."),
    ] = None,
    interaction_window: Annotated[
        int,
        typer.Option("--interaction-window", min=1, help="enhanced: test layer pairs up to "
                     "this many positions apart in model order."),
    ] = 2,
    color_scheme: Annotated[
        Scheme, typer.Option("--color-scheme", help="flow: colours of the tables."),
    ] = Scheme.DEFAULT,
) -> None:
    """Analyse a stored run: gradient flow, enhanced statistics, explosions or weights."""
    import duckdb

    from analysis.store import StoreError, open_store, resolve_run

    err = Console(stderr=True, highlight=False)
    try:
        con = open_store(db)
        try:
            run_id = resolve_run(con, run)
            with err.status(f"analysing run {run_id!r} ({kind.value})..."):
                report, render = _run(con, run_id, kind, from_step, to_step, window, alpha,
                                      threshold, interaction_window, color_scheme)
        finally:
            con.close()
    except (StoreError, ValueError, duckdb.Error) as exc:
        _fail(str(exc))
    if output_format is OutputFormat.JSON:
        typer.echo(report.model_dump_json(indent=2))
    else:
        Console(highlight=False).print(render(report))


def _run(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    kind: AnalysisKind,
    from_step: int | None,
    to_step: int | None,
    window: int | None,
    alpha: float,
    threshold: float | None,
    interaction_window: int,
    color_scheme: Scheme,
) -> tuple[BaseModel, Callable[[Any], RenderableType]]:
    """Build the report of ``kind`` and return it with its terminal renderer."""
    if kind is AnalysisKind.FLOW:
        from analysis.flow import (
            ColorScheme,
            GradientVisualizationConfig,
            build_flow_visualization,
            render_flow,
        )

        config = GradientVisualizationConfig(
            temporal_window=window or 50, alpha=alpha,
            color_scheme=ColorScheme(color_scheme.value),
        )
        return build_flow_visualization(con, run_id, from_step, to_step, config), render_flow
    if kind is AnalysisKind.ENHANCED:
        from analysis.enhanced import (
            DEFAULT_CONVERGENCE_WINDOW,
            build_enhanced_analysis,
            render_enhanced,
        )

        report = build_enhanced_analysis(
            con, run_id, from_step, to_step,
            convergence_window=window or DEFAULT_CONVERGENCE_WINDOW,
            interaction_window=interaction_window, alpha=alpha,
        )
        return report, render_enhanced
    if kind is AnalysisKind.EXPLOSION:
        from analysis.explosion import build_explosion_analysis, render_explosion

        return build_explosion_analysis(con, run_id, from_step, to_step, threshold), (
            render_explosion
        )
    from analysis.weights import build_weight_analysis, render_weights

    return build_weight_analysis(con, run_id, from_step, to_step, alpha), render_weights


def register(app: typer.Typer) -> None:
    """Add ``analyze`` to ``app`` (the ``gradstream`` root).

    Args:
        app: the Typer application to extend; nothing else is modified.
    """
    app.command(name="analyze")(analyze)
