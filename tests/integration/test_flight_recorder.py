"""The flight recorder end to end: one producer per rank in ``local_view="recorder"`` mode,
the real broker, a worker (single-process, or scale-out with the frames topic and the
store writer) and DuckDB.

Three data-parallel ranks send the averaged gradient as a replica and give their own
gradient as the local view; rank 1's local gradient holds a NaN at step 14 only. The
store must hold that rank's local rows for the K steps up to 14 and nothing else (no
quiet step, no other rank), equal to the local gradients' own values, and the report, the
notebook's ``rank_stats`` and the nonfinite alert must name rank 1 and step 14.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import duckdb
import numpy as np
import pytest
from kafka import KafkaProducer

from analysis import Store
from analysis.report import build_report
from consumer.alerts.rows import read_alerts
from consumer.settings import ConsumerSettings
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from consumer.worker import Worker
from producer import GradientProducer

WORLD, STEPS, K = 3, 20, 6
NAN_STEP, NAN_RANK = 14, 1
LAYERS = {"embed.weight": 24, "block.weight": 16, "head.bias": 4}


def local_gradients(step: int, rank: int) -> dict[str, np.ndarray]:
    """Deterministic local gradients of similar norm every step; one NaN in rank 1's
    ``block.weight`` at step 14."""
    rng = np.random.default_rng([step, rank])
    out = {n: (rng.standard_normal(k) * 0.01).astype(np.float32) for n, k in LAYERS.items()}
    if (step, rank) == (NAN_STEP, NAN_RANK):
        out["block.weight"][5] = np.nan
    return out


def averaged(step: int) -> dict[str, np.ndarray]:
    """What every rank applies: the mean of the local gradients (NaN at step 14)."""
    grads = [local_gradients(step, r) for r in range(WORLD)]
    return {n: np.mean([g[n] for g in grads], axis=0).astype(np.float32) for n in LAYERS}


def train(bootstrap: str, topic: str, run_id: str) -> list[int]:
    """Every rank records every step; returns the LocalSummary messages each rank queued."""
    producers = [GradientProducer(run_id, rank=r, world_size=WORLD, bootstrap_servers=bootstrap,
                                  topic=topic, local_view_steps=K) for r in range(WORLD)]
    for p in producers:
        p.start_run(LAYERS)
    for step in range(STEPS):
        avg = averaged(step)
        for rank, p in enumerate(producers):
            p.record_step(step, avg, replicated=True, local_gradients=local_gradients(step, rank))
    sent = []
    for p in producers:
        p.finish_run()
        stats = p.close()
        assert stats.dropped == stats.failed == 0
        sent.append(stats.local_summaries)
    return sent


def send_invalid(bootstrap: str, topic: str, run_id: str) -> None:
    """Two LocalSummary messages the worker must dead-letter: an unknown run, and a layer
    index outside the run's three layers."""
    def local(run: str, layer: int) -> bytes:
        return json.dumps({
            "type": "local_summary", "schema_version": "1.10", "run_id": run, "step": 0,
            "rank": 0, "world_size": WORLD, "wall_time": 1.0, "trigger": "nonfinite",
            "trigger_step": 0, "local_layer_indices": [layer], "local_numel": [4],
            "local_sum_abs": [1.0], "local_sum_sq": [1.0], "local_max_abs": [1.0],
            "local_nonfinite": [1]}).encode()

    raw = KafkaProducer(bootstrap_servers=bootstrap)
    raw.send(topic, key=b"nobody", value=local("nobody", 0))
    raw.send(topic, key=run_id.encode(), value=local(run_id, 7))
    raw.flush()
    raw.close()


