"""matplotlib PNGs of a :class:`~analysis.plots.grid.GradientGrid`.

- :func:`plot_heatmap`: layers (model order, top to bottom) x steps, colour = log10 of the
  gradient L2 norm; vanishing, exploding and non-finite cells marked in colours outside the
  norm scale (hollow squares when cells are large enough to keep the norm colour visible,
  solid cells otherwise); the grid's downsampling caption under the title. Given the run's
  loss binned on the grid's columns (:mod:`analysis.plots.scalars`), the loss curve is drawn
  above the heatmap on the same step axis (shared x), its binning in the title.
- :func:`heatmap_png`: the heatmap's PNG bytes (the notebook's inline picture).
- :func:`plot_series`: one line per row (layer, or bin of layers) of the maximum gradient
  norm over each column's steps, log scale, flagged points marked.

:func:`heatmap_figure` and :func:`series_figure` build the same pictures as
``matplotlib.figure.Figure`` objects (axes and colour bars live, for a notebook to adjust).
Figures are drawn on their own Agg canvas without pyplot, so drawing never changes the
backend or closes a notebook's figures. Layer names are shown literally (``$`` escaped so
no mathtext, control characters escaped).
"""

from __future__ import annotations

import io
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from analysis.plots.colors import FLAG_COLORS, LOSS_COLOR, NORM_CMAP
from analysis.plots.grid import (
    FLAG_EXPLODING,
    FLAG_NO_DATA,
    FLAG_NONFINITE,
    FLAG_VANISHING,
    FLAG_ZERO,
    GradientGrid,
)
from schemas.scalars import LOSS

if TYPE_CHECKING:
    from collections.abc import Iterator

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from analysis.plots.scalars import ScalarBins, ScalarSeries

DPI = 100
"""Pixels per inch of the PNGs (figure sizes are given in pixels)."""

MIN_MARK_PX = 6.0
"""Cells at least this many pixels wide and tall get hollow marks (the norm colour stays
visible inside); smaller cells are filled with the flag colour, which a 1-2 px outline
could not show."""

ROW_PX = 16
"""Height of one heatmap row when there are few rows (8-point labels need ~11 px)."""

LABELED_ROWS = 60
"""Most y tick labels drawn; with more rows, labels are thinned evenly."""

LOSS_PX = 220
"""Height of the loss panel above the heatmap, pixels (added to the figure's height): room
for a curve with five y ticks and the three title lines."""

COLORBAR_WIDTH_RATIO = 0.015
"""Width of the colour bar beside the heatmap under a loss panel, relative to the heatmap's
(24 px of a 1600 px figure, about matplotlib's default bar): the bar gets its own grid
column, so the loss panel and the heatmap keep the same width and step positions."""

_MARK_ORDER = (  # later marks are drawn over earlier ones
    (FLAG_ZERO, "zero"),
    (FLAG_VANISHING, "vanishing"),
    (FLAG_EXPLODING, "exploding"),
    (FLAG_NONFINITE, "nonfinite"),
)


def display_name(name: str) -> str:
    """A layer name as matplotlib text: on one line (control characters escaped as ``repr``
    does), ``""`` for the empty name, ``$`` escaped so it never starts mathtext."""
    if not name:
        return '""'
    shown = name if name.isprintable() else repr(name)[1:-1]
    return shown.replace("$", r"\$")


@contextmanager
def _figure_context() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context({"font.size": 9}), warnings.catch_warnings():
        # Layer names may hold characters the bundled font lacks (CJK, emoji): drawn as boxes.
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        warnings.filterwarnings("ignore", message="Matplotlib currently does not support")
        yield


def _legend_handles(grid: GradientGrid) -> list[object]:
    from matplotlib.patches import Patch

    labels = {
        "vanishing": f"vanishing (mean |g| < {grid.vanishing_threshold:g})",
        "exploding": f"exploding (max |g| > {grid.exploding_threshold:g})",
        "nonfinite": "non-finite (NaN/Inf elements)",
        "zero": "norm = 0",
        "no_data": "no data",
    }
    present = {
        "vanishing": FLAG_VANISHING, "exploding": FLAG_EXPLODING, "nonfinite": FLAG_NONFINITE,
        "zero": FLAG_ZERO, "no_data": FLAG_NO_DATA,
    }
    return [
        Patch(facecolor=FLAG_COLORS[key], edgecolor="black", linewidth=0.5, label=text)
        for key, text in labels.items()
        if key in ("vanishing", "exploding") or (grid.flags & present[key]).any()
    ]


def _step_axis(ax: Axes, grid: GradientGrid) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    first = grid.col_first_step

    def label(x: float, _pos: int) -> str:
        col = round(x)
        return str(int(first[col])) if 0 <= col < len(first) else ""

    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.set_xlabel("optimiser step" + (" (first step of each column)" if grid.steps_per_col > 1
                                      else ""))


