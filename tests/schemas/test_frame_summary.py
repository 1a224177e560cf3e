"""The frame summary computed in NumPy (schemas.frame_summary.summarize_frames) judges every
row as the store's SQL scan does (schemas.rounding.rounding_rows_sql): random frames with
zero, tiny, ordinary, infinite and NaN magnitudes (NaN and +inf included, where DuckDB
orders NaN above every number), NaN/Inf element counts and dtypes, written to a real
DuckDB table and judged there from the stored inputs by the same SQL expression."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.frame_summary import SUMMARY_COLUMNS, summarize_frames
from schemas.rounding import at_rounding_sql, rounding_rows_sql, roundoff_sql
from schemas.tables import SCHEMA_DDL

MAGNITUDES = st.sampled_from(
    [0.0, 1e-300, 1e-12, 1e-9, 3e-6, 1e-3, 0.02, 0.5, 1.0, 7.0, 1e200, np.inf, np.nan])
DTYPES = st.sampled_from(["float32", "bfloat16", "float16", "float64", None])


@st.composite
def frames(draw: st.DrawFn) -> tuple[list[str | None], list[list[tuple]]]:
    """(dtype per layer, frames of rows (layer, magnitude, mean known, nonfinite))."""
    layers = draw(st.integers(1, 7))
    dtypes = draw(st.lists(DTYPES, min_size=layers, max_size=layers))
    out = []
    for _ in range(draw(st.integers(1, 5))):
        present = sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1)))
        out.append([(layer, draw(MAGNITUDES), draw(st.booleans()),
                     draw(st.sampled_from([0, 0, 0, 2]))) for layer in present])
    return dtypes, out


@settings(max_examples=150, deadline=None)
@given(case=frames())
def test_summary_judges_every_row_as_the_sql_scan(case: tuple) -> None:
    dtypes, fs = case
    con = duckdb.connect()
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    con.executemany("INSERT INTO layers (run_id, layer_index, name, numel, dtype) "
                    "VALUES ('r', ?, ?, 1, ?)",
                    [(i, f"l{i}", d) for i, d in enumerate(dtypes)])
    rows = [(step, layer, mag, known, nf) for step, f in enumerate(fs)
            for layer, mag, known, nf in f]
    # As the writer stores them: a known mean |g| in mean_abs_grad, else NULL and the
    # magnitude from sum_sq / numel (numel 1: sum_sq = a^2, NaN and inf kept).
    con.executemany(
        "INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_sq, mean_abs_grad, "
        "nonfinite, grad_norm, flow_intensity, is_vanishing, is_exploding) "
        "VALUES ('r', ?, ?, 1, ?, ?, ?, 0, 0, false, false)",
        [(s, layer, m * m, m if known else None, nf) for s, layer, m, known, nf in rows])
    expected = {(s, layer): bool(a) for s, layer, a in con.execute(
        f"SELECT step, layer_index, at_rounding FROM ({rounding_rows_sql()})",
        {"run_id": "r", "to_step": None}).fetchall()}

    lengths = np.array([len(f) for f in fs])
    arr = np.array([(layer, m, known, nf) for f in fs for layer, m, known, nf in f],
                   dtype=object).reshape(-1, 4)
    layer_index = arr[:, 0].astype(np.int64) if len(arr) else np.zeros(0, np.int64)
    magnitude = arr[:, 1].astype(np.float64) if len(arr) else np.zeros(0)
    known = arr[:, 2].astype(bool) if len(arr) else np.zeros(0, bool)
    nonfinite = arr[:, 3].astype(np.int64) if len(arr) else np.zeros(0, np.int64)
    n = len(layer_index)
    with np.errstate(over="ignore", invalid="ignore"):
        squares = magnitude * magnitude  # as Python computed the stored sum_sq
    summary = summarize_frames(
        lengths, layer_index, np.ones(n, np.int64), squares,
        np.where(known, magnitude, np.nan), nonfinite, None, np.zeros(n, bool),
        np.zeros(n, bool))
    table = pa.table({"step": np.arange(len(fs), dtype=np.int64), **summary})
    assert set(SUMMARY_COLUMNS) <= set(table.column_names)
    con.register("gs_summary", table)
    judged = {(s, layer) for s, layer in con.execute(f"""
        SELECT c.step, c.layer_index FROM (
            SELECT step, top_magnitude AS top, unnest(rounding_candidates) AS layer_index,
                   unnest(rounding_magnitudes) AS magnitude, unnest(rounding_gaps) AS widest
            FROM gs_summary) AS c
        LEFT JOIN layers AS l ON l.run_id = 'r' AND l.layer_index = c.layer_index
        WHERE {at_rounding_sql("c.magnitude", "c.top", roundoff_sql("l.dtype"), "c.widest",
                               nonfinite=None)}""").fetchall()}
    assert judged == {key for key, at in expected.items() if at}
    # the stored magnitudes and top are the scan's doubles (NaN where the scan has NaN)
    tops = con.execute("SELECT step, max(coalesce(mean_abs_grad, sqrt(sum_sq / numel))) "
                       "FROM layer_stats GROUP BY step ORDER BY step").fetchall()
    stored = table["top_magnitude"].to_pylist()
    for step, top in tops:
        assert np.array_equal(np.float64(stored[step]), np.float64(top), equal_nan=True)
