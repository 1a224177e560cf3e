"""A report read from the frames' stored summaries (schemas.frame_summary) is the report a
scan of every ``layer_stats`` row gives: random runs written by the real DuckDB writer
(``DuckDBSink``, real files), with vanishing, exploding, NaN and Inf layers, layers at
rounding level under several dtypes, partial frames and late ranks that rewrite a stored
frame with other layers and values; random step ranges, exclusions and rules."""

from __future__ import annotations

import tempfile
from pathlib import Path

import duckdb
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.read.connect import open_store
from analysis.report import build_report, frames_summarise
from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from schemas.frame_summary import SUMMARY_COLUMNS, fill_frame_summaries
from schemas.stats import GradientSums
from schemas.wire import RunStarted

VANISHING, EXPLODING = 1e-7, 1e3
DTYPES = ["float32", "bfloat16", "float16", "float64", None]

# A layer's gradient at one step: its mean |g| (numel 100), or a NaN / Inf / zero gradient.
# The magnitudes mix ordinary values, values below the vanishing threshold and values at
# rounding level of the step's largest (1e-12 of 1.0 is below every dtype's u; 1e-5 only
# below bfloat16's and float16's), so every branch of the judgement is reached.
MEANS = st.sampled_from([1.0, 0.3, 2e3, 5e-8, 1e-12, 1e-5, 0.0, np.nan, np.inf])


def _started(layers: int, dtypes: list[str | None], ignore: list[str]) -> RunStarted:
    return RunStarted(
        run_id="r", rank=0, world_size=2, layer_names=[f"l{i}" for i in range(layers)],
        numel=[100] * layers, vanishing_threshold=VANISHING, exploding_threshold=EXPLODING,
        host="h", start_time=0.0, config={},
        dtypes=None if all(d is None for d in dtypes) else [d or "float32" for d in dtypes],
        ignore_layers=ignore,
    )


def _frame(step: int, layers: int, present: list[int], means: list[float]) -> GradientFrame:
    idx = np.array(present, np.int64)
    mean = np.array(means, np.float64)
    n = idx.size
    nan = np.isnan(mean)
    inf = np.isinf(mean)
    nonfinite = np.where(nan | inf, 3, 0).astype(np.int64)
    finite = np.where(nan | inf, 1.0, mean)
    sums = GradientSums.from_columns(
        np.full(n, 100, np.int64), finite * 100, finite * finite * 100, finite * 2, nonfinite,
        nan=np.where(nan, 3, 0).astype(np.float64))
    merged = MergedShards.empty(layers).merge_at(idx, MergedShards(sums))
    return compute_frame("r", step, merged, vanishing_threshold=VANISHING,
                         exploding_threshold=EXPLODING, ranks_seen=(0, 1), world_size=2,
                         wall_time=float(step))


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, list[str | None], list[str], list[list[GradientFrame]]]:
    """(layers, dtypes, run ignore patterns, batches of frames written in order)."""
    layers = draw(st.integers(2, 6))
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=layers, max_size=layers))
    ignore = draw(st.lists(st.sampled_from(["l0", "l1*", "l[23]"]), max_size=1, unique=True))
    steps = draw(st.integers(1, 8))
    batches: list[list[GradientFrame]] = []
    for step in range(steps):
        present = sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1)))
        means = draw(st.lists(MEANS, min_size=len(present), max_size=len(present)))
        batches.append([_frame(step, layers, present, means)])
    for _ in range(draw(st.integers(0, 3))):  # late ranks: a stored frame written again
        step = draw(st.integers(0, steps - 1))
        present = sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1)))
        means = draw(st.lists(MEANS, min_size=len(present), max_size=len(present)))
        batches.append([_frame(step, layers, present, means)])
    return layers, dtypes, ignore, batches


def _write(path: Path, layers: int, dtypes: list[str | None], ignore: list[str],
           batches: list[list[GradientFrame]]) -> None:
    sink = DuckDBSink(path, write_behind=False)
    try:
        for i, frames in enumerate(batches):
            batch = Batch()
            if i == 0:
                batch.runs_started.append(_started(layers, dtypes, ignore))
            for frame in frames:
                batch.frames[("r", frame.step)] = (frame, "Healthy")
            batch.offsets[("t", 0)] = i + 1
            sink.write(batch, "g")
    finally:
        sink.close()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(run=runs(), data=st.data())
