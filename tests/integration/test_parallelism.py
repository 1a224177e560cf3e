"""A frame means the gradient the optimiser applies, under every kind of parallelism.

Real ``torch.distributed`` jobs (gloo, CPU processes) train with gradient accumulation through
the real ``GradientTap`` -> ``GradientProducer`` -> broker -> ``Worker`` -> DuckDB; the stored
mean |g|, max |g|, L2 norm, numel and NaN/Inf count of every (step, layer) must equal torch's
own values of the full gradient right before ``optimizer.step()``, and the step's total norm
must equal what ``clip_grad_norm_`` returns. Tolerances: relative 1e-9 per layer (both sides
reduce the same float32 gradient in float64, so only the summation order differs); relative
1e-6 for the total norm, which ``clip_grad_norm_`` computes in the gradients' float32 (a few
roundings of float32's 2^-24 unit roundoff).
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import socket
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from consumer.settings import ConsumerSettings
from consumer.worker import Worker
from tests.integration.parallel_ranks import STEPS, run_framework_rank, run_rank

RTOL = 1e-9
TOTAL_RTOL = 1e-6


def run_ranks(procs: list[Any], queue: Any, results: int) -> list[Any]:
    """Start the rank processes ``procs``, take ``results`` items from their ``queue``
    (failing as soon as a rank exits with an error), join them and check that every rank
    exited cleanly; return the items in arrival order."""
    for p in procs:
        p.start()
    got: list[Any] = []
    try:
        deadline = time.monotonic() + 300
        while len(got) < results and time.monotonic() < deadline:
            try:
                got.append(queue.get(timeout=1))
            except queue_module.Empty:
                assert not any(p.exitcode not in (None, 0) for p in procs), \
                    [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert len(got) == results, f"{len(got)} of {results} rank results arrived"
    return got


def run_job(kind: str, world: int, tmp_path: Path, bootstrap: str, name: str,
            **options: Any) -> tuple[dict[str, Any], duckdb.DuckDBPyConnection, str]:
    """Run a ``world``-rank ``kind`` job into a fresh worker and store; return rank 0's
    torch reference, a read-only connection to the store and the run id."""
    settings = ConsumerSettings(
        bootstrap_servers=bootstrap, topic=f"par-{name}", dlq_topic=f"par-dlq-{name}",
        group_id=f"par-{name}", db=str(tmp_path / f"{kind}.duckdb"),
    )
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    run_id = f"{kind}-{world}-{name}"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / f'pg-{kind}'}"
    try:
        assert worker.wait_ready(60)
        if kind in ("hf", "lightning"):
            with socket.socket() as sock:  # a free port for the rendezvous
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            procs = [ctx.Process(target=run_framework_rank, args=(
                kind, r, world, port, bootstrap, settings.topic, run_id,
                str(tmp_path / kind), queue)) for r in range(world)]
        else:
            procs = [ctx.Process(target=run_rank, args=(
                kind, r, world, init, bootstrap, settings.topic, run_id, queue, options))
                for r in range(world)]
        (result,) = run_ranks(procs, queue, 1)
        assert worker.wait_for_runs([run_id], 60)
        deadline = time.monotonic() + 30
        while worker.counters.frames < STEPS and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.stop()
        thread.join(30)
    assert worker.counters.dead_letters == 0
    return result, duckdb.connect(settings.db, read_only=True), run_id


def stored(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[tuple[int, str], tuple]:
    rows = con.execute(
        "SELECT s.step, l.name, s.numel, s.nonfinite, s.mean_abs_grad, s.max_abs_grad, "
        "s.grad_norm, s.sum_sq FROM layer_stats s JOIN layers l USING (run_id, layer_index) "
        "WHERE run_id = ? ORDER BY s.step, s.layer_index", [run_id]).fetchall()
    return {(r[0], r[1]): r[2:] for r in rows}


def assert_frames_match_torch(result: dict[str, Any], con: duckdb.DuckDBPyConnection,
                              run_id: str, steps: range | None = None) -> None:
    rows = stored(con, run_id)
    for step in steps if steps is not None else range(STEPS):
        ref = result["records"][step]
        sum_sq = 0.0
        for name in result["names"]:
            want = ref["layers"][name]
            numel, nonfinite, mean_abs, max_abs, norm, sq = rows[(step, name)]
            assert numel == want["numel"], (step, name)
            assert nonfinite == want["nonfinite"], (step, name)
            assert mean_abs == pytest.approx(want["mean_abs"], rel=RTOL), (step, name)
            assert max_abs == pytest.approx(want["max_abs"], rel=RTOL), (step, name)
            assert norm == pytest.approx(want["norm"], rel=RTOL), (step, name)
            sum_sq += sq
        if all(ref["layers"][n]["nonfinite"] == 0 for n in result["names"]):
            assert np.sqrt(sum_sq) == pytest.approx(ref["total_norm"], rel=TOTAL_RTOL), step


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ddp_frames_are_the_all_reduced_gradient(world, kafka_bootstrap, tmp_path, unique_name):
    """Default tap (in-band reduction): one reduced summary a step, frames equal torch's
    values, each rank read its share of the gradient; the local view is a flight recorder
    that sent only the lead-up to the NaN, from the rank whose input held it."""
    nan_step = STEPS - 1 if world == 2 else None
    result, con, run_id = run_job("ddp", world, tmp_path, kafka_bootstrap, unique_name,
                                  nan_step=nan_step)
    assert_frames_match_torch(result, con, run_id)
    complete = con.execute("SELECT count(*) FROM frames WHERE run_id = ? AND complete AND "
                           "len(ranks_seen) = ?", [run_id, world]).fetchone()[0]
    assert complete == STEPS
    total = sum(result["records"][0]["layers"][k]["numel"] for k in result["names"])
    assert 0 < result["elements"] < STEPS * total  # rank 0 read a share, not everything
    if nan_step is not None:  # NaN counted once, as torch counts it
        nan = con.execute("SELECT sum(nonfinite) FROM layer_stats WHERE run_id = ? AND "
                          "step = ?", [run_id, nan_step]).fetchone()[0]
        want = sum(v["nonfinite"] for v in result["records"][nan_step]["layers"].values())
        assert nan == want > 0
    local = con.execute(
        "SELECT step, rank, count(*), sum(numel) FROM local_layer_stats WHERE run_id = ? "
        "GROUP BY ALL ORDER BY ALL", [run_id]).fetchall()
    if nan_step is None:
        assert local == []  # steady state: nothing per rank
    else:  # the recorder's lead-up: every step up to the NaN, of the rank that held it
        n = len(result["names"])
        assert local == [(s, world - 1, n, total) for s in range(nan_step + 1)]
        bad = con.execute("SELECT DISTINCT rank FROM local_layer_stats WHERE run_id = ? AND "
                          "step = ? AND nonfinite > 0", [run_id, nan_step]).fetchall()
        assert bad == [(world - 1,)]  # only the rank whose input held the NaN


def test_ddp_per_rank_sending_with_every_step_local_view(kafka_bootstrap, tmp_path,
                                                         unique_name):
    """``reduce="off"``: every rank sends its own replica, the consumer counts it once;
    ``local_view="every_step"``: every rank's own pre-all-reduce gradient, every step."""
    world = 2
    result, con, run_id = run_job("ddp", world, tmp_path, kafka_bootstrap, unique_name,
                                  nan_step=STEPS - 1, reduce="off", local_view="every_step")
    assert_frames_match_torch(result, con, run_id)
    assert result["elements"] is None
    local = con.execute(
        "SELECT step, rank, count(*), sum(numel) FROM local_layer_stats WHERE run_id = ? "
        "GROUP BY ALL ORDER BY ALL", [run_id]).fetchall()
    n = len(result["names"])
    total = sum(result["records"][0]["layers"][k]["numel"] for k in result["names"])
    assert local == [(s, r, n, total) for s in range(STEPS) for r in range(world)]


