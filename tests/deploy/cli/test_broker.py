"""`gradstream broker fetch|start|stop|status` (:mod:`deploy.cli.broker`), registered on a
fresh Typer app. Runs a real Kafka (the locked jars from Maven Central, real JVM, real
sockets)."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from deploy.broker import LocalBroker, resolve_kafka
from deploy.cli.broker import register
from tests.deploy.test_broker import _consume_all, _produce


def _cli_app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def test_cli_status_not_running(tmp_path: Path) -> None:
    result = CliRunner().invoke(_cli_app(), ["broker", "status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "not running" in result.output


def test_cli_help_lists_commands() -> None:
    result = CliRunner().invoke(_cli_app(), ["broker", "--help"])
    assert result.exit_code == 0
    for command in ("fetch", "start", "stop", "status", "lock"):
        assert command in result.output


def test_cli_fetch_prints_directory() -> None:
    result = CliRunner().invoke(_cli_app(), ["broker", "fetch"])
    assert result.exit_code == 0, result.output
    assert Path(result.stdout.strip()) == resolve_kafka()


def test_cli_error_is_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repository without the jars: the error names the jar, the URL and the setting."""
    monkeypatch.setenv("PATH", str(tmp_path))
    repository = (tmp_path / "empty-repository").as_uri()
    result = CliRunner().invoke(
        _cli_app(),
        ["broker", "fetch", "--cache-dir", str(tmp_path / "cache"),
         "--maven-repository", repository],
    )
    assert result.exit_code == 1
    assert "Error:" in result.output
    assert "Cannot download" in result.output and repository in result.output
    assert "GRADSTREAM_MAVEN_REPOSITORY" in result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert not (tmp_path / "cache" / "kafka-4.1.0" / "libs").exists()


def test_cli_invalid_repository_setting_is_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSTREAM_MAVEN_REPOSITORY", "ftp://mirror.example/maven2")
    result = CliRunner().invoke(
        _cli_app(), ["broker", "fetch", "--cache-dir", str(tmp_path / "cache")]
    )
    assert result.exit_code == 1
    assert "GRADSTREAM_MAVEN_REPOSITORY" in result.output and "ftp://" in result.output
    assert "Traceback" not in result.output


def test_cli_lock_without_maven_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    output = tmp_path / "jars.lock.toml"
    result = CliRunner().invoke(_cli_app(), ["broker", "lock", "--output", str(output)])
    assert result.exit_code == 1
    assert "apt-get install maven" in result.output
    assert "never needs it" in result.output
    assert not output.exists()


def test_cli_start_status_stop(tmp_path: Path, unique_name: str) -> None:
    app = _cli_app()
    runner = CliRunner()
    state = ["--state-dir", str(tmp_path)]
    try:
        started = runner.invoke(app, ["broker", "start", *state])
        assert started.exit_code == 0, started.output
        assert "java:" in started.output and "Java " in started.output
        broker = LocalBroker.from_state(tmp_path)
        assert f"export KAFKA_BOOTSTRAP_SERVERS={broker.bootstrap}" in started.output

        # The broker outlives the command and really serves requests.
        topic = f"test-cli-{unique_name}"
        _produce(broker.bootstrap, topic, [b"hello"])
        assert _consume_all(broker.bootstrap, topic, expected=1) == [b"hello"]

        status = runner.invoke(app, ["broker", "status", *state])
        assert status.exit_code == 0, status.output
        assert "running" in status.output and broker.bootstrap in status.output

        again = runner.invoke(app, ["broker", "start", *state])
        assert again.exit_code == 0, again.output
        assert "already running" in again.output
        assert broker.bootstrap in again.output

        stopped = runner.invoke(app, ["broker", "stop", *state])
        assert stopped.exit_code == 0, stopped.output
        assert "Stopped" in stopped.output
        assert not LocalBroker.from_state(tmp_path).status().running

        status = runner.invoke(app, ["broker", "status", *state])
        assert status.exit_code == 1
        stopped = runner.invoke(app, ["broker", "stop", *state])
        assert stopped.exit_code == 0
        assert "No Kafka broker running" in stopped.output
    finally:
        LocalBroker(tmp_path).stop()
