"""``gradstream plot``'s work: the three picture files of one run (heatmap PNG, norm series
PNG, animation HTML), written to a directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from analysis.plots.animation import write_animation
from analysis.plots.png import plot_heatmap, plot_series
from analysis.plots.scalars import grid_scalar_bins
from analysis.read.connect import StoreError
from schemas.scalars import LOSS

if TYPE_CHECKING:
    from analysis.read.reader import StoreReader


@dataclass(frozen=True)
class PlotFiles:
    """Files written by :func:`write_pictures` and the captions of their grids;
    ``loss_caption``: how the heatmap's loss panel is drawn (``None``: the run has no loss
    in the range, the heatmap is drawn alone)."""

    heatmap: Path
    series: Path
    animation: Path
    heatmap_caption: str
    animation_caption: str
    loss_caption: str | None = None


def write_pictures(
    reader: StoreReader,
    run_id: str,
    out_dir: str | os.PathLike[str],
    stem: str,
    *,
    max_steps: int = 1200,
    max_layers: int = 200,
    max_frames: int = 500,
    width_px: int = 1600,
    from_step: int | None = None,
    to_step: int | None = None,
) -> PlotFiles:
    """Write ``<stem>-heatmap.png`` (with the run's loss above the heatmap, on its step
    columns, when the run has one: :func:`analysis.plots.png.heatmap_figure`),
    ``<stem>-norms.png`` and ``<stem>-animation.html``.

    Args:
        reader: the store's reader (:func:`analysis.read.reader.open_reader`: the file, or the
            endpoint of the process writing it).
        run_id: the run.
        out_dir: directory for the files (created).
        stem: file-name stem (e.g. the run id made file-name safe).
        max_steps: most heatmap / time-series columns; the default is about one column per
            pixel of a 1600 px wide image's plot area, so nothing finer could be seen.
        max_layers: most heatmap rows (bins of consecutive layers beyond).
        max_frames: most animation frames (each frame then covers several steps).
        width_px: width of the PNGs.
        from_step / to_step: inclusive step range.

    Returns:
        The paths and the downsampling captions.

    Raises:
        StoreError: unknown run, invalid range, no frame recorded in the range, or a file
            cannot be written.
        ValueError: a limit < 1.
    """
    grid = reader.grid(run_id, max_steps, max_layers, from_step, to_step).require_frames()
    frames = (
        grid
        if max_frames >= grid.shape[1]
        else reader.grid(run_id, max_frames, max_layers, from_step, to_step)
    )
    scalars = grid_scalar_bins(reader, grid, (LOSS,))
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        return PlotFiles(
            heatmap=plot_heatmap(grid, out / f"{stem}-heatmap.png", width_px=width_px,
                                 scalars=scalars),
            series=plot_series(grid, out / f"{stem}-norms.png", width_px=width_px),
            animation=write_animation(frames, out / f"{stem}-animation.html"),
            heatmap_caption=grid.caption(),
            animation_caption=frames.caption(),
            loss_caption=scalars.caption(LOSS) if LOSS in scalars.series else None,
        )
    except OSError as exc:
        raise StoreError(f"cannot write the pictures in {str(out)!r}: {exc}") from None