def _title(ax: Axes, text: str, grid: GradientGrid) -> None:
    ax.set_title(f"{text}\n{grid.caption()}", fontsize=10, loc="left")


def _new_figure(width_px: int, height_px: int) -> tuple[Figure, Axes]:
    """A pyplot-free figure of ``width_px x height_px`` pixels on an Agg canvas, one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _check_drawable(grid: GradientGrid) -> None:
    rows, cols = grid.shape
    if cols == 0 or rows == 0:
        raise ValueError(f"run {grid.run_id!r} has no gradient frame to draw")


def heatmap_figure(grid: GradientGrid, width_px: int = 1600,
                   height_px: int | None = None, scalars: ScalarBins | None = None,
                   scalar: str = LOSS) -> Figure:
    """The layers x steps heatmap of log10 gradient norm as a matplotlib ``Figure``, with the
    run's loss above it when given.

    Args:
        grid: from :func:`analysis.plots.grid.load_grid`.
        width_px: figure width in pixels at :data:`DPI`.
        height_px: height of the heatmap part; default ``240 + ROW_PX x rows``, at most
            2400 (plus :data:`LOSS_PX` with a loss panel).
        scalars: the run's step scalars on ``grid``'s columns
            (:func:`analysis.plots.scalars.grid_scalar_bins`). When they hold ``scalar``,
            a panel above the heatmap draws it against the same step columns (shared x
            axis): per column the mean of its finite values (one step per column: the
            step's value), the min..max band when columns bin several steps, and a magenta
            ``*`` on the panel's top edge over columns with a NaN/Inf value; the title
            says how (:meth:`ScalarBins.caption`). Without, the picture is the heatmap
            alone.
        scalar: the step scalar drawn (``loss``: the mean over the ranks of each step).

    Returns:
        The figure (not registered with pyplot; Jupyter shows it as a PNG).

    Raises:
        ValueError: the grid has no column (no frame recorded in the range).
    """
    import matplotlib

    _check_drawable(grid)
    rows, cols = grid.shape
    height_px = height_px or min(2400, 240 + ROW_PX * rows)
    series = None if scalars is None else scalars.series.get(scalar)
    with _figure_context():
        if series is None:
            fig, ax = _new_figure(width_px, height_px)
            top = cax = None
        else:
            fig, (top, ax, cax) = _loss_figure(width_px, height_px)
        log = grid.log_norm()
        finite = log[np.isfinite(log)]
        vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0, 1)
        if vmin == vmax:
            vmin, vmax = vmin - 0.5, vmax + 0.5
        cmap = matplotlib.colormaps[NORM_CMAP].with_extremes(bad=FLAG_COLORS["no_data"])
        # Colours mapped on the R x C cells, then resampled to the pixels ("rgba" stage):
        # with nearest-neighbour sampling the same picture as mapping every pixel, at the
        # cost of the cells rather than of the image.
        image = ax.imshow(np.ma.masked_invalid(log), aspect="auto", interpolation="nearest",
                          interpolation_stage="rgba", cmap=cmap, vmin=vmin, vmax=vmax)
        if cax is None:
            fig.colorbar(image, ax=ax, label="log10 gradient L2 norm", pad=0.01)
        else:
            fig.colorbar(image, cax=cax, label="log10 gradient L2 norm")
        _lay_out(fig)
        box = ax.get_window_extent()
        _mark_cells(ax, grid, box.width / cols, box.height / rows)
        _step_axis(ax, grid)
        ticks = np.unique(np.linspace(0, rows - 1, min(rows, LABELED_ROWS)).round().astype(int))
        ax.set_yticks(ticks, [display_name(grid.row_labels[i]) for i in ticks])
        ax.set_ylabel("layer (model order)" + (
            f", {grid.layers_per_row} per row" if grid.layers_per_row > 1 else ""))
        title = f"Gradient flow of run {display_name(grid.run_id)}"
        if top is None or scalars is None or series is None:
            _title(ax, title, grid)
        else:
            _draw_scalar(top, series, cols, grid.steps_per_col > 1)
            top.set_title(f"{title}\n{grid.caption()}\n{scalars.caption(scalar)}",
                          fontsize=10, loc="left")
            ax.set_xlim(-0.5, cols - 0.5)  # the image's extent, whatever the curve's margins
        fig.legend(handles=_legend_handles(grid), loc="outside lower left", ncol=5,
                   fontsize=8, frameon=False)
        # The final layout now, then no layout engine: saving with one runs a dry draw of
        # every artist first (to lay it out), which resamples the images a second time
        # (0.4 s of a 1600 x 2400 picture); the pixels are the same.
        _lay_out(fig)
        fig.set_layout_engine(None)
    return fig


def _lay_out(fig: Figure) -> None:
    """Place the axes as drawing will (the figure's constrained layout, which measures the
    text), without rendering: the cell size in pixels is known before the marks are chosen,
    and the images (bounded by pixels, yet the slowest artists) are drawn once, on save."""
    engine = fig.get_layout_engine()
    if engine is None:
        fig.canvas.draw()
    else:
        engine.execute(fig)


def _loss_figure(width_px: int, height_px: int) -> tuple[Figure, tuple[Axes, Axes, Axes]]:
    """A pyplot-free figure with the loss panel (:data:`LOSS_PX` high) above the heatmap's
    axes (``height_px`` high), sharing its x axis, and the colour bar's axes beside the
    heatmap in a grid column of its own: ``(figure, (loss, heatmap, colour bar))``, in
    ``figure.axes`` in that order."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_px / DPI, (height_px + LOSS_PX) / DPI), dpi=DPI,
                 layout="constrained")
    FigureCanvasAgg(fig)
    spec = fig.add_gridspec(2, 2, height_ratios=[LOSS_PX, height_px],
                            width_ratios=[1.0, COLORBAR_WIDTH_RATIO])
    loss = fig.add_subplot(spec[0, 0])
    heat = fig.add_subplot(spec[1, 0], sharex=loss)
    return fig, (loss, heat, fig.add_subplot(spec[1, 1]))


