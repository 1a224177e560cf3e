"""The analysis registry: every entry loads and is consistent, options are validated from
one flat mapping, the command line stays light to import, and an analysis added with one
registry line is served by ``gradstream analyze`` and the dashboard without other edits.

This module is itself a registrable analysis (``ANALYSIS`` below: the number of layers
whose largest gradient norm in the range reaches ``min_norm``), added to the registry by
the ``toy_registered`` fixture with the one line an author would write.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pytest
import typer
from pydantic import BaseModel, ConfigDict, Field
from rich.console import RenderableType
from rich.text import Text
from typer.testing import CliRunner

from analysis import registry
from analysis.dashboard import api
from analysis.read.connect import require_run
from analysis.read.routes import READS
from analysis.read.sql import stats_params
from analysis.registry import ANALYSES, Analysis, UnknownAnalysisError
from deploy.cli import analyze as analyze_cli
from tests.analysis.crafted import open_read, write_history

REPO = Path(__file__).resolve().parents[2]


# -- a toy analysis, complete in these few lines ----------------------------------------


class ToyOptions(BaseModel):
    """Options of the toy analysis: ``min_norm``, the norm a layer must reach (>= 0)."""

    model_config = ConfigDict(frozen=True)

    min_norm: float = Field(default=0.0, ge=0.0)


class ToyReport(BaseModel):
    """Report of the toy analysis: layers whose largest ``grad_norm`` reaches ``min_norm``."""

    run_id: str
    min_norm: float
    layers: int


def build_toy(con: duckdb.DuckDBPyConnection, run_id: str, from_step: int | None,
              to_step: int | None, options: ToyOptions) -> ToyReport:
    """Count the layers whose largest ``grad_norm`` in the range is >= ``min_norm``."""
    params = stats_params(run_id, from_step, to_step)
    require_run(con, run_id)
    (count,) = con.execute(
        "SELECT count(*) FROM (SELECT layer_index FROM layer_stats WHERE run_id = $run_id "
        "AND ($from_step IS NULL OR step >= $from_step) AND ($to_step IS NULL OR step <= "
        "$to_step) GROUP BY layer_index HAVING max(grad_norm) >= $min_norm)",
        {**params, "min_norm": options.min_norm},
    ).fetchone()
    return ToyReport(run_id=run_id, min_norm=options.min_norm, layers=count)


def render_toy(report: ToyReport) -> RenderableType:
    """One line of text."""
    return Text(f"run {report.run_id}: {report.layers} layers reach {report.min_norm:g}")


ANALYSIS = Analysis(name="toy", help="Layers whose gradient norm reaches a level.",
                    options=ToyOptions, build=build_toy, render=render_toy)


@pytest.fixture
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[typer.Typer]:
    """The toy analysis registered with one line; yields a Typer app with ``analyze``
    rebuilt over the extended registry (restored afterwards)."""
    monkeypatch.setitem(ANALYSES, "toy", __name__)
    cli = importlib.reload(analyze_cli)
    app = typer.Typer()
    cli.register(app)

    @app.callback()
    def _root() -> None:
        """test root"""

    try:
        yield app
    finally:
        monkeypatch.undo()
        importlib.reload(analyze_cli)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    norms = np.vstack([np.full(6, 0.5), np.arange(6.0), np.full(6, 4.0)])
    return write_history(tmp_path / "s.duckdb", norms, names=["a", "b", "c"])


# -- the registry ------------------------------------------------------------------------


def test_every_entry_loads_with_default_options() -> None:
    entries = registry.all_analyses()
    assert [a.name for a in entries] == list(ANALYSES) == [
        "flow", "enhanced", "explosion", "weights"]
    for entry in entries:
        assert entry.help.endswith(".") and callable(entry.build) and callable(entry.render)
        assert entry.options() == entry.options_from({})  # every option has a default
    assert registry.get("flow").option_names == (
        "window", "alpha", "color_scheme", "rules", "ignore_layers")
    assert registry.get("enhanced").option_names == (
        "window", "interaction_window", "alpha", "rules", "depth", "stability_threshold",
        "ignore_layers")
    assert registry.get("explosion").option_names == ("threshold", "rules", "ignore_layers")
    assert registry.get("weights").option_names == ("alpha", "rules")
    for entry in entries:  # gradstream's rules by default, the reference's on request
        assert entry.options().rules == "gradstream"
        assert entry.options_from({"rules": "reference"}).rules == "reference"
    with pytest.raises(ValueError, match="rules"):
        registry.get("flow").options_from({"rules": "tukey"})


def test_options_keep_their_own_fields_and_validate() -> None:
    flow, enhanced = registry.get("flow"), registry.get("enhanced")
    values = {"window": "7", "alpha": "0.05", "threshold": 3.0, "color_scheme": "ColorBlind"}
    options = flow.options_from(values)
    assert (options.window, options.alpha, options.color_scheme.value) == (7, 0.05, "ColorBlind")
    assert enhanced.options_from({"threshold": 3.0}).window == 100  # foreign key ignored
    with pytest.raises(ValueError, match=r"invalid enhanced options: window: .*greater than"):
        enhanced.options_from({"window": 2})
    with pytest.raises(ValueError, match="invalid flow options: color_scheme"):
        flow.options_from({"color_scheme": "Purple"})
    with pytest.raises(UnknownAnalysisError, match="no analysis 'nope'; registered: flow"):
        registry.get("nope")


def test_a_bad_registration_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ANALYSES, "renamed", __name__)  # ANALYSIS here is named "toy"
    with pytest.raises(TypeError, match="must be an Analysis named 'renamed'"):
        registry.get("renamed")


def test_command_line_imports_no_analysis() -> None:
    """Building ``analyze`` from the registry (as ``gradstream --help`` does) imports
    neither the analyses nor their heavy dependencies; the root command imports no
    analysis either."""
    code = (
        "import sys, typer, typer.main\n"
        "from deploy.cli import analyze as analyze_cli\n"
        "app = typer.Typer()\n"
        "analyze_cli.register(app)\n"
        "typer.main.get_command(app)\n"
        "analyses = [m for m in sys.modules if m.split('.')[:3] in (['analysis', 'analyses', "
        "'flow'], ['analysis', 'analyses', 'enhanced'], ['analysis', 'analyses', 'explosion'], "
        "['analysis', 'analyses', 'weights'])]\n"
        "heavy = [m for m in ('numpy', 'pydantic', 'duckdb') if m in sys.modules]\n"
        "assert not analyses and not heavy, (analyses, heavy)\n"
        "from deploy.cli import app as root\n"
        "typer.main.get_command(root)\n"
        "assert not any(m.startswith(('analysis.analyses.flow', "
        "'analysis.analyses.weights')) for m in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_help_describes_every_analysis() -> None:
    app = typer.Typer()
    analyze_cli.register(app)

    @app.callback()
    def _root() -> None:
        """test root"""

    result = CliRunner().invoke(app, ["analyze", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for entry in registry.all_analyses():
        assert f"{entry.name}: {entry.help}" in result.output


# -- one registry line is enough ---------------------------------------------------------


def test_added_analysis_runs_from_the_command_line(toy_registered: typer.Typer,
                                                   store: Path) -> None:
    def analyze(*args: str) -> object:
        return CliRunner().invoke(toy_registered, ["analyze", "--db", str(store), *args])

    result = analyze("--kind", "toy", "--option", "min_norm=2", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"run_id": "r", "min_norm": 2.0, "layers": 2}
    table = analyze("--kind", "toy", "--to-step", "1")
    assert table.exit_code == 0 and "run r: 3 layers reach 0" in table.stdout
    unknown = analyze("--kind", "toy", "--option", "window=3")
    assert unknown.exit_code == 1 and "toy has no option 'window'" in unknown.output
    invalid = analyze("--kind", "toy", "--option", "min_norm=-1")
    assert invalid.exit_code == 1 and "invalid toy options: min_norm" in invalid.output
    assert analyze("--kind", "toy", "--option", "min_norm").exit_code == 1
    # The toy's help and options show up with the others'.
    help_text = CliRunner().invoke(toy_registered, ["analyze", "--help"],
                                   env={"COLUMNS": "200"}).output
    assert "toy: Layers whose gradient norm reaches a level. Options: min_norm." in help_text


def test_added_analysis_is_served_by_the_dashboard_api(toy_registered: typer.Typer,
                                                       store: Path) -> None:
    listed = [a["name"] for a in api.analyses()["analyses"]]
    assert listed == ["flow", "enhanced", "explosion", "weights", "toy"]
    con = open_read(store)
    try:
        served = READS["analysis"].run(con, "toy", {"run": "r", "from_step": 2,
                                                     "options": {"min_norm": "2.5"}})
        report = json.loads(served.model_dump_json())
        with pytest.raises(ValueError, match="toy has no option bins"):
            READS["analysis"].run(con, "toy", {"run": "r", "options": {"bins": "3"}})
    finally:
        con.close()
    assert report == {"run_id": "r", "min_norm": 2.5, "layers": 2}
