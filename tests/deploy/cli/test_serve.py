"""``gradstream serve`` runs the worker of ``gradstream consume``, so it takes the same
options (:class:`deploy.cli.consume.WorkerOptions`) and refuses the same mistakes before
connecting to anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from deploy.cli import app
from deploy.cli.consume import WorkerOptions

SCALE_OUT_ONLY = {"--frames-topic", "--runs-topic", "--workers"}
"""Options of ``consume`` that make a worker write no store: nothing to serve."""
READ_ENDPOINT = {"--read-endpoint", "--no-read-endpoint", "--read-port"}
"""Where ``consume`` answers reads; ``serve`` answers them on its own ``--host``/``--port``."""
ICEBERG_STORE = {"--iceberg-catalog", "--iceberg-warehouse", "--iceberg-namespace"}
"""Options of ``consume`` that make a worker write an Iceberg table set: ``serve``'s
dashboard reads the DuckDB file its worker writes (an Iceberg table set is served by
``serve --no-consume --db 'iceberg+...'``, tests/deploy/test_serve_iceberg.py)."""


def _options(name: str) -> dict[str, Any]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {opt: p for p in command.params for opt in p.opts}


def test_serve_takes_every_option_of_consume() -> None:
    consume, serve = _options("consume"), _options("serve")
    missing = set(consume) - set(serve) - SCALE_OUT_ONLY - READ_ENDPOINT - ICEBERG_STORE
    assert not missing, f"serve lacks {sorted(missing)}"
    for flag in ("--alert-set", "--webhook", "--metrics-port", "--log-format", "--max-frames",
                 "--partitions", "--alert-rules", "--db", "--bootstrap-servers",
                 "--max-readers"):
        # serve's --db also takes a store URL with --no-consume: its help says so after consume's
        same = serve[flag].help.startswith if flag == "--db" else serve[flag].help.__eq__
        assert same(consume[flag].help), flag
        assert serve[flag].envvar == consume[flag].envvar


def test_worker_options_build_the_consumer_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADSTREAM_WEBHOOK_URL", raising=False)
    settings = WorkerOptions(
        bootstrap_servers="h:1", db=tmp_path / "s.duckdb", shard_timeout=2.5, max_frames=9,
        alert_set=["exploding.consecutive=5"], webhook="http://127.0.0.1:9/x", metrics_port=0,
    ).settings(frames_topic="f")
    assert settings.bootstrap_servers == "h:1" and settings.db == str(tmp_path / "s.duckdb")
    assert settings.shard_timeout_s == 2.5 and settings.max_frames == 9
    assert settings.alert_set == ["exploding.consecutive=5"]
    assert settings.webhook_url == "http://127.0.0.1:9/x" and settings.frames_topic == "f"
    assert WorkerOptions().settings().webhook_url is None


@pytest.mark.parametrize("command", ["consume", "serve"])
def test_invalid_alert_rules_exit_2_before_connecting(command: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, [command, "--db", str(tmp_path / "s.duckdb"), "--bootstrap-servers",
              "127.0.0.1:1", "--alert-set", "no_such_rule.enabled=true"])
    assert result.exit_code == 2, result.output
    assert "invalid alert rules" in result.output
    assert not (tmp_path / "s.duckdb").exists()


def test_serve_refuses_scale_out_mode_from_the_environment(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--db", str(tmp_path / "s.duckdb")],
                                env={"GRADSTREAM_FRAMES_TOPIC": "gradstream.frames"})
    assert result.exit_code == 2, result.output
    assert "GRADSTREAM_FRAMES_TOPIC" in result.output


def test_serve_no_consume_on_a_missing_store_says_so(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--no-consume", "--port", "0", "--db",
                                      str(tmp_path / "absent.duckdb")])
    assert result.exit_code == 1
    assert "no gradstream store" in result.output
