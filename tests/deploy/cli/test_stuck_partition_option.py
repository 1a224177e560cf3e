"""``--stuck-partition-timeout`` (:data:`deploy.cli.options.StuckPartitionTimeoutOption`):
the flag, else ``GRADSTREAM_STUCK_PARTITION_TIMEOUT_S``, else 30 s reaches the worker's and
the store's settings, and the loop's stuck-partition watchdog."""

from __future__ import annotations

import inspect

import pytest
import typer
from typer.testing import CliRunner

from consumer.store_writer_settings import StoreWriterSettings
from consumer.worker import Worker
from deploy.cli.consume import WorkerOptions, consume, store
from deploy.cli.serve import serve


def test_flag_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADSTREAM_STUCK_PARTITION_TIMEOUT_S", raising=False)
    assert WorkerOptions().settings().stuck_partition_timeout_s == 30.0
    assert StoreWriterSettings().stuck_partition_timeout_s == 30.0
    monkeypatch.setenv("GRADSTREAM_STUCK_PARTITION_TIMEOUT_S", "0")
    settings = WorkerOptions().settings()
    assert settings.stuck_partition_timeout_s == 0.0
    assert not Worker(settings).watchdog.enabled
    assert WorkerOptions(stuck_partition_timeout=2.5).settings().stuck_partition_timeout_s == 2.5
    given = WorkerOptions(stuck_partition_timeout=2.5).settings()
    assert Worker(given).watchdog.interval_s == 0.625


@pytest.mark.parametrize("command", [consume, store, serve], ids=["consume", "store", "serve"])
def test_every_consuming_command_takes_the_option(command: object) -> None:
    assert "stuck_partition_timeout" in inspect.signature(command).parameters
    app = typer.Typer()
    app.command("x")(command)
    app.command("y")(lambda: None)
    result = CliRunner().invoke(app, ["x", "--stuck-partition-timeout", "-1"])
    assert result.exit_code == 2  # refused before anything connects
    assert "--stuck-partition-timeout" in result.output
