"""`gradstream report` and `export` (:mod:`deploy.cli.reports`), registered on a fresh Typer
app."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from deploy.cli.reports import register
from tests.analysis.crafted import EXPLODING, NASTY_NAMES, Stat, StoreBuilder, healthy_stat

MODEL = ["z_embed", "m_block", "a_head"]


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def one_run(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "one.duckdb").add_run("exp/1", MODEL)
    builder.add_steps("exp/1", range(8), {n: healthy_stat() for n in MODEL})
    builder.add_frame("exp/1", 8, {"z_embed": EXPLODING, "m_block": Stat(), "a_head": Stat()})
    return builder.write()


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    builder = StoreBuilder(tmp_path / "two.duckdb").add_run("a", MODEL).add_run("b", NASTY_NAMES)
    builder.add_steps("a", range(4), {n: healthy_stat() for n in MODEL})
    builder.add_steps("b", range(2), {n: healthy_stat() for n in NASTY_NAMES})
    return builder.write()


def test_help(app: typer.Typer, runner: CliRunner) -> None:
    for command in ("report", "export"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, result.output
        assert "--db" in result.output and "--run" in result.output
        assert "--from-step" in result.output


def test_report_table_single_run(app: typer.Typer, runner: CliRunner, one_run: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(one_run)])
    assert result.exit_code == 0, result.output
    assert "ProblemsDetected" in result.output
    assert "z_embed" in result.output
    assert "Gradient Flow Animation" not in result.output


def test_report_heatmap_and_range(app: typer.Typer, runner: CliRunner, one_run: Path) -> None:
    result = runner.invoke(
        app, ["report", "--db", str(one_run), "--heatmap", "--to-step", "7", "--max-columns", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "Healthy" in result.output
    assert "Gradient Flow Animation" in result.output
    assert "each column = 2 steps (mean)" in result.output


def test_report_json(app: typer.Typer, runner: CliRunner, one_run: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(one_run), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["run_id"] == "exp/1"
    assert doc["overall_health"] == "ProblemsDetected"
    assert doc["total_steps"] == 9
    assert doc["layers_with_exploding_grads"] == ["z_embed"]
    assert "heatmap" not in doc
    result = runner.invoke(app, ["report", "--db", str(one_run), "--format", "json", "--heatmap"])
    assert json.loads(result.stdout)["heatmap"].startswith("Gradient Flow Animation")


def test_report_all_runs(app: typer.Typer, runner: CliRunner, two_runs: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(two_runs), "--all", "--format", "json"])
    assert result.exit_code == 0, result.output
    docs = json.loads(result.stdout)
    assert [d["run_id"] for d in docs] == ["a", "b"]
    result = runner.invoke(app, ["report", "--db", str(two_runs), "--all"])
    assert result.exit_code == 0, result.output
    assert "run a" in result.output and "run b" in result.output


def test_report_needs_run_when_several(app: typer.Typer, runner: CliRunner, two_runs: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(two_runs)])
    assert result.exit_code == 1
    assert "choose one with --run" in result.output
    assert "'a', 'b'" in result.output
    assert "Traceback" not in result.output
    result = runner.invoke(app, ["report", "--db", str(two_runs), "--run", "b"])
    assert result.exit_code == 0, result.output


def test_errors_are_clean(app: typer.Typer, runner: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "missing.duckdb"
    for args in (["report"], ["export"]):
        result = runner.invoke(app, [*args, "--db", str(missing)])
        assert result.exit_code == 1
        assert "does not exist" in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
    store = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL).write()
    result = runner.invoke(app, ["report", "--db", str(store), "--run", "nope"])
    assert result.exit_code == 1 and "unknown run 'nope'" in result.output
    result = runner.invoke(
        app, ["report", "--db", str(store), "--from-step", "5", "--to-step", "1"]
    )
    assert result.exit_code == 1 and "after" in result.output


def test_db_from_environment(
    app: typer.Typer, runner: CliRunner, one_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSTREAM_DB", str(one_run))
    result = runner.invoke(app, ["report", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["run_id"] == "exp/1"


def test_export_default_path(
    app: typer.Typer,
    runner: CliRunner,
    one_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["export", "--db", str(one_run)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out" / "exp_1.csv"
    with out.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))
    assert len(rows) == 1 + 9 * 3
    assert "wrote 27 rows" in result.output


def test_export_json_options(
    app: typer.Typer, runner: CliRunner, two_runs: Path, tmp_path: Path
) -> None:
    out = tmp_path / "a" / "b" / "frames.json"
    result = runner.invoke(
        app,
        [
            "export",
            "--db",
            str(two_runs),
            "--run",
            "b",
            "--format",
            "json",
            "-o",
            str(out),
            "--order",
            "model",
            "--from-step",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    frames = json.loads(out.read_text(encoding="utf-8"))
    assert [f["step"] for f in frames] == [1]
    assert [layer["name"] for layer in frames[0]["layers"]] == NASTY_NAMES
    assert "wrote 1 frames" in result.output


def test_export_rejects_bad_choice(app: typer.Typer, runner: CliRunner, one_run: Path) -> None:
    result = runner.invoke(app, ["export", "--db", str(one_run), "--format", "xml"])
    assert result.exit_code == 2