def test_report_from_summaries_is_the_full_scan(run: tuple, data: st.DataObject) -> None:
    layers, dtypes, ignore, batches = run
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.duckdb"
        _write(path, layers, dtypes, ignore, batches)
        con = open_store(path)
        try:
            last = max(f.step for b in batches for f in b)
            lo = data.draw(st.none() | st.integers(0, last))
            hi = data.draw(st.none() | st.integers(lo or 0, last + 1))
            assert frames_summarise(con, "r", hi)  # the fast path is the one compared
            options = {
                "ignore_layers": tuple(data.draw(st.lists(st.sampled_from(["l1", "l4*"]),
                                                          max_size=1))),
                "exclude_rounding": data.draw(st.booleans()),
                "order": data.draw(st.sampled_from(["model", "name"])),
                "nonfinite_rule": data.draw(st.sampled_from(["critical", "reference"])),
            }
            fast = build_report(con, "r", lo, hi, **options)
            full = build_report(con, "r", lo, hi, full_scan=True, **options)
            assert fast == full
        finally:
            con.close()


def test_fill_gives_the_summary_the_writer_wrote(tmp_path: Path) -> None:
    """A store whose frames lack their summary (written before it existed) gets, from
    ``fill_frame_summaries``, the one the writer stores with the rows; until then a report
    reads the rows."""
    layers = 4
    frames = [[_frame(s, layers, [0, 1, 2, 3], m)] for s, m in enumerate(
        [[1.0, 1e-12, 5e-8, 0.0], [np.nan, 1e-12, 0.3, 0.0], [2e3, 0.5, np.inf, 1e-5]])]
    frames.append([_frame(1, layers, [0, 2], [0.2, 1e-12])])  # a late rank rewrites step 1
    path = tmp_path / "s.duckdb"
    _write(path, layers, ["float32", None, "bfloat16", "float16"], [], frames)
    columns = ", ".join(SUMMARY_COLUMNS)
    con = duckdb.connect(str(path))
    written = con.execute(f"SELECT step, {columns} FROM frames ORDER BY step").fetchall()
    assert written[1][1:5] == ([2], [], [], [])  # the rewrite replaced step 1's summary
    assert written[1][6] == [2]  # 1e-12 of 0.2: a rounding candidate
    con.execute(f"UPDATE frames SET {', '.join(f'{c} = NULL' for c in SUMMARY_COLUMNS)}")
    assert not frames_summarise(con, "r", None)
    full = build_report(con, "r")
    assert fill_frame_summaries(con, "r") == 3
    assert fill_frame_summaries(con) == 0  # nothing left without a summary
    filled = con.execute(f"SELECT step, {columns} FROM frames ORDER BY step").fetchall()
    assert filled == written
    assert frames_summarise(con, "r", None)
    assert build_report(con, "r") == full
    assert full.layers_without_gradient == ["l3"]  # zero from its first frame
    con.close()


def test_rows_written_by_another_program_are_read_row_by_row(tmp_path: Path) -> None:
    """A ``layer_stats`` row without its frame's summary behind it (here: one added by
    hand) makes the report scan the rows, so it counts."""
    layers = 3
    path = tmp_path / "s.duckdb"
    _write(path, layers, [None] * layers, [],
           [[_frame(s, layers, [0, 1, 2], [1.0, 0.5, 0.3])] for s in range(3)])
    con = duckdb.connect(str(path))
    assert frames_summarise(con, "r", None)
    assert build_report(con, "r").layers_with_exploding_grads == []
    con.execute("INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_sq, "
                "max_abs_grad, nonfinite, grad_norm, flow_intensity, is_vanishing, "
                "is_exploding) VALUES ('r', 3, 1, 100, 1e8, 5e3, 0, 1e4, 1.0, false, true)")
    assert not frames_summarise(con, "r", None)
    assert frames_summarise(con, "r", 2)  # the rows up to step 2 are still summarised
    report = build_report(con, "r")
    assert report.layers_with_exploding_grads == ["l1"] and report.frames == 4
    con.close()
