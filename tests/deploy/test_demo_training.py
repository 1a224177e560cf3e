"""Tests of the demo's real training: backprop, data parallelism, scenarios, failure handling.

The scenario tests train for real (2 rank processes each) and check the pathologies on the
recorded *averaged* gradients (what SGD applies: bit-identical on every rank, so gradstream
counts one replica), with the default thresholds (vanishing: mean|g| < 1e-7; exploding:
max|g| > 1e3); the recorded *local* gradients are each rank's own shard gradient.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy.demo.mlp import (
    Init,
    forward_backward,
    init_params,
    load_digits_dataset,
    param_names,
    sgd_update,
)
from deploy.demo.scenarios import SCENARIOS
from deploy.demo.telemetry import (
    FailingTelemetry,
    KafkaTelemetry,
    NullTelemetry,
    RecordingTelemetry,
    Telemetry,
    load_recording,
)
from deploy.demo.training import (
    RankError,
    params_checksum,
    run_data_parallel,
)

REPO = Path(__file__).resolve().parents[2]
VANISHING = 1e-7
EXPLODING = 1e3


# ---------------------------------------------------------------------------- model


def _numeric_grad(params: dict[str, np.ndarray], x, y, activation, eps=1e-6):
    numeric = {}
    for name, arr in params.items():
        out = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            old = arr[idx]
            arr[idx] = old + eps
            plus, _ = forward_backward(params, x, y, activation)
            arr[idx] = old - eps
            minus, _ = forward_backward(params, x, y, activation)
            arr[idx] = old
            out[idx] = (plus - minus) / (2 * eps)
        numeric[name] = out
    return numeric


@pytest.mark.parametrize("activation", ["relu", "sigmoid"])
def test_gradient_check_float64(activation: str) -> None:
    rng = np.random.default_rng(7)
    params = init_params([5, 6, 4, 3], "xavier", seed=3, dtype=np.float64)
    for name in params:  # non-zero biases keep ReLU inputs away from the kink at 0
        if name.endswith("bias"):
            params[name][:] = rng.uniform(0.1, 0.5, params[name].shape)
    x = rng.standard_normal((9, 5))
    y = rng.integers(0, 3, 9)
    loss, grads = forward_backward(params, x, y, activation)
    assert np.isfinite(loss)
    numeric = _numeric_grad(params, x, y, activation)
    assert list(grads) == param_names(3)
    for name in params:
        assert grads[name].dtype == np.float64 and grads[name].shape == params[name].shape
        err = np.abs(grads[name] - numeric[name]).max()
        scale = max(np.abs(numeric[name]).max(), 1e-8)
        assert err / scale < 1e-6, (name, err, scale)


def test_forward_backward_float32_shapes_and_loss() -> None:
    x, y = load_digits_dataset()
    assert x.shape == (1797, 64) and x.dtype == np.float32 and y.shape == (1797,)
    np.testing.assert_allclose(x.mean(axis=0), 0, atol=1e-5)
    params = init_params([64, 32, 10], "he", seed=0)
    loss, grads = forward_backward(params, x[:50], y[:50], "relu")
    assert 0 < loss < 10
    assert list(grads) == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    assert grads["layers.0.weight"].shape == (32, 64)
    assert all(g.dtype == np.float32 for g in grads.values())
    # zero weights -> uniform softmax -> loss = ln(10) exactly
    zero = {n: np.zeros_like(p) for n, p in params.items()}
    loss0, _ = forward_backward(zero, x[:50], y[:50], "relu")
    assert loss0 == pytest.approx(np.log(10), rel=1e-6)


def test_blow_up_is_not_sanitised() -> None:
    x, y = load_digits_dataset()
    params = init_params([64, 64, 64, 10], "normal(1e12)", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # overflow must not warn either
        loss, grads = forward_backward(params, x[:20], y[:20], "relu")
    assert not np.isfinite(loss)
    assert any((~np.isfinite(g)).any() for g in grads.values())


def test_init_schemes() -> None:
    for spec, expected in [
        ("he", np.sqrt(2 / 400)),
        ("xavier", np.sqrt(2 / (400 + 300))),
        ("normal(0.03)", 0.03),
    ]:
        w = init_params([400, 300], spec, seed=1)["layers.0.weight"]
        assert w.shape == (300, 400) and w.dtype == np.float32
        assert w.std() == pytest.approx(expected, rel=0.02)
    assert Init.parse("normal(0.5)") == Init("normal", 0.5)
    for bad in ["uniform", "normal(-1)", "normal(x)"]:
        with pytest.raises(ValueError):
            Init.parse(bad)
    a = init_params([3, 4, 2], "he", seed=5)
    b = init_params([3, 4, 2], "he", seed=5)
    assert params_checksum(a) == params_checksum(b)


# ---------------------------------------------------------------------------- data parallel


def _recorded(directory: Path, world_size: int) -> list[Any]:
    recordings = [load_recording(directory, r) for r in range(world_size)]
    for rec in recordings:
        assert rec.world_size == world_size
    return recordings


def test_data_parallel_equals_full_batch(tmp_path: Path) -> None:
    world_size, steps = 3, 6
    sc = SCENARIOS["healthy"]
    result = run_data_parallel(
        "healthy", world_size, steps, functools.partial(RecordingTelemetry, tmp_path)
    )
    assert result.steps == steps and len(result.losses) == steps
    assert len(result.rank_checksums) == world_size
    assert len(set(result.rank_checksums)) == 1 and result.params_identical
    assert params_checksum(result.final_params) == result.params_checksum

    recs = _recorded(tmp_path, world_size)
    assert recs[0].layer_names == list(sc.layer_numel())
    assert recs[0].layer_numel == list(sc.layer_numel().values())
    x, y = load_digits_dataset()
    params = sc.init_params(seed=0)
    for step in range(steps):
        idx = sc.batch_indices(step, 0, len(x))
        loss, full = forward_backward(params, x[idx], y[idx], sc.activation)
        assert result.losses[step] == pytest.approx(loss, rel=1e-5)
        for name in full:
            local = [rec.local[name][step] for rec in recs]
            if step == 0:  # identical parameters: each rank's shard gradient, exactly
                for rank, g in enumerate(local):
                    rows = idx[rank::world_size]
                    _, shard = forward_backward(params, x[rows], y[rows], sc.activation)
                    np.testing.assert_array_equal(g, shard[name])
            # the telemetry's gradient is the all-reduced one: the same bits on every rank,
            # the shard-size weighted mean of the local gradients (float64 sum, rounded to
            # float32, as the coordinator does), ~ the full-batch gradient
            applied = recs[0].grads[name][step]
            for rec in recs[1:]:
                np.testing.assert_array_equal(rec.grads[name][step], applied)
            shard_rows = np.array([len(idx[r::world_size]) for r in range(world_size)], float)
            avg = np.zeros(local[0].shape)
            for w, g in zip(shard_rows / shard_rows.sum(), local, strict=True):
                avg += w * g
            np.testing.assert_array_equal(applied, avg.astype(np.float32))
            rel = np.linalg.norm(avg - full[name]) / np.linalg.norm(full[name])
            assert rel < 1e-5, (step, name, rel)
        sgd_update(params, full, sc.lr_at(step))
    for name, p in params.items():
        np.testing.assert_allclose(result.final_params[name], p, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- scenarios


def _stats(recs: list[Any], which: str = "grads") -> tuple[list[str], np.ndarray, np.ndarray]:
    """(names, mean|g| (T, L), max|g| (T, L)) of the averaged gradient, which every rank
    holds bit for bit (one replica, as gradstream counts it); with ``which="local"``,
    (names, mean (R, T, L), max (R, T, L)) of every rank's local gradient."""
    names = recs[0].layer_names
    steps = len(recs[0].steps)
    if which == "grads":
        for rec in recs[1:]:
            for name in names:
                np.testing.assert_array_equal(rec.grads[name], recs[0].grads[name])
        recs = recs[:1]
    mean = np.zeros((len(recs), steps, len(names)))
    mx = np.zeros((len(recs), steps, len(names)))
    with np.errstate(all="ignore"):
        for r, rec in enumerate(recs):
            arrays = rec.grads if which == "grads" else rec.local
            for j, name in enumerate(names):
                flat = np.abs(arrays[name].reshape(steps, -1).astype(np.float64))
                mean[r, :, j] = flat.mean(axis=1)
                mx[r, :, j] = flat.max(axis=1)
    return (names, mean[0], mx[0]) if which == "grads" else (names, mean, mx)


