"""``gradstream report --ignore-layers`` / ``--exclude-rounding-level`` (flags and their
environment variables), and ``gradstream analyze`` agreeing with ``gradstream report`` on
which layers vanish, explode or hold NaN/Inf, on a store written by the real sink."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from analysis.blocks.gradient_arrays import load_history
from analysis.read.connect import open_store
from analysis.report import build_report
from consumer.frames import compute_frame
from consumer.merge import MergedShards
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from deploy.cli.reports import register
from schemas.flags import FLAG_BITS, FLAG_EXPLODING, FLAG_NONFINITE, FLAG_VANISHING
from schemas.wire import RunStarted

NAMES = ["embed", "attn.self.key.bias", "block.0", "block.1", "head"]


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def write_store(path: Path, means: np.ndarray, nonfinite: np.ndarray,
                ignore_layers: list[str] | None = None) -> Path:
    """A run written by the real sink: frames of ``compute_frame`` from per-layer mean |g|
    ``means[t, l]`` (100 elements of equal magnitude; > 1e3 explodes) and NaN/Inf counts."""
    steps, n = means.shape
    msg = RunStarted(run_id="r", world_size=1, layer_names=NAMES, numel=[100] * n,
                     start_time=1.0, ignore_layers=ignore_layers or [])
    batch = Batch(runs_started=[msg])
    for t in range(steps):
        a = means[t]
        merged = MergedShards.empty(n)
        merged.add(np.arange(n), np.full(n, 100), a * 100, a * a * 100, a, nonfinite[t])
        frame = compute_frame("r", t, merged, vanishing_threshold=1e-7,
                              exploding_threshold=1e3, ranks_seen=(0,), world_size=1,
                              wall_time=1.7e9 + t)
        batch.frames[("r", t)] = (frame, "Healthy")
    sink = DuckDBSink(path, write_behind=False)
    sink.write(batch, "g")
    sink.close()
    return path


def run_like_bert(seed: int, steps: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """Random mean |g| per step: a key bias at rounding level, a block that vanishes now and
    then, one that explodes now and then, a NaN now and then."""
    rng = np.random.default_rng(seed)
    means = 10.0 ** rng.uniform(-4, -1, (steps, len(NAMES)))
    means[:, 1] = 10.0 ** rng.uniform(-14, -12, steps)
    means[:, 2] = np.where(rng.random(steps) < 0.3, 1e-9, means[:, 2])
    means[:, 3] = np.where(rng.random(steps) < 0.2, 5e3, means[:, 3])
    nonfinite = np.where(rng.random((steps, len(NAMES))) < 0.05, 1, 0).astype(np.int64)
    return means, nonfinite


@pytest.mark.parametrize("seed", range(4))
def test_analyses_and_report_agree_on_flagged_layers(tmp_path: Path, seed: int) -> None:
    """The history every analysis reads (its FLAG_* bits, schemas.flags) and the report
    list the same vanishing, exploding and non-finite layers."""
    path = write_store(tmp_path / "s.duckdb", *run_like_bert(seed))
    con = open_store(path)
    try:
        report = build_report(con, "r")
        history = load_history(con, "r")
    finally:
        con.close()
    for bit, listed in ((FLAG_VANISHING, report.layers_with_vanishing_grads),
                        (FLAG_EXPLODING, report.layers_with_exploding_grads),
                        (FLAG_NONFINITE, report.layers_with_nonfinite_grads)):
        rows = ((history.flags & bit) != 0).any(axis=1)
        assert [history.names[i] for i in np.flatnonzero(rows)] == listed
    assert "attn.self.key.bias" in report.layers_with_vanishing_grads


@pytest.mark.parametrize("seed", [7, 8])
def test_cli_analyze_and_report_agree(app: typer.Typer, tmp_path: Path, seed: int) -> None:
    """Through the commands: the layers ``analyze --kind enhanced`` finds vanishing,
    exploding or non-finite at some step (its per-layer health metrics) are those
    ``report`` lists."""
    from deploy.cli.analyze import register as register_analyze

    register_analyze(app)
    path = write_store(tmp_path / "s.duckdb", *run_like_bert(seed))
    runner = CliRunner()
    report = json.loads(runner.invoke(app, ["report", "--db", str(path), "--format", "json"],
                                      catch_exceptions=False).stdout)
    result = runner.invoke(app, ["analyze", "--kind", "enhanced", "--db", str(path),
                                 "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    details = json.loads(result.stdout)["layer_details"]
    order = {name: i for i, name in enumerate(NAMES)}

    def layers(metric: str) -> list[str]:
        hit = [d["layer_name"] for d in details if d["health_metrics"][metric] > 0]
        return sorted(hit, key=order.__getitem__)

    assert layers("vanishing_fraction") == report["layers_with_vanishing_grads"]
    assert layers("exploding_steps") == report["layers_with_exploding_grads"]
    assert layers("nonfinite_steps") == report["layers_with_nonfinite_grads"]
    assert report["layers_with_vanishing_grads"] and report["layers_with_exploding_grads"]


def _cli_json(app: typer.Typer, *args: str) -> dict[str, object]:
    result = CliRunner().invoke(app, [*args, "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(("seed", "given"), [(7, ()), (8, ()), (9, ("block.1",))])
def test_analyze_and_report_agree_with_ignore_layers(
    app: typer.Typer, tmp_path: Path, seed: int, given: tuple[str, ...]
) -> None:
    """A run recorded with ignore_layers (the HF adapter's key-bias exclusion), with and
    without a pattern of the reader's own (``--ignore-layers``, given to both commands):
    report and analyze (flow, enhanced, explosion) leave out the same layers' vanishing and
    exploding flags, still count their NaN/Inf, and name what they excluded."""
    from deploy.cli.analyze import register as register_analyze

    register_analyze(app)
    means, nonfinite = run_like_bert(seed)
    nonfinite[3, 1] = 1  # NaN/Inf in the excluded key bias: still counts everywhere
    path = write_store(tmp_path / "s.duckdb", means, nonfinite,
                       ignore_layers=["*.key.bias"])
    extra = [a for p in given for a in ("--ignore-layers", p)]
    db = ["--db", str(path)]
    report = _cli_json(app, "report", *db, *extra)
    excluded = ["attn.self.key.bias", *given]
    assert report["layers_excluded"] == sorted(excluded, key=NAMES.index)
    assert report["run_ignore_layers"] == ["*.key.bias"]
    assert report["report_ignore_layers"] == list(given)
    assert not set(excluded) & set(report["layers_with_vanishing_grads"])
    assert not set(excluded) & set(report["layers_with_exploding_grads"])
    assert "attn.self.key.bias" in report["layers_with_nonfinite_grads"]
    order = {name: i for i, name in enumerate(NAMES)}

    def in_order(names: set[str]) -> list[str]:
        return sorted(names, key=order.__getitem__)

    enhanced = _cli_json(app, "analyze", "--kind", "enhanced", *db, *extra)
    details = enhanced["layer_details"]

    def layers(metric: str) -> list[str]:
        return in_order({d["layer_name"] for d in details if d["health_metrics"][metric] > 0})

    assert layers("vanishing_fraction") == report["layers_with_vanishing_grads"]
    assert layers("exploding_steps") == report["layers_with_exploding_grads"]
    assert layers("nonfinite_steps") == report["layers_with_nonfinite_grads"]
    assert enhanced["layers_excluded"] == report["layers_excluded"]

    flow = _cli_json(app, "analyze", "--kind", "flow", *db, *extra)
    exploding_regions = {n for r in flow["exploding_regions"] for n in r["affected_layers"]}
    assert in_order(exploding_regions) == in_order(
        {*report["layers_with_exploding_grads"], *report["layers_with_nonfinite_grads"]})
    vanishing_regions = {n for r in flow["vanishing_regions"] for n in r["affected_layers"]}
    assert vanishing_regions <= set(report["layers_with_vanishing_grads"])
    assert flow["layers_excluded"] == report["layers_excluded"]

    explosion = _cli_json(app, "analyze", "--kind", "explosion", *db, *extra)
    rows = explosion["exploding_layers"]
    assert [r["layer_name"] for r in rows if r["exploding_steps"]] == \
        report["layers_with_exploding_grads"]
    assert [r["layer_name"] for r in rows if r["nonfinite_steps"]] == \
        report["layers_with_nonfinite_grads"]
    assert explosion["layers_excluded"] == report["layers_excluded"]
    for kind in ("flow", "enhanced", "explosion"):  # the tables name the exclusion too
        shown = CliRunner().invoke(app, ["analyze", "--kind", kind, *db, *extra],
                                   terminal_width=200, catch_exceptions=False)
        assert shown.exit_code == 0, shown.output
        assert "excluded" in shown.stdout and "by ignore_layers '*.key.bias'" in shown.stdout


def test_enhanced_network_health_ignores_an_excluded_vanishing_layer(
    app: typer.Typer, tmp_path: Path
) -> None:
    """The BERT case: the only vanishing layer is a key bias at rounding level. Counted
    (no exclusion), report and enhanced network health both flag it; excluded by the run
    setting, the report is Healthy and the enhanced network health is not Warning."""
    from deploy.cli.analyze import register as register_analyze

    register_analyze(app)
    rng = np.random.default_rng(3)
    means = 10.0 ** rng.uniform(-3, -2, (12, len(NAMES)))
    means[:, 1] = 10.0 ** rng.uniform(-14, -12, 12)
    health = {}
    for name, ignore in (("counted", None), ("excluded", ["*.key.bias"])):
        path = write_store(tmp_path / f"{name}.duckdb", means,
                           np.zeros(means.shape, np.int64), ignore_layers=ignore)
        report = _cli_json(app, "report", "--db", str(path))
        enhanced = _cli_json(app, "analyze", "--kind", "enhanced", "--db", str(path))
        health[name] = (report["overall_health"],
                        enhanced["network_level_analysis"]["overall_gradient_health"])
    assert health["counted"] == ("ProblemsDetected", "Warning")
    assert health["excluded"] == ("Healthy", "Healthy")


def test_report_ignore_layers_flag_env_and_run_setting(
    app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    means = np.tile([1e-2, 1e-13, 3e-3, 2e-3, 5e-2], (6, 1))
    path = write_store(tmp_path / "s.duckdb", means, np.zeros((6, 5), np.int64))
    runner = CliRunner()

    def report(*args: str) -> dict[str, object]:
        result = runner.invoke(app, ["report", "--db", str(path), "--format", "json", *args],
                               catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    plain = report()
    assert plain["overall_health"] == "ProblemsDetected"
    assert plain["layers_with_vanishing_grads"] == ["attn.self.key.bias"]
    assert plain["layers_without_gradient"] == ["attn.self.key.bias"]
    assert "likely zero by construction" in plain["findings"][0]
    flagged = report("--ignore-layers", "*.key.bias", "--ignore-layers", "nothing.*")
    assert flagged["overall_health"] == "Healthy"
    assert flagged["ignore_layers"] == ["*.key.bias", "nothing.*"]
    assert flagged["layers_excluded"] == ["attn.self.key.bias"]
    assert report("--exclude-rounding-level")["overall_health"] == "Healthy"
    monkeypatch.setenv("GRADSTREAM_IGNORE_LAYERS", "*.key.bias, other")
    assert report()["layers_excluded"] == ["attn.self.key.bias"]
    monkeypatch.delenv("GRADSTREAM_IGNORE_LAYERS")
    monkeypatch.setenv("GRADSTREAM_EXCLUDE_ROUNDING_LEVEL", "true")
    assert report()["excluded_rounding_level"] is True
    assert report("--count-rounding-level")["overall_health"] == "ProblemsDetected"
    text = runner.invoke(app, ["report", "--db", str(path), "--ignore-layers", "*.key.bias"])
    assert "excluded" in text.stdout and \
        "by this report's --ignore-layers '*.key.bias'" in text.stdout
    assert "by run setting" not in text.stdout


def test_run_setting_recorded_by_the_sink_is_applied(tmp_path: Path) -> None:
    means = np.tile([1e-2, 1e-13, 3e-3, 2e-3, 5e-2], (6, 1))
    path = write_store(tmp_path / "s.duckdb", means, np.zeros((6, 5), np.int64),
                       ignore_layers=["attn.*"])
    con = open_store(path)
    try:
        (stored,) = con.execute("SELECT ignore_layers FROM runs").fetchone()
        report = build_report(con, "r")
    finally:
        con.close()
    assert stored == ["attn.*"]
    assert report.overall_health.value == "Healthy"
    assert report.layers_excluded == ["attn.self.key.bias"]


def test_pages_receive_the_one_flag_definition(tmp_path: Path) -> None:
    """heatmap.js holds no flag bit of its own: the dashboard's config and the animation's
    data carry schemas.flags.FLAG_BITS (``flag_bits``), which both page scripts hand to
    ``GradHeatmap.useFlagBits`` before drawing."""
    from analysis.dashboard.server import Dashboard
    from analysis.plots.animation import render_animation
    from analysis.plots.grid import load_grid
    from analysis.read.cursors import ReadCursors

    root = Path(__file__).parents[3]
    js = (root / "analysis" / "plots" / "heatmap.js").read_text()
    assert not re.search(r"\b(VANISHING|EXPLODING|NONFINITE|NO_DATA|ZERO|DEAD)\s*:\s*\d", js)
    assert "H.useFlagBits(config.flag_bits)" in (
        root / "analysis" / "dashboard" / "static" / "dashboard.js").read_text()
    assert "H.useFlagBits(data.flag_bits)" in (
        root / "analysis" / "plots" / "animation.html").read_text()

    path = write_store(tmp_path / "s.duckdb", *run_like_bert(0))
    cursors = ReadCursors.open_read_only(path)
    try:
        page = Dashboard(cursors, "t0ken").index_html().decode()
    finally:
        cursors.close()
    config = json.loads(re.search(
        r'<script type="application/json" id="config">(.*?)</script>', page, re.S).group(1))
    assert config["flag_bits"] == FLAG_BITS
    con = open_store(path)
    try:
        grid = load_grid(con, "r")
    finally:
        con.close()
    html = render_animation(grid)
    data = json.loads(re.search(
        r'<script type="application/json" id="gradstream-data">(.*?)</script>', html,
        re.S).group(1))
    assert data["flag_bits"] == FLAG_BITS


def test_worker_and_store_options_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from consumer.store_writer_settings import StoreWriterSettings
    from deploy.cli.consume import WorkerOptions

    settings = WorkerOptions(ignore_layers=["*.key.bias", "x"],
                             exclude_rounding_level=True).settings()
    assert settings.ignore_layers == ["*.key.bias", "x"] and settings.exclude_rounding_level
    default = WorkerOptions().settings()
    assert default.ignore_layers == [] and not default.exclude_rounding_level
    monkeypatch.setenv("GRADSTREAM_IGNORE_LAYERS", "*.key.bias, y")
    monkeypatch.setenv("GRADSTREAM_EXCLUDE_ROUNDING_LEVEL", "true")
    from_env = WorkerOptions().settings()
    assert from_env.ignore_layers == ["*.key.bias", "y"] and from_env.exclude_rounding_level
    assert StoreWriterSettings().ignore_layers == ["*.key.bias", "y"]
