"""``gradstream analyze``: any analysis registered in :mod:`analysis.registry`, run on a
stored run and shown as terminal tables or JSON.

The command is generic over the registry: ``--kind`` takes a registered name; the values
of the option flags are collected into one mapping, and the analysis's options model keeps
and validates the fields it declares (a flag that the chosen analysis does not declare is
ignored, as ``--threshold`` is by ``--kind flow``). ``--option NAME=VALUE`` sets an option
that has no flag of its own. The store is read through :func:`analysis.read.reader.open_reader`
(the file, or the endpoint of the process writing it), under one time limit
(``--timeout``). The analysis modules and DuckDB are imported only when the command runs
or its help is shown, so ``gradstream --help`` stays fast.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperCommand

from analysis.registry import ANALYSES
from deploy.cli.errors import fail
from deploy.cli.options import (
    DEFAULT_DB,
    DbOption,
    FromStepOption,
    IgnoreLayersOption,
    RunOption,
    ToStepOption,
)
from deploy.cli.reports import TimeoutOption, exclusion_patterns, reading

if TYPE_CHECKING:
    from analysis.registry import Analysis

AnalysisKind = StrEnum("AnalysisKind", [(name.upper(), name) for name in ANALYSES])
"""Which analysis ``gradstream analyze`` runs: one member per name in
:data:`analysis.registry.ANALYSES` (value = the name)."""


class OutputFormat(StrEnum):
    """Output of ``gradstream analyze``."""

    TABLE = "table"
    JSON = "json"


class Scheme(StrEnum):
    """Values of ``--color-scheme``: those of :class:`analysis.analyses.flow.ColorScheme`, repeated
    here so that building the command does not import the flow analysis."""

    DEFAULT = "Default"
    HIGH_CONTRAST = "HighContrast"
    COLOR_BLIND = "ColorBlind"
    MONOCHROME = "Monochrome"


class AnalyzeCommand(TyperCommand):
    """The ``analyze`` command, whose help ends with every registered analysis, its
    description and its option names; the analysis modules are imported only when that
    help is shown."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """Set the epilog from the registry, then format the help as Typer does."""
        from analysis.registry import all_analyses

        self.epilog = "\n\n".join(
            f"{a.name}: {a.help} Options: {', '.join(a.option_names) or 'none'}."
            for a in all_analyses()
        )
        super().format_help(ctx, formatter)


def analyze(
    kind: Annotated[
        AnalysisKind,
        typer.Option("--kind", "-k", help="Which analysis to run (each is described at the "
                     "end of this help)."),
    ],
    db: DbOption = Path(DEFAULT_DB),
    run: RunOption = None,
    from_step: FromStepOption = None,
    to_step: ToStepOption = None,
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
    ignore_layers: IgnoreLayersOption = None,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", metavar="NAME=VALUE", show_default=False,
                     help="An option of the analysis by its field name, for options without "
                     "a flag of their own (repeatable; overrides the flags)."),
    ] = None,
    timeout: TimeoutOption = None,
) -> None:
    """Analyse a stored run: gradient flow, enhanced statistics, explosions, weights, or any
    other registered analysis. The layers the run's ignore_layers or --ignore-layers
    exclude count as in `gradstream report`: their vanishing and exploding flags nowhere,
    NaN/Inf still; the analysis names them."""
    from analysis.registry import get

    entry = get(kind.value)
    patterns = exclusion_patterns(ignore_layers)
    flags = {"window": window, "alpha": alpha, "threshold": threshold,
             "interaction_window": interaction_window, "color_scheme": color_scheme.value,
             "ignore_layers": ",".join(patterns) if patterns else None}
    values: dict[str, object] = {
        name: value for name, value in flags.items() if value is not None}
    values.update(_named_options(entry, option or []))
    try:
        entry.options_from(values)  # invalid values fail here, before the store is opened
    except ValueError as exc:
        fail(str(exc))
    # The analysis's own options, as strings (its options model converts them back).
    own = {name: str(value) for name, value in values.items() if name in entry.option_names}
    err = Console(stderr=True, highlight=False)
    with reading(db, timeout) as reader:
        run_id = reader.resolve_run(run)
        with err.status(f"analysing run {run_id!r} ({entry.name})..."):
            report = reader.analysis(entry.name, run_id, from_step, to_step, own)
    if output_format is OutputFormat.JSON:
        typer.echo(report.model_dump_json(indent=2))
    else:
        Console(highlight=False).print(entry.render(report))


def _named_options(entry: Analysis[Any, Any], pairs: list[str]) -> dict[str, str]:
    """``--option`` values as ``{name: value}``; fails (exit 1) on a malformed pair or a
    name that ``entry``'s options model does not declare."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            fail(f"--option takes NAME=VALUE, got {pair!r}")
        if name not in entry.option_names:
            fail(f"{entry.name} has no option {name!r}; its options: "
                  f"{', '.join(entry.option_names) or 'none'}")
        out[name] = value
    return out


def register(app: typer.Typer) -> None:
    """Add ``analyze`` to ``app`` (the ``gradstream`` root).

    Args:
        app: the Typer application to extend; nothing else is modified.
    """
    app.command(name="analyze", cls=AnalyzeCommand)(analyze)
