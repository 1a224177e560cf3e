"""No gradient by construction (schemas.rounding): the per-frame test, its SQL twin, the
incremental tracker, the vanishing alert rule and the restore after a worker restart."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.alerts.engine import AlertEngine
from consumer.frames import GradientFrame, MergedShards, compute_frame
from consumer.health_tracker import RunHealthTracker
from consumer.outputs.base import Batch
from consumer.outputs.duckdb import DuckDBSink
from consumer.runs import RunInfo
from schemas.alert import AlertRule
from schemas.rounding import (
    DTYPE_EPS,
    at_rounding_level,
    gradient_magnitude,
    rounding_rows_sql,
    unit_roundoff,
)
from schemas.tables import SCHEMA_DDL
from schemas.wire import GradientHealth as H
from schemas.wire import RunStarted
from tests.consumer.alerts.helpers import FIRING, Run, only

U32 = 2.0**-24  # float32 unit roundoff, eps / 2

# Mean |g| of one step of a config-built 2-layer BERT under the HF Trainer (float32,
# measured; see tests/integration/test_no_gradient_by_construction.py): classifier, pooler,
# LayerNorm, value / dense weights, query and key weights, then the two key biases.
BERT_STEP = np.array([3.8e-1, 5.5e-3, 8.7e-4, 6.5e-5, 1.2e-5, 2.6e-7, 1.0e-7, 1.3e-13, 1.7e-14])


def test_unit_roundoff_per_dtype():
    u = unit_roundoff(["float32", "bfloat16", "float16", "float64", "float8_e4m3fn", None], 6)
    assert u.tolist() == [2.0**-24, 2.0**-8, 2.0**-11, 2.0**-53, 2.0**-24, 2.0**-24]
    assert DTYPE_EPS["float32"] == np.finfo(np.float32).eps
    assert unit_roundoff(None, 3).tolist() == [U32] * 3
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        unit_roundoff(["float32", "float32"], 3)


def test_magnitude_is_mean_abs_or_rms_in_norms_mode():
    m = gradient_magnitude(np.array([0.5, np.nan]), np.array([1.0, 8.0]), np.array([4, 2]))
    assert m.tolist() == [0.5, 2.0]


def test_rounding_residue_below_a_gap_is_at_rounding_level():
    u = np.full(BERT_STEP.size, U32)
    at = at_rounding_level(BERT_STEP, u, np.zeros(BERT_STEP.size, np.int64))
    assert at.tolist() == [False] * 7 + [True, True]
    shuffled = np.random.default_rng(0).permutation(BERT_STEP.size)
    assert at_rounding_level(BERT_STEP[shuffled], u, np.zeros(9, np.int64)).tolist() == \
        at[shuffled].tolist()


def test_exact_zero_is_at_rounding_level_but_not_in_an_all_zero_frame():
    zero = np.zeros(3, np.int64)
    assert at_rounding_level(np.array([1e-2, 3e-3, 0.0]), np.full(3, U32), zero).tolist() == \
        [False, False, True]
    assert not at_rounding_level(np.zeros(3), np.full(3, U32), zero).any()


def test_smoothly_vanishing_stack_is_not_at_rounding_level():
    """A 16-layer chain losing 4x per layer reaches 4^-15 = 9.3e-10 of the top, below
    u * top, but leaves no gap: real gradient (the demo's sigmoid stack is like this)."""
    chain = 4.0 ** -np.arange(16)
    assert (chain[-3:] <= U32).all()
    assert not at_rounding_level(chain, np.full(16, U32), np.zeros(16, np.int64)).any()


def test_gap_alone_or_level_alone_is_not_enough():
    zero = np.zeros(2, np.int64)
    # a gap of 1e5 but 1e-5 of the top: above u * top
    assert not at_rounding_level(np.array([1.0, 1e-5]), np.full(2, U32), zero).any()
    # below u * top (1e-8) and a gap of 1e8: at rounding level; non-finite: never
    assert at_rounding_level(np.array([1.0, 1e-8]), np.full(2, U32), zero).tolist() == \
        [False, True]
    assert not at_rounding_level(np.array([1.0, 1e-8]), np.full(2, U32),
                                 np.array([0, 3])).any()


def test_dtype_sets_both_thresholds():
    """1e-3 of the top with a gap of 1e3: bfloat16 rounding (u = 2^-8, gap 2^4), not
    float32 (u = 2^-24, gap 2^12)."""
    mags, zero = np.array([1.0, 0.5, 5e-4]), np.zeros(3, np.int64)
    assert at_rounding_level(mags, unit_roundoff([None, None, "bfloat16"], 3), zero)[2]
    assert not at_rounding_level(mags, unit_roundoff(None, 3), zero).any()


# ------------------------------------------------------------------ SQL twin, by hypothesis

def _store_rows(con: duckdb.DuckDBPyConnection, mags: np.ndarray, present: np.ndarray,
                bad: np.ndarray, norms: np.ndarray, dtypes: list[str | None]) -> None:
    """Rows of run 'r' with magnitude ``mags[t, l]`` where ``present`` (mean |g|, or the RMS
    in a norms-mode row: ``sum_sq = a^2 numel``, mean NULL)."""
    for ddl in SCHEMA_DDL:
        con.execute(ddl)
    con.executemany("INSERT INTO layers (run_id, layer_index, name, numel, dtype) "
                    "VALUES ('r', ?, ?, 4, ?)",
                    [(i, f"l{i}", d) for i, d in enumerate(dtypes)])
    rows = []
    for t, li in zip(*np.nonzero(present), strict=True):
        a = float(mags[t, li])
        mean = None if norms[t, li] else a
        rows.append((int(t), int(li), a * a * 4, int(bad[t, li]), mean))
    if not rows:
        return
    con.executemany(
        "INSERT INTO layer_stats (run_id, step, layer_index, numel, sum_sq, nonfinite, "
        "mean_abs_grad, grad_norm, flow_intensity, is_vanishing, is_exploding) "
        "VALUES ('r', ?, ?, 4, ?, ?, ?, 0, 0, false, false)", rows)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(1, 7))
