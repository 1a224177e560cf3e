"""Exports of one run (or a step range of it), written by DuckDB ``COPY``.

- ``export_csv`` / ``export_json``: the reference CSV and JSON formats of
  trustformers-debug's ``gradient_flow`` module (``export_csv``, ``export_json``).
- ``export_parquet`` / ``export_jsonl``: every stored column of ``layer_stats`` plus the
  layer name, one row per (step, layer), typed (Parquet) or one JSON object per line.
- ``export_run``: any of the four by name, with an optional progress callback.

Every file is produced by ``COPY (SELECT ...) TO path``: DuckDB streams the rows, so a
run of any length exports in bounded memory, and its writers quote and escape arbitrary
layer names (commas, quotes, newlines, unicode). Progress comes
from DuckDB's own query progress (``query_progress()``, polled while ``COPY`` runs on a
cursor in a background thread).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from analysis.store import STATS_SQL, StoreError, require_run, stats_params
from schemas.tables import LAYER_STATS_COLUMNS

if TYPE_CHECKING:
    import duckdb

Progress = Callable[[float | None], None]
"""Progress callback: fraction done in [0, 1], or ``None`` while DuckDB cannot tell yet."""

PROGRESS_POLL_S = 0.1
"""Seconds between two reads of DuckDB's query progress during an export."""

EXPORT_FORMATS: tuple[str, ...] = ("csv", "json", "parquet", "jsonl")
"""Formats of :func:`export_run` (also the file extensions)."""

CSV_HEADER = "step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding"
"""Header line of the CSV export, as in the reference format."""

Order = Literal["name", "model"]


