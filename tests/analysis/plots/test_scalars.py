"""The step scalars binned on the heatmap's columns (:mod:`analysis.plots.scalars`) and the loss
panel above the heatmap (:func:`analysis.plots.png.heatmap_figure`, ``Run.plot``,
``gradstream plot``), on real DuckDB stores."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from analysis.notebook import Store
from analysis.plots.files import write_pictures
from analysis.plots.grid import load_grid
from analysis.plots.png import LOSS_PX, heatmap_figure, heatmap_png
from analysis.plots.scalars import ScalarBins, grid_scalar_bins, load_scalar_bins
from analysis.read.connect import open_store
from analysis.read.reader import open_reader
from deploy.cli.reports import register
from tests.analysis import scalar_run as sr
from tests.analysis.crafted import drop_scalar_tables, write_history, write_scalars


def _bins_by_hand(grid_starts: list[int], grid_stop: int,
                  rows: dict[int, float]) -> dict[int, tuple[int, int, int, int, float]]:
    """column -> (first step, last step, points, non-finite, mean of finite) of ``rows``
    (step -> value), each column covering its first step up to the next column's."""
    out = {}
    for c, start in enumerate(grid_starts):
        stop = grid_starts[c + 1] - 1 if c + 1 < len(grid_starts) else grid_stop
        inside = sorted((s, v) for s, v in rows.items() if start <= s <= stop)
        if inside:
            values = np.array([v for _, v in inside])
            finite = values[np.isfinite(values)]
            out[c] = (inside[0][0], inside[-1][0], len(inside), int((~np.isfinite(values)).sum()),
                      float(finite.mean()) if finite.size else math.nan)
    return out


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_frames=st.integers(1, 40),
    stride=st.integers(1, 4),
    max_steps=st.integers(1, 45),
    seed=st.integers(0, 2**16),
    window=st.sampled_from([(None, None), (5, None), (None, 30), (8, 20)]),
)
def test_bins_follow_the_grid_columns(tmp_path_factory, n_frames, stride, max_steps, seed,
                                      window) -> None:
    """Each column's bin holds the scalar rows of its steps (gaps between frames included),
    both when the SQL makes the columns and when a loaded grid gives them."""
    rng = np.random.default_rng(seed)
    steps = [2 + stride * j for j in range(n_frames)]
    path = write_history(tmp_path_factory.mktemp("b") / "s.duckdb", np.ones((2, n_frames)),
                         steps=steps)
    loss_steps = [s for s in range(steps[-1] + 4) if rng.random() < 0.8]  # some outside
    rows = {s: float(rng.choice([math.nan, math.inf, rng.normal()], p=[0.1, 0.05, 0.85]))
            for s in loss_steps}
    write_scalars(path, "r", [(s, "loss", v) for s, v in rows.items()]
                  + [(s, "lr", 0.1) for s in loss_steps])
    lo, hi = window
    con = open_store(path)
    try:
        grid = load_grid(con, "r", max_steps, from_step=lo, to_step=hi)
        bins = load_scalar_bins(con, "r", max_steps, ("loss",), from_step=lo, to_step=hi)
    finally:
        con.close()
    with open_reader(path) as reader:
        given_grid = grid_scalar_bins(reader, grid, ("loss",))
    assert set(bins.series) <= {"loss"} and set(given_grid.series) == set(bins.series)
    for got in (bins, given_grid):
        assert (got.n_columns, got.steps_per_col, got.n_frames) == (
            grid.shape[1], grid.steps_per_col, grid.n_frames)
    want = _bins_by_hand(grid.col_first_step.tolist(),
                         int(grid.col_last_step[-1]) if grid.shape[1] else -1, rows)
    for got in (bins, given_grid):
        if not want:
            assert "loss" not in got.series
            continue
        s = got.series["loss"]
        assert s.col.tolist() == sorted(want)
        table = [want[c] for c in s.col.tolist()]
        assert s.first_step.tolist() == [w[0] for w in table]
        assert s.last_step.tolist() == [w[1] for w in table]
        assert s.points.tolist() == [w[2] for w in table]
        assert s.nonfinite.tolist() == [w[3] for w in table]
        np.testing.assert_allclose(s.mean, [w[4] for w in table], rtol=1e-12)
        assert np.all((s.low <= s.mean) | np.isnan(s.mean))
        assert np.all((s.mean <= s.high) | np.isnan(s.mean))