def test_sql_twin_equals_numpy_and_tracker(seed, steps, layers):
    """rounding_rows_sql judges every stored row as at_rounding_level does on its frame,
    and its no_gradient equals the tracker's state after the frames seen in step order."""
    rng = np.random.default_rng(seed)
    exponent = rng.uniform(-17, 1, (steps, layers))
    mags = np.where(rng.random((steps, layers)) < 0.15, 0.0, 10.0**exponent)
    mags[:, rng.integers(layers)] *= 10.0 ** rng.integers(0, 2)
    present = rng.random((steps, layers)) < 0.9
    bad = np.where(rng.random((steps, layers)) < 0.1, 2, 0)
    norms = rng.random((steps, layers)) < 0.2
    dtypes = [rng.choice(["float32", "bfloat16", "float16", "float64", "int8", None])
              for _ in range(layers)]
    con = duckdb.connect()
    _store_rows(con, mags, present, bad, norms, dtypes)
    got = {(s, li): (at, ng) for s, li, at, ng in con.execute(
        f"SELECT step, layer_index, at_rounding, no_gradient FROM ({rounding_rows_sql()})",
        {"run_id": "r", "to_step": None}).fetchall()}
    roundoff = unit_roundoff(dtypes, layers)
    tracker = RunHealthTracker(layers, 0, roundoff)
    for t in range(steps):
        idx = np.flatnonzero(present[t])
        if idx.size == 0:
            continue
        rms = np.sqrt(mags[t, idx] ** 2 * 4 / 4)
        mag = np.where(norms[t, idx], rms, mags[t, idx])
        expect = at_rounding_level(mag, roundoff[idx], bad[t, idx])
        tracker.update(t, idx, np.zeros(idx.size, bool), np.zeros(idx.size, bool),
                       bad[t, idx], mag)
        for k, li in enumerate(idx.tolist()):
            assert got[(t, li)] == (bool(expect[k]), bool(tracker.no_gradient[li]))
    con.close()