@pytest.mark.parametrize("name", ["healthy", "vanishing", "exploding", "bad-rank"])
def test_scenario_shows_its_pathology(name: str, tmp_path: Path) -> None:
    sc = SCENARIOS[name]
    result = run_data_parallel(name, 2, None, functools.partial(RecordingTelemetry, tmp_path))
    assert result.steps == sc.steps and result.params_identical
    recs = _recorded(tmp_path, 2)
    names, mean, mx = _stats(recs)
    assert mean.shape == (sc.steps, 2 * sc.num_layers)
    finite = np.isfinite(mx).all(axis=1)
    losses = np.asarray(result.losses)

    if name == "healthy":
        assert finite.all()
        assert (mean > VANISHING).all() and (mx < EXPLODING).all()
        assert losses[-10:].mean() < 0.25 * losses[:5].mean()
    elif name == "bad-rank":
        # healthy until the corrupted sample reaches rank 1 (the last of 2) at step 20:
        # only its local gradient is NaN there, the averaged one everywhere from then on
        onset = sc.corrupt_from_step
        assert sc.corrupted_rank(2) == 1
        assert finite[:onset].all() and not finite[onset:].any()
        assert (mx[:onset] < EXPLODING).all() and (mean[:onset] > VANISHING).all()
        assert np.isfinite(losses[:onset]).all()
        assert losses[onset - 5 : onset].mean() < 0.5 * losses[:5].mean()  # it was learning
        assert np.isnan(losses[onset:]).all()
        _, _, local_mx = _stats(recs, "local")
        local_finite = np.isfinite(local_mx).all(axis=2)  # (rank, step)
        assert local_finite[:, :onset].all()
        assert local_finite[0, onset] and not local_finite[1, onset]
        assert not local_finite[:, onset + 1 :].any()  # the NaN update reached every rank
    elif name == "vanishing":
        assert finite.all() and (mx < EXPLODING).all()
        first = mean[:, names.index("layers.0.weight")]
        last = mean[:, names.index(f"layers.{sc.num_layers - 1}.weight")]
        assert (first < VANISHING).mean() >= 0.9
        assert (last > VANISHING).all()
        assert np.median(last) / np.median(first) > 1e4
    else:
        exploding_steps = np.flatnonzero((mx > EXPLODING).any(axis=1))
        assert exploding_steps.size > 0
        onset = int(exploding_steps[0])
        assert onset > 0  # it trains first: divergence comes from the learning-rate ramp
        assert (mx[:onset] < EXPLODING).all() and (mean[:onset] > VANISHING).all()
        assert losses[:onset].min() < 0.8 * losses[0]  # it was learning before diverging
        assert not finite.all()  # eventually the real inf/nan


