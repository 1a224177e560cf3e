"""ASCII heatmap of flow intensity, layers x steps.

Layout and glyphs follow trustformers-debug's ``gradient_flow`` module
(``to_ascii_animation``); gradstream adds a glyph for cells with NaN/Inf gradient elements
(:data:`NONFINITE_GLYPH`: a layer whose gradient is all NaN has no finite norm, so its
intensity alone would draw it blank like a zero gradient) and a legend line under the grid.

One SQL query aggregates ``layer_stats`` into at most ``max_columns`` buckets of
consecutive frames per layer; NumPy fills the layers x columns grid; Python only joins
characters.

Reference style (``ascii_heatmap(..., style="reference")``, ``gradstream report --heatmap
--heatmap-style reference``) draws exactly what the reference's ``to_ascii_animation`` draws
from the same frames, dropping gradstream's presentation choices: rows by layer name
(code-point order) instead of model order; one column per frame whatever their number (no
``max_columns`` buckets); no NaN/Inf glyph (a non-finite intensity draws as the reference
casts it, blank), and the intensities of a step holding NaN/Inf elements as the reference
computes them (``analysis.nonfinite``; a range holding such a row stored without its NaN
count is refused); no legend line; names printed raw; and the reference's width rule: names
right-aligned to the longest name measured in UTF-8 bytes (the ``layer`` label is not
counted and may stick out), padding counted in characters. The conformance suite
(``tests/conformance``) compares this style with an executable reference byte for byte.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from rich.cells import cell_len

from analysis.nonfinite import has_nan_column, reference_stats_sql, require_nan_split
from analysis.presentation import LAYER_ORDERS, STYLES, LayerOrder, Style, check_choice
from analysis.read.connect import require_run
from analysis.read.sql import STATS_SQL, stats_params, step_buckets

if TYPE_CHECKING:
    import duckdb

BLOCKS: tuple[str, ...] = (" ", "░", "▒", "▓", "█")
"""Intensity glyphs, from 0 (no flow) to 1 (the step's strongest layer)."""

NONFINITE_GLYPH = "!"
"""Glyph of a cell where some frame of the layer had NaN/Inf gradient elements
(``layer_stats.nonfinite > 0``) or a non-finite stored norm or intensity; it replaces the
intensity glyph (the dashboard marks these cells magenta, ``FLAG_COLORS["nonfinite"]``)."""

TITLE = "Gradient Flow Animation (step → right, layer ↓)"
EMPTY = "(no gradient frames recorded)\n"

LEGEND = (
    f"legend: {''.join(BLOCKS[:0:-1])} = norm / step's max ~ 1 .75 .5 .25; "
    f"blank ~ 0 or absent; {NONFINITE_GLYPH} NaN/Inf"
)
"""The line under the grid saying what each glyph means (:data:`BLOCKS`: intensity
rounded to quarters, blank below 1/8 or for a layer absent from the frame;
:data:`NONFINITE_GLYPH`); at most 80 terminal cells."""

_HEATMAP_SQL = f"""
    WITH s AS ({{stats}}),
    {step_buckets("s", "max_columns")}
    SELECT s.layer_index, any_value(s.name) AS name, b.bucket,
           sum(s.flow_intensity) AS intensity_sum,
           coalesce(bool_or(s.nonfinite > 0 OR NOT isfinite(s.grad_norm)
                            OR NOT isfinite(s.flow_intensity)), false) AS nonfinite,
           any_value(b.n_frames) AS n_frames, any_value(b.k) AS k
    FROM s JOIN bucketed AS b USING (step)
    GROUP BY s.layer_index, b.bucket
"""


def glyph(intensity: float) -> str:
    """The block character for one flow intensity.

    ``idx = round(intensity * 4)`` (halves round up, like Rust's ``f64::round`` on
    non-negative values), clamped to 0..4; NaN or negative values give ``' '``.
    """
    return BLOCKS[_indices(np.array([intensity], dtype=np.float64))[0]]


def _indices(intensity: np.ndarray) -> np.ndarray:
    """Glyph indices: ``round(x * 4)`` with halves away from zero (Rust's ``f64::round``;
    ``floor(y + 0.5)`` would round 0.49999999999999994 up), clamped to 0..4, NaN -> 0
    (Rust's saturating ``as usize``)."""
    scaled = np.nan_to_num(intensity, nan=0.0) * (len(BLOCKS) - 1)
    low = np.floor(scaled)
    rounded = np.where(scaled - low >= 0.5, low + 1, low)
    return np.clip(rounded, 0, len(BLOCKS) - 1).astype(np.intp)


def _display(name: str) -> str:
    """A layer name on one terminal line: control characters escaped as in repr(), and
    the empty name shown as ``""``."""
    if not name:
        return '""'
    return name if name.isprintable() else repr(name)[1:-1]


def ascii_heatmap(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    max_columns: int = 100,
    order: LayerOrder = "model",
    *,
    from_step: int | None = None,
    to_step: int | None = None,
    style: Style = "gradstream",
) -> str:
    """Render a run's flow intensity as text: one row per layer, one column per step.

    Layout: a title line, a ruler with the column index modulo
    10, a rule line, then ``name  cells`` per layer with names right-aligned (terminal
    cell width; control characters escaped), then the :data:`LEGEND` line. Cell glyph:
    :func:`glyph` of the layer's ``flow_intensity`` (= grad_norm / max grad_norm within the
    step, in [0, 1]; a zero gradient is blank), or :data:`NONFINITE_GLYPH` when some frame
    of the cell had ``nonfinite > 0`` or a non-finite ``grad_norm`` / ``flow_intensity``
    (NaN/Inf elements are left out of the sums, so a layer that is all NaN has norm 0 and
    would otherwise draw like a zero gradient). A layer absent from a frame counts as
    intensity 0.

    Columns are the recorded frames in step order. With more than ``max_columns`` frames,
    each column covers ``k = ceil(frames / max_columns)`` consecutive frames and shows
    their mean intensity (the last column may cover fewer); a second header line says
    "each column = k steps (mean)".

    Args:
        con: a connection from :func:`analysis.read.connect.open_store`.
        run_id: the run to draw.
        max_columns: most step columns drawn (>= 1).
        order: rows in model order (``layers.layer_index``) or by name (the reference order).
        from_step: first step drawn (inclusive), ``None`` = from the start.
        to_step: last step drawn (inclusive), ``None`` = to the end.
        style: ``"gradstream"`` (the layout above) or ``"reference"``: the reference's
            drawing, exactly (see the module docstring; ``order`` and
            ``max_columns`` are then ignored: name order, one column per frame).

    Returns:
        The heatmap, newline-terminated; ``"(no gradient frames recorded)\\n"`` when the
        run has no frame in the range.

    Raises:
        ValueError: ``max_columns < 1``, an unknown ``order`` or ``style``.
        StoreError: unknown run or invalid step range.
    """
    if max_columns < 1:
        raise ValueError(f"max_columns must be >= 1, got {max_columns}")
    check_choice("order", order, LAYER_ORDERS)
    check_choice("style", style, STYLES)
    reference = style == "reference"
    if reference:  # one column per frame: no bucket can hold two frames
        order, max_columns = "name", _ONE_COLUMN_PER_FRAME
    params = stats_params(run_id, from_step, to_step) | {"max_columns": max_columns}
    require_run(con, run_id)
    stats_sql = STATS_SQL
    if reference:  # the reference's intensities of the steps holding NaN/Inf elements
        require_nan_split(con, stats_params(run_id, from_step, to_step),
                          "heatmap --heatmap-style reference")
        stats_sql = reference_stats_sql(has_nan_column(con))
    cols = con.execute(_HEATMAP_SQL.format(stats=stats_sql), params).fetchnumpy()
    if len(cols["bucket"]) == 0:
        return EMPTY
    layer_index = np.asarray(cols["layer_index"], dtype=np.int64)
    bucket = np.asarray(cols["bucket"], dtype=np.int64)
    sums = np.asarray(cols["intensity_sum"], dtype=np.float64)
    flagged = np.asarray(cols["nonfinite"], dtype=bool)
    n_frames, k = int(cols["n_frames"][0]), int(cols["k"][0])
    names = dict(zip(layer_index.tolist(), cols["name"].tolist(), strict=True))

    indices = sorted(names, key=(lambda i: names[i]) if order == "name" else None)
    row_of = {index: row for row, index in enumerate(indices)}
    n_cols = -(-n_frames // k)
    grid = np.zeros((len(indices), n_cols), dtype=np.float64)
    nonfinite = np.zeros((len(indices), n_cols), dtype=bool)
    rows = [row_of[i] for i in layer_index.tolist()]
    grid[rows, bucket] = sums
    nonfinite[rows, bucket] = flagged
    frames_per_col = np.minimum(k, n_frames - np.arange(n_cols) * k)
    palette = np.array([*BLOCKS, NONFINITE_GLYPH])
    glyphs = np.where(nonfinite, len(BLOCKS), _indices(grid / frames_per_col))

    if reference:
        return _reference_text([names[i] for i in indices], _indices(grid))
    labels = [_display(names[i]) for i in indices]
    width = max(cell_len("layer"), *(cell_len(label) for label in labels))
    lines = [TITLE]
    if k > 1:
        lines.append(f"each column = {k} steps (mean); {n_frames} steps in {n_cols} columns")
    ruler = "".join(str(c % 10) for c in range(n_cols))
    lines.append(" " * (width - cell_len("layer")) + "layer  " + ruler)
    lines.append("─" * (width + 2 + n_cols))
    for label, cells in zip(labels, glyphs, strict=True):
        lines.append(
            " " * (width - cell_len(label)) + label + "  " + "".join(palette[cells])
        )
    lines.append(LEGEND)
    return "\n".join(lines) + "\n"


_ONE_COLUMN_PER_FRAME = 2**62
"""``max_columns`` of the reference style: more columns than a run can have frames."""


def _reference_text(names: list[str], cells: np.ndarray) -> str:
    """The reference's ``to_ascii_animation`` text for rows ``names`` (name order) and
    glyph indices ``cells`` (rows x frames): width = longest name in UTF-8 bytes (8 with no
    name), right-aligned by characters, ``layer`` label not counted."""
    width = max((len(name.encode("utf-8")) for name in names), default=8)

    def right(text: str) -> str:
        return " " * max(0, width - len(text)) + text

    n_frames = cells.shape[1]
    palette = np.array(BLOCKS)
    lines = [TITLE, right("layer") + "  " + "".join(str(c % 10) for c in range(n_frames)),
             "─" * (width + 2 + n_frames)]
    lines.extend(right(name) + "  " + "".join(palette[row]) for name, row in zip(
        names, cells, strict=True))
    return "\n".join(lines) + "\n"
