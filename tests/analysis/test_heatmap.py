"""ascii_heatmap: reference layout, glyphs, absent layers, NaN/Inf cells, legend,
downsampling, ordering."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from rich.cells import cell_len

from analysis.heatmap import BLOCKS, EMPTY, LEGEND, NONFINITE_GLYPH, TITLE, ascii_heatmap, glyph
from analysis.read.connect import StoreError, open_store
from tests.analysis.crafted import NASTY_NAMES, Stat, StoreBuilder, healthy_stat

MODEL = ["z_embed", "m_block", "a_head"]


def draw(path: Path, run: str = "r", **kw: object) -> str:
    con = open_store(path)
    try:
        return ascii_heatmap(con, run, **kw)  # type: ignore[arg-type]
    finally:
        con.close()


def cells(line: str, width: int) -> str:
    """The glyph part of a layer row (after the right-aligned name and two spaces)."""
    return line[len(line) - width :]


@pytest.mark.parametrize(
    ("intensity", "expected"),
    [
        (0.0, " "),
        (0.12, " "),
        (0.125, "░"),
        (0.25, "░"),
        (0.375, "▒"),
        (0.5, "▒"),
        (0.625, "▓"),
        (0.75, "▓"),
        (0.875, "█"),
        (1.0, "█"),
        (3.0, "█"),
        (-1.0, " "),
        (math.nan, " "),
    ],
)
def test_glyph_rounding(intensity: float, expected: str) -> None:
    assert glyph(intensity) == expected


def test_empty_run(tmp_path: Path) -> None:
    path = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL).write()
    assert draw(path) == "(no gradient frames recorded)\n" == EMPTY


def test_unknown_run_and_bad_arguments(tmp_path: Path) -> None:
    path = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL).write()
    with pytest.raises(StoreError, match="unknown run"):
        draw(path, run="other")
    with pytest.raises(ValueError, match="max_columns"):
        draw(path, max_columns=0)
    with pytest.raises(ValueError, match="order"):
        draw(path, order="hash")


def test_shape_glyphs_and_absent_layers(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL)
    # norms 4, 2, 1 -> intensities 1, 0.5, 0.25 -> '█', '▒', '░'
    builder.add_frame(
        "r", 0, {"z_embed": healthy_stat(4), "m_block": healthy_stat(2), "a_head": healthy_stat(1)}
    )
    builder.add_frame("r", 5, {"z_embed": healthy_stat(1)})  # others absent -> ' '
    builder.add_frame("r", 9, {n: healthy_stat(0) for n in MODEL})  # max norm 0 -> all 0
    text = draw(builder.write())
    lines = text.splitlines()
    assert text.endswith("\n")
    assert lines[0] == TITLE
    assert lines[1].endswith("layer  012")
    assert set(lines[2]) == {"─"} and len(lines[2]) == len(lines[1])
    rows = lines[3:-1]
    assert lines[-1] == LEGEND
    assert [r.strip().split("  ")[0] for r in rows] == MODEL  # model order by default
    assert [cells(r, 3) for r in rows] == ["██ ", "▒  ", "░  "]
    assert all(len(r) == len(lines[1]) for r in rows)
    assert "each column" not in text


def test_name_order(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL)
    builder.add_frame("r", 0, {n: healthy_stat() for n in MODEL})
    rows = draw(builder.write(), order="name").splitlines()[3:-1]
    assert [r.strip().split("  ")[0] for r in rows] == sorted(MODEL)


def test_downsampling_is_visible_and_averages(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["steady", "pulse"])
    for step in range(250):
        # pulse has intensity 1 every third step, 0 otherwise; absent at step 249
        stats = {"steady": healthy_stat(1.0)}
        if step != 249:
            stats["pulse"] = healthy_stat(1.0 if step % 3 == 0 else 0.0)
        builder.add_frame("r", step, stats)
    path = builder.write()

    full = draw(path, max_columns=250)
    assert "each column" not in full
    assert cells(full.splitlines()[4], 250)[:6] == "█  █  "

    text = draw(path, max_columns=100)
    lines = text.splitlines()
    assert lines[0] == TITLE
    assert lines[1].startswith("each column = 3 steps (mean)")
    n_cols = math.ceil(250 / 3)  # 84
    assert lines[2].endswith("layer  " + "".join(str(i % 10) for i in range(n_cols)))
    steady, pulse = lines[4], lines[5]
    assert cells(steady, n_cols) == "█" * n_cols
    # bucket mean 1/3 -> round(4/3) = 1 -> '░'; the last bucket is step 249 alone, absent -> ' '
    assert cells(pulse, n_cols) == "░" * (n_cols - 1) + " "
    assert all(len(line) <= len("steady  ") + 100 for line in lines[4:6])
    assert lines[6:] == [LEGEND]


def test_step_range(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["a"])
    builder.add_steps("r", range(50), {"a": healthy_stat()})
    text = draw(builder.write(), from_step=10, to_step=19)
    assert text.splitlines()[1].endswith("layer  0123456789")


def test_nasty_names_stay_on_one_aligned_line(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", NASTY_NAMES)
    builder.add_frame("r", 0, {n: Stat(norm=1.0) for n in NASTY_NAMES})
    lines = draw(builder.write()).splitlines()
    assert len(lines) == 3 + len(NASTY_NAMES) + 1
    rows = lines[3:-1]
    width = cell_len(lines[1])
    assert all(cell_len(line) == width for line in rows)
    assert any("multi\\nline" in line for line in lines)
    assert any(line.strip().startswith('""') for line in rows)
    assert all(line.endswith(BLOCKS[-1]) for line in rows)
    assert lines[-1] == LEGEND


def test_nonfinite_cells_are_marked_apart_from_zero_gradients(tmp_path: Path) -> None:
    """A layer that is all NaN at some steps (its finite sums are empty: norm 0) and a
    layer whose gradient is exactly zero have the same intensity 0; only the NaN cells
    get the NaN/Inf glyph, and the legend names both."""
    names = ["dense", "nan_layer", "zero_layer"]
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", names)
    all_nan = Stat(mean=0.0, max=0.0, norm=0.0, nonfinite=100)
    zero = Stat(mean=0.0, max=0.0, norm=0.0)
    for step in range(6):
        builder.add_frame("r", step, {
            "dense": healthy_stat(1.0),
            "nan_layer": all_nan if step in (2, 3) else healthy_stat(0.5),
            "zero_layer": zero,
        })
    path = builder.write()

    lines = draw(path).splitlines()
    dense, nan_layer, zero_layer = (cells(line, 6) for line in lines[3:6])
    assert dense == "█" * 6
    assert nan_layer == "▒▒" + NONFINITE_GLYPH * 2 + "▒▒"
    assert zero_layer == " " * 6
    assert lines[-1] == LEGEND
    assert f"{NONFINITE_GLYPH} NaN/Inf" in LEGEND and "blank ~ 0" in LEGEND
    assert cell_len(LEGEND) <= 80  # one line in an 80-column terminal
    assert NONFINITE_GLYPH not in BLOCKS and cell_len(NONFINITE_GLYPH) == 1

    # Downsampled: a column is marked when any of its frames had NaN/Inf.
    lines = draw(path, max_columns=3).splitlines()
    assert lines[1].startswith("each column = 2 steps (mean)")
    assert [cells(line, 3) for line in lines[4:7]] == [
        "███", "▒" + NONFINITE_GLYPH + "▒", "   "
    ]


def test_partially_nonfinite_layer_and_infinite_norm_are_marked(tmp_path: Path) -> None:
    """A layer with a few NaN elements beside finite ones (full intensity) and a stored
    infinite norm (a sum of squares that overflowed) are both marked, not drawn as flow."""
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", ["a", "b"])
    builder.add_frame("r", 0, {"a": Stat(norm=2.0, nonfinite=1), "b": healthy_stat(1.0)})
    builder.add_frame("r", 1, {"a": healthy_stat(1.0), "b": healthy_stat(1.0)})
    path = builder.write()
    con = open_store(path, read_only=False)
    try:
        con.execute("UPDATE layer_stats SET grad_norm = 'inf'::DOUBLE WHERE step = 1 "
                    "AND layer_index = 1")
    finally:
        con.close()
    rows = draw(path).splitlines()[3:5]
    assert [cells(r, 2) for r in rows] == [NONFINITE_GLYPH + "█", "▒" + NONFINITE_GLYPH]