@pytest.fixture(scope="module")
def scalar_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("loss-plot") / "store.duckdb"
    sr.write_scalar_run(path)
    write_history(path, np.ones((2, 10)), run_id="plain")
    write_history(path, np.ones((2, 10)), run_id="lr-only")
    write_scalars(path, "lr-only", [(s, "lr", 0.1) for s in range(10)])
    return path


def test_plot_has_the_loss_above_sharing_the_step_axis(scalar_store: Path) -> None:
    run = Store(scalar_store).run("r")
    fig = run.plot()
    loss_ax, heat_ax, bar_ax = fig.axes
    assert loss_ax.get_ylabel() == "loss" and heat_ax.get_ylabel() == "layer (model order)"
    assert bar_ax.get_ylabel() == "log10 gradient L2 norm"
    assert loss_ax.get_shared_x_axes().joined(loss_ax, heat_ax)
    assert loss_ax.get_xlim() == heat_ax.get_xlim() == (-0.5, sr.STEPS - 0.5)
    fig.canvas.draw()
    top, bottom = loss_ax.get_position(), heat_ax.get_position()
    assert (top.x0, top.x1) == pytest.approx((bottom.x0, bottom.x1))  # same step positions
    assert top.y0 > bottom.y1
    line = loss_ax.get_lines()[0]
    want = [sr.step_values(s)["loss"] for s in range(sr.STEPS)]
    want = [v if math.isfinite(v) else math.nan for v in want]
    np.testing.assert_array_equal(line.get_xdata(), np.arange(sr.STEPS))
    np.testing.assert_allclose(line.get_ydata(), want, rtol=1e-12)
    assert "loss: the step's value" in loss_ax.get_title(loc="left")
    assert "NaN/Inf at 2 steps" in loss_ax.get_title(loc="left")
    binned = run.plot(max_steps=8)  # 40 frames -> 8 columns of 5 steps
    title = binned.axes[0].get_title(loc="left")
    assert "each column = max over 5 consecutive recorded steps" in title
    assert "mean of the finite values over each heatmap column's 5 recorded steps" in title
    y = binned.axes[0].get_lines()[0].get_ydata()
    loss = np.array([sr.step_values(s)["loss"] for s in range(sr.STEPS)]).reshape(8, 5)
    finite = np.where(np.isfinite(loss), loss, np.nan)
    np.testing.assert_allclose(y, np.nanmean(finite, axis=1), rtol=1e-12)


def test_no_loss_keeps_the_heatmap_alone(scalar_store: Path) -> None:
    con = open_store(scalar_store)
    try:
        grid = load_grid(con, "lr-only")
    finally:
        con.close()
    with open_reader(scalar_store) as reader:
        bins = grid_scalar_bins(reader, grid, ())
    assert list(bins.series) == ["lr"]
    fig = heatmap_figure(grid, scalars=bins)
    assert [a.get_ylabel() for a in fig.axes] == ["layer (model order)",
                                                  "log10 gradient L2 norm"]
    assert heatmap_png(grid, scalars=bins) == heatmap_png(grid)  # the same picture
    assert len(Store(scalar_store).run("plain").plot().axes) == 2
    empty = ScalarBins("lr-only", grid.shape[1], 1, grid.n_frames, {})
    assert heatmap_png(grid, scalars=empty) == heatmap_png(grid)


def test_older_store_plots_the_heatmap_alone(tmp_path: Path) -> None:
    path = drop_scalar_tables(sr.write_scalar_run(tmp_path / "old.duckdb"))
    assert len(Store(path).run("r").plot().axes) == 2
    con = open_store(path)
    try:
        assert load_scalar_bins(con, "r").series == {}
    finally:
        con.close()


def test_plot_command_draws_the_loss_panel(scalar_store: Path, tmp_path: Path) -> None:
    with open_reader(scalar_store) as reader:
        files = write_pictures(reader, "r", tmp_path / "with", "r", width_px=800)
        plain = write_pictures(reader, "plain", tmp_path / "without", "plain", width_px=800)
    assert files.loss_caption is not None and "loss: the step's value" in files.loss_caption
    assert plain.loss_caption is None
    # the loss panel adds LOSS_PX to the heatmap's own height (240 + 16 per layer row)
    assert mpimg.imread(files.heatmap).shape[0] == 240 + 16 * 2 + LOSS_PX
    assert mpimg.imread(plain.heatmap).shape[0] == 240 + 16 * 2
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["plot", "--db", str(scalar_store), "--run", "r",
                                      "--out", str(tmp_path / "cli"), "--max-steps", "10"])
    assert result.exit_code == 0, result.output
    assert "loss: mean of the finite values over each heatmap column's 4" in result.output
