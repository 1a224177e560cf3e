"""Small helpers shared by the terminal renderings of the analyses (rich)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rich import box
from rich.table import Table
from rich.text import Text

ROWS_IN_TABLE = 20
"""Rows shown per table before "... and N more" (the JSON output has every row)."""


def show_name(name: str) -> str:
    """A layer name as printed in a table: verbatim when printable, else ``repr()``."""
    return name if name and name.isprintable() else repr(name)


MORE = ", ... and "
"""What :func:`more_suffix` puts before the count of the items left out."""


def more_suffix(total: int, shown: int, lead: str = MORE) -> str:
    """The tail of a list cut to its first ``shown`` of ``total`` items: ``lead`` + "N
    more" (N = ``total - shown``), or ``""`` when nothing was cut.

    >>> more_suffix(8, 6)
    ', ... and 2 more'
    >>> more_suffix(3, 6)
    ''
    """
    return f"{lead}{total - shown} more" if total > shown else ""


def joined_names(
    names: Sequence[str], limit: int, show: Callable[[str], str] = show_name,
    lead: str = MORE,
) -> str:
    """The first ``limit`` names, each through ``show``, joined by ", ", then
    :func:`more_suffix` (``lead`` before the count of the names left out)."""
    return ", ".join(show(n) for n in names[:limit]) + more_suffix(len(names), limit, lead)


def names_text(
    names: Sequence[str], limit: int = 6, show: Callable[[str], str] = show_name
) -> Text:
    """Up to ``limit`` layer names joined by ", " (each through ``show``), then
    :func:`more_suffix` dimmed; ``none`` (dimmed) for no names. Plain text, never rich
    markup."""
    if not names:
        return Text("none", style="dim")
    text = Text(", ".join(show(n) for n in names[:limit]))
    text.append(more_suffix(len(names), limit), style="dim")
    return text


def excluded_text(patterns: Sequence[str], names: Sequence[str]) -> Text:
    """The "excluded" cell of an analysis's summary: the ``ignore_layers`` patterns applied
    (the run's and the reader's) and the layers they match, e.g. ``by ignore_layers
    '*.key.bias': a.key.bias`` (plain text)."""
    text = Text("by ignore_layers " + ", ".join(map(repr, patterns)) + ": ")
    text.append_text(names_text(names))
    return text


def report_head(title: str, run_id: str, detail: str) -> Text:
    """The first line of an analysis's rendering: ``<title> of run <run>`` in bold, then
    ``  (<detail>)`` dimmed."""
    head = Text(f"{title} of run ", style="bold")
    head.append(show_name(run_id))
    head.append(f"  ({detail})", style="dim")
    return head


def summary_grid() -> Table:
    """The two-column summary of an analysis's rendering: bold labels, then values
    (``add_row(label, value)``)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def num(value: float | None, digits: int = 3) -> str:
    """A number for a table cell: ``-`` for None/NaN, general format otherwise."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}"


def table(title: str, columns: Sequence[str], numeric: Sequence[bool] | None = None) -> Table:
    """A compact rich table (no vertical rules, so that about ten columns fit in 80
    characters) with a bold title and the given column headers; numeric columns are
    right-aligned."""
    out = Table(title=title, title_style="bold", title_justify="left", header_style="bold",
                box=box.SIMPLE_HEAD, pad_edge=False)
    flags = numeric or [False] * len(columns)
    for name, is_num in zip(columns, flags, strict=True):
        if is_num:  # numbers keep their width; the text columns fold around them
            out.add_column(name, justify="right", no_wrap=True)
        else:
            out.add_column(name, justify="left", overflow="fold", min_width=len(name))
    return out


def add_more_row(out: Table, total: int, shown: int) -> None:
    """Note in the table's caption how many rows were cut (the JSON output has them all)."""
    if total > shown:
        out.caption = f"{shown} of {total} rows shown; --format json has every row"
        out.caption_justify = "left"
