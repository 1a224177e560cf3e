"""The report's no-gradient-by-construction layers and non-finite issue frames, on real
store files with crafted frames; the report agrees with the consumer's tracker."""

from __future__ import annotations

import io
from pathlib import Path

import duckdb
import numpy as np
import pytest
from rich.console import Console

from analysis.read.connect import open_store
from analysis.report import GradientFlowSummary, build_report, render_report
from consumer.health_tracker import RunHealthTracker
from schemas.wire import GradientHealth as H
from tests.analysis.crafted import Stat, StoreBuilder, healthy_stat

NAMES = ["embed", "attn.key.weight", "attn.key.bias", "head"]
KEY_BIAS = 2


def report_of(path: Path, **kw: object) -> GradientFlowSummary:
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


def set_run_ignore_layers(path: Path, patterns: list[str]) -> None:
    """Record ``patterns`` as the run's own ignore_layers (as RunStarted 1.5 does)."""
    con = duckdb.connect(str(path))
    con.execute("UPDATE runs SET ignore_layers = ? WHERE run_id = 'r'", [patterns])
    con.close()


def test_layer_at_rounding_level_from_step_0_is_a_finding_and_still_vanishing(tmp_path):
    """The reference rule: a layer below the vanishing threshold in every frame makes every
    frame an issue frame (ratio 1.0 > 0.3: ProblemsDetected), whatever its magnitude. Its
    rounding level is a finding beside the verdict, never a silent exclusion."""
    path = write(tmp_path, bert_like(20))
    con = duckdb.connect(str(path), read_only=True)
    (flags,) = con.execute("SELECT count(*) FROM layer_stats WHERE is_vanishing").fetchone()
    con.close()
    assert flags == 20  # the stored threshold flag is unchanged
    summary = report_of(path)
    assert summary.layers_without_gradient == ["attn.key.bias"]
    assert summary.no_gradient_since_step == 0
    assert summary.layers_with_vanishing_grads == ["attn.key.bias"]
    assert (summary.issue_frames, summary.overall_health) == (20, H.PROBLEMS_DETECTED)
    assert summary.layers_excluded == [] and not summary.excluded_rounding_level
    assert len(summary.findings) == 1
    assert summary.findings[0].startswith(
        "gradient at rounding level since step 0: attn.key.bias; likely zero by "
        "construction, e.g. a softmax attention key bias (they count as vanishing, as in "
        "the reference")
    text = text_of(summary)
    assert "no gradient   at rounding level since step 0: attn.key.bias" in text
    assert "Findings" in text and "likely zero by construction" in text
    assert "Vanishing gradients in attn.key.bias" in text
    assert "finding" in summary.model_dump_json()


def test_exclude_rounding_level_is_an_explicit_visible_option(tmp_path):
    """The old behaviour, asked for: the layer leaves the verdict and the report says so."""
    summary = report_of(write(tmp_path, bert_like(20)), exclude_rounding=True)
    assert summary.layers_with_vanishing_grads == []
    assert (summary.issue_frames, summary.overall_health) == (0, H.HEALTHY)
    assert summary.excluded_rounding_level
    assert "left out of the verdict" in summary.findings[0]
    assert "(excluded: exclude layers at rounding level)" in text_of(summary)


@pytest.mark.parametrize("where", ["run", "report"])
def test_ignore_layers_excludes_by_name_and_the_report_names_them(tmp_path, where):
    """Patterns of the run (runs.ignore_layers) or of the report: the matched layers'
    vanishing flags count nowhere, the run is Healthy, and the report names what it left
    out; the rounding-level finding stays."""
    path = write(tmp_path, bert_like(20))
    kw: dict[str, object] = {}
    if where == "run":
        set_run_ignore_layers(path, ["*.key.bias"])
    else:
        kw["ignore_layers"] = ("*.key.bias",)
    summary = report_of(path, **kw)
    assert summary.ignore_layers == ["*.key.bias"]
    assert summary.layers_excluded == ["attn.key.bias"]
    assert summary.layers_with_vanishing_grads == []
    assert (summary.issue_frames, summary.overall_health) == (0, H.HEALTHY)
    assert summary.layers_without_gradient == ["attn.key.bias"]
    label = {"run": "by run setting", "report": "by this report's --ignore-layers"}[where]
    other = {"run": "by this report's", "report": "by run setting"}[where]
    assert summary.findings[0].endswith(
        {"run": "(excluded by the run setting ignore_layers).",
         "report": "(excluded by this report's --ignore-layers)."}[where])
    assert (summary.run_ignore_layers, summary.report_ignore_layers) == (
        (["*.key.bias"], []) if where == "run" else ([], ["*.key.bias"]))
    text = text_of(summary)
    assert f"excluded      {label} '*.key.bias': attn.key.bias" in text
    assert other not in text


