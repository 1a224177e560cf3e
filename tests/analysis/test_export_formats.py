"""Parquet and JSON Lines exports: round trips, ranges, order, progress, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from analysis.export import TABLE_COLUMNS, export_jsonl, export_parquet, export_run
from analysis.read.connect import StoreError, open_store
from deploy.cli.reports import register
from tests.analysis.crafted import EXPLODING, NASTY_NAMES, VANISHING, Stat, StoreBuilder

MODEL = ["z_embed", "m_block", "a_head"]

TABLE_SQL = """
    SELECT s.run_id, s.step, s.layer_index, l.name AS layer, s.* EXCLUDE (run_id, step,
           layer_index)
    FROM layer_stats s JOIN layers l USING (run_id, layer_index)
    WHERE run_id = $run_id AND step BETWEEN $lo AND $hi
    ORDER BY step, {order}
"""


@pytest.fixture
def store(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", NASTY_NAMES).add_run("m", MODEL)
    for step in range(6):
        stats = {n: Stat(norm=float(i + 1) + step) for i, n in enumerate(NASTY_NAMES)}
        if step == 2:
            stats[NASTY_NAMES[0]] = VANISHING
            stats[NASTY_NAMES[1]] = EXPLODING
        if step == 4:
            stats[NASTY_NAMES[2]] = Stat(mean=math.inf, max=math.inf, norm=math.nan, nonfinite=2)
        builder.add_frame("r", step, stats)
    builder.add_steps("m", range(50), {n: Stat() for n in MODEL})
    return builder.write()


def same_table(got, want) -> bool:  # type: ignore[no-untyped-def]
    """Equal column names, types (up to NOT NULL markers and list item names) and values,
    NaN equal to NaN."""

    def norm(value: object) -> object:
        return "NaN" if isinstance(value, float) and math.isnan(value) else value

    want = want.cast(got.schema)  # fails if a type differs beyond those markers
    return got.column_names == want.column_names and [
        {k: norm(v) for k, v in row.items()} for row in got.to_pylist()
    ] == [{k: norm(v) for k, v in row.items()} for row in want.to_pylist()]


def stored(store: Path, run: str, lo: int = 0, hi: int = 10**9, order: str = "name"):  # type: ignore[no-untyped-def]
    con = duckdb.connect(str(store), read_only=True)
    try:
        by = "l.name, s.layer_index" if order == "name" else "s.layer_index"
        return con.sql(
            TABLE_SQL.format(order=by), params={"run_id": run, "lo": lo, "hi": hi}
        ).to_arrow_table()
    finally:
        con.close()


def test_parquet_round_trip_equals_the_table(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "x" / "r.parquet"
    con = open_store(store)
    try:
        assert export_parquet(con, "r", out) == 6 * len(NASTY_NAMES)
    finally:
        con.close()
    back = pq.read_table(out)
    assert back.column_names == list(TABLE_COLUMNS)
    expected = stored(store, "r")
    assert same_table(back, expected)  # NaN/inf, every nasty name kept exactly
    grad_norm = back.column("grad_norm").to_pylist()
    assert any(math.isnan(v) for v in grad_norm)


def test_parquet_range_and_model_order(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.parquet"
    con = open_store(store)
    try:
        assert export_parquet(con, "m", out, from_step=10, to_step=19, order="model") == 30
    finally:
        con.close()
    back = pq.read_table(out)
    assert same_table(back, stored(store, "m", 10, 19, order="model"))
    assert back.column("layer").to_pylist()[:3] == MODEL


def test_jsonl_lines_are_json_with_nulls_for_non_finite(store: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    con = open_store(store)
    try:
        n = export_jsonl(con, "r", out, from_step=2, to_step=4)
    finally:
        con.close()
    lines = out.read_text(encoding="utf-8").splitlines()
    assert n == len(lines) == 3 * len(NASTY_NAMES)
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
            for line in lines]
    assert all(list(r) == list(TABLE_COLUMNS) for r in rows)
    expected = stored(store, "r", 2, 4).to_pylist()
    for got, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            if isinstance(value, float) and not math.isfinite(value):
                assert got[key] is None, key
            else:
                assert got[key] == value, key
    bad = next(r for r in rows if r["step"] == 4 and r["layer"] == NASTY_NAMES[2])
    assert bad["grad_norm"] is None and bad["max_abs_grad"] is None and bad["nonfinite"] == 2


def test_progress_is_reported_to_completion(store: Path, tmp_path: Path) -> None:
    seen: list[float | None] = []
    con = open_store(store)
    try:
        for fmt in ("csv", "json", "parquet", "jsonl"):
            seen.clear()
            count = export_run(con, "m", tmp_path / f"p.{fmt}", fmt, progress=seen.append)
            assert count == (50 if fmt == "json" else 150)
            assert seen and seen[-1] == 1.0
            known = [p for p in seen if p is not None]
            assert all(0.0 <= p <= 1.0 for p in known)
    finally:
        con.close()


def test_progress_export_errors_are_raised(store: Path, tmp_path: Path) -> None:
    con = open_store(store)
    try:
        with pytest.raises(StoreError, match="unknown run"):
            export_run(con, "nope", tmp_path / "x.parquet", "parquet", progress=print)
        with pytest.raises(ValueError, match="format"):
            export_run(con, "r", tmp_path / "x.xml", "xml")
        with pytest.raises(StoreError, match="cannot write"):  # the target is a directory
            export_run(con, "r", tmp_path / "missing-dir-file" / "sub" / "..", "parquet",
                       progress=lambda _p: None)
    finally:
        con.close()


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_cli_export_new_formats(store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                fmt: str) -> None:
    app = typer.Typer()
    register(app)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["export", "--db", str(store), "--run", "m", "--format", fmt, "--to-step", "9"]
    )
    assert result.exit_code == 0, result.output
    assert "wrote 30 rows of run 'm'" in result.output
    out = tmp_path / "out" / f"m.{fmt}"
    if fmt == "parquet":
        back = pq.read_table(out)
        assert same_table(back, stored(store, "m", 0, 9))
    else:
        assert len(out.read_text(encoding="utf-8").splitlines()) == 30


def test_norms_mode_nulls_stay_empty(store: Path, tmp_path: Path) -> None:
    """Runs that send norms only store NULL mean/max |g|: empty in CSV, null in JSON."""
    con = duckdb.connect(str(store))
    con.execute("UPDATE layer_stats SET sum_abs = NULL, max_abs_grad = NULL, "
                "mean_abs_grad = NULL WHERE run_id = 'm'")
    con.close()
    con = open_store(store)
    try:
        export_run(con, "m", tmp_path / "m.csv", "csv", to_step=0)
        export_run(con, "m", tmp_path / "m.jsonl", "jsonl", to_step=0)
        export_run(con, "m", tmp_path / "m.json", "json", to_step=0)
    finally:
        con.close()
    rows = (tmp_path / "m.csv").read_text(encoding="utf-8").splitlines()
    assert rows[1].split(",")[2:5] == ["", "", "1.00000000e0"]
    line = json.loads((tmp_path / "m.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert line["mean_abs_grad"] is None and line["grad_norm"] == 1.0
    frame = json.loads((tmp_path / "m.json").read_text(encoding="utf-8"))[0]
    assert frame["layers"][0]["max_abs_grad"] is None
