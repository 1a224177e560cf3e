"""The shared option types and option groups of :mod:`deploy.cli.options`, and how the root
``gradstream`` application is assembled from them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from deploy.cli.options import (
    DEFAULT_DB,
    BootstrapServersOption,
    DbOption,
    MaxFramesOption,
    OptionGroup,
    given,
    with_option_groups,
)

REPO = Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class _Pair(OptionGroup):
    bootstrap_servers: BootstrapServersOption = None
    max_frames: MaxFramesOption = None


def _one_command(command: Any) -> typer.Typer:
    app = typer.Typer()
    app.command("x")(command)
    app.command("y")(lambda: None)  # a group, so the command is called by name
    return app


def test_a_group_becomes_options_and_comes_back_as_one_instance(tmp_path: Path) -> None:
    seen: list[Any] = []

    @with_option_groups
    def command(*, db: DbOption = Path(DEFAULT_DB), pair: _Pair, loud: bool = False) -> None:
        seen.append((db, pair, loud))

    app = _one_command(command)
    result = CliRunner().invoke(app, ["x", "--max-frames", "7", "--db", str(tmp_path / "s"),
                                      "--loud"])
    assert result.exit_code == 0, result.output
    assert seen == [(tmp_path / "s", _Pair(max_frames=7), True)]
    helped = CliRunner().invoke(app, ["x", "--help"], env={"COLUMNS": "200"})
    for flag in ("--db", "--bootstrap-servers", "--max-frames", "--loud"):
        assert flag in helped.output
    assert helped.output.index("--db") < helped.output.index("--bootstrap-servers") < (
        helped.output.index("--loud"))


def test_a_group_field_named_like_a_parameter_is_refused() -> None:
    def command(*, max_frames: int = 0, pair: _Pair) -> None:
        pass

    with pytest.raises(TypeError, match="max_frames"):
        with_option_groups(command)


def test_given_keeps_the_options_given_and_paths_as_text() -> None:
    assert given(a=None, b=0, c=Path("x/y"), d=[]) == {"b": 0, "c": "x/y", "d": []}


def test_the_settings_default_store_is_the_commands_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from consumer.settings import ConsumerSettings
    from consumer.store_writer_settings import StoreWriterSettings

    monkeypatch.delenv("GRADSTREAM_DB", raising=False)
    assert ConsumerSettings().db == StoreWriterSettings().db == DEFAULT_DB
    result = CliRunner().invoke(_root(), ["report", "--help"], env={"COLUMNS": "200"})
    assert f"[default: {DEFAULT_DB}]" in result.output


def _root() -> typer.Typer:
    from deploy.cli import app

    return app


def test_importing_the_options_builds_nothing_and_loads_nothing_heavy() -> None:
    """A package's command module may import the options without an import cycle: the
    command modules and the root app are not loaded, nor pydantic, DuckDB or Kafka."""
    code = (
        "import sys, deploy.cli.options\n"
        "loaded = [m for m in sys.modules if m.startswith(('deploy.cli.', 'analysis', "
        "'pydantic', 'duckdb', 'kafka')) and m != 'deploy.cli.options']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_python_m_deploy_cli_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for command in ("consume", "store", "serve", "alerts", "dlq", "report", "analyze", "demo",
                    "broker"):
        assert command in done.stdout
