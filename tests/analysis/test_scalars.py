"""The report's training-scalars section (:mod:`analysis.scalars`) on a crafted run in a real
DuckDB store, against the same figures computed here with NumPy from the values written;
its rows in the terminal and Jupyter renderings; and its absence without scalars (a run
without, an older store without the tables)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from analysis.notebook import Store
from analysis.notebook_html import report_html
from analysis.report import GradientFlowSummary, build_report, render_report
from tests.analysis import scalar_run as sr
from tests.analysis.crafted import drop_scalar_tables, open_read, write_history


def expected(lo: int, hi: int) -> dict[str, object]:
    """The section's fields over steps ``lo..hi``, from the written values."""
    steps = list(range(lo, hi + 1))
    loss = np.array([sr.step_values(s)["loss"] for s in steps])
    finite = np.isfinite(loss)
    fin_steps = [s for s, ok in zip(steps, finite, strict=True) if ok]
    low = float(loss[finite].min())
    bad = [s for s, ok in zip(steps, finite, strict=True) if not ok]
    scales = [sr.loss_scale(s) for s in steps if sr.loss_scale(s) is not None]
    step_times = [sr.step_values(s)["step_time_s"] for s in steps if s]
    computes = [sr.step_values(s)["compute_time_s"] for s in steps]
    per_rank = {r: float(np.median([sr.compute_time(s, r) for s in steps]))
                for r in range(sr.WORLD)}
    slowest = max(per_rank, key=lambda r: (per_rank[r], -r))
    others = float(np.median([m for r, m in per_rank.items() if r != slowest]))
    bad_ranks = ([r for r in range(sr.WORLD) if not math.isfinite(sr.rank_loss(bad[0], r))]
                 if bad else [])
    return {
        "steps": len(steps),
        "loss_steps": len(steps),
        "first_loss": float(loss[steps.index(fin_steps[0])]), "first_loss_step": fin_steps[0],
        "last_loss": float(loss[steps.index(fin_steps[-1])]), "last_loss_step": fin_steps[-1],
        "min_loss": low,
        "min_loss_step": min(s for s in fin_steps if loss[steps.index(s)] == low),
        "nonfinite_loss_steps": len(bad),
        "first_nonfinite_loss_step": bad[0] if bad else None,
        "first_nonfinite_loss_ranks": bad_ranks,
        "loss_scale_decreases": int(np.sum(np.diff(scales) < 0)),
        "last_loss_scale": scales[-1] if scales else None,
        "median_step_time_s": float(np.median(step_times)) if step_times else None,
        "median_compute_time_s": float(np.median(computes)),
        "ranks_timed": sr.WORLD,
        "slowest_rank": slowest,
        "slowest_rank_compute_time_s": per_rank[slowest],
        "other_ranks_compute_time_s": others,
        "slowest_rank_ratio": per_rank[slowest] / others,
    }


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("scalars") / "store.duckdb"
    sr.write_scalar_run(path)
    write_history(path, np.ones((2, 5)), run_id="plain")  # frames, no scalars
    return path


@pytest.mark.parametrize("bounds", [(None, None), (0, 24), (10, 39), (26, 29), (31, 39)])
def test_section_equals_the_direct_computation(store_path: Path, bounds) -> None:  # type: ignore[no-untyped-def]
    con = open_read(store_path)
    try:
        summary = build_report(con, "r", *bounds)
    finally:
        con.close()
    lo, hi = bounds[0] or 0, sr.STEPS - 1 if bounds[1] is None else bounds[1]
    want = expected(lo, hi)
    training = summary.training
    assert training is not None
    got = training.model_dump()
    for key, value in want.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-12), key
        else:
            assert got[key] == value, key
    names = {"loss", "lr", "tokens", "compute_time_s", "step_time_s"}
    assert names <= set(training.names) and training.names == sorted(training.names)
    assert ("eval:ppl" in training.names) == any(s % 10 == 0 for s in range(lo, hi + 1))


def test_the_full_run_names_its_findings(store_path: Path) -> None:
    """The scenario's own facts, so the direct computation above cannot agree by mistake."""
    con = open_read(store_path)
    try:
        training = build_report(con, "r").training
    finally:
        con.close()
    assert training is not None
    assert (training.nonfinite_loss_steps, training.first_nonfinite_loss_step) == (2, sr.NAN_STEP)
    assert training.first_nonfinite_loss_ranks == [sr.NAN_RANK]
    assert training.loss_scale_decreases == 2  # 65536 -> 32768 at 10, 65536 -> 16384 at 30
    assert training.last_loss_scale == 16384.0
    assert training.slowest_rank == sr.SLOW_RANK
    assert training.slowest_rank_ratio == pytest.approx(0.5 / 0.101, rel=1e-12)
    assert training.first_loss_step == 0 and training.last_loss_step == sr.STEPS - 1
    assert training.min_loss_step == sr.STEPS - 1  # the loss falls; step 33's bump is higher


def test_rendered_rows(store_path: Path) -> None:
    con = open_read(store_path)
    try:
        summary = build_report(con, "r")
    finally:
        con.close()
    console = Console(width=200, record=True)
    console.print(render_report(summary))
    text = console.export_text()
    assert "first 3.01 (step 0)" in text and "NaN/Inf at 2 steps, first at step 25 (rank 2)" in text
    assert "2 decreases (overflow backoffs), last 16384" in text
    assert "slowest rank 1: median compute 0.5 s against 0.101 s on the other ranks (4.95x)" in text
    html = report_html(summary)
    assert "<th style=\"text-align:left;padding-right:1em\">loss scale</th>" in html
    assert "(rank 2)" in html


def test_the_section_travels_through_the_reader(store_path: Path) -> None:
    """The notebook's report (a reader's read, the route's builder) carries the same section,
    and its JSON round trip keeps it."""
    report = Store(store_path).run("r").report()
    con = open_read(store_path)
    try:
        direct = build_report(con, "r")
    finally:
        con.close()
    assert report.training == direct.training
    again = GradientFlowSummary.model_validate_json(report.model_dump_json())
    assert again.training == direct.training


def test_no_scalars_no_section(store_path: Path, tmp_path: Path) -> None:
    con = open_read(store_path)
    try:
        assert build_report(con, "plain").training is None
        assert build_report(con, "r", 100, 200).training is None  # no step in the range
    finally:
        con.close()
    old = sr.write_scalar_run(tmp_path / "old.duckdb")
    drop_scalar_tables(old)
    con = open_read(old)
    try:
        summary = build_report(con, "r")
    finally:
        con.close()
    assert summary.training is None and summary.frames == sr.STEPS
    console = Console(width=200, record=True)
    console.print(render_report(summary))
    assert "loss scale" not in console.export_text()