def _draw_scalar(ax: Axes, series: ScalarSeries, n_columns: int, binned: bool) -> None:
    """Draw ``series`` on ``ax`` against the heatmap's column positions (0..C-1): the
    columns' means as a line (broken where a column has no finite value), the min..max
    band when ``binned``, and non-finite columns as magenta ``*`` on the top edge."""
    x = np.arange(n_columns, dtype=np.float64)
    mean, low, high = series.dense(n_columns)
    if binned:
        ax.fill_between(x, low, high, color=LOSS_COLOR, alpha=0.2, linewidth=0,
                        label="min..max of the column")
    ax.plot(x, mean, color=LOSS_COLOR, linewidth=1.2, marker=".", markersize=3,
            label=series.name)
    bad = series.col[series.nonfinite > 0]
    if len(bad):
        ax.scatter(bad, np.ones(len(bad)), marker="*", s=40, zorder=3, clip_on=False,
                   color=FLAG_COLORS["nonfinite"], transform=ax.get_xaxis_transform(),
                   label=f"NaN/Inf {series.name}")
    ax.set_ylabel(series.name)
    ax.grid(True, which="major", alpha=0.3)
    ax.tick_params(labelbottom=False)
    ax.legend(fontsize=8, loc="best")


def plot_heatmap(
    grid: GradientGrid,
    path: str | os.PathLike[str],
    width_px: int = 1600,
    height_px: int | None = None,
    scalars: ScalarBins | None = None,
) -> Path:
    """Draw :func:`heatmap_figure` to a PNG.

    Args:
        grid: from :func:`analysis.plots.grid.load_grid`.
        path: the PNG to write (parent directories are created).
        width_px / height_px: image size in pixels (see :func:`heatmap_figure`).
        scalars: the run's step scalars on ``grid``'s columns: the loss panel above the
            heatmap when they hold a loss (see :func:`heatmap_figure`).

    Returns:
        The written path.

    Raises:
        ValueError: the grid has no column (no frame recorded in the range).
        OSError: the file cannot be written.
    """
    return _save(heatmap_figure(grid, width_px, height_px, scalars), path)


