"""Exports of one run (or a step range of it), streamed from a read connection.

- ``export_csv`` / ``export_json``: the reference CSV and JSON formats of
  trustformers-debug's ``gradient_flow`` module (``export_csv``, ``export_json``).
- ``export_parquet`` / ``export_jsonl``: every stored column of ``layer_stats`` plus the
  layer name, one row per (step, layer), typed (Parquet) or one JSON object per line.
- ``export_run``: any of the four by name, with an optional progress callback.

DuckDB reads the rows and, for the text formats, renders each one (a CSV line with its
quoting, a JSON object with ``to_json``), so Python never loops over rows: the result
streams as Arrow record batches of :data:`BATCH_ROWS` rows (``to_arrow_reader``), and
this module writes them with pyarrow, a batch at a time, so a run of any length exports
in bounded memory. No DuckDB ``COPY ... TO`` is used: read connections have file access
turned off (:func:`analysis.read.query.harden`), and the file is written by this process. The
bytes are those DuckDB's ``COPY`` writers produced (CSV quoted when a field is empty or
holds a comma, quote, CR or LF; a JSON array ``[\n\t{...},\n\t{...}\n]\n``; one object
per line; zstd Parquet). The file is written to ``<path>.part`` and renamed when complete.
Progress is the fraction of rows written (a ``count(*)`` of the range first).

Styles (``csv`` and ``json``, :data:`analysis.presentation.Style`): ``"gradstream"``: the
CSV quotes a name that needs it (RFC 4180: empty, or holding a comma, quote, CR or LF); the
JSON is one compact frame per line, non-finite floats ``null``. ``"reference"``: byte for
byte what the reference's (trustformers-debug, ``gradient_flow``) ``export_csv`` /
``export_json`` write for the same frames, layers in name order: CSV names raw (a name
holding a comma or a line break then breaks the CSV's columns); JSON pretty-printed as
``serde_json::to_string_pretty`` does (two-space indent, floats as ryu's shortest round-trip
text: ``0.1``, ``1.0``, ``1e-7``, ``1.5e300``; non-finite floats ``null``; control
characters escaped ``\\u00xx`` in lower case; no trailing newline). The reference style also
shows the reference's values of the layers holding NaN/Inf elements (``analysis.nonfinite``:
mean and norm NaN with a NaN, inf with an Inf; max inf with an Inf; an Inf layer exploding;
the step's intensities rebuilt), and refuses (``StoreError``) a range holding such a row
stored without its NaN count.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from analysis.nonfinite import has_nan_column, reference_stats_sql, require_nan_split
from analysis.presentation import (
    EXPORT_FORMATS,
    LAYER_ORDERS,
    STYLES,
    LayerOrder,
    Style,
    check_choice,
)
from analysis.read.connect import StoreError, require_run
from analysis.read.sql import STATS_SQL, stats_params
from schemas.tables import LAYER_STATS_COLUMNS

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

Progress = Callable[[float | None], None]
"""Progress callback: fraction done in [0, 1], or ``None`` while it cannot be told yet."""

BATCH_ROWS = 65_536
"""Rows per Arrow record batch fetched from DuckDB and written at once (a few MB)."""

CSV_HEADER = "step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding"
"""Header line of the CSV export, as in the reference format."""



def file_stem(run_id: str) -> str:
    """``run_id`` as a portable file-name stem: each run of characters other than ASCII
    letters, digits, ``.``, ``_`` and ``-`` becomes one ``_``, leading and trailing ``.`` and
    ``_`` are dropped, and ``"run"`` stands for an empty result (``"a/1"`` -> ``"a_1"``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", run_id).strip("._") or "run"


def rust_exp_sql(column: str) -> str:
    """SQL expression formatting a DOUBLE like Rust's ``format!("{:.8e}", x)``.

    ``printf('%.8e', x)`` gives C's ``1.00000000e-02``; Rust writes ``1.00000000e-2``
    (no ``+``, no zero padding of the exponent). The printf exponent always has a sign
    and at least two digits, so three plain ``replace`` calls (``e+0`` -> ``e``,
    ``e+`` -> ``e``, ``e-0`` -> ``e-``) give Rust's text, with no regular expression.
    Non-finite values follow Rust too: ``NaN``, ``inf``, ``-inf``.
    NULL (a statistic the run does not send, e.g. ``mean_abs_grad`` in norms mode) stays
    NULL, an empty CSV field.

    Args:
        column: a SQL expression of type DOUBLE (trusted text, not user input).

    Returns:
        A SQL expression of type VARCHAR.
    """
    c_style = f"printf('%.8e', {column})"
    return (
        f"CASE WHEN {column} IS NULL THEN NULL WHEN isfinite({column}) THEN "
        f"replace(replace(replace({c_style}, 'e+0', 'e'), 'e+', 'e'), 'e-0', 'e-') "
        f"WHEN isnan({column}) THEN 'NaN' WHEN {column} > 0 THEN 'inf' ELSE '-inf' END"
    )


def _finite_or_null(column: str) -> str:
    # serde_json (the reference's writer) emits non-finite floats as null; so do we.
    return f"CASE WHEN isfinite({column}) THEN {column} END"


def _order_sql(order: str) -> str:
    """The ``ORDER BY`` terms of the layers within a step (:data:`LayerOrder`)."""
    check_choice("order", order, LAYER_ORDERS)
    return "name, layer_index" if order == "name" else "layer_index"


def _target(path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    if target.is_dir():
        raise StoreError(f"output path {str(target)!r} is a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the output directory {str(target.parent)!r}: {exc}"
        ) from None
    return target


def _csv_field(column: str) -> str:
    """SQL rendering a VARCHAR as a CSV field the way DuckDB's CSV writer does: quoted
    (quotes doubled) when empty or when it holds a comma, a quote, CR or LF; NULL stays
    NULL (the caller writes an empty field)."""
    needs = (f"{column} = '' OR contains({column}, ',') OR contains({column}, '\"') "
             f"OR contains({column}, chr(10)) OR contains({column}, chr(13))")
    return (f"CASE WHEN {needs} THEN '\"' || replace({column}, '\"', '\"\"') || '\"' "
            f"ELSE {column} END")


@dataclass(frozen=True)
class _Text:
    """How rendered rows (one VARCHAR column) become a text file: ``prefix``, the rows
    separated by ``separator``, ``suffix``. The SQL renders ``separator`` in front of every
    row (see :func:`_sql_text`); the writer drops it before the first row."""

    prefix: str
    separator: str
    suffix: str
    empty: str | None = None
    """The whole file when there is no row (None: ``prefix + suffix``)."""


_CSV = _Text(CSV_HEADER + "\n", "", "")
"""CSV: the header line, then the rows, each ending in a line feed."""
_JSON_ARRAY = _Text("[\n\t", ",\n\t", "\n]\n")
"""A JSON array laid out as DuckDB's ``FORMAT json, ARRAY true`` writer does."""
_JSON_LINES = _Text("", "", "")
"""JSON Lines: the rows, each ending in a line feed."""
_JSON_PRETTY = _Text("[\n", ",\n", "\n]", "[]")
"""A JSON array as ``serde_json::to_string_pretty`` lays it out (frames rendered by
:func:`_pretty_frame_sql`); ``[]`` when empty; no trailing newline."""


def json_float_sql(column: str) -> str:
    """SQL expression writing a DOUBLE as serde_json does (ryu's ``format64``).

    Non-finite or NULL: ``null``. Zero: ``0.0`` (``-0.0`` for negative zero). Otherwise
    the shortest round-trip decimal digits d (``CAST(x AS VARCHAR)`` gives them, as
    CPython's ``repr`` and ryu do) with value ``d * 10^k``, n digits and ``kk = n + k``,
    laid out as: ``k >= 0 and kk <= 16``: digits, k zeros, ``.0``; ``0 < kk <= 16``: a
    decimal point after kk digits; ``-5 < kk <= 0``: ``0.``, -kk zeros, digits; one digit:
    ``de(kk-1)``; else ``d.ddde(kk-1)``.

    Args:
        column: a SQL expression of type DOUBLE (trusted text, not user input).

    Returns:
        A SQL expression of type VARCHAR.
    """
    text = f"CAST(abs({column}) AS VARCHAR)"
    mant = f"regexp_extract({text}, '^[0-9.]+')"
    exp = (f"CASE WHEN contains({text}, 'e') THEN "
           f"CAST(regexp_extract({text}, 'e([+-]?[0-9]+)$', 1) AS INTEGER) ELSE 0 END")
    frac = f"split_part({mant}, '.', 2)"
    raw = f"ltrim(split_part({mant}, '.', 1) || {frac}, '0')"
    d = f"rtrim({raw}, '0')"
    n = f"length({d})"
    k = f"({exp} - length({frac}) + length({raw}) - {n})"
    kk = f"({n} + {k})"
    sign = f"CASE WHEN {column} < 0 OR (CAST({column} AS VARCHAR) = '-0.0') THEN '-' ELSE '' END"
    body = (
        f"CASE WHEN {k} >= 0 AND {kk} <= 16 THEN {d} || repeat('0', {k}) || '.0' "
        f"WHEN {kk} > 0 AND {kk} <= 16 THEN left({d}, {kk}) || '.' || substr({d}, {kk} + 1) "
        f"WHEN {kk} > -5 AND {kk} <= 0 THEN '0.' || repeat('0', -{kk}) || {d} "
        f"WHEN {n} = 1 THEN {d} || 'e' || CAST({kk} - 1 AS VARCHAR) "
        f"ELSE left({d}, 1) || '.' || substr({d}, 2) || 'e' || CAST({kk} - 1 AS VARCHAR) END"
    )
    return (f"CASE WHEN {column} IS NULL OR NOT isfinite({column}) THEN 'null' "
            f"WHEN {column} = 0 THEN {sign} || '0.0' ELSE {sign} || ({body}) END")


_JSON_ESCAPES: tuple[tuple[int, str], ...] = tuple(
    (c, {8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r"}.get(c, f"\\u{c:04x}"))
    for c in range(32)
)
"""serde_json's escapes of the control characters (lower-case hex)."""


def json_string_sql(column: str) -> str:
    """SQL expression writing a VARCHAR as a JSON string the way serde_json escapes it:
    backslash and quote escaped, ``\\b \\t \\n \\f \\r``, the other control
    characters as ``\\u00xx`` (lower case), everything else (DEL and non-ASCII
    included) raw."""
    expr = f"replace(replace({column}, '\\', '\\\\'), '\"', '\\\"')"
    for code, escape in _JSON_ESCAPES:
        expr = f"replace({expr}, chr({code}), {_sql_text(escape)})"
    return f"'\"' || {expr} || '\"'"


def _pretty_frame_sql(order_by: str, stats_sql: str = STATS_SQL) -> str:
    """SQL of one frame per row, laid out as serde_json's pretty printer (inside the
    array: 2 spaces per level), with the separator in front (see :data:`_JSON_PRETTY`);
    ``stats_sql`` is the relation of the run's rows (``analysis.nonfinite``'s for the
    reference style)."""
    layer = (
        "'      {\n        \"name\": ' || jname"
        " || ',\n        \"mean_abs_grad\": ' || " + json_float_sql("mean_abs_grad") +
        " || ',\n        \"max_abs_grad\": ' || " + json_float_sql("max_abs_grad") +
        " || ',\n        \"grad_norm\": ' || " + json_float_sql("grad_norm") +
        " || ',\n        \"is_vanishing\": ' || CASE WHEN is_vanishing THEN 'true' ELSE 'false' END"
        " || ',\n        \"is_exploding\": ' || CASE WHEN is_exploding THEN 'true' ELSE 'false' END"
        " || ',\n        \"flow_intensity\": ' || " + json_float_sql("flow_intensity") +
        " || '\n      }'"
    )
    return f"""
        WITH s AS ({stats_sql}),
        n AS (SELECT DISTINCT layer_index, name, {json_string_sql("name")} AS jname FROM s)
        SELECT {_sql_text(_JSON_PRETTY.separator)} || '  {{\n    "step": ' || CAST(step AS VARCHAR)
               || ',\n    "layers": [\n'
               || string_agg({layer}, ',\n' ORDER BY {order_by})
               || '\n    ]\n  }}' AS line
        FROM s JOIN n USING (layer_index, name)
        GROUP BY step
        ORDER BY step
    """


def _sql_text(text: str) -> str:
    """``text`` as a SQL string literal (DuckDB: quotes doubled, no backslash escapes, so
    line feeds and tabs stand as themselves)."""
    return "'" + text.replace("'", "''") + "'"


def _utf8_bytes(column: pa.Array) -> memoryview:
    """The bytes of every value of a string column, concatenated: a zero-copy view of the
    Arrow data buffer between the first and the last offset (NULLs add nothing)."""
    import numpy as np
    import pyarrow as pa

    if pa.types.is_large_string(column.type):
        width = np.int64
    elif pa.types.is_string(column.type):
        width = np.int32
    else:
        column, width = column.cast(pa.large_string()), np.int64
    _validity, offsets_buffer, data = column.buffers()
    if data is None or len(column) == 0:
        return memoryview(b"")
    offsets = np.frombuffer(offsets_buffer, dtype=width, count=len(column) + 1,
                            offset=column.offset * np.dtype(width).itemsize)
    return memoryview(data)[int(offsets[0]):int(offsets[-1])]


def _write_text(batches: pa.RecordBatchReader, out: Path, text: _Text,
                on_rows: Callable[[int], None]) -> int:
    """Write the single string column of ``batches`` as ``text`` says; returns the rows."""
    lead = len(text.separator.encode("utf-8"))
    rows = 0
    with out.open("wb") as fh:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            data = _utf8_bytes(batch.column(0))
            if not rows:
                fh.write(text.prefix.encode("utf-8"))
            fh.write(data if rows else data[lead:])
            rows += batch.num_rows
            on_rows(rows)
        if rows or text.empty is None:
            fh.write(((text.prefix if not rows else "") + text.suffix).encode("utf-8"))
        else:
            fh.write(text.empty.encode("utf-8"))
    return rows


def _write_parquet(batches: pa.RecordBatchReader, out: Path,
                   on_rows: Callable[[int], None]) -> int:
    """Write ``batches`` as one zstd-compressed Parquet file; returns the rows."""
    import pyarrow.parquet as pq

    rows = 0
    with pq.ParquetWriter(out, batches.schema, compression="zstd") as writer:
        for batch in batches:
            writer.write_batch(batch)
            rows += batch.num_rows
            on_rows(rows)
    return rows


def _export(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    select: str,
    params: dict[str, object],
    text: _Text | None,
    count_sql: str,
    progress: Progress | None,
) -> int:
    """Stream ``select`` (bound with ``params``) into ``path`` (Parquet if ``text`` is None).

    Raises:
        StoreError: unknown run or unusable output path.
    """
    require_run(con, run_id)
    target = _target(path)
    total = 0
    if progress is not None:
        rows = con.execute(count_sql, params).fetchall()
        total = int(rows[0][0]) if rows else 0
        progress(0.0 if total else None)

    def on_rows(rows: int) -> None:
        if progress is not None and total:
            progress(min(rows / total, 1.0))

    batches = con.sql(select, params=params).to_arrow_reader(BATCH_ROWS)
    with written_atomically(target, f"cannot write {str(target)!r}") as part:
        if text is None:
            rows = _write_parquet(batches, part, on_rows)
        else:
            rows = _write_text(batches, part, text, on_rows)
    if progress is not None:
        progress(1.0)
    return rows


@contextmanager
def written_atomically(target: Path, failure: str) -> Iterator[Path]:
    """Yield ``<target>.part`` to write; on success rename it to ``target`` (readers never
    see a half-written file), on any failure remove it.

    Args:
        target: the final file.
        failure: the start of the message of the :class:`StoreError` an ``OSError`` becomes
            (``"<failure>: <OSError>"``).

    Raises:
        StoreError: an ``OSError`` while writing or renaming (other exceptions pass through).
    """
    part = target.with_name(target.name + ".part")
    try:
        yield part
        os.replace(part, target)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise StoreError(f"{failure}: {exc}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _count_sql(frames: bool) -> str:
    """SQL counting the rows an export writes: frames (distinct steps) or (step, layer)
    rows of :data:`STATS_SQL`."""
    what = "count(DISTINCT step)" if frames else "count(*)"
    return f"WITH s AS ({STATS_SQL}) SELECT {what} FROM s"


def _csv_select(stats_sql: str, order: str, style: str) -> str:
    """One CSV line per (step, layer) row (:data:`CSV_HEADER` columns)."""
    name_sql = "name" if style == "reference" else _csv_field("name")
    # concat() skips NULLs, so a NULL statistic is an empty field, as in DuckDB's CSV writer.
    return f"""
        WITH s AS ({stats_sql})
        SELECT concat(
                   step, ',', {name_sql}, ',',
                   {rust_exp_sql("mean_abs_grad")}, ',',
                   {rust_exp_sql("max_abs_grad")}, ',',
                   {rust_exp_sql("grad_norm")}, ',',
                   CAST(is_vanishing AS INTEGER), ',',
                   CAST(is_exploding AS INTEGER), chr(10)
               ) AS line
        FROM s
        ORDER BY step, {_order_sql(order)}
    """


def _json_select(stats_sql: str, order: str, style: str) -> str:
    """One JSON frame per step: compact (``to_json``), or serde_json's pretty layout for the
    reference style."""
    if style == "reference":
        return _pretty_frame_sql(_order_sql(order), stats_sql)
    return f"""
        WITH s AS ({stats_sql})
        SELECT {_sql_text(_JSON_ARRAY.separator)} || to_json(struct_pack(
               step := step, layers := list(struct_pack(
                   name := name,
                   mean_abs_grad := {_finite_or_null("mean_abs_grad")},
                   max_abs_grad := {_finite_or_null("max_abs_grad")},
                   grad_norm := {_finite_or_null("grad_norm")},
                   is_vanishing := is_vanishing,
                   is_exploding := is_exploding,
                   flow_intensity := {_finite_or_null("flow_intensity")}
               ) ORDER BY {_order_sql(order)}))) AS line
        FROM s
        GROUP BY step
        ORDER BY step
    """


_DOUBLE_COLUMNS = frozenset({
    "sum_abs", "sum_sq", "max_abs_grad", "mean_abs_grad", "grad_norm", "flow_intensity",
    "weight_sum_sq", "update_sum_sq", "update_to_weight",
})

TABLE_COLUMNS: tuple[str, ...] = (
    *LAYER_STATS_COLUMNS[:3], "layer", *LAYER_STATS_COLUMNS[3:],
)
"""Columns of the Parquet and JSON Lines exports: ``layer_stats``'s, with the layer name
(``layer``) after ``layer_index``."""


def _table_select(stats_sql: str, order: str, as_json: bool) -> str:
    """The rows of :data:`TABLE_COLUMNS`: typed columns, or (``as_json``) one JSON object
    per row (non-finite floats as null) with its line feed."""
    order_by = _order_sql(order)
    items = []
    for column in TABLE_COLUMNS:
        if column == "layer":
            items.append(("layer", "name"))
        elif as_json and column in _DOUBLE_COLUMNS:
            items.append((column, _finite_or_null(column)))
        else:
            items.append((column, column))
    if as_json:
        fields = ", ".join(f"{name} := {expr}" for name, expr in items)
        columns = f"to_json(struct_pack({fields})) || chr(10) AS line"
    else:
        columns = ", ".join(expr if name == expr else f"{expr} AS {name}"
                            for name, expr in items)
    return f"""
        WITH s AS ({stats_sql})
        SELECT {columns}
        FROM s
        ORDER BY step, {order_by}
    """


@dataclass(frozen=True)
class _Format:
    """One export format: the SQL of its rows, how they are laid out, what is counted."""

    select: Callable[[str, str, str], str]
    """``(stats_sql, order, style)`` -> the SQL of the rows (one VARCHAR column for a text
    format; ``stats_sql`` is the run's relation, bound with :func:`stats_params`)."""
    text: _Text | None
    """Layout of a text format; ``None``: the typed columns written as Parquet."""
    frames: bool
    """Whether a row is a frame (the count of distinct steps) rather than a (step, layer)."""
    styles: tuple[str, ...] = ("gradstream",)


_FORMATS: dict[str, _Format] = {
    "csv": _Format(_csv_select, _CSV, frames=False, styles=STYLES),
    "json": _Format(_json_select, _JSON_ARRAY, frames=True, styles=STYLES),
    "parquet": _Format(lambda stats, order, _style: _table_select(stats, order, False),
                       None, frames=False),
    "jsonl": _Format(lambda stats, order, _style: _table_select(stats, order, True),
                     _JSON_LINES, frames=False),
}
"""Format name (:data:`EXPORT_FORMATS`) -> its rows and layout."""


def export_run(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    fmt: str,
    from_step: int | None = None,
    to_step: int | None = None,
    order: LayerOrder = "name",
    progress: Progress | None = None,
    style: Style = "gradstream",
) -> int:
    """Export a run in ``fmt`` (one of :data:`EXPORT_FORMATS`, see the function of each).

    The parent directory is created; an existing file is replaced.

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run to export.
        path: output file.
        fmt: ``"csv"``, ``"json"``, ``"parquet"`` or ``"jsonl"``.
        from_step / to_step: inclusive step range, ``None`` = unbounded.
        order: layer order within a step, ``"name"`` (reference order: code points) or
            ``"model"`` (``layer_index``); the reference style is always in name order.
        progress: optional callback of the fraction done (see :data:`Progress`).
        style: ``"gradstream"`` or ``"reference"`` (module doc, "Styles"; ``csv`` and ``json``).

    Returns:
        Rows written: data rows for ``csv`` (header excluded), ``parquet`` and ``jsonl``;
        frames for ``json``.

    Raises:
        ValueError: unknown format, order or style, or the reference style with parquet or
            jsonl.
        StoreError: unknown run, invalid step range, or unusable output path.
    """
    check_choice("format", fmt, EXPORT_FORMATS)
    spec = _FORMATS[fmt]
    check_choice("style", style, STYLES)
    if style not in spec.styles:
        raise ValueError(f"style {style!r} exists for the csv and json formats only, not {fmt}")
    params = stats_params(run_id, from_step, to_step)
    stats_sql = STATS_SQL
    if style == "reference":
        order = "name"
        require_run(con, run_id)
        require_nan_split(con, params, "export --style reference")
        stats_sql = reference_stats_sql(has_nan_column(con))
    select = spec.select(stats_sql, order, style)
    text = _JSON_PRETTY if fmt == "json" and style == "reference" else spec.text
    return _export(con, run_id, path, select, params, text, _count_sql(spec.frames), progress)


class ExportOptions(TypedDict, total=False):
    """The keyword arguments of :func:`export_run` after ``fmt``."""

    from_step: int | None
    to_step: int | None
    order: LayerOrder
    progress: Progress | None
    style: Style


def export_csv(con: duckdb.DuckDBPyConnection, run_id: str, path: str | os.PathLike[str],
               **options: Unpack[ExportOptions]) -> int:
    """Write one run's per-layer timeline as CSV (the reference ``export_csv`` format).

    Columns: ``step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding``
    (:data:`CSV_HEADER`). Floats as Rust ``{:.8e}`` (:func:`rust_exp_sql`), flags as 0/1.
    One row per (step, layer) stored, ordered by step, then layer name or model order.
    Fields are RFC 4180-quoted when needed (style ``"gradstream"``); the reference style
    writes names raw, in name order: the reference's bytes exactly (module doc, "Styles").
    Arguments, return value (data rows) and errors: :func:`export_run`.
    """
    return export_run(con, run_id, path, "csv", **options)


def export_json(con: duckdb.DuckDBPyConnection, run_id: str, path: str | os.PathLike[str],
                **options: Unpack[ExportOptions]) -> int:
    """Write one run's frames as a JSON array (the reference ``export_json`` format).

    Shape: ``[{"step": s, "layers": [{"name", "mean_abs_grad", "max_abs_grad",
    "grad_norm", "is_vanishing", "is_exploding", "flow_intensity"}, ...]}, ...]``; frames
    in step order, layers within a frame by name (reference order) or model order; flags
    are JSON booleans; non-finite floats are ``null`` (as serde_json writes them). Built
    with ``GROUP BY step`` and ``list(struct_pack(...) ORDER BY ...)``, each frame rendered
    by DuckDB's ``to_json``; one compact frame per line inside ``[`` and ``]`` (the layout
    of DuckDB's ``FORMAT json, ARRAY true`` writer). ``style="reference"`` writes the
    reference's bytes instead (module doc, "Styles": serde_json's pretty layout and float text,
    name order). Arguments, return value (frames) and errors: :func:`export_run`.
    """
    return export_run(con, run_id, path, "json", **options)


def export_parquet(con: duckdb.DuckDBPyConnection, run_id: str, path: str | os.PathLike[str],
                   **options: Unpack[ExportOptions]) -> int:
    """Write one run's ``layer_stats`` rows, with layer names, as a Parquet file.

    Columns: :data:`TABLE_COLUMNS` with their store types (BIGINT step, DOUBLE statistics,
    BOOLEAN flags, list columns for the exponent histogram; NaN/Inf kept as such). Rows in
    step order, then layer name (``order="name"``) or model order. zstd-compressed.
    Arguments, return value (rows) and errors: :func:`export_run`.
    """
    return export_run(con, run_id, path, "parquet", **options)


def export_jsonl(con: duckdb.DuckDBPyConnection, run_id: str, path: str | os.PathLike[str],
                 **options: Unpack[ExportOptions]) -> int:
    """Write one run's ``layer_stats`` rows, with layer names, as JSON Lines.

    One compact JSON object per line with the keys of :data:`TABLE_COLUMNS`; non-finite
    floats are ``null`` (JSON has no NaN/Infinity; DuckDB's writer would emit them bare).
    Rows in step order, then layer name or model order. Arguments, return value (lines)
    and errors: :func:`export_run`.
    """
    return export_run(con, run_id, path, "jsonl", **options)