def rust_exp_sql(column: str) -> str:
    """SQL expression formatting a DOUBLE like Rust's ``format!("{:.8e}", x)``.

    ``printf('%.8e', x)`` gives C's ``1.00000000e-02``; Rust writes ``1.00000000e-2``
    (no ``+``, no zero padding of the exponent). The printf exponent always has a sign
    and at least two digits, so three plain ``replace`` calls (``e+0`` -> ``e``,
    ``e+`` -> ``e``, ``e-0`` -> ``e-``) give Rust's text; this costs ~15% over bare printf,
    a regular expression ~50%. Non-finite values follow Rust too: ``NaN``, ``inf``, ``-inf``.
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
    # serde_json (the reference implementation's writer) emits non-finite floats as null; so do we.
    return f"CASE WHEN isfinite({column}) THEN {column} END"


def _order_sql(order: str) -> str:
    if order == "name":
        return "name, layer_index"
    if order == "model":
        return "layer_index"
    raise ValueError(f"order must be 'name' or 'model', got {order!r}")


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


def _sql_string(text: str) -> str:
    """A SQL string literal (DuckDB: single quotes doubled, no backslash escapes)."""
    return "'" + text.replace("'", "''") + "'"


def _copy(
    con: duckdb.DuckDBPyConnection,
    select: str,
    target: Path,
    options: str,
    params: dict[str, object],
    progress: Progress | None = None,
) -> int:
    sql = f"COPY ({select}) TO {_sql_string(str(target))} ({options})"
    if progress is None:
        row = con.execute(sql, params).fetchone()
        return 0 if row is None else int(row[0])
    return _copy_with_progress(con, sql, params, progress)


def _copy_with_progress(
    con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, object], progress: Progress
) -> int:
    """Run ``sql`` on a new cursor in a thread; report DuckDB's query progress meanwhile.

    ``enable_progress_bar`` makes DuckDB track progress (``enable_progress_bar_print =
    false`` keeps it from drawing its own bar); both are set on the cursor only. Ctrl-C
    interrupts the query.
    """
    cur = con.cursor()
    outcome: dict[str, object] = {}

    def work() -> None:
        try:
            outcome["row"] = cur.execute(sql, params).fetchone()
        except BaseException as exc:  # re-raised in the calling thread
            outcome["error"] = exc

    try:
        cur.execute("SET enable_progress_bar = true")
        cur.execute("SET enable_progress_bar_print = false")
        thread = threading.Thread(target=work, name="gradstream-export", daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(PROGRESS_POLL_S)
                percent = cur.query_progress()
                progress(percent / 100.0 if percent >= 0 else None)
        except BaseException:
            cur.interrupt()
            thread.join()
            raise
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        progress(1.0)
        row = outcome.get("row")
        return 0 if row is None else int(row[0])  # type: ignore[index]
    finally:
        cur.close()


def export_csv(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
    progress: Progress | None = None,
) -> int:
    """Write one run's per-layer timeline as CSV (the reference ``export_csv`` format).

    Columns: ``step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding``
    (:data:`CSV_HEADER`). Floats as Rust ``{:.8e}`` (:func:`rust_exp_sql`), flags as 0/1.
    One row per (step, layer) stored, ordered by step, then layer name (code-point order,
    the reference order) or model order (``layer_index``). Fields are RFC 4180-quoted when needed.
    The parent directory is created; an existing file is replaced.

    Args:
        con: a connection from :func:`analysis.store.open_store`.
        run_id: the run to export.
        path: output file.
        from_step: first step exported (inclusive), ``None`` = from the start.
        to_step: last step exported (inclusive), ``None`` = to the end.
        order: layer order within a step, ``"name"`` (reference order) or ``"model"``.
        progress: optional callback of the fraction done (see :data:`Progress`).

    Returns:
        Number of data rows written (header excluded).

    Raises:
        StoreError: unknown run, invalid step range, or unusable output path.
        ValueError: unknown ``order``.
    """
    order_by = _order_sql(order)
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    target = _target(path)
    select = f"""
        WITH s AS ({STATS_SQL})
        SELECT step,
               name AS layer,
               {rust_exp_sql("mean_abs_grad")} AS mean_abs_grad,
               {rust_exp_sql("max_abs_grad")} AS max_abs_grad,
               {rust_exp_sql("grad_norm")} AS grad_norm,
               CAST(is_vanishing AS INTEGER) AS is_vanishing,
               CAST(is_exploding AS INTEGER) AS is_exploding
        FROM s
        ORDER BY step, {order_by}
    """
    return _copy(con, select, target, "FORMAT csv, HEADER true", params, progress)


def export_json(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
    progress: Progress | None = None,
) -> int:
    """Write one run's frames as a JSON array (the reference ``export_json`` format).

    Shape: ``[{"step": s, "layers": [{"name", "mean_abs_grad", "max_abs_grad",
    "grad_norm", "is_vanishing", "is_exploding", "flow_intensity"}, ...]}, ...]``; frames
    in step order, layers within a frame by name (reference order) or model order; flags are JSON
    booleans; non-finite floats are ``null`` (as serde_json writes them). Built with
    ``GROUP BY step`` and ``list(struct_pack(...) ORDER BY ...)``, written by
    ``COPY ... (FORMAT json, ARRAY true)``; the file is compact JSON, not pretty-printed.
    The parent directory is created; an existing file is replaced.

    Args:
        con: a connection from :func:`analysis.store.open_store`.
        run_id: the run to export.
        path: output file.
        from_step: first step exported (inclusive), ``None`` = from the start.
        to_step: last step exported (inclusive), ``None`` = to the end.
        order: layer order within a frame, ``"name"`` (reference order) or ``"model"``.
        progress: optional callback of the fraction done (see :data:`Progress`).

    Returns:
        Number of frames written.

    Raises:
        StoreError: unknown run, invalid step range, or unusable output path.
        ValueError: unknown ``order``.
    """
    order_by = _order_sql(order)
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    target = _target(path)
    select = f"""
        WITH s AS ({STATS_SQL})
        SELECT step,
               list(struct_pack(
                   name := name,
                   mean_abs_grad := {_finite_or_null("mean_abs_grad")},
                   max_abs_grad := {_finite_or_null("max_abs_grad")},
                   grad_norm := {_finite_or_null("grad_norm")},
                   is_vanishing := is_vanishing,
                   is_exploding := is_exploding,
                   flow_intensity := {_finite_or_null("flow_intensity")}
               ) ORDER BY {order_by}) AS layers
        FROM s
        GROUP BY step
        ORDER BY step
    """
    return _copy(con, select, target, "FORMAT json, ARRAY true", params, progress)


_DOUBLE_COLUMNS = frozenset({
    "sum_abs", "sum_sq", "max_abs_grad", "mean_abs_grad", "grad_norm", "flow_intensity",
    "weight_sum_sq", "update_sum_sq", "update_to_weight",
})

TABLE_COLUMNS: tuple[str, ...] = (
    *LAYER_STATS_COLUMNS[:3], "layer", *LAYER_STATS_COLUMNS[3:],
)
"""Columns of the Parquet and JSON Lines exports: ``layer_stats``'s, with the layer name
(``layer``) after ``layer_index``."""


def _table_select(order: str, finite_only: bool) -> str:
    order_by = _order_sql(order)
    items = []
    for column in TABLE_COLUMNS:
        if column == "layer":
            items.append("name AS layer")
        elif finite_only and column in _DOUBLE_COLUMNS:
            items.append(f"{_finite_or_null(column)} AS {column}")
        else:
            items.append(column)
    return f"""
        WITH s AS ({STATS_SQL})
        SELECT {", ".join(items)}
        FROM s
        ORDER BY step, {order_by}
    """


def export_parquet(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
    progress: Progress | None = None,
) -> int:
    """Write one run's ``layer_stats`` rows, with layer names, as a Parquet file.

    Columns: :data:`TABLE_COLUMNS` with their store types (BIGINT step, DOUBLE statistics,
    BOOLEAN flags, list columns for the exponent histogram; NaN/Inf kept as such). Rows in
    step order, then layer name (``order="name"``) or model order. zstd-compressed. The
    parent directory is created; an existing file is replaced.

    Args:
        con: a connection from :func:`analysis.store.open_store`.
        run_id: the run to export.
        path: output file.
        from_step / to_step: inclusive step range, ``None`` = unbounded.
        order: layer order within a step, ``"name"`` or ``"model"``.
        progress: optional callback of the fraction done (see :data:`Progress`).

    Returns:
        Number of rows written.

    Raises:
        StoreError: unknown run, invalid step range, or unusable output path.
        ValueError: unknown ``order``.
    """
    select = _table_select(order, finite_only=False)
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    target = _target(path)
    return _copy(con, select, target, "FORMAT parquet, COMPRESSION zstd", params, progress)


def export_jsonl(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
    progress: Progress | None = None,
) -> int:
    """Write one run's ``layer_stats`` rows, with layer names, as JSON Lines.

    One compact JSON object per line with the keys of :data:`TABLE_COLUMNS`; non-finite
    floats are ``null`` (JSON has no NaN/Infinity; DuckDB's writer would emit them bare).
    Rows in step order, then layer name or model order. The parent directory is created;
    an existing file is replaced.

    Args:
        con: a connection from :func:`analysis.store.open_store`.
        run_id: the run to export.
        path: output file.
        from_step / to_step: inclusive step range, ``None`` = unbounded.
        order: layer order within a step, ``"name"`` or ``"model"``.
        progress: optional callback of the fraction done (see :data:`Progress`).

    Returns:
        Number of lines (rows) written.

    Raises:
        StoreError: unknown run, invalid step range, or unusable output path.
        ValueError: unknown ``order``.
    """
    select = _table_select(order, finite_only=True)
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    target = _target(path)
    return _copy(con, select, target, "FORMAT json", params, progress)


_WRITERS = {
    "csv": export_csv,
    "json": export_json,
    "parquet": export_parquet,
    "jsonl": export_jsonl,
}


def export_run(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    fmt: str,
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
    progress: Progress | None = None,
) -> int:
    """Export a run in ``fmt`` (one of :data:`EXPORT_FORMATS`); see the writer of each.

    Returns:
        Rows written (frames for ``json``).

    Raises:
        ValueError: unknown format or order.
        StoreError: unknown run, invalid step range, or unusable output path.
    """
    writer = _WRITERS.get(fmt)
    if writer is None:
        raise ValueError(f"format must be one of {', '.join(EXPORT_FORMATS)}, got {fmt!r}")
    return writer(con, run_id, path, from_step, to_step, order, progress)