def test_run_and_report_patterns_are_labelled_apart(tmp_path):
    """Both settings at once: each "excluded" row names its own patterns and layers; a
    report pattern the run already has is the run's."""
    path = write(tmp_path, bert_like(20))
    set_run_ignore_layers(path, ["*.key.bias"])
    summary = report_of(path, ignore_layers=("*.key.bias", "attn.key.weight"))
    assert summary.ignore_layers == ["*.key.bias", "attn.key.weight"]
    assert (summary.run_ignore_layers, summary.report_ignore_layers) == (
        ["*.key.bias"], ["attn.key.weight"])
    assert summary.layers_excluded_by_run == ["attn.key.bias"]
    assert summary.layers_excluded_by_report == ["attn.key.weight"]
    text = text_of(summary)
    assert "excluded      by run setting '*.key.bias': attn.key.bias" in text
    assert "excluded      by this report's --ignore-layers 'attn.key.weight': " \
        "attn.key.weight" in text


def test_ignore_layers_never_hides_nonfinite_gradients(tmp_path):
    means = np.tile([1e-2, 3e-3, 1e-3, 2e-2], (10, 1))
    nonfinite = np.zeros((10, 4), np.int64)
    nonfinite[4, 3] = 1
    summary = report_of(write(tmp_path, means, nonfinite), ignore_layers=("head",))
    assert summary.layers_excluded == ["head"]
    assert summary.layers_with_nonfinite_grads == ["head"]
    assert summary.overall_health is H.CRITICAL and summary.issue_frames == 1


def test_float64_run_without_dtypes_keeps_a_tiny_layer_vanishing(tmp_path):
    """A float64 run that declares no dtypes (float32 assumed) with one layer at mean |g| =
    2e-9 in every step, 4e-9 of the largest: it looks like float32 rounding, and is listed
    as a finding, but the verdict is the reference's: ProblemsDetected, layer listed."""
    means = np.tile([3e-3, 1e-3, 2e-9, 0.5], (12, 1))
    summary = report_of(write(tmp_path, means))
    assert summary.layers_with_vanishing_grads == ["attn.key.bias"]
    assert (summary.frames, summary.issue_frames) == (12, 12)
    assert summary.overall_health is H.PROBLEMS_DETECTED
    assert summary.layers_without_gradient == ["attn.key.bias"]


def test_layer_that_had_a_gradient_and_lost_it_is_still_vanishing(tmp_path):
    means = bert_like(20)
    means[:5, KEY_BIAS] = 1e-3
    path = write(tmp_path, means)
    summary = report_of(path)
    assert summary.layers_without_gradient == [] and summary.no_gradient_since_step is None
    assert summary.layers_with_vanishing_grads == ["attn.key.bias"]
    assert summary.issue_frames == 15 and summary.overall_health is H.PROBLEMS_DETECTED
    assert "no gradient" not in text_of(summary) and summary.findings == []
    excluded = report_of(path, exclude_rounding=True)
    assert excluded.issue_frames == 15  # a lost gradient is never at rounding level


def test_zero_then_a_gradient_counts_and_ranges_see_the_run(tmp_path):
    """Exactly zero for steps 0-4 (e.g. feeding a zero-initialised layer), a gradient from
    step 5, lost from step 12. By default every vanishing row counts; with
    ``exclude_rounding`` the rows before its first gradient do not. A range is judged from
    the run's first frame."""
    means = bert_like(20)
    means[:, KEY_BIAS] = np.r_[np.zeros(5), np.full(7, 1e-3), np.full(8, 1e-13)]
    path = write(tmp_path, means)
    whole = report_of(path)
    assert whole.layers_without_gradient == []
    assert whole.layers_with_vanishing_grads == ["attn.key.bias"] and whole.issue_frames == 13
    assert report_of(path, exclude_rounding=True).issue_frames == 8
    early = report_of(path, to_step=4)
    assert early.layers_without_gradient == ["attn.key.bias"]
    assert (early.issue_frames, early.overall_health) == (5, H.PROBLEMS_DETECTED)
    early_excluded = report_of(path, to_step=4, exclude_rounding=True)
    assert (early_excluded.issue_frames, early_excluded.overall_health) == (0, H.HEALTHY)
    middle = report_of(path, from_step=3, to_step=13)
    assert middle.layers_without_gradient == [] and middle.issue_frames == 4
    assert report_of(path, from_step=3, to_step=13, exclude_rounding=True).issue_frames == 2
    late = report_of(path, from_step=12)
    assert late.layers_with_vanishing_grads == ["attn.key.bias"]
    assert late.frames == late.issue_frames == 8


