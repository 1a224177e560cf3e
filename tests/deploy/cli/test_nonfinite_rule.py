"""``--nonfinite-rule critical|reference`` (and ``GRADSTREAM_NONFINITE_RULE``): the report,
the reference presentation styles, the worker's restored health and the settings, on stores
written by the real sink; and what happens to rows whose NaN/Inf split is unknown (a
producer before wire schema 1.7, a store written before it): a clear refusal, never a
guess."""

from __future__ import annotations

import json
import math
from pathlib import Path

import duckdb
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from analysis.read.connect import StoreError, open_store
from analysis.report import build_report
from consumer.frames import MergedShards, compute_frame
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from consumer.runbook import RunBook
from deploy.cli.reports import register
from schemas.stats import GradientSums
from schemas.wire import GradientHealth, RunStarted

NAMES = ["ok", "has_nan", "has_inf"]
NAN, INF = math.nan, math.inf
GRADS = [  # per step, per layer: NaN at step 0 in has_nan, Inf at step 2 in has_inf
    [[1.0, 2.0], [NAN, 2.0], [1.0, 0.5]],
    [[1.0, 2.0], [1.0, 0.5], [1.0, 0.5]],
    [[1.0, 2.0], [1.0, 0.5], [INF, 1.0]],
    [[1.0, 2.0], [1.0, 0.5], [1.0, 0.5]],
]


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def write_store(path: Path, known_split: bool = True, run_id: str = "r") -> Path:
    """The run of :data:`GRADS` written by the real sink; ``known_split=False`` drops the
    NaN counts, as a producer before schema 1.7 sends them (none)."""
    batch = Batch(runs_started=[RunStarted(
        run_id=run_id, world_size=1, layer_names=NAMES, numel=[2, 2, 2], start_time=1.0)])
    for step, layers in enumerate(GRADS):
        sums = GradientSums.from_layers([np.array(g) for g in layers])
        if not known_split:
            cols = sums.to_columns()
            sums = GradientSums.from_columns(cols["numel"], cols["sum_abs"], cols["sum_sq"],
                                             cols["max_abs"], cols["nonfinite"])
        frame = compute_frame(run_id, step, MergedShards(sums), vanishing_threshold=1e-7,
                              exploding_threshold=1e3, ranks_seen=(0,), world_size=1,
                              wall_time=1.7e9 + step)
        batch.frames[(run_id, step)] = (frame, "Critical")
    sink = DuckDBSink(path, write_behind=False)
    sink.write(batch, "g")
    sink.close()
    return path


def test_stored_nan_counts_and_the_report_under_each_rule(tmp_path: Path) -> None:
    path = write_store(tmp_path / "s.duckdb")
    con = open_store(path)
    try:
        rows = con.execute("SELECT step, layer_index, nonfinite, nan FROM layer_stats "
                           "WHERE nonfinite > 0 ORDER BY step").fetchall()
        default = build_report(con, "r")
        reference = build_report(con, "r", nonfinite_rule="reference")
        with pytest.raises(ValueError, match="nonfinite_rule must be one of"):
            build_report(con, "r", nonfinite_rule="lenient")
    finally:
        con.close()
    assert rows == [(0, 1, 1, 1), (2, 2, 1, 0)]  # (step, layer, nonfinite, nan)
    assert default.overall_health is GradientHealth.CRITICAL
    assert (default.issue_frames, default.layers_with_exploding_grads) == (2, [])
    # the reference: the NaN is no issue, the Inf is exploding; 1 issue frame of 4
    assert reference.overall_health is GradientHealth.PROBLEMS_DETECTED
    assert reference.layers_with_exploding_grads == ["has_inf"]
    assert reference.issue_frames == 1 and reference.nonfinite_rule == "reference"
    assert reference.layers_with_nonfinite_grads == ["has_nan", "has_inf"]  # still facts


