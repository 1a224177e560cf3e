"""The store's schema (schemas.tables) and the migrations of older stores
(schemas.migrations): a new store and a migrated old one end with the same columns."""

from __future__ import annotations

import duckdb

from schemas.migrations import MIGRATIONS
from schemas.tables import CREATE_TABLES, FRAMES_COLUMNS, LAYER_STATS_COLUMNS, SCHEMA_DDL


def _columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str, str, str]]:
    return con.execute(
        "SELECT table_name, column_name, is_nullable, data_type FROM information_schema.columns"
        " ORDER BY table_name, ordinal_position").fetchall()


def _older_store(con: duckdb.DuckDBPyConnection) -> None:
    """The tables without any column a migration adds, gradient sums NOT NULL."""
    added = {(m.split()[2], m.split()[-2]) for m in MIGRATIONS if " ADD COLUMN " in m}
    for ddl in CREATE_TABLES:
        table = ddl.split("EXISTS", 1)[1].split("(", 1)[0].strip()
        head, body = ddl.split("(", 1)
        kept = [line for line in body.splitlines()
                if not line.strip() or (table, line.split()[0]) not in added]
        text = head + "(" + "\n".join(kept)
        for column in ("sum_abs", "max_abs_grad", "mean_abs_grad"):
            text = text.replace(f"{column} DOUBLE,", f"{column} DOUBLE NOT NULL,")
        con.execute(text.replace(",\n    )", "\n    )"))


def test_new_store_is_created_at_the_current_schema() -> None:
    con = duckdb.connect()
    for ddl in CREATE_TABLES:
        con.execute(ddl)
    created = _columns(con)
    for ddl in SCHEMA_DDL:  # the migrations change nothing on a current store
        con.execute(ddl)
    assert _columns(con) == created
    layer_stats = [c[1] for c in created if c[0] == "layer_stats"]
    assert tuple(layer_stats) == LAYER_STATS_COLUMNS
    frames = [c[1] for c in created if c[0] == "frames"]
    assert tuple(frames[:len(FRAMES_COLUMNS)]) == FRAMES_COLUMNS


def test_older_store_migrates_to_the_same_columns() -> None:
    old = duckdb.connect()
    _older_store(old)
    before = _columns(old)
    for ddl in SCHEMA_DDL:
        old.execute(ddl)
    new = duckdb.connect()
    for ddl in CREATE_TABLES:
        new.execute(ddl)
    assert len(before) < len(_columns(new))
    assert _columns(old) == _columns(new)