# ------------------------------------------------------------------ tracker

def frame(step: int, mean: list[float], nonfinite: list[int] | None = None,
          run_id: str = "r") -> GradientFrame:
    """A real frame (compute_frame) of layers with the given mean |g| (100 elements each,
    all of the same magnitude)."""
    n = len(mean)
    a = np.asarray(mean, np.float64)
    merged = MergedShards.empty(n)
    merged.add(np.arange(n), np.full(n, 100), a * 100, a * a * 100, a,
               np.asarray(nonfinite or [0] * n, np.int64))
    return compute_frame(run_id, step, merged, vanishing_threshold=1e-7,
                         exploding_threshold=1e3, ranks_seen=(0,), world_size=1,
                         wall_time=1.7e9 + step)


def feed(tracker: RunHealthTracker, f: GradientFrame) -> H:
    return tracker.update(f.step, f.layer_index, f.is_vanishing, f.is_exploding, f.nonfinite,
                          gradient_magnitude(f.mean_abs_grad, f.sum_sq, f.numel))


def test_layer_at_rounding_level_from_step_0_is_judged_but_counts_by_default():
    """The reference rule by default: the layer is vanishing in every frame (issue ratio
    1.0: ProblemsDetected) and is also known as having no gradient by construction (the
    report's finding). Only ``exclude_rounding`` leaves it out (the run is Healthy)."""
    t = RunHealthTracker(4)
    old = RunHealthTracker(4, exclude_rounding=True)
    rng = np.random.default_rng(1)
    for s in range(20):
        f = frame(s, [1e-2, 3e-3, float(rng.uniform(2e-14, 3e-13)), 5e-2])
        assert f.is_vanishing.tolist() == [False, False, True, False]  # the stored threshold flag
        assert feed(t, f) is H.PROBLEMS_DETECTED
        assert feed(old, f) is H.HEALTHY
    for tracker in (t, old):
        assert tracker.no_gradient.tolist() == [False, False, True, False]
    assert t.frames == 20 and t.issue_frames == 20 and t.vanishing_frames.tolist() == [0, 0, 20, 0]
    assert t.left_out.tolist() == [False] * 4
    assert old.issue_frames == 0 and not old.vanishing_frames.any()
    assert old.left_out.tolist() == [False, False, True, False]


def test_excluded_layers_count_nowhere_but_nonfinite_still_does():
    """The run's ignore_layers: vanishing and exploding flags of the excluded layer count
    nowhere; its NaN/Inf does (Critical)."""
    t = RunHealthTracker(3, excluded=np.array([False, True, False]))
    for s in range(5):
        assert feed(t, frame(s, [1e-2, 1e-13 if s % 2 else 2e3, 5e-2])) is H.HEALTHY
    assert t.issue_frames == 0 and not (t.vanishing_frames.any() or t.exploding_frames.any())
    assert feed(t, frame(5, [1e-2, 1e-3, 5e-2], nonfinite=[0, 1, 0])) is H.CRITICAL
    assert t.issue_frames == 1 and t.nonfinite_frames.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="excluded has shape"):
        RunHealthTracker(3, excluded=np.zeros(2, bool))


def test_layer_that_had_a_gradient_and_lost_it_is_vanishing():
    t = RunHealthTracker(4)
    for s in range(20):
        feed(t, frame(s, [1e-2, 3e-3, 1e-2 if s < 5 else 1e-13, 5e-2]))
    assert not t.no_gradient.any()
    assert t.vanishing_frames.tolist() == [0, 0, 15, 0]
    assert t.issue_frames == 15 and t.health is H.PROBLEMS_DETECTED  # 75 % > 30 %


