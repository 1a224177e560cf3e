"""``gradstream alerts`` (the stored list) reads the store through the reader: the file,
or the endpoint of the process that writes it, with the same events either way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
import typer
from typer.testing import CliRunner

from analysis.dashboard.server import Dashboard, DashboardServer
from analysis.read.cursors import ReadCursors
from analysis.read.sidecar import new_token, remove_sidecar, write_sidecar
from consumer.alerts.rows import write_alerts
from deploy.cli.alerts import register
from schemas.alert import Alert
from tests.analysis.crafted import Stat, StoreBuilder


def alert(step: int, rule: str, state: str, created: float) -> Alert:
    incident = f"r-{rule}-{step}"
    return Alert(alert_id=f"{incident}-{state}", incident_id=incident, run_id="r", step=step,
                 first_step=step, rule=rule, severity="critical", state=state,
                 layers=["a", "b,\"c\""], ranks=[0, 3], message=f"{rule} at {step}",
                 values={"layers": {"a": {"grad_norm": 1.5}}}, created_at=created,
                 wall_time=created - 1)


EVENTS = [alert(2, "nonfinite", "firing", 100.0), alert(4, "nonfinite", "resolved", 101.0),
          alert(5, "exploding", "firing", 102.0)]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["a", "b,\"c\""])
    builder.add_steps("r", range(6), {"a": Stat(), "b,\"c\"": Stat()})
    db = builder.write()
    con = duckdb.connect(str(db))
    write_alerts(con, EVENTS)
    con.close()
    return db


@pytest.fixture
def served(store: Path) -> Iterator[None]:
    """This process writes the store and serves its reads (as ``gradstream consume``)."""
    con = duckdb.connect(str(store))
    cursors = ReadCursors.from_connection(con.cursor(), store)
    token = new_token()
    server = DashboardServer(Dashboard(cursors, token), "127.0.0.1", 0)
    server.start()
    write_sidecar(store, server.url, token, writer=True, command="consume")
    try:
        yield
    finally:
        remove_sidecar(store)
        server.stop()
        cursors.close()
        con.close()


def listed(store: Path, *args: str) -> list[Alert]:
    app = typer.Typer()
    register(app)
    done = CliRunner().invoke(app, ["alerts", "--db", str(store), "--json", *args])
    assert done.exit_code == 0, done.output
    return [Alert.model_validate_json(line) for line in done.stdout.splitlines() if line]


@pytest.mark.parametrize("through", ["file", "endpoint"])
def test_stored_alerts_through_either_path(request: pytest.FixtureRequest, store: Path,
                                           through: str) -> None:
    if through == "endpoint":
        request.getfixturevalue("served")
    assert listed(store) == EVENTS  # oldest first, every field intact
    assert listed(store, "--rule", "exploding") == EVENTS[2:]
    assert listed(store, "--state", "resolved", "--run", "r") == EVENTS[1:2]
    assert listed(store, "--limit", "2") == EVENTS[1:]


def test_missing_store_says_where_to_look(tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    done = CliRunner().invoke(app, ["alerts", "--db", str(tmp_path / "none.duckdb")])
    assert done.exit_code == 1
    assert "does not exist" in done.output and "--follow reads the alerts topic" in done.output
