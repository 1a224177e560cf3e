"""build_report / render_report over real store files."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from analysis.read.connect import StoreError, open_store
from analysis.report import (
    GradientFlowSummary,
    build_recommendations,
    build_report,
    health_window_text,
    live_health_text,
    local_origin_text,
    render_report,
)
from schemas.wire import GradientHealth
from tests.analysis.crafted import (
    EXPLODING,
    NASTY_NAMES,
    NONFINITE,
    VANISHING,
    Stat,
    StoreBuilder,
    healthy_stat,
)

H = GradientHealth
MODEL = ["z_embed", "m_block.0", "a_head"]  # model order differs from name order


def report_of(path: Path, run: str = "r", **kw: int | None) -> GradientFlowSummary:
    con = open_store(path)
    try:
        return build_report(con, run, **kw)
    finally:
        con.close()


def store_with_issues(
    tmp_path: Path, frames: int, issue_frames: int, bad: Stat, layer: str = "a_head"
) -> Path:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL)
    for step in range(frames):
        stats = {name: healthy_stat() for name in MODEL}
        if step < issue_frames:
            stats[layer] = bad
        builder.add_frame("r", step, stats)
    return builder.write()


@pytest.mark.parametrize(
    ("frames", "issues", "bad", "expected"),
    [
        (10, 0, VANISHING, H.HEALTHY),
        (10, 1, VANISHING, H.MINOR_ISSUES),  # 0.1 exactly; vanishing flag alone suffices
        (10, 3, VANISHING, H.MINOR_ISSUES),  # 0.3 exactly is not above
        (100, 31, VANISHING, H.PROBLEMS_DETECTED),  # just above 0.3
        (10, 4, VANISHING, H.PROBLEMS_DETECTED),
        (10, 10, VANISHING, H.PROBLEMS_DETECTED),  # never Critical without exploding
        (10, 1, EXPLODING, H.PROBLEMS_DETECTED),
        (10, 5, EXPLODING, H.PROBLEMS_DETECTED),  # 0.5 exactly is not above
        (100, 51, EXPLODING, H.CRITICAL),  # just above 0.5
        (10, 1, NONFINITE, H.CRITICAL),  # gradstream's rule
        (100, 1, NONFINITE, H.CRITICAL),
    ],
)
def test_health_from_data(
    tmp_path: Path, frames: int, issues: int, bad: Stat, expected: GradientHealth
) -> None:
    summary = report_of(store_with_issues(tmp_path, frames, issues, bad))
    assert summary.overall_health is expected
    assert summary.frames == frames
    assert summary.issue_frames == issues  # a NaN/Inf frame is an issue frame too
    assert summary.issue_ratio == pytest.approx(issues / frames)


def test_layer_lists_in_model_order(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL)
    # Every layer carries gradient first: in a run's first frame, mean |g| 1e-9 beside an
    # exploding layer's 10 is at float32 rounding level (no gradient by construction).
    builder.add_frame("r", 0, {n: healthy_stat() for n in MODEL})
    builder.add_frame("r", 1, {"z_embed": VANISHING, "m_block.0": EXPLODING, "a_head": VANISHING})
    builder.add_frame("r", 2, {"z_embed": EXPLODING, "m_block.0": NONFINITE, "a_head": NONFINITE})
    summary = report_of(builder.write())
    assert summary.layers_with_vanishing_grads == ["z_embed", "a_head"]
    assert summary.layers_with_exploding_grads == ["z_embed", "m_block.0"]
    assert summary.layers_with_nonfinite_grads == ["m_block.0", "a_head"]
    assert summary.first_nonfinite_step == 2
    assert summary.layers_without_gradient == []
    assert summary.overall_health is H.CRITICAL
    recs = summary.recommendations
    assert "m_block.0, a_head" in recs[0] and "step 2" in recs[0]
    assert "z_embed, a_head" in recs[1]
    assert "z_embed, m_block.0" in recs[3]


def test_total_steps_is_last_step_plus_one_and_range(tmp_path: Path) -> None:
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL, world_size=4)
    for step in (0, 3, 7, 12):
        builder.add_frame("r", step, {n: healthy_stat() for n in MODEL}, complete=step != 7)
    builder.add_frame("r", 20, {"a_head": EXPLODING, "z_embed": healthy_stat()})
    builder.add_frame("r", 25, {"a_head": NONFINITE, "z_embed": VANISHING}, complete=False)
    path = builder.write()

    whole = report_of(path)
    assert whole.total_steps == 26
    assert whole.frames == 6
    assert whole.issue_frames == 2
    assert whole.partial_frames == 2
    assert whole.world_size == 4
    assert whole.num_layers == 3
    assert whole.first_nonfinite_step == 25
    assert whole.overall_health is H.CRITICAL

    early = report_of(path, to_step=12)
    assert (early.total_steps, early.frames, early.issue_frames) == (13, 4, 0)
    assert early.partial_frames == 1
    assert early.overall_health is H.HEALTHY
    assert early.layers_with_exploding_grads == []
    assert early.first_nonfinite_step is None

    middle = report_of(path, from_step=4, to_step=20)
    assert (middle.total_steps, middle.frames, middle.issue_frames) == (21, 3, 1)
    assert middle.layers_with_exploding_grads == ["a_head"]
    assert middle.overall_health is H.PROBLEMS_DETECTED
    assert (middle.from_step, middle.to_step) == (4, 20)

    late = report_of(path, from_step=21)
    assert late.layers_with_vanishing_grads == ["z_embed"]
    assert late.layers_with_nonfinite_grads == ["a_head"]
    assert late.partial_frames == 1

    nothing = report_of(path, from_step=100)
    assert (nothing.total_steps, nothing.frames, nothing.issue_ratio) == (0, 0, 0.0)
    assert nothing.overall_health is H.HEALTHY


def test_empty_run_and_errors(tmp_path: Path) -> None:
    path = StoreBuilder(tmp_path / "s.duckdb").add_run("r", MODEL).write()
    summary = report_of(path)
    assert summary.total_steps == 0 and summary.frames == 0
    assert summary.overall_health is H.HEALTHY
    assert summary.recommendations == ["Gradient flow looks healthy; nothing to do."]
    with pytest.raises(StoreError, match="unknown run 'nope'"):
        report_of(path, run="nope")
    with pytest.raises(StoreError, match="after"):
        report_of(path, from_step=5, to_step=1)


def test_model_round_trips_json(tmp_path: Path) -> None:
    summary = report_of(store_with_issues(tmp_path, 10, 2, EXPLODING))
    again = GradientFlowSummary.model_validate_json(summary.model_dump_json())
    assert again == summary
    assert summary.model_dump(mode="json")["overall_health"] == "ProblemsDetected"


def render(summary: GradientFlowSummary) -> str:
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(render_report(summary))
    return out.getvalue()


def test_render_truncates_and_keeps_names_literal(tmp_path: Path) -> None:
    names = [*NASTY_NAMES, *(f"block.{i}" for i in range(15))]
    builder = StoreBuilder(tmp_path / "s.duckdb").add_run("[red]run[/red]", names)
    builder.add_frame("[red]run[/red]", 0, {n: VANISHING for n in names})
    summary = report_of(builder.write(), run="[red]run[/red]")
    text = render(summary)
    assert "ProblemsDetected" in text  # every frame has an issue: ratio 1 > 0.3
    assert f"... and {len(names) - 10} more" in text
    assert "[bold]markup[/bold]" in text  # not swallowed as markup
    assert "[red]run[/red]" in text
    assert "'multi\\nline'" in text
    assert "Recommendations" in text


def test_render_nonfinite_first_step(tmp_path: Path) -> None:
    text = render(report_of(store_with_issues(tmp_path, 10, 3, NONFINITE)))
    assert "Critical" in text
    assert "first at step 0" in text


def test_first_bad_local_rank_from_the_local_view(tmp_path: Path) -> None:
    """The earliest step at which some rank's local gradient had NaN/Inf or max |g| above
    the run's exploding threshold (1e3), and the ranks bad at that step; one query over
    ``local_layer_stats``, restricted to the step range."""
    import duckdb

    path = store_with_issues(tmp_path, 6, 0, NONFINITE)
    rows = [  # (step, rank, layer_index, max_abs_grad, nonfinite)
        (1, 0, 0, 5.0, 0), (1, 1, 2, 999.0, 0),  # fine: at or below the threshold
        (2, 2, 1, 0.5, 4),  # rank 2's local gradient holds NaN/Inf first
        (3, 0, 0, 2e3, 0), (3, 1, 1, 0.1, 7), (3, 1, 2, 0.1, 7),  # then ranks 0 and 1
        (4, 0, 0, 0.1, 1), (4, 1, 0, 0.1, 1), (4, 2, 0, 0.1, 1),
    ]
    con = duckdb.connect(str(path))
    con.executemany(
        "INSERT INTO local_layer_stats (run_id, step, rank, layer_index, numel, sum_abs, "
        "sum_sq, max_abs_grad, nonfinite) VALUES ('r', ?, ?, ?, 10, 1.0, 1.0, ?, ?)", rows)
    con.close()
    whole = report_of(path)
    assert (whole.first_bad_local_step, whole.first_bad_local_ranks) == (2, [2])
    assert whole.first_bad_local_nonfinite and not whole.first_bad_local_exploding
    assert "NaN/Inf first in rank 2's local gradient at step 2" in render(whole)
    later = report_of(path, from_step=3)
    assert (later.first_bad_local_step, later.first_bad_local_ranks) == (3, [0, 1])
    assert later.first_bad_local_nonfinite and later.first_bad_local_exploding
    assert local_origin_text(later) == (
        "NaN/Inf or max |g| above the exploding threshold first in the local gradients "
        "of ranks 0, 1 at step 3")
    assert report_of(path, to_step=1).first_bad_local_step is None
    assert "started in" not in render(report_of(path, to_step=1))

    con = duckdb.connect(str(path))
    con.execute("DROP TABLE local_layer_stats")  # an older store, without the local view
    con.close()
    old = report_of(path)
    assert old.first_bad_local_step is None and old.first_bad_local_ranks == []


def consumer_store(path: Path, max_frames: int, steps: int, bad_from: int) -> Path:
    """A store written by the consumer's own code (``consumer.runbook.RunBook`` with
    ``LoopSettings.max_frames``, ``consumer.outputs.duckdb.DuckDBSink``), one frame per step, one
    transaction per frame as a worker flushes; from ``bad_from`` on the last layer's max
    |g| is above the exploding threshold (1e3)."""
    import numpy as np

    from consumer.frames import MergedShards, compute_frame
    from consumer.outputs.base import Batch
    from consumer.outputs.duckdb import DuckDBSink
    from consumer.runbook import RunBook
    from schemas.wire import RunStarted

    numel = np.full(len(MODEL), 100, np.int64)
    start = RunStarted(run_id="r", world_size=1, layer_names=MODEL, numel=numel.tolist(),
                       start_time=1.7e9)
    book = RunBook(max_frames)
    book.start(start)
    sink = DuckDBSink(path, write_behind=False)
    try:
        for step in range(steps):
            merged = MergedShards.empty(len(MODEL))
            max_abs = np.array([0.5, 0.5, 5e3 if step >= bad_from else 0.5])
            merged.add(np.arange(len(MODEL)), numel, max_abs * 10, max_abs**2 * 10, max_abs,
                       np.zeros(len(MODEL), np.int64))
            frame = compute_frame("r", step, merged, vanishing_threshold=1e-7,
                                  exploding_threshold=1e3, ranks_seen=(0,), world_size=1,
                                  wall_time=1.7e9 + step)
            batch = Batch(runs_started=[start] if step == 0 else [])
            book.record(frame, batch)
            sink.write(batch, "gradstream-workers")
    finally:
        sink.close()
    return path


def test_health_states_its_window_and_the_consumers_live_window(tmp_path: Path) -> None:
    """``gradstream consume --max-frames 10``: the consumer's stored health covers the last
    10 frames (steps 20..29, all exploding: Critical), the report's the whole run (steps
    0..29, 10 issue frames of 30: ProblemsDetected); both are shown with their windows."""
    summary = report_of(consumer_store(tmp_path / "s.duckdb", max_frames=10, steps=30,
                                       bad_from=20))
    assert (summary.first_step, summary.last_step, summary.frames) == (0, 29, 30)
    assert (summary.issue_frames, summary.overall_health) == (10, H.PROBLEMS_DETECTED)
    assert summary.live_health is not None and summary.live_window_differs
    live = summary.live_health
    assert (live.frames, live.first_step, live.last_step) == (10, 20, 29)
    assert (live.issue_frames, live.health) == (10, H.CRITICAL)
    assert health_window_text(summary) == "steps 0..29, 30 frames"
    assert live_health_text(summary) == (
        "live health over the last 10 frames (steps 20..29): Critical, 10 issue frames")
    text = " ".join(render(summary).split())
    assert "health ProblemsDetected over steps 0..29, 30 frames" in text
    assert "live health over the last 10 frames (steps 20..29): Critical, 10 issue frames" in text
    document = summary.model_dump(mode="json")
    assert document["live_health"] == {"health": "Critical", "frames": 10,
                                       "issue_frames": 10, "first_step": 20, "last_step": 29}
    assert (document["first_step"], document["last_step"]) == (0, 29)
    assert GradientFlowSummary.model_validate_json(summary.model_dump_json()) == summary

    # The report asked for the consumer's window: the same health, no second line.
    same = report_of(tmp_path / "s.duckdb", from_step=20)
    assert (same.overall_health, same.frames, same.live_window_differs) == (H.CRITICAL, 10,
                                                                          False)
    assert live_health_text(same) is None and "live health" not in render(same)
    assert "health Critical over steps 20..29, 10 frames" in " ".join(render(same).split())


def test_whole_run_consumer_health_is_the_reports_window(tmp_path: Path) -> None:
    """Without ``--max-frames`` the consumer's health covers every frame: the same window as
    a whole-run report, shown once; a step range makes them differ."""
    path = consumer_store(tmp_path / "s.duckdb", max_frames=0, steps=12, bad_from=9)
    whole = report_of(path)
    assert whole.live_health is not None and not whole.live_window_differs
    assert whole.live_health.health is whole.overall_health is H.PROBLEMS_DETECTED
    assert (whole.live_health.frames, whole.live_health.first_step) == (12, 0)
    assert "live health" not in render(whole)
    early = report_of(path, to_step=5)
    assert early.overall_health is H.HEALTHY and early.live_window_differs
    assert health_window_text(early) == "steps 0..5, 6 frames"
    assert live_health_text(early) == (
        "live health over the last 12 frames (steps 0..11): ProblemsDetected, 3 issue frames")


def test_store_without_live_health(tmp_path: Path) -> None:
    """A run the consumer has classified no frame of (``runs.frames = 0``) has no live
    health; an empty range states that it has no frames."""
    summary = report_of(store_with_issues(tmp_path, 4, 0, VANISHING))
    assert summary.live_health is None and not summary.live_window_differs
    assert health_window_text(summary) == "steps 0..3, 4 frames"
    assert "live health" not in render(summary)
    assert health_window_text(report_of(tmp_path / "s.duckdb", from_step=50)) == "no frames"


@pytest.mark.parametrize("health", list(GradientHealth))
def test_one_health_line_per_level(health: GradientHealth) -> None:
    recs = build_recommendations(health, [], [])
    assert len(recs) == 1
    others = {build_recommendations(h, [], [])[0] for h in GradientHealth}
    assert len(others) == len(GradientHealth)


def test_recommendation_structure() -> None:
    recs = build_recommendations(
        H.CRITICAL, ["v1", "v2"], ["e1"], nonfinite=["n1"], first_nonfinite_step=42
    )
    assert len(recs) == 1 + 2 + 2 + 1
    assert "n1" in recs[0] and "42" in recs[0]
    assert "v1, v2" in recs[1]
    assert "initialis" in recs[2].lower()
    assert "e1" in recs[3] and "clip" in recs[3].lower()
    assert "learning rate" in recs[4].lower()
    assert recs[-1] == build_recommendations(H.CRITICAL, [], [])[0]


def test_recommendation_truncates_and_quotes_names() -> None:
    names = [f"layer{i}" for i in range(20)] + ["a,b", "x\ny"]
    rec = build_recommendations(H.MINOR_ISSUES, names, [])[0]
    assert "layer7" in rec and "layer8" not in rec
    assert "... and 14 more" in rec
    rec = build_recommendations(H.MINOR_ISSUES, ["a,b", "x\ny", ""], [])[0]
    assert "'a,b'" in rec and "'x\\ny'" in rec and "''" in rec
