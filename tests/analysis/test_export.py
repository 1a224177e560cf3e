"""export_csv / export_json: reference formats, quoting of arbitrary names, order, ranges."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.export import CSV_HEADER, export_csv, export_json, rust_exp_sql
from analysis.read.connect import StoreError, open_store
from tests.analysis.crafted import EXPLODING, NASTY_NAMES, VANISHING, Stat, StoreBuilder

MODEL = ["z_embed", "m_block", "a_head"]


def run_export(kind: str, store: Path, out: Path, run: str = "r", **kw: object) -> int:
    con = open_store(store)
    try:
        writer = export_csv if kind == "csv" else export_json
        return writer(con, run, out, **kw)  # type: ignore[arg-type]
    finally:
        con.close()


def read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


@pytest.fixture
def nasty_store(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", NASTY_NAMES)
    for step in range(3):
        builder.add_frame(
            "r", step, {n: Stat(norm=float(i + 1)) for i, n in enumerate(NASTY_NAMES)}
        )
    builder.add_frame("r", 3, {NASTY_NAMES[0]: VANISHING, NASTY_NAMES[1]: EXPLODING})
    return builder.write()


def test_csv_round_trips_nasty_names(nasty_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "deep" / "er" / "x.csv"
    n = run_export("csv", nasty_store, out)
    rows = read_csv(out)
    assert out.read_text(encoding="utf-8").splitlines()[0] == CSV_HEADER
    assert rows[0] == CSV_HEADER.split(",")
    assert n == len(rows) - 1 == 3 * len(NASTY_NAMES) + 2
    assert all(len(r) == 7 for r in rows)
    for step in range(3):
        names = [r[1] for r in rows[1:] if r[0] == str(step)]
        assert names == sorted(NASTY_NAMES)  # reference order: by name (code points)
    last = {r[1]: r for r in rows[1:] if r[0] == "3"}
    assert last[NASTY_NAMES[0]][5:] == ["1", "0"]
    assert last[NASTY_NAMES[1]][5:] == ["0", "1"]
    assert "\r\n" in {r[1] for r in rows[1:] if r[1].startswith("crlf")}.pop()


def test_csv_float_format_is_rusts(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["a"])
    builder.add_frame("r", 0, {"a": Stat(mean=0.01, max=123.0, norm=0.0)})
    builder.add_frame("r", 1, {"a": Stat(mean=1e-300, max=5e300, norm=1.5)})
    out = tmp_path / "x.csv"
    run_export("csv", builder.write(), out)
    rows = read_csv(out)
    assert rows[1] == ["0", "a", "1.00000000e-2", "1.23000000e2", "0.00000000e0", "0", "0"]
    assert rows[2] == ["1", "a", "1.00000000e-300", "5.00000000e300", "1.50000000e0", "1", "1"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=50))
def test_rust_exp_sql_matches_correctly_rounded_formatting(values: list[float]) -> None:
    def rust(x: float) -> str:  # Rust's {:.8e}: Python's digits, unpadded exponent
        if math.isnan(x):
            return "NaN"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        mantissa, exponent = f"{x:.8e}".split("e")
        return f"{mantissa}e{int(exponent)}"

    got = duckdb.sql(
        f"SELECT {rust_exp_sql('x')} FROM (SELECT unnest($v::DOUBLE[]) AS x, "
        "generate_subscripts($v::DOUBLE[], 1) AS i) ORDER BY i",
        params={"v": values},
    ).fetchall()
    assert [g[0] for g in got] == [rust(v) for v in values]


def test_csv_model_order_and_range(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL)
    builder.add_steps("r", range(10), {n: Stat() for n in MODEL})
    store = builder.write()
    out = tmp_path / "m.csv"
    assert run_export("csv", store, out, order="model", from_step=3, to_step=5) == 9
    rows = read_csv(out)[1:]
    assert [r[0] for r in rows] == ["3"] * 3 + ["4"] * 3 + ["5"] * 3
    assert [r[1] for r in rows[:3]] == MODEL
    assert run_export("csv", store, out, order="name", from_step=8) == 6
    assert [r[1] for r in read_csv(out)[1:4]] == sorted(MODEL)


def test_csv_large_run_stays_ordered(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL)
    builder.add_steps("r", range(3000), {n: Stat() for n in MODEL})
    out = tmp_path / "big.csv"
    assert run_export("csv", builder.write(), out) == 9000
    rows = read_csv(out)[1:]
    keys = [(int(r[0]), r[1]) for r in rows]
    assert keys == sorted(keys)


def test_json_round_trips_nasty_names(nasty_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "j" / "x.json"
    assert run_export("json", nasty_store, out) == 4
    with out.open(encoding="utf-8") as fh:
        frames = json.load(fh)
    assert [f["step"] for f in frames] == [0, 1, 2, 3]
    assert list(frames[0]) == ["step", "layers"]
    first = frames[0]["layers"]
    assert [layer["name"] for layer in first] == sorted(NASTY_NAMES)
    assert list(first[0]) == [
        "name",
        "mean_abs_grad",
        "max_abs_grad",
        "grad_norm",
        "is_vanishing",
        "is_exploding",
        "flow_intensity",
    ]
    by_name = {layer["name"]: layer for layer in first}
    top = len(NASTY_NAMES)
    for i, name in enumerate(NASTY_NAMES):
        assert by_name[name]["grad_norm"] == float(i + 1)
        assert by_name[name]["flow_intensity"] == pytest.approx((i + 1) / top)
        assert by_name[name]["is_vanishing"] is False
    assert {layer["name"]: layer["is_exploding"] for layer in frames[3]["layers"]} == {
        NASTY_NAMES[0]: False,
        NASTY_NAMES[1]: True,
    }


def test_json_model_order_range_and_empty(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL).add_run("idle", MODEL)
    builder.add_steps("r", range(5), {n: Stat() for n in MODEL})
    store = builder.write()
    out = tmp_path / "x.json"
    assert run_export("json", store, out, order="model", to_step=1) == 2
    frames = json.loads(out.read_text(encoding="utf-8"))
    assert [layer["name"] for layer in frames[0]["layers"]] == MODEL
    assert run_export("json", store, out, run="idle") == 0
    assert json.loads(out.read_text(encoding="utf-8")) == []
    assert run_export("csv", store, tmp_path / "idle.csv", run="idle") == 0
    assert read_csv(tmp_path / "idle.csv") == [CSV_HEADER.split(",")]


@pytest.mark.parametrize("kind", ["csv", "json"])
def test_errors(tmp_path: Path, kind: str) -> None:
    store = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL).write()
    with pytest.raises(StoreError, match="unknown run 'x'"):
        run_export(kind, store, tmp_path / "o", run="x")
    with pytest.raises(ValueError, match="order"):
        run_export(kind, store, tmp_path / "o", order="hash")
    with pytest.raises(StoreError, match="directory"):
        run_export(kind, store, tmp_path)
    with pytest.raises(StoreError, match="after"):
        run_export(kind, store, tmp_path / "o", from_step=3, to_step=2)
    assert not (tmp_path / "o").exists()


def test_output_path_with_quote(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["a"])
    builder.add_steps("r", range(2), {"a": Stat()})
    out = tmp_path / "it's here" / "x.csv"
    assert run_export("csv", builder.write(), out) == 2
    assert out.exists()