@pytest.mark.parametrize(("exclude_rounding", "counted"), [(False, 8), (True, 5)])
def test_zero_until_it_gets_a_gradient(exclude_rounding, counted):
    """Exactly zero for 3 steps (e.g. feeding a zero-initialised layer), then a gradient:
    ordinary from step 3 on. Its 3 zero frames and 5 lost ones are vanishing; with
    ``exclude_rounding`` only the 5 from step 10 on count."""
    t = RunHealthTracker(3, exclude_rounding=exclude_rounding)
    for s in range(15):
        g = 0.0 if s < 3 else (1e-3 if s < 10 else 1e-13)
        feed(t, frame(s, [1e-2, g, 5e-2]))
        assert bool(t.no_gradient[1]) is (s < 3)
    assert t.vanishing_frames.tolist() == [0, counted, 0] and t.issue_frames == counted


@pytest.mark.parametrize(("exclude_rounding", "issues"), [(False, 3), (True, 2)])
def test_nonfinite_frame_ends_no_gradient_and_counts_as_issue(exclude_rounding, issues):
    t = RunHealthTracker(3, exclude_rounding=exclude_rounding)
    feed(t, frame(0, [1e-2, 1e-13, 5e-2]))
    assert t.no_gradient.tolist() == [False, True, False]
    feed(t, frame(1, [1e-2, 1e-13, 5e-2], nonfinite=[0, 2, 0]))
    assert not t.no_gradient.any()
    feed(t, frame(2, [1e-2, 1e-13, 5e-2]))
    assert t.issue_frames == issues and t.health is H.CRITICAL


def test_without_magnitudes_every_flag_counts_as_in_the_seed():
    t = RunHealthTracker(3)
    f = frame(0, [1e-2, 1e-13, 5e-2])
    t.update(f.step, f.layer_index, f.is_vanishing, f.is_exploding, f.nonfinite)
    assert t.issue_frames == 1 and t.vanishing_frames.tolist() == [0, 1, 0]
    assert not t.no_gradient.any()


# ------------------------------------------------------------------ restart

def _started(dtypes: list[str] | None) -> RunStarted:
    return RunStarted(run_id="r", world_size=1, layer_names=["a", "b", "c", "d"],
                      numel=[100] * 4, start_time=1.0, dtypes=dtypes)