def test_cli_flag_and_environment(app: typer.Typer, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_store(tmp_path / "s.duckdb")
    runner = CliRunner()

    def report(*args: str) -> dict[str, object]:
        result = runner.invoke(app, ["report", "--db", str(path), "--format", "json", *args],
                               catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    assert report()["overall_health"] == "Critical"
    assert report("--nonfinite-rule", "reference")["overall_health"] == "ProblemsDetected"
    monkeypatch.setenv("GRADSTREAM_NONFINITE_RULE", "reference")
    assert report()["nonfinite_rule"] == "reference"
    assert report("--nonfinite-rule", "critical")["overall_health"] == "Critical"
    monkeypatch.setenv("GRADSTREAM_NONFINITE_RULE", "strict")
    result = runner.invoke(app, ["report", "--db", str(path)])
    assert result.exit_code == 2 and "GRADSTREAM_NONFINITE_RULE='strict'" in result.output


def test_reference_export_shows_the_reference_values(app: typer.Typer, tmp_path: Path) -> None:
    path = write_store(tmp_path / "s.duckdb")
    out = tmp_path / "r.csv"
    result = CliRunner().invoke(app, ["export", "--db", str(path), "--style", "reference",
                                      "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = out.read_text().splitlines()
    # step 0: has_nan's mean and norm NaN, its max the finite 2 (f64::max ignores NaN)
    assert lines[1] == "0,has_inf,7.50000000e-1,1.00000000e0,1.11803399e0,0,0"
    assert lines[2] == "0,has_nan,NaN,2.00000000e0,NaN,0,0"
    assert lines[7] == "2,has_inf,inf,inf,inf,0,1"


def test_unknown_split_is_refused_by_the_reference_options(app: typer.Typer,
                                                            tmp_path: Path) -> None:
    """NaN counts NULL (an older producer): the reference's options refuse the range with
    an error naming the first row; gradstream's own presentation still works; a range
    without those rows works under the reference options too."""
    path = write_store(tmp_path / "s.duckdb", known_split=False)
    con = open_store(path)
    try:
        # unknown where a layer held NaN/Inf; a finite layer has no NaN, known
        assert con.execute("SELECT count(*) FILTER (WHERE nan IS NULL), "
                           "count(*) FILTER (WHERE nonfinite > 0) FROM layer_stats"
                           ).fetchone() == (2, 2)
        with pytest.raises(StoreError, match=r"NaN count is unknown \(first: step 0, "
                                             r"layer 'has_nan'\)"):
            build_report(con, "r", nonfinite_rule="reference")
        assert build_report(con, "r").overall_health is GradientHealth.CRITICAL
        only_finite = build_report(con, "r", from_step=3, nonfinite_rule="reference")
        assert only_finite.overall_health is GradientHealth.HEALTHY
    finally:
        con.close()
    runner = CliRunner()
    for args in (["report", "--nonfinite-rule", "reference"],
                 ["export", "--style", "reference", "-o", str(tmp_path / "x.csv")],
                 ["report", "--heatmap", "--heatmap-style", "reference"]):
        result = runner.invoke(app, [*args, "--db", str(path)])
        assert result.exit_code != 0 and "wire schema 1.7" in result.output, result.output


def test_store_written_before_the_nan_column(tmp_path: Path) -> None:
    """A store whose ``layer_stats`` has no ``nan`` column (written before schema 1.7):
    the reference rule refuses a non-finite range, gradstream's rule reports; the sink adds
    the column when it opens the store again."""
    path = write_store(tmp_path / "s.duckdb")
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE layer_stats DROP COLUMN nan")
    con.close()
    con = open_store(path)
    try:
        with pytest.raises(StoreError, match=r"wire schema 1\.7"):
            build_report(con, "r", nonfinite_rule="reference")
        assert build_report(con, "r").overall_health is GradientHealth.CRITICAL
    finally:
        con.close()
    DuckDBSink(path, write_behind=False).close()
    con = duckdb.connect(str(path), read_only=True)
    assert con.execute("SELECT count(*) FROM layer_stats WHERE nan IS NULL").fetchone() == (12,)
    con.close()


def test_worker_restart_restores_the_reference_health(tmp_path: Path) -> None:
    """The worker's tracker rebuilt from the store (``RunBook.restore``,
    ``DuckDBSink.load_flags``) under each rule equals the report's verdict."""
    path = write_store(tmp_path / "s.duckdb")
    write_store(path, known_split=False, run_id="old")
    sink = DuckDBSink(path, write_behind=False)
    try:
        health = {}
        for rule in ("critical", "reference"):
            book = RunBook(0, nonfinite_rule=rule)  # type: ignore[arg-type]
            book.restore(sink)
            health[rule] = (book.trackers["r"].health, book.trackers["old"].health)
    finally:
        sink.close()
    assert health["critical"] == (GradientHealth.CRITICAL, GradientHealth.CRITICAL)
    # the split unknown in run "old": the reference rule keeps Critical there
    assert health["reference"] == (GradientHealth.PROBLEMS_DETECTED, GradientHealth.CRITICAL)


def test_worker_and_store_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from consumer.settings import ConsumerSettings
    from consumer.store_writer_settings import StoreWriterSettings
    from deploy.cli.consume import WorkerOptions
    from deploy.cli.options import NonfiniteVerdictChoice

    assert WorkerOptions().settings().nonfinite_rule == "critical"
    given = WorkerOptions(nonfinite_rule=NonfiniteVerdictChoice.REFERENCE).settings()
    assert given.nonfinite_rule == "reference"
    monkeypatch.setenv("GRADSTREAM_NONFINITE_RULE", "reference")
    assert WorkerOptions().settings().nonfinite_rule == "reference"
    assert StoreWriterSettings().nonfinite_rule == "reference"
    monkeypatch.setenv("GRADSTREAM_NONFINITE_RULE", "lenient")
    with pytest.raises(ValueError, match="critical"):
        ConsumerSettings()
