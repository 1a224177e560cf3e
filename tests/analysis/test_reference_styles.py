"""The reference styles of the ASCII heatmap and the CSV and JSON exports reproduce the reference
implementation's output (``tests/conformance/reference.py``) byte for byte, from the same
frames: name order, one column per frame (no ``max_columns`` buckets), raw names, its width
rule, no legend (the CLI options: ``tests/deploy/cli/test_reference_styles.py``)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.export import export_csv, export_json, export_run, json_float_sql
from analysis.heatmap import NONFINITE_GLYPH, ascii_heatmap
from analysis.read.connect import open_store
from analysis.report import build_report
from tests.analysis.crafted import NASTY_NAMES, Stat, StoreBuilder
from tests.conformance.reference import (
    GradientFlowAnimator,
    GradientFrame,
    LayerGradientInfo,
    rust_json_float,
)

MODEL = ["z_embed", "m_block", "a_head", "head ünï"]


def build(tmp_path: Path, names: list[str], steps: int) -> tuple[Path, GradientFlowAnimator]:
    """A store and the reference animator holding the same frames (norms vary per step)."""
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", names)
    animator = GradientFlowAnimator(0)
    for step in range(steps):
        stats = {n: Stat(mean=1e-9 if i == 1 else 0.01, max=2e3 if step % 7 == 3 else 1.0,
                         norm=float((step * 7 + i * 3) % 9))
                 for i, n in enumerate(names)}
        builder.add_frame("r", step, stats)
        top = max(s.norm for s in stats.values())
        animator.frames.append(GradientFrame(step, tuple(sorted((
            LayerGradientInfo(n, s.mean, s.max, s.norm, s.mean < 1e-7, s.max > 1e3,
                              min(max(s.norm / top, 0.0), 1.0) if top > 0 else 0.0)
            for n, s in stats.items()), key=lambda ly: ly.name))))
    return builder.write(), animator


@pytest.mark.parametrize(("names", "steps"), [(MODEL, 5), (MODEL, 150), (["x"], 1),
                                              (NASTY_NAMES, 4)])
def test_heatmap_reference_style_is_the_references(tmp_path: Path, names: list[str],
                                                    steps: int) -> None:
    path, animator = build(tmp_path, names, steps)
    con = open_store(path)
    try:
        text = ascii_heatmap(con, "r", max_columns=10, order="model", style="reference")
        assert text == animator.to_ascii_animation()
        assert ascii_heatmap(con, "r", style="gradstream") != text  # legend, layout
    finally:
        con.close()


def test_csv_reference_style_is_the_references(tmp_path: Path) -> None:
    path, animator = build(tmp_path, MODEL + NASTY_NAMES, 6)
    con = open_store(path)
    try:
        out = tmp_path / "ref.csv"
        rows = export_csv(con, "r", out, order="model", style="reference")
        assert out.read_bytes() == animator.export_csv().encode("utf-8")
        assert rows == 6 * len(MODEL + NASTY_NAMES)
        quoted = tmp_path / "quoted.csv"
        export_csv(con, "r", quoted)
        assert quoted.read_bytes() != out.read_bytes()  # "encoder.layer,0" quoted
        with pytest.raises(ValueError, match="style"):
            export_csv(con, "r", out, style="rust")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="csv and json formats only"):
            export_run(con, "r", tmp_path / "x.parquet", "parquet", style="reference")
        with pytest.raises(ValueError, match="style"):
            ascii_heatmap(con, "r", style="rust")  # type: ignore[arg-type]
    finally:
        con.close()


@pytest.mark.parametrize("steps", [0, 1, 7])
def test_json_reference_style_is_the_references(tmp_path: Path, steps: int) -> None:
    path, animator = build(tmp_path, MODEL + NASTY_NAMES + ["ctl\x01\x1f\x7f", "\\u001F"],
                           steps)
    con = open_store(path)
    try:
        out = tmp_path / "ref.json"
        frames = export_json(con, "r", out, order="model", style="reference")
        assert frames == steps
        assert out.read_bytes() == animator.export_json().encode("utf-8")
        assert export_run(con, "r", out, "json", style="reference") == steps
        assert out.read_bytes() == animator.export_json().encode("utf-8")
    finally:
        con.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=40))
def test_json_float_text_is_serde_jsons(values: list[float]) -> None:
    con = duckdb.connect()
    got = con.execute(f"SELECT {json_float_sql('x')} FROM (SELECT unnest($1::DOUBLE[]) AS x)",
                      [values]).fetchall()
    assert [g for (g,) in got] == [rust_json_float(v) for v in values]


def test_nan_intensity_draws_blank_in_reference_style(tmp_path: Path) -> None:
    """The reference casts a NaN intensity (inf / inf) to glyph 0; gradstream's own style
    marks the cell with its NaN/Inf glyph."""
    path, _ = build(tmp_path, ["a", "b"], 1)
    con = duckdb.connect(str(path))
    con.execute("UPDATE layer_stats SET flow_intensity = 'NaN'::DOUBLE, "
                "grad_norm = 'inf'::DOUBLE WHERE layer_index = 0")
    con.close()
    con = open_store(path)
    try:
        assert ascii_heatmap(con, "r", style="reference").splitlines()[3] == "a   "
        assert ascii_heatmap(con, "r").splitlines()[3].endswith(f"a  {NONFINITE_GLYPH}")
    finally:
        con.close()


def test_report_order_name_lists_layers_as_the_reference(tmp_path: Path) -> None:
    """``build_report(order="name")`` sorts the flagged-layer lists by name (the reference's
    ``summary_report`` order), the default keeps model order; the names quoted in the
    recommendations follow."""
    path, animator = build(tmp_path, ["z_embed", "m_block", "a_head", "b_mid"], 8)
    want = animator.summary_report()
    con = open_store(path)
    try:
        by_model = build_report(con, "r")
        by_name = build_report(con, "r", order="name")
        with pytest.raises(ValueError, match="order"):
            build_report(con, "r", order="hash")
    finally:
        con.close()
    assert by_name.layers_with_exploding_grads == want.layers_with_exploding_grads
    assert by_name.layers_with_vanishing_grads == want.layers_with_vanishing_grads == ["m_block"]
    assert by_model.layers_with_exploding_grads == ["z_embed", "m_block", "a_head", "b_mid"]
    assert want.layers_with_exploding_grads == ["a_head", "b_mid", "m_block", "z_embed"]
    line = next(r for r in by_name.recommendations if r.startswith("Exploding"))
    assert line.index("a_head") < line.index("b_mid") < line.index("z_embed")
