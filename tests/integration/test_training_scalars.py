"""Training scalars through a real Kafka broker into a real DuckDB file.

Three ranks send their gradients with their own loss, tokens and compute time and the
shared learning rate and loss scale; rank 2's loss turns NaN at one step and rank 1 is a
straggler for a stretch. A worker stores the per-rank rows and the step values (the mean
loss, the summed tokens, the slowest rank's compute time), and its ``nonfinite_loss`` and
``straggler`` rules name the ranks. One scale-out worker + store writer pair gives the same
stored scalars.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest

from consumer.settings import ConsumerSettings
from consumer.store_writer import StoreWriter
from consumer.store_writer_settings import StoreWriterSettings
from consumer.worker import Worker
from producer import GradientProducer

WORLD = 3
STEPS = 30
NAN_STEP, NAN_RANK = 21, 2
SLOW_RANK, SLOW_STEPS = 1, range(5, 18)
ALERT_SET = ["straggler.consecutive=5"]


def loss(step: int, rank: int) -> float:
    if step == NAN_STEP and rank == NAN_RANK:
        return math.nan
    return 2.0 / (1 + step) + 0.01 * rank


def compute_time(step: int, rank: int) -> float:
    return 0.4 if rank == SLOW_RANK and step in SLOW_STEPS else 0.1 + 0.001 * rank


def scalars(step: int, rank: int) -> dict[str, float]:
    return {"loss": loss(step, rank), "lr": 1e-3 * 0.9**step, "loss_scale": 65536.0,
            "tokens": 100.0 * (rank + 1), "compute_time_s": compute_time(step, rank)}


def produce(bootstrap: str, topic: str, run_id: str) -> None:
    producers = [GradientProducer(run_id, rank=r, world_size=WORLD, bootstrap_servers=bootstrap,
                                  topic=topic) for r in range(WORLD)]
    for p in producers:
        p.start_run({"w": 8 * WORLD})
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        for rank, p in enumerate(producers):
            grad = rng.standard_normal(8).astype(np.float32) * np.float32(0.01)
            p.record_step(step, {"w": grad}, scalars=scalars(step, rank))
    for p in producers:
        p.finish_run()
        stats = p.close()
        assert stats.sent >= STEPS and stats.dropped == 0 and stats.failed == 0


def run_single(kafka_bootstrap: str, tmp_path: Path, name: str, run_id: str) -> Path:
    """``gradstream consume --db``: one worker writes the store."""
    settings = ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{name}", dlq_topic=f"dlq-{name}",
        group_id=f"grp-{name}", db=str(tmp_path / "store.duckdb"), shard_timeout_s=60.0,
        alert_set=ALERT_SET)
    worker = Worker(settings)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        assert worker.wait_ready(60), worker.error
        produce(kafka_bootstrap, settings.topic, run_id)
        assert worker.wait_for_runs([run_id], 60), worker.error
    finally:
        worker.stop()
        thread.join(30)
    assert worker.error is None and worker.counters.dead_letters == 0
    return Path(settings.db)


def run_scale_out(kafka_bootstrap: str, tmp_path: Path, name: str, run_id: str) -> Path:
    """A worker publishing merged frames and ``gradstream store`` writing them (the store
    writer evaluates the rules in this shape)."""
    frames_topic = f"frames-{name}"
    worker = Worker(ConsumerSettings(
        bootstrap_servers=kafka_bootstrap, topic=f"sum-{name}", frames_topic=frames_topic,
        dlq_topic=f"dlq-{name}", alerts_topic=f"alerts-{name}", runs_topic=f"runs-{name}",
        group_id=f"grp-{name}", shard_timeout_s=60.0, alert_set=ALERT_SET))
    store = StoreWriter(StoreWriterSettings(
        bootstrap_servers=kafka_bootstrap, frames_topic=frames_topic,
        alerts_topic=f"alerts-{name}", group_id=f"store-{name}",
        db=str(tmp_path / "store.duckdb"), alert_set=ALERT_SET))
    threads = [threading.Thread(target=p.run, daemon=True) for p in (worker, store)]
    for t in threads:
        t.start()
    try:
        assert worker.wait_ready(60) and store.wait_ready(60)
        produce(kafka_bootstrap, f"sum-{name}", run_id)
        deadline = time.monotonic() + 60
        while not store.runs_done([run_id]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.runs_done([run_id]), "the store did not see the run finish"
    finally:
        for process in (worker, store):
            process.stop()
        for t in threads:
            t.join(30)
    assert worker.error is None and store.error is None
    return tmp_path / "store.duckdb"


@pytest.mark.parametrize("shape", [run_single, run_scale_out], ids=["single", "scale-out"])
def test_scalars_are_stored_per_rank_and_per_step_and_rules_name_ranks(
        shape, kafka_bootstrap, tmp_path, unique_name):
    run_id = f"run-{unique_name}"
    db = shape(kafka_bootstrap, tmp_path, unique_name, run_id)
    con = duckdb.connect(str(db), read_only=True)
    step_rows = con.execute(
        "SELECT step, name, value FROM step_scalars WHERE run_id = ?", [run_id]).fetchall()
    values = {(step, name): value for step, name, value in step_rows}
    for step in range(STEPS):
        losses = [loss(step, r) for r in range(WORLD)]
        if step == NAN_STEP:
            assert math.isnan(values[(step, "loss")])
        else:
            assert values[(step, "loss")] == pytest.approx(np.mean(losses), rel=1e-12)
        assert values[(step, "lr")] == pytest.approx(1e-3 * 0.9**step, rel=1e-12)
        assert values[(step, "loss_scale")] == 65536.0
        assert values[(step, "tokens")] == 600.0
        assert values[(step, "compute_time_s")] == max(compute_time(step, r)
                                                       for r in range(WORLD))
        if step:  # measured by each rank's SDK from its second recorded step
            assert values[(step, "step_time_s")] > 0
    ranks = con.execute(
        "SELECT step, rank, value FROM rank_scalars WHERE run_id = ? AND name = 'loss'",
        [run_id]).fetchall()
    assert len(ranks) == STEPS * WORLD
    nan_ranks = [(s, r) for s, r, v in ranks if math.isnan(v)]
    assert nan_ranks == [(NAN_STEP, NAN_RANK)]
    alerts = con.execute(
        "SELECT rule, state, step, ranks FROM alerts WHERE run_id = ? AND rule IN "
        "('nonfinite_loss', 'straggler') ORDER BY created_at", [run_id]).fetchall()
    con.close()
    fired = {rule: (step, ranks) for rule, state, step, ranks in alerts if state == "firing"}
    assert fired["nonfinite_loss"] == (NAN_STEP, [NAN_RANK])
    step, named = fired["straggler"]
    assert named == [SLOW_RANK] and step == SLOW_STEPS.start + 4  # the 5th slow step
    assert any(rule == "straggler" and state == "resolved" for rule, state, _, _ in alerts)
