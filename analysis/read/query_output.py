"""Output of ``gradstream query``: a result table as a terminal table, CSV or JSON.

The result is a ``pyarrow.Table`` (same types whether it came from a read-only connection
or from ``gradstream serve``). Values map to text as follows: NULL is empty in CSV,
``null`` in JSON and ``NULL`` in the table; floats use Python's shortest round-trip
``repr``, non-finite floats are ``NaN``/``inf``/``-inf`` in CSV and the table and ``null``
in JSON (JSON has no NaN); lists and structs are JSON text in CSV and the table, JSON
values in JSON; dates, times, decimals and other types use their ISO/``str`` form.
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa
    from rich.table import Table

FORMATS: tuple[str, ...] = ("table", "csv", "json")
"""Output formats of ``gradstream query``."""


def _json_value(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def _text(value: Any, null: str) -> str:
    if value is None:
        return null
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, dict | list | tuple):
        return json.dumps(_json_value(value), ensure_ascii=False)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def to_csv(table: pa.Table) -> str:
    """RFC 4180 CSV with a header line (fields quoted when needed, ``\\r\\n`` inside a
    field kept)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(list(table.column_names))
    columns = [column.to_pylist() for column in table.columns]
    for row in zip(*columns, strict=True):
        writer.writerow([_text(v, "") for v in row])
    return buffer.getvalue()


def to_json(table: pa.Table) -> str:
    """A JSON array of objects (one per row, keys = column names), pretty-printed.

    Duplicate column names (``SELECT 1 AS a, 2 AS a``) keep the last value, as JSON
    objects cannot repeat keys; use aliases to keep both.
    """
    names = list(table.column_names)
    columns = [column.to_pylist() for column in table.columns]
    rows = [
        {name: _json_value(v) for name, v in zip(names, row, strict=True)}
        for row in zip(*columns, strict=True)
    ]
    return json.dumps(rows, ensure_ascii=False, indent=2, allow_nan=False) + "\n"


def to_rich_table(table: pa.Table, title: str | None = None) -> Table:
    """A ``rich`` table with the column names and DuckDB/Arrow types in the header."""
    import pyarrow.types as pat
    from rich.table import Table
    from rich.text import Text

    out = Table(title=title, show_lines=False, header_style="bold")
    for field in table.schema:
        kind = field.type
        numeric = pat.is_integer(kind) or pat.is_floating(kind) or pat.is_decimal(kind)
        out.add_column(Text(f"{field.name}\n{field.type}"), justify="right" if numeric else "left",
                       overflow="fold")
    columns = [column.to_pylist() for column in table.columns]
    for row in zip(*columns, strict=True):
        out.add_row(*(Text(_text(v, "NULL")) for v in row))
    return out
