"""gradstream plot: the SQL grid (downsampling), the PNGs, the offline HTML animation."""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from analysis.plots.animation import render_animation
from analysis.plots.colors import FLAG_COLORS
from analysis.plots.files import write_pictures
from analysis.plots.grid import (
    FLAG_EXPLODING,
    FLAG_NO_DATA,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    load_grid,
    load_layer_series,
)
from analysis.read.connect import StoreError, open_store
from analysis.read.reader import open_reader
from deploy.cli.reports import register
from tests.analysis.crafted import NASTY_NAMES, Stat, StoreBuilder
from tests.chromium import chromium_page, image_stats

NAMES = ["embed", "block.0", "block.1", "norm", "head"]


def reference_columns(steps: list[int], max_steps: int) -> tuple[list[int], int, int]:
    """The grid's columns as ``load_grid``'s documentation states them, one frame at a
    time: (each frame's column, frames per column ``k``, aligned span or 0).

    ``k = ceil(F / max_steps)`` consecutive frames per column; evenly spaced frames
    (stride ``s``) whose columns span 16 steps or more get the smallest span that is a
    multiple of ``lcm(16, s)`` and at least ``k * s`` (or the next multiple) whose
    intervals from multiples of it give at most ``max_steps`` columns."""
    n = len(steps)
    k = -(-n // max_steps)
    s = steps[1] - steps[0] if n > 1 else 1
    if any(b - a != s for a, b in itertools.pairwise(steps)):
        return [j // k for j in range(n)], k, 0
    if k > 1 and k * s >= 16:
        unit = 16 * s // math.gcd(16, s)
        smallest = -(-k * s // unit) * unit
        for span in (smallest, smallest + unit):
            if steps[-1] // span - steps[0] // span + 1 <= max_steps:
                return [x // span - steps[0] // span for x in steps], span // s, span
    return [(x - steps[0]) // (k * s) for x in steps], k, 0


def random_run(path: Path, steps: list[int], seed: int) -> tuple[Path, dict]:
    """A run with random norms and flags; returns the store and the dense truth arrays
    (layers x recorded frames)."""
    rng = np.random.default_rng(seed)
    n, f = len(NAMES), len(steps)
    norm = 10.0 ** rng.uniform(-4, 2, size=(n, f))
    van = rng.random((n, f)) < 0.1
    exp = rng.random((n, f)) < 0.1
    bad = rng.random((n, f)) < 0.05
    present = rng.random((n, f)) < 0.9
    present[0] = True  # every frame has a row
    builder = StoreBuilder(path).add_run("r", NAMES)
    for j, step in enumerate(steps):
        stats = {}
        for i, name in enumerate(NAMES):
            if present[i, j]:
                stats[name] = Stat(mean=1e-9 if van[i, j] else 1e-2,
                                   max=5e3 if exp[i, j] else 1.0, norm=float(norm[i, j]),
                                   nonfinite=int(bad[i, j]))
        builder.add_frame("r", step, stats)
    truth = {"norm": np.where(present, norm, np.nan), "van": van & present,
             "exp": exp & present, "bad": bad & present, "present": present}
    return builder.write(), truth


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_frames=st.integers(1, 60),
    stride=st.integers(1, 7),
    max_steps=st.integers(1, 70),
    max_layers=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_grid_is_the_max_and_any_over_bins(tmp_path_factory, n_frames, stride, max_steps,
                                           max_layers, seed) -> None:
    steps = [3 + stride * j for j in range(n_frames)]  # sparse steps: bins follow frames
    store, truth = random_run(tmp_path_factory.mktemp("g") / "s.duckdb", steps, seed)
    con = open_store(store)
    try:
        grid = load_grid(con, "r", max_steps, max_layers)
    finally:
        con.close()
    frame_cols, k, span = reference_columns(steps, max_steps)
    m = -(-len(NAMES) // max_layers)
    rows, cols = -(-len(NAMES) // m), frame_cols[-1] + 1
    assert grid.shape == (rows, cols) and grid.steps_per_col == k and grid.layers_per_row == m
    assert grid.aligned_span == span
    assert cols <= max_steps and rows <= max_layers
    in_col = np.array(frame_cols)
    for r in range(rows):
        for c in range(cols):
            block = (slice(r * m, (r + 1) * m), in_col == c)
            norms = truth["norm"][block]
            if np.isnan(norms).all():
                assert grid.flags[r, c] & FLAG_NO_DATA and np.isnan(grid.max_norm[r, c])
                continue
            assert grid.max_norm[r, c] == np.nanmax(norms)
            assert bool(grid.flags[r, c] & FLAG_VANISHING) == truth["van"][block].any()
            assert bool(grid.flags[r, c] & FLAG_EXPLODING) == truth["exp"][block].any()
            assert bool(grid.flags[r, c] & FLAG_NONFINITE) == truth["bad"][block].any()
    first = [steps[frame_cols.index(c)] for c in range(cols)]
    last = [steps[len(frame_cols) - 1 - frame_cols[::-1].index(c)] for c in range(cols)]
    assert grid.col_first_step.tolist() == first and grid.col_last_step.tolist() == last
    assert grid.col_frames.tolist() == np.bincount(frame_cols).tolist()
    assert grid.row_labels[0] == (NAMES[0] if m == 1 else f"{NAMES[0]} … {NAMES[m - 1]}")
    caption = grid.caption()
    assert f"{n_frames} recorded step" in caption
    assert ("downsampled" in caption) == (k > 1 or m > 1)
    if k > 1 and span:
        assert (f"each column = max over the recorded steps of a {span}-step interval "
                f"from a multiple of {span} (up to {k};") in caption
    elif k > 1:
        assert f"each column = max over {k} consecutive recorded steps" in caption


def test_layer_series_bins_and_range(tmp_path: Path) -> None:
    steps = list(range(0, 100, 2))
    store, truth = random_run(tmp_path / "s.duckdb", steps, 7)
    con = open_store(store)
    try:
        series = load_layer_series(con, "r", 0, max_points=10, from_step=20, to_step=79)
        with pytest.raises(StoreError, match="no layer index 9"):
            load_layer_series(con, "r", 9)
    finally:
        con.close()
    kept = [j for j, s in enumerate(steps) if 20 <= s <= 79]  # 30 frames -> bins of 3
    assert series.total == 30 and series.steps_per_bin == 3 and len(series.first_step) == 10
    norms = truth["norm"][0, kept].reshape(10, 3)
    assert np.array_equal(series.max_norm, norms.max(axis=1))
    assert np.array_equal(series.min_norm, norms.min(axis=1))
    assert series.first_step.tolist() == [steps[kept[3 * b]] for b in range(10)]
    assert "max (band: min) over 3" in series.caption()


@pytest.fixture
def demo_store(tmp_path: Path) -> Path:
    names = [*NASTY_NAMES, "</script><script>window.pwned = 1</script>"]
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("run/1", names).add_run("empty", names)
    for step in range(400):
        stats = {n: Stat(norm=(i + 1) * (1 + step / 100)) for i, n in enumerate(names)}
        if step % 40 == 0:
            stats[names[0]] = Stat(mean=1e-9, max=1e-8, norm=1e-8)
        if step >= 300:
            stats[names[1]] = Stat(mean=10.0, max=5e3, norm=1e4)
        builder.add_frame("run/1", step, stats)
    return builder.write()


def has_colour(png: Path, hex_colour: str, tolerance: float = 0.02) -> bool:
    pixels = mpimg.imread(png)[..., :3]
    target = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(pixels - target).max(axis=-1) < tolerance).any())


def test_write_pictures_writes_marked_pictures(demo_store: Path, tmp_path: Path) -> None:
    with open_reader(demo_store) as reader:
        files = write_pictures(reader, "run/1", tmp_path / "pics", "run_1", max_steps=100,
                           max_frames=50, width_px=1200)
        with pytest.raises(StoreError, match="no gradient frame"):
            write_pictures(reader, "empty", tmp_path / "pics", "empty")
    assert "each column = max over 4 consecutive recorded steps" in files.heatmap_caption
    assert "each column = max over 8 consecutive recorded steps" in files.animation_caption
    for png in (files.heatmap, files.series):
        image = mpimg.imread(png)
        assert image.shape[1] == 1200
        std, colours = image_stats(png)
        assert std > 0.05 and colours > 50, (png, std, colours)
    # Exploding and vanishing cells are marked in their colours; no non-finite here.
    assert has_colour(files.heatmap, FLAG_COLORS["exploding"])
    assert has_colour(files.heatmap, FLAG_COLORS["vanishing"])
    assert not has_colour(files.heatmap, FLAG_COLORS["nonfinite"])


def test_animation_is_offline_and_plays_in_chromium(demo_store: Path, tmp_path: Path) -> None:
    con = open_store(demo_store)
    try:
        grid = load_grid(con, "run/1", max_steps=80)
    finally:
        con.close()
    html = render_animation(grid)
    # Self-contained: no external script, style, image or font.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html
    assert html.count("</script>") == 3  # the two scripts and the data; names are escaped
    page_file = tmp_path / "anim.html"
    page_file.write_text(html, encoding="utf-8")

    with chromium_page() as page:
        page.route("**/*", lambda route: route.abort()
                   if not route.request.url.startswith("file:") else route.continue_())
        page.goto(page_file.as_uri())
        assert page.evaluate("window.pwned") is None
        assert page.evaluate("window.gradstreamAnimation.frames") == 80
        assert "downsampled" in page.inner_text("#caption")
        assert page.inner_text("#stepLabel").startswith("steps 0–4 (5 recorded)")
        page.fill("#slider", "79")
        page.dispatch_event("#slider", "input")
        assert page.inner_text("#stepLabel").startswith("steps 395–399")
        page.select_option("#speed", "60")
        page.click("#play")  # restarts from the first frame when at the end
        page.wait_for_function("window.gradstreamAnimation.current() >= 10", timeout=10_000)
        page.click("#play")  # pause
        paused = page.evaluate("window.gradstreamAnimation.current()")
        page.wait_for_timeout(300)
        assert page.evaluate("window.gradstreamAnimation.current()") == paused
        shot = tmp_path / "anim.png"
        page.screenshot(path=str(shot), full_page=True)
    std, colours = image_stats(shot)
    assert std > 0.05 and colours > 50, (std, colours)


def test_plot_command(demo_store: Path, tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["plot", "--db", str(demo_store), "--run", "run/1", "--out",
                                 str(out), "--max-steps", "50", "--to-step", "199"])
    assert result.exit_code == 0, result.output
    assert "200 recorded steps" in result.output and "max over 4" in result.output
    assert {p.name for p in out.iterdir()} == {
        "run_1-heatmap.png", "run_1-norms.png", "run_1-animation.html"
    }
    result = runner.invoke(app, ["plot", "--db", str(demo_store), "--run", "nope"])
    assert result.exit_code == 1 and "unknown run 'nope'" in result.output
    result = runner.invoke(app, ["plot", "--db", str(demo_store), "--run", "empty",
                                 "--out", str(out)])
    assert result.exit_code == 1 and "no gradient frame" in result.output


def test_step_columns_examples() -> None:
    import doctest

    import analysis.plots.grid as grid_module

    result = doctest.testmod(grid_module)
    assert result.attempted >= 3 and result.failed == 0


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 10**6), stride=st.integers(1, 40), count=st.integers(1, 5000),
       max_steps=st.integers(1, 1200))
def test_step_columns_fit_and_align(start: int, stride: int, count: int,
                                    max_steps: int) -> None:
    """At most ``max_steps`` columns, each a run of consecutive frames, none empty; aligned
    columns are step intervals of a multiple of 16 steps starting at multiples of it."""
    from analysis.plots.grid import ALIGNED_SPAN, step_columns

    steps = start + stride * np.arange(count, dtype=np.int64)
    columns = step_columns(steps, max_steps)
    frame_cols = columns.frame_cols
    assert frame_cols[0] == 0 and columns.count <= max_steps
    assert set(np.diff(frame_cols).tolist()) <= {0, 1}
    assert np.bincount(frame_cols).max() <= columns.k
    want = reference_columns(steps.tolist(), max_steps) if count <= 200 else None
    if want is not None:
        assert (frame_cols.tolist(), columns.k) == want[:2]
    if columns.aligned:
        assert columns.span % ALIGNED_SPAN == 0 and columns.origin % columns.span == 0
        np.testing.assert_array_equal(frame_cols, (steps - columns.origin) // columns.span)