# ---------------------------------------------------------------------------- failures


def _assert_gone(pids: set[int]) -> None:
    assert pids, "no rank process was observed"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert multiprocessing.active_children() == []


def _pid_collector(pids: set[int], stop_at: int | None = None):
    def on_step(step: int, loss: float) -> None:
        pids.update(p.pid for p in multiprocessing.active_children() if p.pid is not None)
        if stop_at is not None and step == stop_at:
            raise KeyboardInterrupt

    return on_step


def test_rank_exception_propagates_and_no_child_survives() -> None:
    pids: set[int] = set()
    make = functools.partial(FailingTelemetry, fail_rank=1, fail_step=2)
    with pytest.raises(RankError, match=r"rank 1 at step 2 failed: RuntimeError: injected") as ei:
        run_data_parallel("healthy", 3, 10, make, on_step=_pid_collector(pids))
    assert ei.value.rank == 1 and ei.value.step == 2
    assert "injected failure on rank 1 at step 2" in ei.value.remote_traceback
    assert len(pids) == 3
    _assert_gone(pids)


def test_rank_dying_without_report_is_detected() -> None:
    pids: set[int] = set()
    make = functools.partial(FailingTelemetry, fail_rank=0, fail_step=1, mode="exit")
    # telemetry runs after the all-reduce: the rank dies having sent step 1's gradients,
    # and the coordinator notices while waiting for those of step 2
    with pytest.raises(RankError, match=r"rank 0 at step 2 failed: .*exit code 3") as ei:
        run_data_parallel("healthy", 2, 10, make, on_step=_pid_collector(pids))
    assert ei.value.exitcode == 3
    _assert_gone(pids)


def test_keyboard_interrupt_cleans_up() -> None:
    pids: set[int] = set()
    with pytest.raises(KeyboardInterrupt):
        run_data_parallel("healthy", 2, 50, NullTelemetry, on_step=_pid_collector(pids, 2))
    _assert_gone(pids)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown scenario"):
        run_data_parallel("nope", 2, 1, NullTelemetry)
    with pytest.raises(ValueError, match="world_size"):
        run_data_parallel("healthy", 0, 1, NullTelemetry)
    with pytest.raises(TypeError, match="picklable"):
        run_data_parallel("healthy", 2, 1, lambda r, w: NullTelemetry(r, w))
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------------------- telemetry glue