def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Poll ``condition`` every 0.1 s until it holds (True) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("shape", ["single-process", "scale-out"])
def test_recorder_stores_the_last_k_steps_of_the_rank_that_went_bad(
    shape: str, kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    topic, run_id, db = f"fr-{unique_name}", f"run-{unique_name}", tmp_path / "store.duckdb"
    common = dict(bootstrap_servers=kafka_bootstrap, topic=topic, dlq_topic=f"{topic}-dlq",
                  alerts_topic=f"{topic}-alerts", group_id=f"g-{unique_name}",
                  shard_timeout_s=60.0)
    loops: list[Worker | StoreWriter]
    if shape == "single-process":
        worker = Worker(ConsumerSettings(**common, db=str(db)))
        loops = [worker]
    else:
        frames = f"{topic}-frames"
        worker = Worker(ConsumerSettings(**common, frames_topic=frames,
                                         runs_topic=f"{topic}-runs"))
        store = StoreWriter(StoreWriterSettings(
            bootstrap_servers=kafka_bootstrap, frames_topic=frames,
            alerts_topic=common["alerts_topic"], group_id=f"s-{unique_name}", db=str(db)))
        loops = [worker, store]
    threads = [threading.Thread(target=loop.run, daemon=True) for loop in loops]
    for t in threads:
        t.start()
    try:
        assert all(loop.wait_ready(60) for loop in loops), [loop.error for loop in loops]
        sent = train(kafka_bootstrap, topic, run_id)
        send_invalid(kafka_bootstrap, topic, run_id)
        assert all(loop.wait_for_runs([run_id], 90) for loop in loops), [
            loop.error for loop in loops]
        assert until(lambda: worker.counters.dead_letters >= 2)
        if shape == "scale-out":
            assert until(lambda: store.counters.alerts >= 1 and store.runs_done([run_id]))
    finally:
        for loop in loops:
            loop.stop()
        for t in threads:
            t.join(30)
    assert all(loop.error is None for loop in loops)
    assert sent == [0, K, 0]  # steady state sends nothing; rank 1 its last K entries once
    assert worker.counters.local_summaries == K and worker.counters.dead_letters == 2

    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT s.step, s.rank, l.name, s.numel, s.sum_abs, s.sum_sq, s.max_abs_grad, "
        "s.nonfinite, s.trigger, s.trigger_step FROM local_layer_stats s JOIN layers l "
        "USING (run_id, layer_index) WHERE run_id = ? ORDER BY s.step, s.layer_index",
        [run_id]).fetchall()
    report = build_report(con, run_id)
    (alert,) = read_alerts(con, run_id=run_id, rule="nonfinite", state="firing")
    con.close()

    steps = list(range(NAN_STEP - K + 1, NAN_STEP + 1))
    assert [(r[0], r[2]) for r in rows] == [(s, n) for s in steps for n in LAYERS]
    for step, rank, name, numel, sum_abs, sum_sq, max_abs, nonfinite, trigger, at in rows:
        g = local_gradients(step, rank)[name].astype(np.float64)
        finite = g[np.isfinite(g)]
        assert (rank, trigger, at) == (NAN_RANK, "nonfinite", NAN_STEP)
        assert (numel, nonfinite) == (g.size, g.size - finite.size)
        assert sum_abs == pytest.approx(np.abs(finite).sum(), rel=1e-6)
        assert sum_sq == pytest.approx((finite**2).sum(), rel=1e-6)
        assert max_abs == pytest.approx(np.abs(finite).max(), rel=1e-6)
    assert [r[7] for r in rows if r[0] == NAN_STEP] == [0, 1, 0]

    assert report.first_nonfinite_step == NAN_STEP
    assert (report.first_bad_local_step, report.first_bad_local_ranks) == (NAN_STEP, [NAN_RANK])
    assert report.first_bad_local_nonfinite and not report.first_bad_local_exploding
    assert alert.step == NAN_STEP and alert.ranks == [0, 1, 2]  # every replica is NaN
    assert alert.values["local_origin"] == {"step": NAN_STEP, "ranks": [NAN_RANK]}
    assert f"NaN/Inf first in rank {NAN_RANK}'s local gradient at step {NAN_STEP}" in (
        alert.message)

    ranks = Store(db).run(run_id).rank_stats()
    bad = ranks[ranks.nonfinite > 0].groupby("rank").step.min()
    assert bad.to_dict() == {NAN_RANK: NAN_STEP}
    assert sorted(set(ranks.step)) == steps
