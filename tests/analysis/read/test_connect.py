"""analysis.read.connect: opening the store (missing, locked, foreign files) and naming runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from analysis.read.connect import (
    StoreError,
    StoreLockedError,
    check_step_range,
    list_runs,
    open_store,
    require_run,
    resolve_run,
)
from tests.analysis.crafted import StoreBuilder, healthy_stat


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "store.duckdb")
    builder.add_run("run-b", ["l0"]).add_run("run-a", ["l0"])
    builder.add_steps("run-a", range(2), {"l0": healthy_stat()})
    return builder.write()


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Path]:
    """A store held open read-write by another process, as `gradstream consume` does."""
    path = StoreBuilder(tmp_path / "busy.duckdb").add_run("r", ["l0"]).write()
    script = textwrap.dedent(
        f"""
        import sys, duckdb
        con = duckdb.connect({str(path)!r})
        print("ready", flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield path
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        open_store(tmp_path / "nope.duckdb")
    with pytest.raises(StoreError, match="does not exist"):
        open_store(tmp_path / "nope.duckdb", read_only=False)
    assert not (tmp_path / "nope.duckdb").exists()


def test_locked_by_writer_is_a_locked_store(writer: Path) -> None:
    with pytest.raises(StoreLockedError, match="being written by another process"):
        open_store(writer)


def test_not_a_duckdb_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.duckdb"
    junk.write_text("definitely not a database\n" * 100)
    with pytest.raises(StoreError, match="cannot open the store"):
        open_store(junk)


def test_duckdb_file_without_gradstream_tables(tmp_path: Path) -> None:
    path = tmp_path / "other.duckdb"
    duckdb.connect(str(path)).close()
    with pytest.raises(StoreError, match="not a gradstream store"):
        open_store(path)


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="directory"):
        open_store(tmp_path)


def test_read_only_connection_cannot_write(two_runs: Path) -> None:
    con = open_store(two_runs)
    try:
        with pytest.raises(duckdb.Error):
            con.execute("DELETE FROM runs")
    finally:
        con.close()


def test_list_runs_sorted(two_runs: Path) -> None:
    con = open_store(two_runs)
    try:
        assert list_runs(con) == ["run-a", "run-b"]
    finally:
        con.close()


def test_resolve_run(two_runs: Path, tmp_path: Path) -> None:
    con = open_store(two_runs)
    try:
        assert resolve_run(con, "run-b") == "run-b"
        with pytest.raises(StoreError, match=r"2 runs.*'run-a', 'run-b'"):
            resolve_run(con, None)
        with pytest.raises(StoreError, match=r"unknown run 'zzz'.*'run-a', 'run-b'"):
            resolve_run(con, "zzz")
        assert resolve_run(con, "run-a") == "run-a"  # exact beats prefix
        with pytest.raises(StoreError, match=r"'run-' is ambiguous.*'run-a', 'run-b'"):
            resolve_run(con, "run-")
        require_run(con, "run-a")
        with pytest.raises(StoreError, match="unknown run 'run'"):
            require_run(con, "run")  # builders take exact ids: no prefix matching
    finally:
        con.close()

    single = StoreBuilder(tmp_path / "one.duckdb").add_run("only", ["l0"]).write()
    con = open_store(single)
    try:
        assert resolve_run(con, None) == "only"
        assert resolve_run(con, "on") == "only"  # a unique prefix
    finally:
        con.close()

    empty = StoreBuilder(tmp_path / "empty.duckdb").write()
    con = open_store(empty)
    try:
        assert list_runs(con) == []
        with pytest.raises(StoreError, match="no runs"):
            resolve_run(con, None)
        with pytest.raises(StoreError, match="no runs"):
            resolve_run(con, "x")
    finally:
        con.close()


@pytest.mark.parametrize(
    ("from_step", "to_step", "ok"),
    [
        (None, None, True),
        (0, 0, True),
        (3, 9, True),
        (9, 3, False),
        (-1, None, False),
        (None, -2, False),
    ],
)
def test_check_step_range(from_step: int | None, to_step: int | None, ok: bool) -> None:
    if ok:
        check_step_range(from_step, to_step)
    else:
        with pytest.raises(StoreError):
            check_step_range(from_step, to_step)