class _CallLog:
    """Stands in for GradientProducer to check KafkaTelemetry's calls (no broker involved)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def start_run(self, layer_numel, **kwargs) -> None:
        self.calls.append(("start_run", (dict(layer_numel), kwargs)))

    def record_step(self, step, gradients, weights=None, *, replicated=False,
                    local_gradients=None, scalars=None) -> None:
        self.calls.append(("record_step", (step, list(gradients), weights, replicated,
                                           local_gradients, scalars)))

    def finish_run(self) -> None:
        self.calls.append(("finish_run", None))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_kafka_telemetry_maps_onto_the_producer_api() -> None:
    log = _CallLog()
    tel = KafkaTelemetry(log, vanishing_threshold=1e-6, exploding_threshold=10.0, config={"a": 1})
    assert isinstance(tel, Telemetry)
    tel.start({"layers.0.weight": 6, "layers.0.bias": 3})
    params = {"layers.0.weight": np.zeros((3, 2), np.float32), "layers.0.bias": np.zeros(3)}
    avg = {"layers.0.weight": np.ones((3, 2), np.float32), "layers.0.bias": np.ones(3)}
    local = {n: 2 * g for n, g in avg.items()}
    tel.step(0, avg, weights=params, local=local, scalars={"loss": 2.5, "lr": 0.1})
    tel.finish()
    tel.abort()  # already closed: no second close
    assert [c[0] for c in log.calls] == ["start_run", "record_step", "finish_run", "close"]
    assert log.calls[0][1] == (
        {"layers.0.weight": 6, "layers.0.bias": 3},
        {"vanishing_threshold": 1e-6, "exploding_threshold": 10.0, "config": {"a": 1}},
    )
    # the averaged gradient goes as a replicated layout, the local one as the local view
    assert log.calls[1][1] == (0, ["layers.0.weight", "layers.0.bias"], params, True, local,
                               {"loss": 2.5, "lr": 0.1})
    off = _CallLog()
    KafkaTelemetry(off, local_view=False).step(0, avg, weights=params, local=local)
    assert off.calls[0][1][3:] == (True, None, None)


def test_corrupted_shard_inputs() -> None:
    sc = SCENARIOS["bad-rank"]
    x, _ = load_digits_dataset()
    rows = sc.batch_indices(25, 0, len(x))[2::3]
    assert sc.corrupted_rank(3) == 2 and sc.corrupted_rank(1) == 0
    bad = sc.shard_inputs(x, rows, 2, 3, sc.corrupt_from_step)
    assert np.isnan(bad[0]).all() and np.array_equal(bad[1:], x[rows[1:]])
    assert np.isfinite(x).all()  # the data set itself is untouched
    np.testing.assert_array_equal(sc.shard_inputs(x, rows, 1, 3, 30), x[rows])
    np.testing.assert_array_equal(sc.shard_inputs(x, rows, 2, 3, sc.corrupt_from_step - 1),
                                  x[rows])
    assert SCENARIOS["healthy"].corrupted_rank(3) is None
    assert sc.config()["corrupt_value"] == "nan"


def test_import_is_light() -> None:
    code = (
        "import sys, deploy.demo.training\n"
        "heavy = [m for m in ('producer', 'sklearn', 'duckdb', 'kafka') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_loss_spike_batch_shifts_every_label_at_its_step_only() -> None:
    sc = SCENARIOS["loss-spike"]
    _, y = load_digits_dataset()
    rows = sc.batch_indices(sc.spike_step, 0, len(y))
    assert (sc.shard_labels(y, rows, sc.spike_step, 10) == (y[rows] + 1) % 10).all()
    assert (sc.shard_labels(y, rows, sc.spike_step - 1, 10) == y[rows]).all()


def test_straggler_delays_only_its_rank_during_its_steps() -> None:
    sc = SCENARIOS["straggler"]
    slow = [sc.compute_delay(1, 2, step) for step in range(sc.steps)]
    assert slow == [sc.slow_s if sc.slow_from_step <= s < sc.slow_from_step + sc.slow_steps
                    else 0.0 for s in range(sc.steps)]
    assert all(sc.compute_delay(0, 2, step) == 0.0 for step in range(sc.steps))
    assert SCENARIOS["healthy"].compute_delay(0, 1, 3) == 0.0
    with pytest.raises(ValueError, match="does not have"):
        sc.compute_delay(0, 0, 3)
