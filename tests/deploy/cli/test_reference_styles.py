"""``gradstream export --style reference`` (CSV and JSON) and ``gradstream report --heatmap
--heatmap-style reference`` write the reference implementation's bytes."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from deploy.cli import app
from tests.analysis.test_reference_styles import MODEL, build


def test_cli_options_select_the_reference_styles(tmp_path: Path) -> None:
    path, animator = build(tmp_path, MODEL, 120)
    runner = CliRunner()
    out = tmp_path / "cli.csv"
    result = runner.invoke(app, ["export", "--db", str(path), "--run", "r", "--style",
                                 "reference", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == animator.export_csv().encode("utf-8")
    result = runner.invoke(app, ["report", "--db", str(path), "--run", "r", "--heatmap",
                                 "--heatmap-style", "reference", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["heatmap"] == animator.to_ascii_animation()
    out = tmp_path / "cli.json"
    result = runner.invoke(app, ["export", "--db", str(path), "--run", "r", "--format",
                                 "json", "--style", "reference", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == animator.export_json().encode("utf-8")
    result = runner.invoke(app, ["export", "--db", str(path), "--run", "r", "--format",
                                 "parquet", "--style", "reference", "--output",
                                 str(tmp_path / "x.parquet")])
    assert result.exit_code != 0 and "csv and json formats only" in result.output


def test_report_order_name(tmp_path: Path) -> None:
    path, animator = build(tmp_path, MODEL, 8)
    result = CliRunner().invoke(app, ["report", "--db", str(path), "--run", "r", "--order",
                                      "name", "--format", "json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["layers_with_exploding_grads"]
    assert got == animator.summary_report().layers_with_exploding_grads == sorted(MODEL)