def heatmap_png(grid: GradientGrid, width_px: int = 1600,
                scalars: ScalarBins | None = None) -> bytes:
    """The bytes of the PNG of :func:`heatmap_figure` (drawn without pyplot, so a
    notebook's backend and figures are left alone), with the loss panel when ``scalars``
    hold a loss.

    Raises:
        StoreError: the grid has no frame (:meth:`GradientGrid.require_frames`).
    """
    buffer = io.BytesIO()
    with _figure_context():
        heatmap_figure(grid.require_frames(), width_px, scalars=scalars).savefig(
            buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    target = _prepare(path)
    with _figure_context():
        fig.savefig(target, dpi=DPI)
    return target


def _mark_cells(ax: Axes, grid: GradientGrid, cell_w: float, cell_h: float) -> None:
    """Mark flagged cells: hollow squares on large cells, solid colour on small ones.

    A cell whose norm is 0 has no colour on the log scale: it is always filled (black)."""
    from matplotlib.colors import to_rgba

    hollow = min(cell_w, cell_h) >= MIN_MARK_PX
    overlay = np.zeros((*grid.shape, 4), dtype=np.uint8)  # 8-bit RGBA: resampled fastest
    for bit, key in _MARK_ORDER:
        if bit == FLAG_ZERO or not hollow:
            overlay[(grid.flags & bit) > 0] = np.round(np.multiply(to_rgba(FLAG_COLORS[key]),
                                                                   255))
    if overlay[..., 3].any():  # nothing to fill: no second image to draw
        ax.imshow(overlay, aspect="auto", interpolation="nearest")
    if not hollow:
        return
    side_pt = 0.8 * min(cell_w, cell_h) * 72 / DPI
    for bit, key in _MARK_ORDER:
        if bit == FLAG_ZERO:
            continue
        r, c = np.nonzero(grid.flags & bit)
        if len(r):
            ax.scatter(c, r, marker="s", s=side_pt**2, facecolors="none",
                       edgecolors=FLAG_COLORS[key], linewidths=max(1.0, side_pt / 8))


def series_figure(grid: GradientGrid, width_px: int = 1600, height_px: int = 800) -> Figure:
    """Each row's maximum gradient norm per column against the step, log scale, as a
    matplotlib ``Figure``.

    Up to 10 rows get a legend with their names (``tab10`` colours); more rows are coloured
    by model depth (``plasma``, with a colour bar of the layer index). Flagged points are
    marked (exploding: red x, vanishing: blue v). Steps with non-finite gradient elements
    in any row get a magenta * on the top edge (their norm, over finite elements only, may
    be 0 or meaningless). Norms of 0 cannot be drawn on a log axis and are left out.

    Args:
        grid: from :func:`analysis.plots.grid.load_grid`.
        width_px / height_px: figure size in pixels at :data:`DPI`.

    Returns:
        The figure (not registered with pyplot).

    Raises:
        ValueError: the grid has no column.
    """
    import matplotlib

    _check_drawable(grid)
    rows = grid.shape[0]
    with _figure_context():
        fig, ax = _new_figure(width_px, height_px)
        x = grid.col_first_step.astype(np.float64)
        y = np.where(grid.max_norm > 0, grid.max_norm, np.nan)
        few = rows <= 10
        cmap = matplotlib.colormaps["tab10" if few else "plasma"]
        colors = cmap(np.arange(rows) if few else np.linspace(0, 1, rows))
        for r in range(rows):
            ax.plot(x, y[r], color=colors[r], linewidth=1.0,
                    label=display_name(grid.row_labels[r]) if few else None)
        marks = ((FLAG_VANISHING, "vanishing", "v"), (FLAG_EXPLODING, "exploding", "x"))
        for bit, key, marker in marks:
            r, c = np.nonzero((grid.flags & bit) > 0)
            ok = np.isfinite(y[r, c])
            if ok.any():
                ax.scatter(x[c[ok]], y[r[ok], c[ok]], marker=marker, s=30, zorder=3,
                           color=FLAG_COLORS[key], label=key)
        bad_cols = np.flatnonzero(((grid.flags & FLAG_NONFINITE) > 0).any(axis=0))
        if len(bad_cols):
            ax.scatter(x[bad_cols], np.ones(len(bad_cols)), marker="*", s=40, zorder=3,
                       color=FLAG_COLORS["nonfinite"], clip_on=False,
                       transform=ax.get_xaxis_transform(),
                       label="non-finite elements (any layer)")
        ax.set_yscale("log")
        span = max(float(x[-1] - x[0]), 1.0)  # all steps, also those without a norm
        ax.set_xlim(x[0] - 0.02 * span, x[-1] + 0.02 * span)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("optimiser step" + (" (first step of each point's bin)"
                                          if grid.steps_per_col > 1 else ""))
        ax.set_ylabel("gradient L2 norm" + (" (max over bin)" if grid.downsampled else ""))
        ax.grid(True, which="major", alpha=0.3)
        if few or (grid.flags & (FLAG_VANISHING | FLAG_EXPLODING | FLAG_NONFINITE)).any():
            ax.legend(fontsize=8, loc="best")
        if not few:
            mappable = matplotlib.cm.ScalarMappable(
                norm=matplotlib.colors.Normalize(0, grid.n_layers - 1), cmap=cmap)
            fig.colorbar(mappable, ax=ax, label="layer index (model order)", pad=0.01)
        _title(ax, f"Per-layer gradient norm of run {display_name(grid.run_id)}", grid)
    return fig


def plot_series(
    grid: GradientGrid,
    path: str | os.PathLike[str],
    width_px: int = 1600,
    height_px: int = 800,
) -> Path:
    """Draw :func:`series_figure` to a PNG.

    Args:
        grid: from :func:`analysis.plots.grid.load_grid`.
        path: the PNG to write (parent directories are created).
        width_px / height_px: image size in pixels.

    Returns:
        The written path.

    Raises:
        ValueError: the grid has no column.
        OSError: the file cannot be written.
    """
    return _save(series_figure(grid, width_px, height_px), path)


def _prepare(path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target
