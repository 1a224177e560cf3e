"""CSV and JSON exports of seed 001 (``export_csv``, ``export_json``), written by DuckDB.

Both files are produced by ``COPY (SELECT ...) TO path``: DuckDB streams the rows, so a
run of any length exports in bounded memory, and its writers quote and escape arbitrary
layer names (commas, quotes, newlines, unicode; DESIGN.md, "Bad input").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from analysis.store import STATS_SQL, StoreError, require_run, stats_params

if TYPE_CHECKING:
    import duckdb

CSV_HEADER = "step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding"
"""Header line of the CSV export, as in seed 001."""

Order = Literal["name", "model"]


def rust_exp_sql(column: str) -> str:
    """SQL expression formatting a DOUBLE like Rust's ``format!("{:.8e}", x)`` (seed 001).

    ``printf('%.8e', x)`` gives C's ``1.00000000e-02``; Rust writes ``1.00000000e-2``
    (no ``+``, no zero padding of the exponent). The printf exponent always has a sign
    and at least two digits, so three plain ``replace`` calls (``e+0`` -> ``e``,
    ``e+`` -> ``e``, ``e-0`` -> ``e-``) give Rust's text; this costs ~15% over bare printf,
    a regular expression ~50%. Non-finite values follow Rust too: ``NaN``, ``inf``, ``-inf``.

    Args:
        column: a SQL expression of type DOUBLE (trusted text, not user input).

    Returns:
        A SQL expression of type VARCHAR.
    """
    c_style = f"printf('%.8e', {column})"
    return (
        f"CASE WHEN isfinite({column}) THEN "
        f"replace(replace(replace({c_style}, 'e+0', 'e'), 'e+', 'e'), 'e-0', 'e-') "
        f"WHEN isnan({column}) THEN 'NaN' WHEN {column} > 0 THEN 'inf' ELSE '-inf' END"
    )


def _finite_or_null(column: str) -> str:
    # serde_json (the seed's writer) emits non-finite floats as null; so do we.
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
) -> int:
    row = con.execute(
        f"COPY ({select}) TO {_sql_string(str(target))} ({options})", params
    ).fetchone()
    return 0 if row is None else int(row[0])


def export_csv(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
) -> int:
    """Write one run's per-layer timeline as CSV (seed 001 ``export_csv``).

    Columns: ``step,layer,mean_abs_grad,max_abs_grad,grad_norm,is_vanishing,is_exploding``
    (:data:`CSV_HEADER`). Floats as Rust ``{:.8e}`` (:func:`rust_exp_sql`), flags as 0/1.
    One row per (step, layer) stored, ordered by step, then layer name (code-point order,
    the seed's) or model order (``layer_index``). Fields are RFC 4180-quoted when needed.
    The parent directory is created; an existing file is replaced.

    Args:
        con: a connection from :func:`analysis.store.open_store`.
        run_id: the run to export.
        path: output file.
        from_step: first step exported (inclusive), ``None`` = from the start.
        to_step: last step exported (inclusive), ``None`` = to the end.
        order: layer order within a step, ``"name"`` (seed) or ``"model"``.

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
    return _copy(con, select, target, "FORMAT csv, HEADER true", params)


def export_json(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    path: str | os.PathLike[str],
    from_step: int | None = None,
    to_step: int | None = None,
    order: Order = "name",
) -> int:
    """Write one run's frames as a JSON array (seed 001 ``export_json`` format).

    Shape: ``[{"step": s, "layers": [{"name", "mean_abs_grad", "max_abs_grad",
    "grad_norm", "is_vanishing", "is_exploding", "flow_intensity"}, ...]}, ...]``; frames
    in step order, layers within a frame by name (seed) or model order; flags are JSON
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
        order: layer order within a frame, ``"name"`` (seed) or ``"model"``.

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
    return _copy(con, select, target, "FORMAT json, ARRAY true", params)
