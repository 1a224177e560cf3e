"""A read-only store connection bounds DuckDB's buffer pool (``GRADSTREAM_READ_MEMORY_LIMIT``,
default 1GB), refuses a value that is not a size, and a second open of a hardened store in
the same process still works."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from analysis.read.connect import StoreError, open_store
from analysis.read.query import harden
from schemas.tables import SCHEMA_DDL


def _store(path: Path) -> Path:
    con = duckdb.connect(str(path))
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    con.close()
    return path


def _limit(con: duckdb.DuckDBPyConnection) -> str:
    return con.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]


def test_read_only_connection_is_limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _store(tmp_path / "s.duckdb")
    monkeypatch.delenv("GRADSTREAM_READ_MEMORY_LIMIT", raising=False)
    con = open_store(path)
    assert _limit(con) == "953.6 MiB"  # 1GB as DuckDB prints it
    harden(con)
    again = open_store(path)  # the same instance, its configuration locked: no error
    assert _limit(again) == "953.6 MiB"
    again.close()
    con.close()
    monkeypatch.setenv("GRADSTREAM_READ_MEMORY_LIMIT", "256MiB")
    con = open_store(path)
    assert _limit(con) == "256.0 MiB"
    con.close()
    writable = open_store(path, read_only=False)  # a writer keeps DuckDB's default
    assert _limit(writable) not in ("256.0 MiB", "953.6 MiB")
    writable.close()


@pytest.mark.parametrize("value", ["lots", "1 GB extra", "-1GB", "80%"])
def test_a_limit_that_is_not_a_size_is_refused(tmp_path: Path, value: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = _store(tmp_path / "s.duckdb")
    monkeypatch.setenv("GRADSTREAM_READ_MEMORY_LIMIT", value)
    with pytest.raises(StoreError, match="GRADSTREAM_READ_MEMORY_LIMIT must be a size"):
        open_store(path)
    open_store(path, read_only=False).close()  # the file was closed: a writer may open it
