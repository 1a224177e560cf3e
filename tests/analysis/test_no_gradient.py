"""The report's no-gradient-by-construction layers and non-finite issue frames, on real
store files with crafted frames; the report agrees with the consumer's tracker."""

from __future__ import annotations

import io
from pathlib import Path

import duckdb
import numpy as np
import pytest
from rich.console import Console

from analysis.report import GradientFlowSummary, build_report, render_report
from analysis.store import open_store
from consumer.health import RunHealthTracker
from schemas.wire import GradientHealth as H
from tests.analysis import Stat, StoreBuilder, healthy_stat

NAMES = ["embed", "attn.key.weight", "attn.key.bias", "head"]
KEY_BIAS = 2


def report_of(path: Path, **kw: int | None) -> GradientFlowSummary:
    con = open_store(path)
    try:
        return build_report(con, "r", **kw)
    finally:
        con.close()


def text_of(summary: GradientFlowSummary) -> str:
    out = io.StringIO()
    Console(file=out, width=160, color_system=None).print(render_report(summary))
    return out.getvalue()


def write(tmp_path: Path, means: np.ndarray, nonfinite: np.ndarray | None = None,
          dtypes: list[str | None] | None = None) -> Path:
    """A run with ``means[t, l]`` (mean |g|; NaN = no row) and optional NaN/Inf counts."""
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", NAMES)
    for t, row in enumerate(means):
        stats = {}
        for i, m in enumerate(row):
            if np.isnan(m):
                continue
            bad = 0 if nonfinite is None else int(nonfinite[t, i])
            stats[NAMES[i]] = Stat(mean=m, max=max(m, 1e-30), norm=m * 10, nonfinite=bad)
        builder.add_frame("r", t, stats)
    path = builder.write()
    if dtypes is not None:
        con = duckdb.connect(str(path))
        con.executemany("UPDATE layers SET dtype = ? WHERE layer_index = ?",
                        [(d, i) for i, d in enumerate(dtypes)])
        con.close()
    return path


def bert_like(steps: int, seed: int = 0) -> np.ndarray:
    """Mean |g| per step: embed 3e-4, key weight 1e-7 (small, a real gradient), key bias at
    rounding level (2e-14 .. 3e-13, as measured on a config-built BERT), head 1e-2."""
    rng = np.random.default_rng(seed)
    means = np.empty((steps, 4))
    means[:, 0] = rng.uniform(3e-4, 5e-4, steps)
    means[:, 1] = rng.uniform(1e-7, 2.5e-7, steps)
    means[:, KEY_BIAS] = rng.uniform(2e-14, 3e-13, steps)
    means[:, 3] = rng.uniform(1e-2, 4e-1, steps)
    return means


def test_layer_at_rounding_level_from_step_0_is_listed_apart_and_run_is_healthy(tmp_path):
    path = write(tmp_path, bert_like(20))
    con = duckdb.connect(str(path), read_only=True)
    (flags,) = con.execute("SELECT count(*) FROM layer_stats WHERE is_vanishing").fetchone()
    con.close()
    assert flags == 20  # the stored threshold flag is unchanged
    summary = report_of(path)
    assert summary.layers_without_gradient == ["attn.key.bias"]
    assert summary.no_gradient_since_step == 0
    assert summary.layers_with_vanishing_grads == []
    assert (summary.issue_frames, summary.overall_health) == (0, H.HEALTHY)
    assert summary.recommendations == ["Gradient flow looks healthy; nothing to do."]
    assert "no gradient   by construction since step 0: attn.key.bias" in text_of(summary)


def test_layer_that_had_a_gradient_and_lost_it_is_still_vanishing(tmp_path):
    means = bert_like(20)
    means[:5, KEY_BIAS] = 1e-3
    summary = report_of(write(tmp_path, means))
    assert summary.layers_without_gradient == [] and summary.no_gradient_since_step is None
    assert summary.layers_with_vanishing_grads == ["attn.key.bias"]
    assert summary.issue_frames == 15 and summary.overall_health is H.PROBLEMS_DETECTED
    assert "no gradient" not in text_of(summary)