@pytest.mark.parametrize("reduce", ["in_band", "off"])
def test_ddp_replica_that_diverges_raises_an_alert(reduce, kafka_bootstrap, tmp_path,
                                                   unique_name):
    """Rank 2 of 3 perturbs its copy of the first layer's gradient from step 1 on. Per-rank
    sending compares every replica at every step; the in-band cross-check
    (``check_slices=1``) compares each replica's copy within R - 1 = 2 steps."""
    world, diverge = 3, 1
    result, con, run_id = run_job("ddp", world, tmp_path, kafka_bootstrap, unique_name,
                                  diverge_step=diverge, reduce=reduce, check_slices=1)
    assert_frames_match_torch(result, con, run_id, steps=range(diverge))
    alerts = con.execute(
        "SELECT step, layers, ranks FROM alerts WHERE run_id = ? AND rule = "
        "'replica_divergence' AND state = 'firing'", [run_id]).fetchall()
    assert len(alerts) == 1
    step, layers, ranks = alerts[0]
    # The counted replica and the one compared with it are both named; the perturbed rank
    # 2 is one of them.
    assert diverge <= step <= diverge + (world - 1) - 1 and layers == [result["names"][0]]
    assert 2 in ranks and set(ranks) <= {0, 1, 2} and len(ranks) >= 2


@pytest.mark.parametrize("kind,world", [("fsdp2", 2), ("hsdp", 4), ("tp", 2)])
def test_sharded_frames_are_the_full_gradient(kind, world, kafka_bootstrap, tmp_path,
                                              unique_name):
    result, con, run_id = run_job(kind, world, tmp_path, kafka_bootstrap, unique_name)
    assert_frames_match_torch(result, con, run_id)
    frames = con.execute("SELECT count(*) FROM frames WHERE run_id = ? AND complete",
                         [run_id]).fetchone()[0]
    assert frames == STEPS  # every rank reported every step


@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_trainer_frameworks_under_ddp(kind, kafka_bootstrap, tmp_path, unique_name):
    """Hugging Face ``Trainer`` and Lightning ``strategy="ddp"``, 2 CPU ranks started like
    torchrun starts them, gradient accumulation 2: frames equal torch's values."""
    result, con, run_id = run_job(kind, 2, tmp_path, kafka_bootstrap, unique_name)
    assert len(result["records"]) == STEPS
    assert_frames_match_torch(result, con, run_id)  # in-band by default
    local = con.execute("SELECT count(DISTINCT rank), count(DISTINCT step) FROM "
                        "local_layer_stats WHERE run_id = ?", [run_id]).fetchone()
    assert local == ((2, STEPS) if kind == "lightning" else (0, 0))  # Lightning: local_view