def test_dtype_from_the_layers_table(tmp_path):
    """Mean |g| 5e-8 beside 1e-2 (5e-6 of the top, below a gap of 2e5): rounding level in
    bfloat16 (u = 2^-8), a vanishing gradient in float32 or an unknown dtype. Either way it
    is vanishing; only bfloat16 adds the finding."""
    means = np.tile([1e-2, 3e-3, 5e-8, 2e-2], (10, 1))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    f32 = report_of(write(tmp_path / "a", means))
    assert f32.layers_with_vanishing_grads == ["attn.key.bias"]
    assert f32.layers_without_gradient == []
    path = write(tmp_path / "b", means, dtypes=[None, None, "bfloat16", None])
    bf16 = report_of(path)
    assert bf16.layers_without_gradient == ["attn.key.bias"]
    assert bf16.overall_health is H.PROBLEMS_DETECTED
    assert report_of(path, exclude_rounding=True).overall_health is H.HEALTHY


def test_store_without_dtype_column_counts_float32(tmp_path):
    path = write(tmp_path, bert_like(6))
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE layers DROP COLUMN dtype")  # an older store, without dtypes
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


@pytest.mark.parametrize("exclude_rounding", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_report_agrees_with_the_consumer_tracker(tmp_path, seed, exclude_rounding):
    """Random runs mixing zero-by-construction, lost, tiny and NaN layers, with one layer
    excluded by name: the report's health, issue frames and vanishing / no-gradient layers
    equal the tracker's, by default and with ``exclude_rounding``."""
    rng = np.random.default_rng(seed)
    steps = 15
    means = bert_like(steps, seed)
    means[:, 0] = np.where(rng.random(steps) < 0.3, 10.0 ** rng.uniform(-15, -8, steps),
                           means[:, 0])
    lost = int(rng.integers(0, steps))
    means[lost:, 1] = 10.0 ** rng.uniform(-14, -12, steps - lost)
    nonfinite = np.where(rng.random((steps, 4)) < 0.05, 1, 0)
    ignore = ("embed",) if seed % 2 else ()
    summary = report_of(write(tmp_path, means, nonfinite), ignore_layers=ignore,
                        exclude_rounding=exclude_rounding)
    tracker = RunHealthTracker(4, excluded=np.array([bool(ignore), False, False, False]),
                               exclude_rounding=exclude_rounding)
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


def test_notebook_html_shows_the_finding_and_the_exclusion(tmp_path):
    from analysis.notebook_html import report_html

    path = write(tmp_path, bert_like(5))
    page = report_html(report_of(path, ignore_layers=("attn.key.*",)))
    assert "<strong>Findings</strong>" in page and "likely zero by construction" in page
    assert "excluded" in page and \
        "by this report&#x27;s --ignore-layers &#x27;attn.key.*&#x27;: " in page
    assert "<code>attn.key.weight</code>, <code>attn.key.bias</code>" in page
    plain = report_html(report_of(path))
    assert "Findings" in plain and ">excluded<" not in plain


def test_store_without_ignore_layers_column_still_reports(tmp_path):
    """An older store without runs.ignore_layers: the report opens it, applies only its
    own patterns, and the consumer's sink adds the column on open."""
    path = write(tmp_path, bert_like(6))
    con = duckdb.connect(str(path))
    con.execute("ALTER TABLE runs DROP COLUMN ignore_layers")
    con.close()
    summary = report_of(path)
    assert summary.ignore_layers == [] and summary.overall_health is H.PROBLEMS_DETECTED
    assert report_of(path, ignore_layers=("*.bias",)).layers_excluded == ["attn.key.bias"]
    from consumer.outputs.duckdb import DuckDBSink

    sink = DuckDBSink(path, write_behind=False)
    (run,) = sink.load_runs()
    sink.close()
    assert run.ignore_layers == ()