def test_zero_then_a_gradient_counts_from_then_on_and_ranges_see_the_run(tmp_path):
    """Exactly zero for steps 0-4 (e.g. feeding a zero-initialised layer), a gradient from
    step 5, lost from step 12: its vanishing rows count from 12 on. A range is judged from
    the run's first frame."""
    means = bert_like(20)
    means[:, KEY_BIAS] = np.r_[np.zeros(5), np.full(7, 1e-3), np.full(8, 1e-13)]
    path = write(tmp_path, means)
    whole = report_of(path)
    assert whole.layers_without_gradient == []
    assert whole.layers_with_vanishing_grads == ["attn.key.bias"] and whole.issue_frames == 8
    early = report_of(path, to_step=4)
    assert early.layers_without_gradient == ["attn.key.bias"]
    assert (early.issue_frames, early.overall_health) == (0, H.HEALTHY)
    middle = report_of(path, from_step=3, to_step=13)
    assert middle.layers_without_gradient == [] and middle.issue_frames == 2
    late = report_of(path, from_step=12)
    assert late.layers_with_vanishing_grads == ["attn.key.bias"]
    assert late.frames == late.issue_frames == 8


def test_dtype_from_the_layers_table(tmp_path):
    """Mean |g| 5e-8 beside 1e-2 (5e-6 of the top, below a gap of 2e5): rounding level in
    bfloat16 (u = 2^-8), a vanishing gradient in float32 or an unknown dtype."""
    means = np.tile([1e-2, 3e-3, 5e-8, 2e-2], (10, 1))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert report_of(write(tmp_path / "a", means)).layers_with_vanishing_grads == \
        ["attn.key.bias"]
    bf16 = report_of(write(tmp_path / "b", means, dtypes=[None, None, "bfloat16", None]))
    assert bf16.layers_without_gradient == ["attn.key.bias"]
    assert bf16.overall_health is H.HEALTHY


def test_store_without_dtype_column_counts_float32(tmp_path):
    path = write(tmp_path, bert_like(6))
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE layers DROP COLUMN dtype")  # a store written before schema 1.3
    con.close()
    assert report_of(path).layers_without_gradient == ["attn.key.bias"]


def test_nonfinite_frames_are_issue_frames(tmp_path):
    """The last 39 of 60 frames hold NaN in one layer: 39 issue frames (65 %), not 0."""
    means = np.tile([1e-2, 3e-3, 1e-3, 2e-2], (60, 1))
    nonfinite = np.zeros((60, 4), np.int64)
    nonfinite[21:, 3] = 5
    summary = report_of(write(tmp_path, means, nonfinite))
    assert (summary.frames, summary.issue_frames) == (60, 39)
    assert summary.issue_ratio == pytest.approx(0.65)
    assert summary.overall_health is H.CRITICAL and summary.first_nonfinite_step == 21
    assert "issue frames  39 (65.0% of frames)" in text_of(summary)


@pytest.mark.parametrize("seed", range(6))
def test_report_agrees_with_the_consumer_tracker(tmp_path, seed):
    """Random runs mixing zero-by-construction, lost, tiny and NaN layers: the report's
    health, issue frames and vanishing / no-gradient layers equal the tracker's."""
    rng = np.random.default_rng(seed)
    steps = 15
    means = bert_like(steps, seed)
    means[:, 0] = np.where(rng.random(steps) < 0.3, 10.0 ** rng.uniform(-15, -8, steps),
                           means[:, 0])
    lost = int(rng.integers(0, steps))
    means[lost:, 1] = 10.0 ** rng.uniform(-14, -12, steps - lost)
    nonfinite = np.where(rng.random((steps, 4)) < 0.05, 1, 0)
    summary = report_of(write(tmp_path, means, nonfinite))
    tracker = RunHealthTracker(4)
    for t in range(steps):
        idx = np.arange(4)
        van = means[t] < 1e-7  # the flag StoreBuilder stores
        tracker.update(t, idx, van, np.zeros(4, bool), nonfinite[t], means[t])
    assert summary.overall_health is tracker.health
    assert summary.issue_frames == tracker.issue_frames
    assert summary.layers_with_vanishing_grads == \
        [NAMES[i] for i in np.flatnonzero(tracker.vanishing_frames)]
    assert summary.layers_without_gradient == [NAMES[i] for i in np.flatnonzero(
        tracker.no_gradient)]


def test_a_healthy_run_has_no_such_layer(tmp_path):
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", NAMES)
    builder.add_steps("r", range(5), {n: healthy_stat() for n in NAMES})
    summary = report_of(builder.write())
    assert summary.layers_without_gradient == [] and summary.overall_health is H.HEALTHY