@pytest.mark.parametrize("exclude_rounding", [False, True])
@pytest.mark.parametrize("dtypes", [None, ["float32", "float32", "bfloat16", "float32"]])
def test_restore_from_the_store_equals_incremental(tmp_path, dtypes, exclude_rounding):
    """Frames written by the real sink; a restarted worker's tracker (load_runs, load_flags,
    load_gradient_state, RunHealthTracker.restored) equals the one that saw them, and goes on alike,
    by default and with ``exclude_rounding``."""
    msg = _started(dtypes)
    run = RunInfo.from_message(msg)
    live = RunHealthTracker(4, 0, run.roundoff, exclude_rounding=exclude_rounding)
    means = [  # b: zero by construction; c: zero for 2 steps, then 1e-4 (2e-3 of the top
        # below a gap of 100: rounding level in bfloat16, a gradient in float32), then
        # 1e-13 from step 6; d: exploding at step 3
        [1e-2, 1e-13, 0.0, 5e-2], [1e-2, 2e-13, 0.0, 5e-2], [1e-2, 1e-14, 1e-4, 5e-2],
        [1e-2, 1e-13, 1e-4, 2e3], [1e-2, 1e-13, 1e-4, 5e-2], [1e-2, 1e-13, 1e-4, 5e-2],
        [1e-2, 1e-13, 1e-13, 5e-2], [1e-2, 1e-13, 1e-13, 5e-2],
    ]
    bf16 = dtypes is not None
    batch = Batch(runs_started=[msg])
    for s, m in enumerate(means):
        f = frame(s, m)
        health = feed(live, f)
        batch.frames[("r", s)] = (f, health.value)
    sink = DuckDBSink(tmp_path / "s.duckdb", write_behind=False)
    sink.write(batch, "g")
    (loaded,) = sink.load_runs()
    assert loaded.dtypes == (None if dtypes is None else tuple(dtypes))
    flags = sink.load_flags("r", exclude_rounding)
    seen, ordinary = sink.load_gradient_state("r", 4)
    steps = sink.load_frames("r")[0]
    sink.close()
    restored = RunHealthTracker.restored(
        4, 0, steps, flags["step"], flags["layer_index"], flags["is_vanishing"].astype(bool),
        flags["is_exploding"].astype(bool), flags["nonfinite"].astype(bool),
        roundoff=loaded.roundoff, seen=seen, ordinary=ordinary,
        exclude_rounding=exclude_rounding)
    for t in (live, restored):
        assert t.no_gradient.tolist() == [False, True, bf16, False]
    for name in ("frames", "issue_frames", "health"):
        assert getattr(restored, name) == getattr(live, name)
    for name in ("vanishing_frames", "exploding_frames", "nonfinite_frames"):
        assert getattr(restored, name).tolist() == getattr(live, name).tolist()
    if exclude_rounding:
        assert live.vanishing_frames.tolist() == [0, 0, 0 if bf16 else 2, 0]
    else:  # every vanishing row: b in all 8 frames, c at steps 0, 1, 6, 7
        assert live.vanishing_frames.tolist() == [0, 8, 4, 0]
    nxt = frame(8, [1e-2, 1e-13, 1e-13, 5e-2])
    assert feed(restored, nxt) is feed(live, nxt)
    expect = (1 if bf16 else 4) if exclude_rounding else 9
    assert restored.issue_frames == live.issue_frames == expect
    assert restored.no_gradient.tolist() == live.no_gradient.tolist()


# ------------------------------------------------------------------ vanishing alert

class JudgedRun(Run):
    """The alert-test run, with the tracker judging rounding level as the worker does."""

    def feed(self, frame, now=None):
        feed(self.tracker, frame)
        out = self.engine.on_frame(frame, self.info, self.tracker,
                                   now=float(frame.step) if now is None else now)
        self.events.extend(out)
        return out


def test_vanishing_alert_fires_for_a_layer_at_rounding_level_by_default():
    """The reference rule: a layer below the threshold is vanishing, whatever its
    magnitude; the tracker knows it as no gradient by construction (a finding)."""
    run = JudgedRun(AlertEngine(only("vanishing", consecutive=3, resolve_after=2)))
    for s in range(4):  # "attn.q" zero by construction from step 0: |g| ~ 1e-13 of 1e-2
        run.step(s, scale={"attn.q": 1e-11})
    fired = run.of(AlertRule.VANISHING)
    assert [(e.state.value, e.step, e.layers) for e in fired] == [(FIRING, 2, ["attn.q"])]
    assert run.tracker.no_gradient.tolist() == [False, True, False, False]


def test_vanishing_alert_skips_excluded_layers_but_not_lost_gradients():
    """With the layer excluded (here: exclude_rounding), it raises no alert; a layer that
    had a gradient and loses it still does."""
    run = JudgedRun(AlertEngine(only("vanishing", consecutive=3, resolve_after=2)))
    run.tracker.exclude_rounding = True
    for s in range(8):  # "attn.q" zero by construction from step 0: |g| ~ 1e-13 of 1e-2
        run.step(s, scale={"attn.q": 1e-11})
    assert run.events == [] and run.tracker.no_gradient.tolist() == [False, True, False, False]
    assert run.tracker.health is H.HEALTHY
    for s in range(8, 12):  # "head" had a gradient and loses it
        run.step(s, scale={"attn.q": 1e-11, "head": 1e-11})
    fired = run.of(AlertRule.VANISHING)
    assert [(e.state.value, e.step, e.layers) for e in fired] == [(FIRING, 10, ["head"])]
