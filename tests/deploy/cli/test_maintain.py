"""``gradstream maintain`` on a real Iceberg table set (SQLite catalog, file warehouse) written
by the real Iceberg output: the settings from flags and ``GRADSTREAM_ICEBERG_*``, the dry run,
the summary line, and its errors."""

from __future__ import annotations

import socket
from pathlib import Path

from typer.testing import CliRunner

from deploy.cli import app
from tests.consumer.test_iceberg_maintenance import (
    GROUPS,
    WRITES,
    _offsets,
    _reader,
    _state,
    _write_history,
)


def test_maintain_dry_run_then_for_real(tmp_path: Path) -> None:
    catalog, warehouse = f"sqlite:///{tmp_path}/catalog.db", (tmp_path / "wh").as_uri()
    _write_history(catalog, warehouse)
    before = _state(_reader(catalog, warehouse))
    offsets = _offsets(catalog, warehouse)
    env = {"GRADSTREAM_ICEBERG_CATALOG": catalog, "GRADSTREAM_ICEBERG_WAREHOUSE": warehouse,
           "GRADSTREAM_ICEBERG_RETAIN": "0s"}

    dry = CliRunner().invoke(app, ["maintain", "--quiet-period", "0", "--dry-run"], env=env)
    assert dry.exit_code == 0, dry.output
    assert "dry run: would compact 2 partition(s) of 2 table(s) (20 data files)" in dry.stdout
    assert "would carry 3 Kafka offset(s)" in dry.stdout
    assert "retain 0s, compact from 5 small files, quiet period 0s" in dry.stderr
    assert _state(_reader(catalog, warehouse)) == before

    done = CliRunner().invoke(app, ["maintain", "--catalog", catalog, "--warehouse", warehouse,
                                    "--retain", "0s", "--quiet-period", "0s",
                                    "--min-input-files", str(WRITES)])
    assert done.exit_code == 0, done.output
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith(f"maintained: compact 2 partition(s) of 2 table(s) ({2 * WRITES} "
                           "data files -> 2); expire ")
    assert line.endswith("; carry 3 Kafka offset(s) into a new snapshot")
    after = _state(_reader(catalog, warehouse))
    assert {n: t["rows"] for n, t in after.items()} == {n: t["rows"] for n, t in before.items()}
    assert len(after["layer_stats"]["files"]) == 1
    assert _offsets(catalog, warehouse) == offsets and set(offsets) == set(GROUPS)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_maintain_errors_say_what_to_do(tmp_path: Path) -> None:
    runner = CliRunner()
    unset: dict[str, str | None] = {"GRADSTREAM_ICEBERG_CATALOG": None,
                                    "GRADSTREAM_ICEBERG_WAREHOUSE": None}
    missing = runner.invoke(app, ["maintain"], env=unset)
    assert missing.exit_code == 2 and "give --catalog and --warehouse" in missing.stderr

    wh = tmp_path.as_uri()
    absent = runner.invoke(app, ["maintain", "--catalog", f"sqlite:///{tmp_path}/none.db",
                                 "--warehouse", wh])
    assert absent.exit_code == 1 and "no Iceberg catalog at" in absent.stderr
    assert not (tmp_path / "none.db").exists()

    wrong = runner.invoke(app, ["maintain", "--catalog", "sqlite:///x.db", "--warehouse", wh,
                                "--retain", "7 days"])
    assert wrong.exit_code == 2 and "iceberg_retain" in wrong.stderr
    assert "write a number and a unit" in wrong.stderr

    # a PostgreSQL catalog that does not answer: the password is not printed
    url = f"postgresql+psycopg2://gradstream:s3cret@127.0.0.1:{_closed_port()}/iceberg"
    down = runner.invoke(app, ["maintain", "--catalog", url, "--warehouse", wh])
    assert down.exit_code == 1, down.output
    assert "cannot open the catalog postgresql+psycopg2://gradstream:***@127.0.0.1" in down.stderr
    assert "OperationalError" in down.stderr and "s3cret" not in down.output


def test_maintain_a_duckdb_store(tmp_path: Path) -> None:
    """``maintain --db``: the dry run counts what an older store lacks and changes nothing;
    the real run fills it; Iceberg flags beside --db are refused."""
    from tests.consumer.test_duckdb_maintenance import STEPS, as_written_before, written_store

    path = tmp_path / "old.duckdb"
    written_store(path)
    as_written_before(path)
    dry = CliRunner().invoke(app, ["maintain", "--db", str(path), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert f"dry run: {STEPS} frames to summarise; grid rollup to rebuild for 1 run (r)" \
        in dry.stdout
    again = CliRunner().invoke(app, ["maintain", "--db", str(path), "--dry-run"])
    assert again.stdout == dry.stdout  # the dry run changed nothing

    done = CliRunner().invoke(app, ["maintain", "--db", str(path), "--run", "r"])
    assert done.exit_code == 0, done.output
    assert f"frame summaries: {STEPS} frames filled; grid rollup: 1 run rebuilt" in done.stdout
    after = CliRunner().invoke(app, ["maintain", "--db", str(path), "--dry-run"])
    assert "dry run: 0 frames to summarise; grid rollup to rebuild for 0 runs" in after.stdout

    mixed = CliRunner().invoke(app, ["maintain", "--db", str(path), "--retain", "1d"])
    assert mixed.exit_code == 2 and "--retain maintain Iceberg tables" in mixed.stderr
    unknown = CliRunner().invoke(app, ["maintain", "--db", str(path), "--run", "nope"])
    assert unknown.exit_code == 1 and "no frames of run 'nope'" in unknown.stderr
    stray = CliRunner().invoke(app, ["maintain", "--run", "r"])
    assert stray.exit_code == 2 and "--run goes with --db" in stray.stderr
