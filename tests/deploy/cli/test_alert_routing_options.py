"""The alert-routing options (:class:`deploy.cli.options.AlertRoutingOptions`): every
command that takes ``--webhook`` takes them, they become the settings of the process it
starts, and invalid values stop the command before it connects to anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from deploy.cli import app
from deploy.cli.consume import WorkerOptions
from deploy.cli.options import AlertRoutingOptions

ROUTING_FLAGS = ("--alertmanager-url", "--alertmanager-resend-interval", "--alertmanager-lease",
                 "--pagerduty-routing-key", "--pagerduty-url", "--dashboard-url")


def _options(name: str) -> dict[str, Any]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {opt: p for p in command.params for opt in p.opts}


def test_every_command_taking_a_webhook_takes_the_routing_options() -> None:
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    with_webhook = sorted(n for n in commands if "--webhook" in _options(n))
    assert with_webhook == ["consume", "demo", "serve", "store"]
    reference = _options("consume")
    for name in with_webhook:
        options = _options(name)
        for flag in ROUTING_FLAGS:
            assert options[flag].help == reference[flag].help, (name, flag)


def test_routing_options_become_the_worker_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GRADSTREAM_ALERTMANAGER_URL", "GRADSTREAM_PAGERDUTY_ROUTING_KEY",
                 "GRADSTREAM_DASHBOARD_URL", "GRADSTREAM_ALERTMANAGER_LEASE_S",
                 "GRADSTREAM_ALERTMANAGER_RESEND_INTERVAL_S", "GRADSTREAM_PAGERDUTY_URL"):
        monkeypatch.delenv(name, raising=False)
    assert AlertRoutingOptions().settings() == {}
    routing = AlertRoutingOptions(
        alertmanager_url="http://am:9093", alertmanager_resend_interval=20.0,
        alertmanager_lease=90.0, pagerduty_routing_key="k" * 32,
        pagerduty_url="http://127.0.0.1:9/v2/enqueue", dashboard_url="http://dash:8765/")
    settings = WorkerOptions().settings(**routing.settings())
    assert settings.alertmanager_url == "http://am:9093"
    assert (settings.alertmanager_resend_interval_s, settings.alertmanager_lease) == (20.0, 90.0)
    assert settings.pagerduty_routing_key == "k" * 32
    assert settings.pagerduty_url == "http://127.0.0.1:9/v2/enqueue"
    assert settings.dashboard_url == "http://dash:8765"


@pytest.mark.parametrize("command", ["consume", "serve", "store"])
def test_invalid_routing_exits_2_before_connecting_without_printing_the_key(
        command: str, tmp_path: Path) -> None:
    key = "secret-but-31-characters-long.."
    result = CliRunner().invoke(
        app, [command, "--db", str(tmp_path / "s.duckdb"), "--bootstrap-servers",
              "127.0.0.1:1", "--alertmanager-url", "alertmanager:9093",
              "--pagerduty-routing-key", key], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "invalid settings" in result.output
    assert "GRADSTREAM_ALERTMANAGER_URL must be an http" in result.output
    assert "32-character Integration Key" in result.output and key not in result.output
    assert not (tmp_path / "s.duckdb").exists()
